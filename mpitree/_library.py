"""Load the compiled library (``_native*.c``, built as ``mpitree._native``) once, thread-safely.

Also :func:`address`: a numpy array's address, for its calls, cheaply.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import importlib.util
import os
import threading

from mpi4py import MPI

try:  # the hottest call's CPython entry (mpitree/_native_call.c), built where Python's headers are
    from ._native_call import STEP_SIZE as _CALL_STEP_SIZE
    from ._native_call import call as _native_call
except ImportError:
    _native_call = _CALL_STEP_SIZE = None

NATIVE_ENV = "MPITREE_NATIVE_OP"
STATUS_WORDS = 8  # int64 words of room for one MPI_Status in mpitree_step
_lock = threading.Lock()
_loaded = False
_lib = None
_error = None


class AttnArgs(ctypes.Structure):
    """Mirror of ``mpitree_attn_args`` in ``_native.h``."""

    _fields_ = [
        ("batch", ctypes.c_int64),
        ("q_heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("q_len", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("k_strides", ctypes.c_int64 * 3),
        ("v_strides", ctypes.c_int64 * 3),
        ("lens", ctypes.c_void_p),
        ("t", ctypes.c_int64),
        ("vis", ctypes.c_void_p),
        ("vis_heads", ctypes.c_int64),
        ("scale", ctypes.c_float),
    ]


class StepArgs(ctypes.Structure):
    """Mirror of ``mpitree_step`` in ``_native.h``: the one compiled step, bound once."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("t", ctypes.c_int64),
        ("lens", ctypes.c_void_p),
        ("vis", ctypes.c_void_p),
        ("vis_heads", ctypes.c_int64),
        ("source", ctypes.c_void_p),
        ("local", ctypes.c_int64),
        ("output", ctypes.c_int64),
        ("rec", ctypes.c_void_p),
        ("nbytes", ctypes.c_int64),
        ("scratch", ctypes.c_void_p),
        ("args", AttnArgs),
        ("finalized", ctypes.c_void_p),
        ("allreduce", ctypes.c_void_p),
        ("handle_bytes", ctypes.c_int64),
        ("comm", ctypes.c_int64),
        ("int64_type", ctypes.c_int64),
        ("min_op", ctypes.c_int64),
        ("sent", ctypes.c_int64 * 4),
        ("got", ctypes.c_int64 * 4),
        ("start", ctypes.c_void_p),
        ("wait", ctypes.c_void_p),
        ("request", ctypes.c_void_p),
        ("flag", ctypes.c_void_p),
        ("timed", ctypes.c_int64),
        ("kernel_ns", ctypes.c_int64),
        ("collective_ns", ctypes.c_int64),
        ("mpi_error", ctypes.c_int64),
        ("status", ctypes.c_int64 * STATUS_WORDS),
    ]


class StepCode(enum.IntEnum):
    """Mirror of ``enum mpitree_code`` in ``_native.h``: what ``mpitree_step_run`` returns.

    Codes up to ``MERGE_ERROR``: the agreement, where one is bound, held on every
    rank and the merge ran. :func:`mpitree._step_code.settle_code` acts on the others.
    """

    OK = 0  # out written
    FLAGGED = 1  # a rank's flag says it failed: out untouched
    MERGE_ERROR = 2  # the merge's MPI call failed (its code in mpi_error)
    UNBOUND = 3  # no merge is bound: nothing ran
    FINALIZED = 4  # MPI is finalized: nothing ran
    DISAGREED = 5  # the agreement's result (got) is not this rank's vector: nothing else ran
    AGREE_ERROR = 6  # MPI_Finalized or the agreement failed (mpi_error): nothing else ran


class StepLocal(enum.IntEnum):
    """Mirror of ``enum mpitree_local``: how a step gets this rank's records."""

    KERNEL = 0  # the kernel over the bound shard with this call's q, t and visibility
    COPY = 1  # nbytes of ``source`` copied in


class StepOutput(enum.IntEnum):
    """Mirror of ``enum mpitree_output``: what a step writes to ``out``."""

    LAYER = 0  # n / d in transformers' (B, Sq, Hq, D)
    HEADS = 1  # n / d in tree_decode's (B, Hq, Sq, D)
    RECORDS = 2  # the merged records


_view = MPI.buffer.frombuffer


def address(x):
    """Return the address of numpy array ``x``'s first element, as ``x.ctypes.data`` does.

    A C-contiguous array's comes through the buffer protocol (mpi4py's buffer view),
    about 6x cheaper than ``x.ctypes``, which builds a helper object on every use:
    this is on every decode step's path. Any other array's comes from ``x.ctypes``
    (the buffer protocol exports no other layout, and mpi4py's fallback refuses some
    dtypes).
    """
    if x.flags.c_contiguous:
        return _view(x, readonly=True).address
    return x.ctypes.data


