"""The C kernel inside a jitted JAX program: an XLA FFI custom call, K/V read in place.

XLA calls :func:`_handler` through the XLA FFI C API (a ``ctypes`` function
registered with :func:`jax.ffi.register_ffi_target`) with pointers to the
operands' own buffers: K and V are viewed as numpy arrays without a copy (a
``jax.pure_callback`` or ``io_callback`` copies its operands, 0.5 GiB a step
at 128K keys) and :func:`mpitree.extend.attend` runs the core's local kernel on
them into the call's result buffer. The call is local (no communication): the
merge stays in the adapter's ordered callback. The call never fails in XLA: a
kernel error is kept (:func:`failure`) and the call's second result, a flag,
carries it into the merge's agreement, so every rank raises (an XLA error on
one rank would leave the others waiting in the merge). Importing this module
imports JAX.
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


_EXTENSION_METADATA, _STAGE_EXECUTE = 1, 3
_API_VERSION = (0, 1)  # the XLA FFI C API version these mirrors follow
FAILED = 2  # the flag bit of a failed kernel call (the adapter's kv_len check is bit 1)
_DTYPES = {1: np.bool_, 4: np.int32, 11: np.float32}  # XLA_FFI_DataType: PRED, S32, F32
_NUMPY = extend.namespace(np.zeros(0, np.float32))
_HANDLER = ctypes.CFUNCTYPE(_ptr, _ptr)
_failures = []  # the kernel errors not yet raised (by failure())


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
    """Run the kernel: operands q, k, v, scale[, lens][, vis]; results the records, the flag."""
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


def failure():
    """Return the exception of the kernel call that set :data:`FAILED` (and forget it)."""
    exc = _failures[0] if _failures else None
    _failures.clear()
    error = RuntimeError(f"mpitree: local kernel failed: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


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
    flag = _view(frame.rets.items[1]).reshape(-1)
    try:
        _attend(frame)
        flag[:] = 0
    except BaseException as exc:  # raised on every rank by the merge's agreement, never lost
        _failures.append(exc)
        flag[:] = FAILED
    return None


if "_CALLBACK" not in globals():  # a reload keeps XLA's registration and the callback it holds
    _CALLBACK = _HANDLER(_handler)  # alive as long as the process: XLA holds its address
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(_CALLBACK), platform="cpu")


def records(q, k, v, scale, lens, vis):
    """Return this shard's float32 records ``(B, Hq, Sq, D + 2)`` by the C kernel, and a flag.

    The records are ``[m, d, n]``; the int32 flag is :data:`FAILED` when the
    kernel raised (:func:`failure` returns the error), else 0.

    ``q`` ``(B, Hq, Sq, D)`` and ``k``, ``v`` ``(B, Hkv, T, D)`` float32 with
    ``T > 0``; ``lens`` int32 ``(B,)`` already within ``[0, T]`` or None;
    ``vis`` bool ``(B, 1 or Hq, Sq, T)`` or None. Traceable; under ``jax.vmap``
    see :func:`_batched`.
    """
    return _records(q, k, v, jnp.asarray(scale, jnp.float32), (lens, vis))


def _call(q, k, v, scale, masking):
    """Run the custom call: every operand has the same leading (vmapped) axes, kernel-folded."""
    lead = q.shape[:-4]
    b, hq, sq, d = q.shape[-4:]
    result = jax.ShapeDtypeStruct((*lead, b, hq, sq, d + 2), jnp.float32)
    flag = jax.ShapeDtypeStruct(lead, jnp.int32)
    operands = [q, k, v, scale, *(x for x in masking if x is not None)]
    return jax.ffi.ffi_call(TARGET, (result, flag))(*operands)


_records = jax.custom_batching.custom_vmap(_call)


@_records.def_vmap
def _batched(size, batched, q, k, v, scale, masking):
    """``jax.vmap`` of the call: a mapped q over shared K/V becomes query rows, else broadcast.

    Only ``q`` mapped (several queries against one cache): its mapped axis joins
    the query rows (``vis`` repeated along them), so K/V are read once and never
    copied. Otherwise every operand is broadcast along the mapped axis, which the
    kernel folds into the batch (unmapped K/V copied once per element).
    """
    shared = not any(jax.tree_util.tree_leaves(batched[1:]))
    if shared and q.ndim == 5:
        n, b, hq, sq, d = q.shape
        rows = jnp.moveaxis(q, 0, 2).reshape(b, hq, n * sq, d)
        lens, vis = masking
        if vis is not None:
            vis = jnp.broadcast_to(vis[:, :, None], (*vis.shape[:2], n, *vis.shape[2:]))
            vis = vis.reshape(*vis.shape[:2], n * sq, vis.shape[-1])
        rec, flag = _records(rows, k, v, scale, (lens, vis))
        rec = jnp.moveaxis(rec.reshape(b, hq, n, sq, d + 2), 2, 0)
        return (rec, jnp.broadcast_to(flag, (n,))), (True, True)
    args = jax.tree_util.tree_map(
        lambda x, mapped: x if mapped else jnp.broadcast_to(x, (size, *x.shape)),
        (q, k, v, scale, masking),
        tuple(batched),
    )
    return _records(*args), (True, True)
