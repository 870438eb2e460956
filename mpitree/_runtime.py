"""Process-wide runtime: the private communicator, BLAS threads, MPI's window, MPI calls."""

import atexit
import ctypes
import os
import threading

from mpi4py import MPI

_THREADS_ENV = "MPITREE_BLAS_THREADS"
_lock = threading.Lock()
_default_comm = None
_blas_threads = None  # threads set so far in this process, or None
_mpi_calls = False  # not looked up yet
_initialized = False  # MPI was seen initialized
FINALIZED = (
    "mpitree: MPI has been finalized (MPI.Finalize() was called), and no MPI call may "
    "follow it; decode before finalizing, or let mpi4py finalize at exit"
)


def check_mpi_usable():
    """Raise ``RuntimeError`` unless MPI is initialized and not yet finalized (local).

    Any MPI call outside that window aborts the process from inside the MPI
    library; mpitree's entry points call this first, on every rank that calls them.
    """
    global _initialized
    if MPI.Is_finalized():
        raise RuntimeError(FINALIZED)
    if not _initialized:  # once initialized, MPI stays so (finalized is checked above)
        if not MPI.Is_initialized():
            raise RuntimeError(
                "mpitree: MPI is not initialized (mpi4py.rc.initialize = False?); call "
                "MPI.Init() or MPI.Init_thread() first"
            )
        _initialized = True


def default_comm() -> MPI.Intracomm:
    """Return mpitree's private duplicate of ``COMM_WORLD`` (created on first use).

    Library traffic on it never matches the user's own messages on ``COMM_WORLD``.
    Creating it is collective over ``COMM_WORLD``: the first call must happen on
    every rank (any mpitree call with ``comm=None`` does that).

    Raises
    ------
    RuntimeError
        After ``MPI.Finalize()``, or before MPI is initialized.
    """
    global _default_comm
    check_mpi_usable()
    if _default_comm is None:
        with _lock:
            if _default_comm is None:
                comm = MPI.COMM_WORLD.Dup()
                comm.Set_name("mpitree")
                _default_comm = comm
    return _default_comm


_BEFORE_FREE = []  # run at exit before the private communicator is freed


def before_comm_free(fn):
    """Run ``fn()`` at exit before the private communicator is freed (a decorator).

    What holds requests on it frees them here: a merger's own finalizer may run
    after this module's exit hook (``weakref.finalize`` runs its finalizers from
    an exit hook of its own, registered first where another library made one
    before mpitree was imported), and MPICH aborts freeing a request whose
    communicator is gone.
    """
    _BEFORE_FREE.append(fn)
    return fn


@atexit.register
def _free_default_comm():
    """Free the private communicator before MPI finalizes (its requests first)."""
    global _default_comm
    if not MPI.Is_finalized():
        for fn in _BEFORE_FREE:
            fn()
    if _default_comm is not None and not MPI.Is_finalized():
        _default_comm.Free()
    _default_comm = None


def set_blas_threads(n: int) -> None:
    """Limit the BLAS threads this process uses for local attention.

    By default mpitree divides the node's cores among the ranks sharing it (at
    least 1 each) the first time a plan is built, because ranks that each start a
    full-size BLAS pool oversubscribe the node (measured: ~30x slower). Call this
    (or set ``MPITREE_BLAS_THREADS``) to choose yourself; it overrides the default.

    Parameters
    ----------
    n : int
        Threads per process, >= 1.
    """
    global _blas_threads
    n = int(n)
    if n < 1:
        raise ValueError(f"BLAS threads must be >= 1, got {n}")
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=n, user_api="blas")
    _blas_threads = n


# Launchers export how many ranks share this node: Hydra (MPICH), Open MPI's prte,
# Slurm's srun (e.g. "4(x2)" or "4,3"), Intel MPI / PMI.
_LOCAL_SIZE_VARS = (
    "MPI_LOCALNRANKS",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "SLURM_STEP_TASKS_PER_NODE",
    "PMI_LOCAL_SIZE",
)


def ranks_on_node():
    """Return how many ranks share this node, read from the launcher's environment.

    No communication, so it is safe to call from any rank at any time. Without a
    known launcher variable: 1 when this is a singleton run, otherwise the world
    size (a conservative guess).
    """
    for var in _LOCAL_SIZE_VARS:
        value = os.environ.get(var, "")
        digits = value.split("(")[0].split(",")[0]
        if digits.isdigit() and int(digits) > 0:
            return int(digits)
    return MPI.COMM_WORLD.Get_size()


def limit_blas_threads():
    """Apply the default BLAS thread limit once per process (no communication)."""
    if _blas_threads is not None:
        return
    env = os.environ.get(_THREADS_ENV)
    if env:
        set_blas_threads(env)
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    set_blas_threads(max(1, (cores or 1) // ranks_on_node()))


def _address(lib, name):
    """Return the address of symbol ``name`` in ``lib``'s scope, or None."""
    try:
        return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
    except AttributeError:
        return None


def mpi_calls(status_bytes=None):
    """Return the addresses of ``MPI_Start``, ``MPI_Wait``, ``MPI_Finalized``, ``MPI_Allreduce``.

    The first three take pointers only (to a request's handle, to a status, to
    an int), so a compiled caller needs no ``mpi.h``; ``MPI_Allreduce`` takes
    handles by value, which its caller must pass as the MPI's handle type
    (``MPI._sizeof(MPI.Comm)`` bytes). They are looked up, once, in
    the libraries mpi4py's extension module loaded; but where the process's
    global scope holds that same MPI library (its ``PMPI_Start`` is the same),
    there, so that a profiling tool preloaded over ``MPI_Start`` sees these calls
    as it sees mpi4py's.

    Parameters
    ----------
    status_bytes : int, optional
        The room the caller has for an ``MPI_Status`` (None: it calls no
        ``MPI_Wait``).

    Returns
    -------
    tuple of int or None
        ``(MPI_Start, MPI_Wait, MPI_Finalized, MPI_Allreduce)``; None where they are not found
        or an ``MPI_Status`` needs more than ``status_bytes``.
    """
    global _mpi_calls
    if _mpi_calls is False:
        found = None
        try:
            mpi4py_scope, global_scope = ctypes.CDLL(MPI.__file__), ctypes.CDLL(None)
            pmpi = _address(mpi4py_scope, "PMPI_Start")
            same = pmpi is not None and _address(global_scope, "PMPI_Start") == pmpi
            scope = global_scope if same else mpi4py_scope
            names = ("Start", "Wait", "Finalized", "Allreduce")
            found = tuple(_address(scope, f"MPI_{name}") for name in names)
        except OSError:
            pass
        ok = found is not None and None not in found
        _mpi_calls = (found, MPI._sizeof(MPI.Status)) if ok else None
    if _mpi_calls is None or (status_bytes is not None and _mpi_calls[1] > status_bytes):
        return None
    return _mpi_calls[0]
