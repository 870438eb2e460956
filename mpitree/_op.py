"""The (m, d, n) combine as an MPI user-defined reduction, native or numpy."""

import atexit
import ctypes
import glob
import os
import warnings

import numpy as np
from mpi4py import MPI

from ._records import combine_records

_NATIVE_ENV = "MPITREE_NATIVE_OP"
_lib = None  # ctypes handle of the compiled combine, or False when unavailable
_load_error = None
_ops = {}  # (dtype char, D) -> (MPI.Datatype record, MPI.Op, native: bool)
_next_slot = {32: 0, 64: 0}
_warned = False


def _find_library():
    """Return the path of the compiled combine built with the package, or None."""
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_native*.so")))
    return found[0] if found else None


def _native_lib():
    """Load the compiled combine once; return the ctypes library or None."""
    global _lib, _load_error
    if _lib is None:
        _lib = False
        if os.environ.get(_NATIVE_ENV, "1") == "0":
            _load_error = f"disabled by {_NATIVE_ENV}=0"
            return None
        path = _find_library()
        if path is None:
            _load_error = "mpitree/_native*.so was not built (no C compiler at install time?)"
            return None
        try:
            lib = ctypes.CDLL(path)
            lib.mpitree_bind_slot.restype = ctypes.c_void_p
            lib.mpitree_bind_slot.argtypes = [ctypes.c_int] * 3
            lib.mpitree_nslots.restype = ctypes.c_int
            lib.mpitree_combine.restype = None
            lib.mpitree_combine.argtypes = [
                ctypes.c_int,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_int,
                ctypes.c_int,
            ]
        except (OSError, AttributeError) as exc:
            _load_error = f"could not load {path}: {exc}"
            return None
        _lib = lib
    return _lib or None


def native_op_available():
    """Return whether the compiled MPI combine op is in use.

    Returns
    -------
    bool
        True when ``strategy="allreduce"`` runs the compiled C combine inside MPI;
        False when it falls back to a (slower) numpy Python op.
    """
    return _native_lib() is not None


def native_load_error():
    """Return why the native op is unavailable, or None when it is available."""
    _native_lib()
    return _load_error


def _mpi_op_create(fn_ptr):
    """Call MPI_Op_create from the MPI library mpi4py loaded; return an MPI.Op."""
    mpi = ctypes.CDLL(MPI.__file__)
    create = mpi.MPI_Op_create
    create.restype = ctypes.c_int
    create.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    size = MPI._sizeof(MPI.Op)
    handle = ctypes.create_string_buffer(size)
    err = create(fn_ptr, 1, handle)
    if err != 0:
        raise RuntimeError(f"MPI_Op_create failed with error code {err}")
    value = int.from_bytes(handle.raw, byteorder="little" if np.little_endian else "big")
    return MPI.Op.fromhandle(value)


def _python_op(dtype, dim):
    """Create the numpy fallback op (runs Python for every reduction step)."""

    def fn(inmem, inoutmem, datatype):
        a = np.frombuffer(inmem, dtype=dtype).reshape(-1, dim + 2)
        b = np.frombuffer(inoutmem, dtype=dtype).reshape(-1, dim + 2)
        b[...] = combine_records(a, b)

    return MPI.Op.Create(fn, commute=True)


def record_op(dtype, dim):
    """Return ``(record datatype, op)`` for records of ``dim + 2`` values of ``dtype``.

    Ops are created lazily, cached per (dtype, D) and freed at exit.
    """
    global _warned
    dtype = np.dtype(dtype)
    key = (dtype.char, int(dim))
    if key in _ops:
        return _ops[key][:2]
    base = MPI.FLOAT if dtype == np.float32 else MPI.DOUBLE
    rec = base.Create_contiguous(dim + 2).Commit()
    lib = _native_lib()
    if lib is not None:
        bits = dtype.itemsize * 8
        slot = _next_slot[bits]
        if slot >= lib.mpitree_nslots():
            rec.Free()
            raise RuntimeError(
                f"mpitree: all {lib.mpitree_nslots()} native op slots for float{bits} are in "
                f"use (one per distinct head dim); cannot create one for D={dim}"
            )
        _next_slot[bits] = slot + 1
        op = _mpi_op_create(lib.mpitree_bind_slot(bits, slot, dim))
    else:
        if not _warned:
            warnings.warn(
                f"mpitree: native MPI combine unavailable ({_load_error}); using a numpy "
                "Python op, about 3-5x slower per merge",
                RuntimeWarning,
                stacklevel=3,
            )
            _warned = True
        try:
            op = _python_op(dtype, dim)
        except MPI.Exception as exc:  # mpi4py caps Python user ops at 32
            rec.Free()
            raise RuntimeError(f"mpitree: cannot create another MPI user op: {exc}") from exc
    _ops[key] = (rec, op, lib is not None)
    return rec, op


@atexit.register
def _free_ops():
    """Free cached ops and datatypes before MPI finalizes."""
    if MPI.Is_finalized():
        return
    for rec, op, _ in _ops.values():
        op.Free()
        rec.Free()
    _ops.clear()
