"""Process-wide runtime: the library-private communicator, BLAS thread limits, MPI's calls."""

import atexit
import ctypes
import os
import threading

from mpi4py import MPI

_THREADS_ENV = "MPITREE_BLAS_THREADS"
_lock = threading.Lock()
_default_comm = None
_blas_threads = None  # threads set so far in this process, or None
_request_calls = False  # not looked up yet
_initialized = False  # MPI was seen initialized


def check_mpi_usable():
    """Raise ``RuntimeError`` unless MPI is initialized and not yet finalized (local).

    Any MPI call outside that window aborts the process from inside the MPI
    library; mpitree's entry points call this first, on every rank that calls them.
    """
    global _initialized
    if MPI.Is_finalized():
        raise RuntimeError(
            "mpitree: MPI has been finalized (MPI.Finalize() was called), and no MPI call "
            "may follow it; decode before finalizing, or let mpi4py finalize at exit"
        )
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


@atexit.register
def _free_default_comm():
    """Free the private communicator before MPI finalizes."""
    global _default_comm
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


def request_calls():
    """Return ``(MPI_Start, MPI_Wait, size of an MPI_Status)`` of the MPI that mpi4py loaded.

    The two are addresses, found in the libraries mpi4py's extension module
    loaded (whichever MPI it runs on); both take pointers only (to a request's
    handle, to a status), so a compiled caller needs no ``mpi.h``. None where
    they cannot be found. Looked up once.
    """
    global _request_calls
    if _request_calls is False:
        try:
            lib = ctypes.CDLL(MPI.__file__)
            found = (lib.MPI_Start, lib.MPI_Wait)
            start, wait = (ctypes.cast(f, ctypes.c_void_p).value for f in found)
            _request_calls = (start, wait, MPI._sizeof(MPI.Status))
        except (OSError, AttributeError, TypeError):
            _request_calls = None
    return _request_calls
