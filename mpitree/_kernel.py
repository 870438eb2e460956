"""ctypes bridge to the compiled float32 local-attention kernel in ``_native.c``."""

import ctypes
import os
import time

import numpy as np

from ._op import _native_lib

_KERNEL_ENV = "MPITREE_LOCAL_KERNEL"  # "native" (default when built) or "numpy"


class _Args(ctypes.Structure):
    """Mirror of ``mpitree_attn_args``."""

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


def _lib():
    """Return the native library with kernel signatures set, or None."""
    lib = _native_lib()
    if lib is None or os.environ.get(_KERNEL_ENV, "native") == "numpy":
        return None
    if not hasattr(lib, "_mpitree_kernel_ready"):
        lib.mpitree_attend_f32.restype = None
        lib.mpitree_attend_f32.argtypes = [ctypes.POINTER(_Args)] + [ctypes.c_void_p] * 5
        lib.mpitree_attend_scratch.restype = ctypes.c_int64
        lib.mpitree_attend_scratch.argtypes = [ctypes.c_int64] * 2
        lib.mpitree_read_f32.restype = ctypes.c_float
        lib.mpitree_read_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        lib._mpitree_kernel_ready = True
    return lib


def native_kernel_available():
    """Return whether the compiled float32 local kernel is in use."""
    return _lib() is not None


def _strides(x):
    """Element strides of the batch, head and key axes of a (B, H, T, D) array."""
    return (ctypes.c_int64 * 3)(*(s // x.itemsize for s in x.strides[:3]))


def attend_native(q, k, v, scale, lens, vis, out):
    """Run the C kernel if it applies (float32 K/V); return False to fall back to numpy."""
    lib = _lib()
    if lib is None or k.dtype != np.float32 or out.dtype != np.float32:
        return False
    q = np.ascontiguousarray(q, dtype=np.float32)
    b, hq, sq, dim = q.shape
    args = _Args(
        b, hq, k.shape[1], sq, dim, _strides(k), _strides(v), None, k.shape[2], None, 0, scale
    )
    if lens is not None:
        lens = np.ascontiguousarray(lens, dtype=np.int64)
        args.lens = lens.ctypes.data
    if vis is not None:
        vis = np.ascontiguousarray(vis)
        args.vis = vis.ctypes.data
        args.vis_heads = vis.shape[1]
    scratch = np.empty(lib.mpitree_attend_scratch(hq // k.shape[1] * sq, dim), np.float32)
    lib.mpitree_attend_f32(
        ctypes.byref(args),
        q.ctypes.data,
        k.ctypes.data,
        v.ctypes.data,
        out.ctypes.data,
        scratch.ctypes.data,
    )
    return True


def read_seconds(x):
    """Stream-read a contiguous float32 array once with the compiled loop; return seconds."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("mpitree: the native library is not built")
    t0 = time.perf_counter()
    lib.mpitree_read_f32(x.ctypes.data, x.size)
    return time.perf_counter() - t0
