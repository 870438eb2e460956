"""ctypes bridge to the compiled float32 local-attention kernel in ``_native.c``."""

from __future__ import annotations

import ctypes
import os
import threading
import time

import numpy as np

from ._library import AttnArgs, native_lib

KERNEL_ENV = "MPITREE_LOCAL_KERNEL"  # "native" (default when built) or "numpy"
_local = threading.local()  # per-thread scratch buffer of the kernel
_I64x3 = ctypes.c_int64 * 3


def _lib():
    """Return the native library unless the numpy kernel is forced, else None."""
    if os.environ.get(KERNEL_ENV, "native") == "numpy":
        return None
    return native_lib()


def _scratch(n):
    """Return this thread's float32 scratch of at least ``n`` values (grown, never shrunk)."""
    buf = getattr(_local, "scratch", None)
    if buf is None or buf.size < n:
        buf = _local.scratch = np.empty(max(n, 1 << 16), np.float32)
    return buf


def native_kernel_available():
    """Return whether the compiled float32 local kernel is in use."""
    return _lib() is not None


def kernel_isa():
    """Return which build of the compiled kernel runs on this CPU (e.g. "x86-64-v3 (AVX2, FMA)")."""
    lib = _lib()
    return "numpy (no compiled kernel)" if lib is None else lib.mpitree_kernel_isa().decode()


def _element_strides(x):
    """Batch, head and key strides of a (B, H, T, D) array in elements, or None if not whole."""
    if x.size == 0:
        return (0, 0, 0)
    sb, sh, st, sd = x.strides
    size = x.itemsize
    if (sd != size and x.shape[3] > 1) or sb % size or sh % size or st % size:
        return None  # e.g. a field of a structured array: not addressable in elements
    return (sb // size, sh // size, st // size)


def attend_native(q, k, v, scale, lens, vis, out):
    """Run the C kernel on host float32 inputs into ``out`` records; False if it does not apply.

    K/V views whose strides are not whole elements are copied first (never misread).
    """
    lib = _lib()
    if lib is None or k.dtype != np.float32 or out.dtype != np.float32:
        return False
    k_strides, v_strides = _element_strides(k), _element_strides(v)
    if k_strides is None:
        k = np.ascontiguousarray(k)
        k_strides = _element_strides(k)
    if v_strides is None:
        v = np.ascontiguousarray(v)
        v_strides = _element_strides(v)
    q = np.ascontiguousarray(q, dtype=np.float32)
    b, hq, sq, dim = q.shape
    lens_ptr = vis_ptr = vis_heads = 0
    if lens is not None:
        lens = np.ascontiguousarray(lens, dtype=np.int64)
        lens_ptr = lens.ctypes.data
    if vis is not None:
        vis = np.ascontiguousarray(vis)
        vis_ptr, vis_heads = vis.ctypes.data, vis.shape[1]
    hkv = k.shape[1]
    args = AttnArgs(
        b, hq, hkv, sq, dim, _I64x3(*k_strides), _I64x3(*v_strides), lens_ptr, k.shape[2]
    )
    args.vis, args.vis_heads, args.scale = vis_ptr, vis_heads, scale
    scratch = _scratch(lib.mpitree_attend_scratch(hq // hkv * sq, dim))
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
