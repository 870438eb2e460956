"""The C kernel inside a jitted JAX program: an XLA FFI custom call, K/V read in place.

XLA calls :func:`_handler` through the XLA FFI C API (a ``ctypes`` function
registered with :func:`jax.ffi.register_ffi_target`) with pointers to the
operands' own buffers: K and V are viewed as numpy arrays without a copy (a
``jax.pure_callback`` or ``io_callback`` copies its operands, 0.5 GiB a step
at 128K keys) and :func:`mpitree.extend.attend` runs the core's local kernel on
them into the call's result buffer. The call is local (no communication): the
merge stays in the adapter's ordered callback. Importing this module imports JAX.
"""

from __future__ import annotations

import ctypes

import jax
import jax.numpy as jnp
import numpy as np

from mpitree import extend

TARGET = "mpitree_attend_f32"

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class _Buffer(ctypes.Structure):
    """``XLA_FFI_Buffer``."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", _ptr),
        ("dtype", ctypes.c_int),
        ("data", _ptr),
        ("rank", _i64),
        ("dims", ctypes.POINTER(_i64)),
    ]


class _List(ctypes.Structure):
    """``XLA_FFI_Args`` and ``XLA_FFI_Rets`` (the same layout)."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", _ptr),
        ("size", _i64),
        ("types", _ptr),
        ("items", ctypes.POINTER(_ptr)),
    ]


class _Attrs(ctypes.Structure):
    """``XLA_FFI_Attrs`` (none are passed)."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", _ptr),
        ("size", _i64),
        ("types", _ptr),
        ("names", _ptr),
        ("attrs", _ptr),
    ]


class _Frame(ctypes.Structure):
    """``XLA_FFI_CallFrame``."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", _ptr),
        ("api", _ptr),
        ("ctx", _ptr),
        ("stage", ctypes.c_int),
        ("args", _List),
        ("rets", _List),
        ("attrs", _Attrs),
        ("future", _ptr),
    ]


class _Version(ctypes.Structure):
    """``XLA_FFI_Api_Version``."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", _ptr),
        ("major", ctypes.c_int),
        ("minor", ctypes.c_int),
    ]


class _Metadata(ctypes.Structure):
    """``XLA_FFI_Metadata`` up to its traits."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("version", _Version),
        ("traits", ctypes.c_uint32),
    ]


class _MetadataExtension(ctypes.Structure):
    """``XLA_FFI_Metadata_Extension``: XLA asks the handler's API version with it."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("type", ctypes.c_int),
        ("next", _ptr),
        ("metadata", ctypes.POINTER(_Metadata)),
    ]


class _ErrorArgs(ctypes.Structure):
    """``XLA_FFI_Error_Create_Args``."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", _ptr),
        ("message", ctypes.c_char_p),
        ("errc", ctypes.c_int),
    ]


_EXTENSION_METADATA, _STAGE_EXECUTE, _ERROR_INTERNAL = 1, 3, 13
_API_VERSION = (0, 1)  # the XLA FFI C API version these mirrors follow
_ERROR_CREATE_OFFSET = 48  # XLA_FFI_Api: size, extension, version (24 bytes), internal api
_DTYPES = {1: np.bool_, 4: np.int32, 11: np.float32}  # XLA_FFI_DataType: PRED, S32, F32
_NUMPY = extend.namespace(np.zeros(0, np.float32))
_HANDLER = ctypes.CFUNCTYPE(_ptr, _ptr)
_ERROR_CREATE = ctypes.CFUNCTYPE(_ptr, ctypes.POINTER(_ErrorArgs))


def _view(address):
    """Return the ``XLA_FFI_Buffer`` at ``address`` as a numpy array on its memory (no copy)."""
    buf = _Buffer.from_address(address)
    shape = tuple(buf.dims[i] for i in range(buf.rank))
    dtype = np.dtype(_DTYPES[buf.dtype])
    size = int(np.prod(shape)) * dtype.itemsize
    if size == 0:
        return np.empty(shape, dtype)
    return np.frombuffer((ctypes.c_char * size).from_address(buf.data), dtype).reshape(shape)


def _fold(x, lead):
    """Fold the ``lead`` leading axes (``jax.vmap``'s) of ``x`` into its first kernel axis."""
    return x if lead == 0 else x.reshape(-1, *x.shape[lead + 1 :])


def _attend(frame):
    """Run the kernel: operands q, k, v, scale[, lens][, vis]; result the records."""
    args = [_view(frame.args.items[i]) for i in range(frame.args.size)]
    out = _view(frame.rets.items[0])
    q, k, v, scale, *masking = args
    lead = q.ndim - 4  # axes jax.vmap put in front of every operand (broadcast_all)
    lens = vis = None
    for x in masking:
        if x.dtype == np.bool_:
            vis = _fold(x, lead)
        else:
            lens = x.reshape(-1)
    scale = float(scale.reshape(-1)[0]) if scale.size else 1.0
    extend.attend(
        _NUMPY, _fold(q, lead), _fold(k, lead), _fold(v, lead), scale, lens, vis, _fold(out, lead)
    )


def _error(frame, exc):
    """Return an ``XLA_FFI_Error`` carrying ``exc`` (XLA raises it in the caller)."""
    create = _ERROR_CREATE(ctypes.c_void_p.from_address(frame.api + _ERROR_CREATE_OFFSET).value)
    message = f"mpitree: local kernel failed: {type(exc).__name__}: {exc}".encode()
    args = _ErrorArgs(ctypes.sizeof(_ErrorArgs) - 4, None, message, _ERROR_INTERNAL)
    return create(ctypes.byref(args))


def _handler(address):
    """Handle one XLA FFI call: answer the metadata query; run the kernel at execution."""
    frame = _Frame.from_address(address)
    if frame.extension_start:
        ext = _MetadataExtension.from_address(frame.extension_start)
        if ext.type == _EXTENSION_METADATA:
            meta = ext.metadata.contents
            meta.version.struct_size = ctypes.sizeof(_Version)
            meta.version.major, meta.version.minor = _API_VERSION
            meta.traits = 0
            return None
    if frame.stage != _STAGE_EXECUTE:
        return None
    try:
        _attend(frame)
    except Exception as exc:  # reported by XLA as the call's error, never lost
        return _error(frame, exc)
    return None


_CALLBACK = _HANDLER(_handler)  # kept alive as long as the module: XLA holds its address
jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(_CALLBACK), platform="cpu")


def records(q, k, v, scale, lens, vis):
    """Return this shard's float32 ``(B, Hq, Sq, D + 2)`` records ``[m, d, n]`` by the C kernel.

    ``q`` ``(B, Hq, Sq, D)`` and ``k``, ``v`` ``(B, Hkv, T, D)`` float32 with
    ``T > 0``; ``lens`` int32 ``(B,)`` already within ``[0, T]`` or None;
    ``vis`` bool ``(B, 1 or Hq, Sq, T)`` or None. Traceable; ``jax.vmap``
    broadcasts every operand along the mapped axis and the kernel folds it
    into the batch.
    """
    b, hq, sq, d = q.shape
    operands = [q, k, v, jnp.asarray(scale, jnp.float32)]
    operands += [x for x in (lens, vis) if x is not None]
    result = jax.ShapeDtypeStruct((b, hq, sq, d + 2), jnp.float32)
    call = jax.ffi.ffi_call(TARGET, result, vmap_method="broadcast_all")
    return call(*operands)
