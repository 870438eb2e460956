"""ctypes bridge to the compiled float32 local-attention kernel in ``_native_kernel.c``."""

from __future__ import annotations

import ctypes
import operator
import os
import threading
import time

import numpy as np

from ._library import AttnArgs, address, native_lib
from ._traffic import hook

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
    """Return which build of the compiled kernel runs on this CPU (local).

    Returns
    -------
    str
        E.g. ``"x86-64-v4 (AVX-512)"``, or ``"numpy (no compiled kernel)"`` without
        the compiled library. Invariant mode's results depend on its arithmetic
        (see `kernel_arithmetic`).
    """
    lib = _lib()
    return "numpy (no compiled kernel)" if lib is None else lib.mpitree_kernel_isa().decode()


_SUBNORMALS = (
    "",
    ", subnormal results flushed to zero",
    ", subnormal inputs read as zero",
    ", subnormals flushed to zero",
)
_ROUNDING = ("", ", rounding down", ", rounding up", ", rounding toward zero")


def kernel_arithmetic():
    """Return the arithmetic whose bits the local kernel gives (local).

    Invariant mode's results depend on it, so ranks agree on it: the x86-64-v3 and v4
    builds fuse every product into its sum and give the same bits, the baseline and
    portable builds fuse none, on every compiler (``tests/test_kernel.py`` holds both
    with golden hashes). The calling thread's floating-point mode joins it where the
    compiled library is loaded: flushing subnormals to zero (what
    ``torch.set_flush_denormal(True)`` sets, or loading another library linked with
    ``-ffast-math``) or another rounding direction changes the bits of the kernel, the
    merge and numpy alike. It is read on each call.

    Returns
    -------
    str
        ``"C kernel, fused multiply-adds"``, ``"C kernel, unfused"``, or
        ``"numpy (no compiled kernel)"`` (the kernel forced to numpy, or no compiled
        library), followed by e.g. ``", subnormals flushed to zero"`` or
        ``", rounding up"`` when the thread's mode is not IEEE's default.
    """
    isa = kernel_isa()
    if native_kernel_available():
        fused = isa.startswith(("x86-64-v4", "x86-64-v3"))
        isa = "C kernel, fused multiply-adds" if fused else "C kernel, unfused"
    lib = native_lib()
    if lib is None:
        return isa
    mode = lib.mpitree_fp_mode()
    return isa + _SUBNORMALS[mode & 3] + _ROUNDING[(mode >> 2) & 3]


# Builds of the compiled kernel, best first: x86-64-v4 (AVX-512), x86-64-v3 (AVX2, FMA),
# and the baseline (x86-64 SSE2, or portable C off x86-64 / without GCC).
ISA_LEVELS = (4, 3, 1)


def kernel_levels():
    """Return the builds of the compiled kernel this CPU can run, best first (local).

    Returns
    -------
    tuple of int
        A subset of ``(4, 3, 1)``: x86-64-v4 (AVX-512), x86-64-v3 (AVX2, FMA), the
        baseline. Empty without the compiled library.
    """
    lib = _lib()
    if lib is None:
        return ()
    best = lib.mpitree_kernel_best()
    return tuple(level for level in ISA_LEVELS if level <= best)


def select_kernel(level=0):
    """Make build ``level`` of the compiled kernel the one that runs (local, process-wide).

    For tests and benchmarks: not safe while another thread runs the kernel, and
    invariant mode needs every rank on the same build.

    Parameters
    ----------
    level : int
        4, 3 or 1 (see `kernel_levels`); 0 for the best this CPU supports. A level
        above the best is lowered to it.

    Returns
    -------
    int
        The level in use.

    Raises
    ------
    TypeError
        ``level`` is not an integer (a bool, a float, a string).
    ValueError
        ``level`` is not 0, 1, 3 or 4.
    RuntimeError
        Without the compiled library.
    """
    level = _checked_level(level)
    lib = _lib()
    if lib is None:
        raise RuntimeError("mpitree: the native library is not built")
    return lib.mpitree_kernel_select(level)