def bind_call(fn, args, keep=()):
    """Return ``step(out) -> int``: the compiled ``int fn(args *, void *out)``, ``args`` bound.

    For ``mpitree_step_run`` (a decode layer's step, a recurring one-shot call's).
    Through ``mpitree._native_call`` where it was built from these sources (a
    CPython call: through ctypes, a later decode layer's step costs 2-3 us more on
    caches the model's dense layers cooled), else through ctypes (``fn``'s argtypes: a pointer to
    ``args``'s type, then ``c_void_p``). Either way the callable holds ``args``, a
    ctypes struct, alive, and ``keep`` (``step.keep``: what the struct's addresses
    point into), so a step kept past its owner still reads live memory.
    """
    if _native_call is not None and _CALL_STEP_SIZE == ctypes.sizeof(args):
        step = functools.partial(_native_call, ctypes.cast(fn, ctypes.c_void_p).value, args)
    else:
        step = functools.partial(fn, ctypes.byref(args))
    step.keep = keep
    return step


def library_path():
    """Return the path of the compiled library built for this interpreter, or None.

    Found through the import system, so only a file with this interpreter's
    extension suffix counts (a stray ``_native*.so`` of another build does not).
    """
    try:
        spec = importlib.util.find_spec("mpitree._native")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return None
    return spec.origin


def _load():
    """Open the library and declare its functions; return (lib, None) or (None, reason)."""
    if os.environ.get(NATIVE_ENV, "1") == "0":
        return None, f"disabled by {NATIVE_ENV}=0"
    path = library_path()
    if path is None:
        return None, "mpitree/_native*.so was not built (no C compiler at install time?)"
    try:
        lib = ctypes.CDLL(path)
        lib.mpitree_bind_slot.restype = ctypes.c_void_p
        lib.mpitree_bind_slot.argtypes = [ctypes.c_int] * 3
        lib.mpitree_nslots.restype = ctypes.c_int
        lib.mpitree_combine.restype = None
        lib.mpitree_combine.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        lib.mpitree_combine.argtypes += [ctypes.c_int, ctypes.c_int]
        lib.mpitree_merge_exp.restype = None
        lib.mpitree_merge_exp.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        lib.mpitree_merge_exp.argtypes += [ctypes.c_int64]
        lib.mpitree_finish_f32.restype = None
        lib.mpitree_finish_f32.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 4
        lib.mpitree_finish_f32.argtypes += [ctypes.c_void_p]
        lib.mpitree_attend_f32.restype = None
        lib.mpitree_attend_f32.argtypes = [ctypes.POINTER(AttnArgs)] + [ctypes.c_void_p] * 5
        lib.mpitree_step_local.restype = None
        lib.mpitree_step_local.argtypes = [ctypes.POINTER(StepArgs)]
        lib.mpitree_step_output.restype = None
        lib.mpitree_step_output.argtypes = [ctypes.POINTER(StepArgs), ctypes.c_void_p]
        lib.mpitree_step_run.restype = ctypes.c_int
        lib.mpitree_step_run.argtypes = [ctypes.POINTER(StepArgs), ctypes.c_void_p]
        lib.mpitree_attend_scratch.restype = ctypes.c_int64
        lib.mpitree_attend_scratch.argtypes = [ctypes.c_int64] * 2
        lib.mpitree_read_f32.restype = ctypes.c_float
        lib.mpitree_read_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        lib.mpitree_kernel_isa.restype = ctypes.c_char_p
        lib.mpitree_kernel_isa.argtypes = []
        lib.mpitree_fp_mode.restype = ctypes.c_int
        lib.mpitree_fp_mode.argtypes = []
        lib.mpitree_kernel_select.restype = ctypes.c_int
        lib.mpitree_kernel_select.argtypes = [ctypes.c_int]
        lib.mpitree_kernel_best.restype = ctypes.c_int
        lib.mpitree_kernel_best.argtypes = []
        lib.mpitree_kernel_read_order.restype = ctypes.c_int
        lib.mpitree_kernel_read_order.argtypes = [ctypes.c_int, ctypes.c_int]
        lib.mpitree_struct_size.restype = ctypes.c_int64
        lib.mpitree_struct_size.argtypes = [ctypes.c_int]
    except (OSError, AttributeError) as exc:
        return None, f"could not load {path}: {exc}"
    built = (lib.mpitree_struct_size(0), lib.mpitree_struct_size(1))
    mirrored = (ctypes.sizeof(StepArgs), ctypes.sizeof(AttnArgs))
    if built != mirrored:
        return None, (
            f"{path} was built from other sources (its step and kernel structs are {built} "
            f"bytes, mpitree's {mirrored}): rebuild it (pip install -e .)"
        )
    return lib, None


def native_lib():
    """Return the loaded library, or None when it is unavailable (loads once, under a lock)."""
    global _loaded, _lib, _error
    if not _loaded:
        with _lock:
            if not _loaded:
                _lib, _error = _load()
                _loaded = True
    return _lib


def load_error():
    """Return why the library is unavailable, or None when it is loaded."""
    native_lib()
    return _error
