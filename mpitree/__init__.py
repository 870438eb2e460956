"""mpitree: exact attention decoding over a sequence-sharded KV cache, merged by MPI.

Each rank computes the partial online-softmax state ``(m, d, n)`` of the queries
over its own keys; the states merge associatively across ranks in one
``MPI_Allreduce`` with a native user-defined op. Log-sum-exp values are natural
log throughout. Every function that communicates is collective over its
communicator and raises on every rank when any rank's input is invalid.
"""

from . import _registry, energy, extend, model, spec
from ._decode_plan import DecodePlan
from ._guard import RankError
from ._local import local_state
from ._oneshot import allreduce_state, tree_decode
from ._op import native_op_available
from ._reference import reference_attention
from ._runtime import default_comm, set_blas_threads
from ._state import State, combine

__version__ = "0.2.0"


def __getattr__(name):
    """``mpitree.STRATEGIES``: the names ``strategy=`` takes, ``"auto"`` first (a tuple).

    Read from the strategy registry, which ``mpitree._strategies`` fills with every
    strategy module the package holds.
    """
    if name == "STRATEGIES":
        return _registry.strategy_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "STRATEGIES",
    "DecodePlan",
    "RankError",
    "State",
    "__version__",
    "allreduce_state",
    "combine",
    "default_comm",
    "energy",
    "extend",
    "local_state",
    "model",
    "native_op_available",
    "reference_attention",
    "set_blas_threads",
    "spec",
    "tree_decode",
]