def _checked_level(level):
    """Return ``level`` as an int if it is 0, 4, 3 or 1; raise TypeError/ValueError if not."""
    if isinstance(level, bool) or not hasattr(type(level), "__index__"):
        raise TypeError(f"mpitree: a kernel level is an int, not {type(level).__name__}")
    level = operator.index(level)
    if level not in (0, *ISA_LEVELS):
        raise ValueError(f"mpitree: kernel level {level} is not one of 0, 4, 3, 1")
    return level


_READ_ORDERS = {1: "address order", 0: "prefetch", -1: "undecided"}
_FORCE = {None: -2, "address order": 1, "prefetch": 0, "timed": -1}


def kernel_read_order(force=None, level=0):
    """Return how the compiled kernel reads one row per KV head over contiguous keys (local).

    Such calls (MHA, one query) can read K and V in address order, leaving the
    fetching to the hardware prefetcher, or prefetch in software: the same sums, bit
    for bit, but which is faster differs between machines. The process times both
    ways, in turn, on its first 8 such calls that read at least 8 MiB, and keeps the
    faster; other such calls before then read in address order.

    Parameters
    ----------
    force : {None, "address order", "prefetch", "timed"}, optional
        For tests and benchmarks (process-wide, every build; not while another
        thread runs the kernel): use one way from now on, or ``"timed"`` to go back
        to the timed choice, timing afresh. None changes nothing.
    level : int, optional
        The kernel build asked about (4, 3 or 1, lowered to the best this CPU runs,
        as `select_kernel` does); 0 for the one selected.

    Returns
    -------
    str
        ``"address order"``, ``"prefetch"``, or ``"undecided"`` while the timed
        choice has not been made.

    Raises
    ------
    TypeError
        ``level`` is not an integer.
    ValueError
        ``force`` is not one of the above, or ``level`` not 0, 4, 3 or 1.
    RuntimeError
        Without the compiled library.
    """
    if not isinstance(force, (str, type(None))) or force not in _FORCE:
        names = ", ".join(repr(f) for f in _FORCE)
        raise ValueError(f"mpitree: force is one of {names}, not {force!r}")
    level = _checked_level(level)
    lib = _lib()
    if lib is None:
        raise RuntimeError("mpitree: the native library is not built")
    return _READ_ORDERS[lib.mpitree_kernel_read_order(_FORCE[force], level)]


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
    The call is the ``"kernel"`` phase of an observer on :data:`~._traffic.hook`.
    """
    observer = hook.observer
    if observer is not None and observer.enter("kernel"):
        return observer.timed("kernel", attend_native, q, k, v, scale, lens, vis, out)
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
        lens_ptr = address(lens)
    if vis is not None:
        vis = np.ascontiguousarray(vis)
        if vis.shape != (b, vis.shape[1], sq, k.shape[2]) or vis.shape[1] not in (1, hq):
            raise ValueError(  # the kernel reads (B, 1 or Hq, Sq, T): never past its end
                f"mpitree: visibility of shape {vis.shape} for q {q.shape} and T={k.shape[2]}"
            )
        vis_ptr, vis_heads = address(vis), vis.shape[1]
    hkv = k.shape[1]
    args = AttnArgs(
        b, hq, hkv, sq, dim, _I64x3(*k_strides), _I64x3(*v_strides), lens_ptr, k.shape[2]
    )
    args.vis, args.vis_heads, args.scale = vis_ptr, vis_heads, scale
    scratch = _scratch(lib.mpitree_attend_scratch(hq // hkv * sq, dim))
    lib.mpitree_attend_f32(
        ctypes.byref(args),
        address(q),
        address(k),
        address(v),
        address(out),
        address(scratch),
    )
    return True


def _unit_strides(x):
    """Element strides (batch, head, key) of a 4-d array, whatever its length; None if unusable."""
    size = x.itemsize
    sb, sh, st, sd = x.strides
    if (sd != size and x.shape[3] > 1) or sb % size or sh % size or st % size:
        return None
    return (sb // size, sh // size, st // size)


class Prepared:
    """The C kernel's arguments for one validated layout, reused step after step.

    A decode loop calls the kernel with the same shapes, dtype and strides every
    step (only the shard length ``T`` may grow): this holds the argument struct,
    the scratch and the bound function, so a step only sets ``T``, the lengths
    pointer and the data pointers. Built only for host float32 numpy arrays with
    whole-element strides and a C-contiguous ``q``; None otherwise (see :meth:`of`,
    the way to build one). :meth:`run` and :meth:`run_raw` check nothing; each
    call is the ``"kernel"`` phase of an observer on :data:`~._traffic.hook`.

    Parameters
    ----------
    lib : ctypes.CDLL
        The compiled library whose ``mpitree_attend_f32`` runs.
    q : numpy.ndarray
        float32 ``(B, Hq, Sq, D)``: the bound shape.
    k, v : numpy.ndarray
        float32 ``(B, Hkv, T, D)``: ``Hkv`` divides ``Hq``.
    scale : float
        The score scale.
    ks, vs : tuple of int
        K's and V's ``(batch, head, key)`` strides in elements (unit stride
        along ``D``), as every later step's K and V must have them.
    """

    __slots__ = (
        "_fn",
        "_k",
        "_kp",
        "_o",
        "_op",
        "_ref",
        "_sp",
        "_v",
        "_vp",
        "args",
        "lens",
        "scratch",
    )

    def __init__(self, lib, q, k, v, scale, ks, vs):
        b, hq, sq, dim = q.shape
        hkv = k.shape[1]
        self.args = AttnArgs(b, hq, hkv, sq, dim, _I64x3(*ks), _I64x3(*vs), 0, k.shape[2])
        self.args.vis, self.args.vis_heads, self.args.scale = 0, 0, scale
        self.scratch = np.empty(lib.mpitree_attend_scratch(hq // hkv * sq, dim), np.float32)
        self.lens = np.zeros(b, np.int64)
        self._ref = ctypes.byref(self.args)
        self._fn = lib.mpitree_attend_f32
        self._sp = address(self.scratch)
        self._k = self._v = self._o = None
        self._kp = self._vp = self._op = 0

    @classmethod
    def of(cls, q, k, v, scale, lib=None):
        """Return a :class:`Prepared` for these (already validated) arrays, or None.

        Parameters
        ----------
        q : numpy.ndarray
            float32 ``(B, Hq, Sq, D)``, C-contiguous.
        k, v : numpy.ndarray
            float32 ``(B, Hkv, T, D)``, unit stride along ``D``.
        scale : float
            The score scale.
        lib : ctypes.CDLL, optional
            Another build of the compiled library to run (benchmarks: an older
            commit's ``mpitree/_native*.so``), with ``mpitree_attend_f32``'s six
            arguments declared as pointers and ``mpitree_attend_scratch``
            returning ``c_int64``; this build's by default.

        Returns
        -------
        Prepared or None
            None without the compiled library or for other arrays; then
            :meth:`run` (``out``: float32 ``(B, Hq, Sq, D + 2)`` records, C order)
            is not available and the caller takes the general path.
        """
        lib = _lib() if lib is None else lib
        if lib is None or not all(type(x) is np.ndarray for x in (q, k, v)):
            return None
        if not (q.dtype == k.dtype == v.dtype == np.float32) or not q.flags.c_contiguous:
            return None
        ks, vs = _unit_strides(k), _unit_strides(v)
        if ks is None or vs is None:
            return None
        return cls(lib, q, k, v, scale, ks, vs)

    def run_raw(self, q, k, v, t, out, lens=None, vis=None):
        """Run the kernel on raw data addresses of the bound layout, with ``T = t``.

        Unchecked: nothing about the memory behind the addresses is verified. A
        wrong address, a buffer too small or a layout other than the bound one
        reads or writes out of bounds (a crash or silent corruption, not an
        exception). For benchmarks timing the bare C call.

        Parameters
        ----------
        q : int
            Address of float32 ``(B, Hq, Sq, D)`` queries, C order.
        k, v : int
            Addresses of float32 K and V ``(B, Hkv, T, D)`` with the strides
            this was built for (``ks``, ``vs``), holding at least ``t`` keys.
        t : int
            The shard length ``T`` (keys per row), ``t >= 0``.
        out : int
            Address of the float32 ``(B * Hq * Sq, D + 2)`` records, C order.
        lens, vis : numpy.ndarray or None
            As :meth:`run` takes them (arrays, not addresses).
        """
        observer = hook.observer
        if observer is not None and observer.enter("kernel"):
            return observer.timed("kernel", self.run_raw, q, k, v, t, out, lens, vis)
        args = self.args
        args.t = t
        args.lens = None if lens is None else address(lens)
        if vis is None:
            args.vis, args.vis_heads = None, 0
        else:
            args.vis, args.vis_heads = address(vis), vis.shape[1]
        self._fn(self._ref, q, k, v, out, self._sp)

    def run(self, q, k, v, lens, out, vis=None):
        """Write the records of ``q`` over ``(k, v)`` into ``out``.

        Unchecked: the caller has validated the arrays (shapes, dtype, strides
        as when built, ``lens`` in range); nothing is checked here, and other
        arrays read or write out of bounds (a crash or silent corruption, not an
        exception). :meth:`of` and the plan's kernel slot are the checked way
        in.

        Parameters
        ----------
        q : numpy.ndarray
            float32 ``(B, Hq, Sq, D)``, C-contiguous, the bound shape.
        k, v : numpy.ndarray
            float32 ``(B, Hkv, T, D)``, the strides this was built for; ``T``
            may differ from the build's.
        lens : numpy.ndarray or None
            int64 ``(B,)`` valid keys per batch row, each in ``[0, T]``; None
            for all ``T``.
        out : numpy.ndarray
            float32 ``(B * Hq * Sq, D + 2)`` records (any shape of that size),
            C-contiguous; written, one record ``(m, n, d...)`` per query row.
        vis : numpy.ndarray or None
            bool ``(B, Hm, Sq, T)``, C-contiguous, ``Hm`` 1 or Hq: the keys each
            row sees (True); None for every key.
        """
        observer = hook.observer
        if observer is not None and observer.enter("kernel"):
            return observer.timed("kernel", self.run, q, k, v, lens, out, vis)
        if k is not self._k:  # a cache is usually the same array step after step
            self._k, self._kp = k, address(k)
        if v is not self._v:
            self._v, self._vp = v, address(v)
        if out is not self._o:
            self._o, self._op = out, address(out)
        args = self.args
        args.t = k.shape[2]
        args.lens = None if lens is None else address(lens)
        if vis is None:
            args.vis, args.vis_heads = None, 0
        else:
            args.vis, args.vis_heads = address(vis), vis.shape[1]
        self._fn(self._ref, address(q), self._kp, self._vp, self._op, self._sp)


def read_seconds(x):
    """Stream-read a contiguous float32 array once with the compiled loop; return seconds.

    The read floor of the local kernel: K and V read once each bound its time.

    Parameters
    ----------
    x : numpy.ndarray
        C-contiguous float32, any shape (an ``np.ndarray`` itself, not a subclass).

    Returns
    -------
    float
        Wall seconds of one pass.

    Raises
    ------
    TypeError
        If ``x`` is not a float32 ``numpy.ndarray``.
    ValueError
        If ``x`` is not C-contiguous.
    RuntimeError
        Without the compiled library.
    """
    if type(x) is not np.ndarray or x.dtype != np.float32:
        what = type(x).__name__ if type(x) is not np.ndarray else f"{x.dtype} array"
        raise TypeError(f"mpitree: read_seconds takes a float32 numpy array, not {what}")
    if not x.flags.c_contiguous:
        raise ValueError("mpitree: read_seconds takes a C-contiguous array")
    lib = _lib()
    if lib is None:
        raise RuntimeError("mpitree: the native library is not built")
    t0 = time.perf_counter()
    lib.mpitree_read_f32(address(x), x.size)
    return time.perf_counter() - t0
