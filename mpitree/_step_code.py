"""What a compiled step's return code does in Python: one function for every bound step."""

from __future__ import annotations

from mpi4py import MPI

from ._guard import raise_failure
from ._library import StepCode
from ._runtime import FINALIZED


def settle_code(code, comm, call):
    """Act on ``mpitree_step_run``'s nonzero ``code``: raise, or return what to settle.

    Parameters
    ----------
    code : int
        A :class:`~._library.StepCode` other than ``OK``.
    comm : mpi4py.MPI.Intracomm
        The merge's communicator (``FLAGGED``: every rank raises together).
    call : mpitree._library.StepArgs
        The step's struct: its ``mpi_error``, its agreement's ``got``.

    Returns
    -------
    bytes
        For ``DISAGREED`` on a step with an agreement: the agreement's result
        ``got``, which the caller settles as :func:`~._guard.agree` would.

    Raises
    ------
    Exception
        ``FLAGGED``: on every rank, as :func:`~._guard.raise_failure` does.
    mpi4py.MPI.Exception
        ``MERGE_ERROR`` or ``AGREE_ERROR``: an MPI call returned ``call.mpi_error``.
    RuntimeError
        ``FINALIZED``: MPI is finalized; any other code: an internal error (a
        bound step whose struct lacks its merge, or a code the step cannot return).
    """
    if code == StepCode.FLAGGED:
        raise_failure(comm, None)
    if code == StepCode.MERGE_ERROR or code == StepCode.AGREE_ERROR:
        raise MPI.Exception(call.mpi_error)
    if code == StepCode.FINALIZED:
        raise RuntimeError(FINALIZED)
    if code == StepCode.DISAGREED and call.allreduce:
        return bytes(call.got)
    raise RuntimeError(f"mpitree internal error: a compiled step returned {code}")
