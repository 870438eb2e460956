"""ctypes bridge to the compiled float32 local-attention kernel in ``_native.c``."""

from __future__ import annotations

import ctypes
import os
import time

import numpy as np

from ._library import AttnArgs, native_lib

KERNEL_ENV = "MPITREE_LOCAL_KERNEL"  # "native" (default when built) or "numpy"


def _lib():
    """Return the native library unless the numpy kernel is forced, else None."""
    if os.environ.get(KERNEL_ENV, "native") == "numpy":
        return None
    return native_lib()


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
        return [0, 0, 0]
    if x.strides[3] != x.itemsize and x.shape[3] > 1:
        return None
    if any(s % x.itemsize for s in x.strides[:3]):
        return None  # e.g. a field of a structured array: not addressable in elements
    return [s // x.itemsize for s in x.strides[:3]]


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
    args = AttnArgs(b, hq, k.shape[1], sq, dim, (ctypes.c_int64 * 3)(*k_strides))
    args.v_strides = (ctypes.c_int64 * 3)(*v_strides)
    args.t, args.scale = k.shape[2], scale
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
