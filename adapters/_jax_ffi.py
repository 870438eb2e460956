"""mpitree's two custom calls inside a jitted JAX program, through the XLA FFI C API.

XLA calls the handlers (``ctypes`` functions registered with
:func:`jax.ffi.register_ffi_target`) with pointers to the operands' own buffers,
viewed here as numpy arrays without a copy (a ``jax.pure_callback`` or
``io_callback`` copies its operands, 0.5 GiB a step at 128K keys):

- :func:`records`, local: :func:`mpitree._local.attend` runs the core's C
  kernel on K/V in place into the call's result buffer. It never fails in XLA:
  a kernel error is kept (:func:`failure`) and the call's second result, a
  flag, carries it into the merge's agreement, so every rank raises (an XLA
  error on one rank would leave the others waiting in the merge).
- :func:`merge`, the collective: a primitive with JAX's ordered-callback effect
  (threaded through XLA tokens, as mpi4jax orders its collectives, and shared
  with ordered ``io_callback``s), so every rank runs its merges exactly once per
  call and in program order. Its handler runs the
  adapter's guarded host step (the agreement, then one ``MPI_Allreduce`` with
  the native op) on the records in place and writes the merged records into
  the result buffer; the step's exception becomes the call's XLA error.

The primitive uses JAX internals (``jax._src``, as mpi4jax does), checked with
JAX 0.10; CPU only, one device per rank. Importing this module imports JAX.
"""

from __future__ import annotations

import ctypes
import threading

import jax
import jax.numpy as jnp
import numpy as np

from mpitree._local import attend
from mpitree._namespace import namespace

try:  # the ordered effect of the merge: JAX internals (as mpi4jax uses them)
    from jax._src.callback import _OrderedIOEffect
    from jax._src.core import ShapedArray, abstract_token, trace_state_clean
    from jax.extend.core import Primitive
    from jax.interpreters import mlir
except ImportError as exc:  # pragma: no cover - a JAX whose internals moved
    raise ImportError(
        f"mpitree.adapters.jax needs JAX 0.10's effects API (found jax {jax.__version__}): "
        f"{exc}; install the version the 'jax' extra names"
    ) from exc

TARGET = "mpitree_attend_f32"
MERGE_TARGET = "mpitree_merge"

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


