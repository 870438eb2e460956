"""The (m, d, n) combine as an MPI user-defined reduction: compiled C, or a numpy fallback.

Thread contract: creating ops is serialised by a lock (the slot table and the op
cache are shared by all threads); using them is as thread-safe as the MPI
library's own thread level.
"""

from __future__ import annotations

import atexit
import ctypes
import sys
import threading
import warnings

import numpy as np
from mpi4py import MPI

from ._library import load_error, native_lib
from ._options import dtype_name
from ._state import N, combine_records

_lock = threading.Lock()
_ops = {}  # (dtype name, record width) -> (MPI.Datatype record, MPI.Op)
_next_slot = {32: 0, 64: 0}
_warned = False


def native_op_available() -> bool:
    """Return whether the compiled MPI combine op is in use.

    Returns
    -------
    bool
        True when ``strategy="allreduce"`` runs the compiled C combine inside MPI;
        False when it falls back to a (slower) numpy Python op.
    """
    return native_lib() is not None


def _mpi_op_create(fn_ptr):
    """Call MPI_Op_create from the MPI library mpi4py loaded; return an MPI.Op."""
    create = ctypes.CDLL(MPI.__file__).MPI_Op_create
    create.restype = ctypes.c_int
    create.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    handle = ctypes.create_string_buffer(MPI._sizeof(MPI.Op))
    err = create(fn_ptr, 1, handle)
    if err != 0:
        raise RuntimeError(f"MPI_Op_create failed with error code {err}")
    return MPI.Op.fromhandle(int.from_bytes(handle.raw, byteorder=sys.byteorder))


def python_op(dtype, width):
    """Return ``(record datatype, op)``: the numpy fallback combine, built together.

    The op runs :func:`~mpitree._state.combine_records` in Python per reduction.
    Its user function never raises (an exception there aborts the MPI job): it takes
    the record width from the datatype MPI hands it, so it merges whole records of
    any count, and its own datatype is the one to pair it with. Whatever it cannot
    merge (a datatype that is not whole records, or anything numpy raises on) it
    writes as NaN, which a flagged merge reports as a failure on every rank.

    Parameters
    ----------
    dtype : numpy dtype
        float32 or float64.
    width : int
        Values per record, ``D + 2`` (at least 2).

    Returns
    -------
    rec : mpi4py.MPI.Datatype
        The committed contiguous record datatype of ``width`` values.
    op : mpi4py.MPI.Op
        The commutative op; the caller frees both.
    """
    dtype = np.dtype(dtype)
    itemsize = dtype.itemsize

    def fn(inmem, inoutmem, datatype):
        ours = np.frombuffer(inoutmem, dtype=np.uint8)
        try:
            record = datatype.Get_size() // itemsize  # this call's width, from its datatype
            if record < 2 or ours.size % (record * itemsize):
                raise ValueError("the datatype is not whole (m, d, n) records of this dtype")
            a = np.frombuffer(inmem, dtype=dtype).reshape(-1, record)
            b = ours.view(dtype).reshape(-1, record)
            with np.errstate(all="ignore"):
                b[...] = combine_records(a, b)
        except Exception:  # never out of a user function (MPI would abort): NaN, reported
            ours[...] = 0xFF  # all-ones bytes: a NaN in float32 and in float64

    return _paired(dtype, width, lambda: MPI.Op.Create(fn, commute=True))


def _paired(dtype, width, make_op):
    """Return ``(record datatype, make_op())``; the datatype is freed if no op is made."""
    base = MPI.FLOAT if dtype == np.float32 else MPI.DOUBLE
    rec = base.Create_contiguous(width).Commit()
    try:
        return rec, make_op()
    except Exception:
        rec.Free()
        raise


def record_op(dtype, width):
    """Return ``(record datatype, op)`` for records of ``width = D + 2`` values of ``dtype``.

    Ops are created once per (dtype, width) under a lock, and freed at exit.

    Raises
    ------
    RuntimeError
        When no op can be created: all native slots for this dtype are bound to
        other widths, or MPI refuses another Python op.
    """
    key = (dtype_name(dtype), int(width))
    found = _ops.get(key)
    if found is not None:
        return found
    with _lock:
        if key not in _ops:
            _ops[key] = _create(np.dtype(key[0]), key[1])
        return _ops[key]


def _create(dtype, width):
    """Create the datatype and op for one key (caller holds the lock)."""
    global _warned
    lib = native_lib()
    bits = dtype.itemsize * 8
    if lib is not None and _next_slot[bits] >= lib.mpitree_nslots():
        raise RuntimeError(
            f"mpitree: all {lib.mpitree_nslots()} native op slots for float{bits} are in use "
            f"(one per distinct record width); cannot create one for width {width}"
        )

    def native_op():
        slot = _next_slot[bits]
        _next_slot[bits] = slot + 1
        return _mpi_op_create(lib.mpitree_bind_slot(bits, slot, width - N.start))

    try:
        if lib is not None:
            return _paired(dtype, width, native_op)
        if not _warned:
            warnings.warn(
                f"mpitree: native MPI combine unavailable ({load_error()}); using a numpy "
                "Python op, about 3-5x slower per merge",
                RuntimeWarning,
                stacklevel=4,
            )
            _warned = True
        return python_op(dtype, width)
    except Exception as exc:
        raise RuntimeError(f"mpitree: cannot create an MPI op for width {width}: {exc}") from exc


@atexit.register
def _free_ops():
    """Free cached ops and datatypes before MPI finalizes."""
    if MPI.Is_finalized():
        return
    with _lock:
        for rec, op in _ops.values():
            op.Free()
            rec.Free()
        _ops.clear()