class _Api(ctypes.Structure):
    """``XLA_FFI_Api`` up to ``XLA_FFI_Error_Create``."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", _ptr),
        ("api_version", _Version),
        ("internal_api", _ptr),
        ("error_create", ctypes.CFUNCTYPE(_ptr, ctypes.POINTER(_ErrorArgs))),
    ]


_EXTENSION_METADATA, _STAGE_EXECUTE = 1, 3
_API_VERSION = (0, 1)  # the XLA FFI C API version these mirrors follow
_INTERNAL = 13  # XLA_FFI_Error_Code_INTERNAL
FAILED = 2  # the flag bit of a failed kernel call (the adapter's kv_len check is bit 1)
_DTYPES = {1: np.bool_, 4: np.int32, 11: np.float32, 12: np.float64}  # PRED S32 F32 F64
_NUMPY = namespace(np.zeros(0, np.float32))
_HANDLER = ctypes.CFUNCTYPE(_ptr, _ptr)
_failures = []  # the kernel errors not yet raised (by failure())
_eager = threading.local()  # per thread: ``count``, the merges run outside a program
if "_hosts" not in globals():  # a reload keeps the keys compiled programs already hold
    _hosts = []  # the lowered merges' host steps, by key: compiled programs call them for life


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
    attend(
        _NUMPY, _fold(q, lead), _fold(k, lead), _fold(v, lead), scale, lens, vis, _fold(out, lead)
    )


def failure():
    """Return the exception of the kernel call that set :data:`FAILED` (and forget it)."""
    exc = _failures[0] if _failures else None
    _failures.clear()
    error = RuntimeError(f"mpitree: local kernel failed: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def _executes(frame):
    """Whether XLA calls to execute (else: answer its metadata query; other stages: nothing)."""
    if frame.extension_start:
        ext = _MetadataExtension.from_address(frame.extension_start)
        if ext.type == _EXTENSION_METADATA:
            meta = ext.metadata.contents
            meta.version.struct_size = ctypes.sizeof(_Version)
            meta.version.major, meta.version.minor = _API_VERSION
            meta.traits = 0
            return False
    return frame.stage == _STAGE_EXECUTE


def _attend_handler(address):
    """Handle one kernel call: run the kernel; a failure sets the flag, never an XLA error."""
    frame = _Frame.from_address(address)
    if not _executes(frame):
        return None
    flag = _view(frame.rets.items[1]).reshape(-1)
    try:
        _attend(frame)
        flag[:] = 0
    except BaseException as exc:  # raised on every rank by the merge's agreement, never lost
        _failures.append(exc)
        flag[:] = FAILED
    return None


def _merge_handler(address):
    """Handle one merge: operands records, flag, key, token; results merged records, token.

    The host step's exception (the agreement's verdict, on every rank alike)
    becomes the call's XLA error, its last line ``Type: message``.
    """
    frame = _Frame.from_address(address)
    if not _executes(frame):
        return None
    try:
        records, flag, key = (_view(frame.args.items[i]) for i in range(3))
        out = _view(frame.rets.items[0])
        _hosts[int(key)](records, flag, out)
    except BaseException as exc:  # an exception escaping a ctypes callback is lost
        try:
            text = f"{type(exc).__name__}: {exc}"
        except Exception:  # a str() that raises: the type still names it
            text = type(exc).__name__
        message = f"mpitree: the merge raised\n{text}"
        api = _Api.from_address(frame.api)
        args = _ErrorArgs(ctypes.sizeof(_ErrorArgs), None, message.encode(), _INTERNAL)
        return api.error_create(ctypes.byref(args))
    return None


# The merge's ordered effect is JAX's own ordered-callback effect: merges share one token
# chain with ordered io_callbacks and debug prints, so a user's own MPI calls in an ordered
# callback keep their place among the merges (a separate effect would be a separate chain).
_EFFECT = _OrderedIOEffect
_lock = threading.Lock()  # one key per lowered merge, whatever thread lowers

_merge_p = Primitive("mpitree_merge")
_merge_p.def_effectful_abstract_eval(
    lambda records, flag, *, host: (ShapedArray(records.shape, records.dtype), {_EFFECT})
)


def tracing():
    """Whether JAX is tracing (``jax.jit``, ``jax.vmap``, ``jax.grad``), inputs traced or not.

    A merge bound now may join a program instead of running at once
    (:func:`merges_run` tells whether it ran).
    """
    return not trace_state_clean()


def merges_run():
    """How many merges this thread has entered outside a compiled program.

    A change across a traced call (under ``jax.vmap`` or ``jax.grad`` eagerly, the
    merge runs at once) means its collective ran: every rank settled it, and an
    exception from it is already every rank's.
    """
    return getattr(_eager, "count", 0)


@_merge_p.def_impl
def _merge_now(records, flag, *, host):
    """Run a merge outside a compiled program, after the merges already dispatched."""
    jax.effects_barrier()
    placed = records.sharding if isinstance(records, jax.Array) and records.committed else None
    records, flag = np.asarray(records), np.asarray(flag)
    _eager.count = merges_run() + 1  # the collective is entered: it settles on every rank
    merged = np.empty(records.shape, records.dtype)
    host(records, flag, merged)
    if placed is not None:  # back where the records were
        return jax.device_put(merged, placed)
    return jnp.asarray(merged)


def _devices(axis_context):
    """How many devices a lowering's program runs on (its axis context's)."""
    count = getattr(axis_context, "num_devices", None)
    if count is None:
        mesh = getattr(axis_context, "mesh", None)
        count = 1 if mesh is None else mesh.size
    return count


def _lower_merge(ctx, records, flag, *, host):
    """Lower a merge to the custom call, its token in and out, ``host`` kept by a key operand.

    ``host`` is also the program's host callback, as for an ``io_callback``: JAX
    then runs the program as it runs those, and a merge that raised leaves the
    effect's runtime token usable (otherwise that rank's next program fails at
    once with the old error while the others wait in its merge: a hang), and
    JAX keeps such a program out of its persistent compilation cache (``key``
    means nothing in another process).
    """
    devices = _devices(ctx.module_context.axis_context)
    if devices > 1:
        raise ValueError(
            f"mpitree.adapters.jax runs on one device per rank; this program spans {devices} "
            "devices: put its inputs on one device"
        )
    with _lock:
        key = mlir.ir_constant(np.int32(len(_hosts)))
        _hosts.append(host)
    ctx.module_context.add_host_callback(host)
    call = ctx.replace(
        avals_in=(*ctx.avals_in, ShapedArray((), np.int32), abstract_token),
        avals_out=(*ctx.avals_out, abstract_token),
    )
    lower = jax.ffi.ffi_lowering(MERGE_TARGET, has_side_effect=True)
    merged, token = lower(call, records, flag, key, ctx.tokens_in.get(_EFFECT))
    ctx.set_tokens_out(mlir.TokenSet({_EFFECT: token}))
    return [merged]


def _lower_merge_off_cpu(ctx, records, flag, *, host):
    """Refuse to compile a merge for an accelerator: the merge and the kernel are host calls."""
    platforms = ", ".join(ctx.module_context.platforms)
    raise ValueError(
        f"mpitree.adapters.jax compiles its merge for the CPU only, and this program is "
        f"compiled for {platforms}: call tree_decode outside jax.jit (accelerator arrays "
        "work there), or put the jitted function's inputs on a CPU device "
        "(jax.device_put(x, jax.devices('cpu')[0])). Every rank must do the same"
    )


mlir.register_lowering(_merge_p, _lower_merge, platform="cpu")
for _platform in ("cuda", "rocm"):
    mlir.register_lowering(_merge_p, _lower_merge_off_cpu, platform=_platform)

if "_CALLBACKS" not in globals():  # a reload keeps XLA's registrations and the callbacks they
    _CALLBACKS = (_HANDLER(_attend_handler), _HANDLER(_merge_handler))  # hold for life
    for _target, _callback in zip((TARGET, MERGE_TARGET), _CALLBACKS, strict=True):
        jax.ffi.register_ffi_target(_target, jax.ffi.pycapsule(_callback), platform="cpu")


def merge(host, records, flag):
    """Return the records ``host(records, flag, out)`` writes, run by the ordered merge call.

    ``records`` float32 or float64, any shape; ``flag`` int32 scalar; ``host``
    writes the merged records into ``out`` (a C-order numpy array of ``records``'
    shape and dtype: the call's result buffer) or raises, alike on every rank.
    Traced, it is a custom call in program order among the program's merges
    (lowered once per compilation; the compiled program keeps ``host``); outside
    a program it runs ``host`` at once, after the merges already dispatched.
    Not batched, differentiated or transposed: the adapter's ``custom_vmap`` and
    ``custom_vjp`` wrap it.
    """
    return _merge_p.bind(records, flag, host=host)


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
