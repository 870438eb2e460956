"""Cross-rank merge strategies: one module each, one registry, one rule for ``"auto"``."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
from mpi4py import MPI

from .._options import STRATEGIES
from .._topology import layout

REGISTRY: dict = {}

# Without the native op, gathering p states and merging locally measured as fast as
# or faster than Algorithm 3 for p <= 8 (README, "Choosing a strategy"); past that
# the all-gather's p-fold volume and O(p) merge lose to log-depth all-reduces.
ALLGATHER_MAX_RANKS = 8


class Strategy(ABC):
    """One way of merging a :class:`~mpitree._merger.Merger`'s record buffer across ranks.

    The buffer is ``(rows + 1, D + 2)``: the records, then a flag record whose
    ``m`` is 1 on a rank whose local work failed and ``-inf`` elsewhere. The
    flag merges like any record (its ``m`` is a max), so a failure anywhere
    reaches every rank in the same collective.
    """

    name = ""

    def __init__(self, merger, node_size=0, persistent=True):
        self.merger = merger
        self.comm = merger.comm
        self.error = None  # an exception this rank hit inside the strategy's own steps
        self.requests = []  # persistent requests, freed with the merger (see free_requests)

    @abstractmethod
    def reduce(self, local, failed):
        """Merge the buffer in place; return whether any rank failed."""

    def bound_collective(self):
        """Return what a compiled step needs to run this merge itself; None: it may not."""
        return None

    def reduce_bound(self, bound, out):
        """Run a layer bound to :meth:`bound_collective`; return its code (None: not now)."""
        return None


def free_requests(requests):
    """Free persistent requests (local, never collective); safe after MPI finalized."""
    while requests:
        request = requests.pop()
        if not MPI.Is_finalized() and request != MPI.REQUEST_NULL:
            request.Free()


def register(cls):
    """Add a strategy class to :data:`REGISTRY` under its ``name``."""
    REGISTRY[cls.name] = cls
    return cls


def set_flag(buf, failed):
    """Write this rank's failure flag into the last record."""
    buf[-1, 0] = 1 if failed else -np.inf
    buf[-1, 1:] = 0


def flagged(buf):
    """Whether the merged flag record says some rank failed."""
    return float(buf[-1, 0]) != -np.inf


def op_needed(strategy, deterministic, acc, head_dim):
    """Return the ``(dtype, width)`` of the native op a requested strategy may run, or None.

    Obtained in the guarded local phase, before the agreement, so that running
    out of op slots is an agreed error rather than a failure after it.
    """
    from .._op import native_op_available

    if deterministic or strategy not in ("auto", "allreduce", "hierarchical"):
        return None
    if strategy == "auto" and not native_op_available():
        return None  # "auto" then resolves to allgather or allreduce3: no user op
    return (acc, head_dim + 2)


def resolve(strategy, comm, native, node_size=0, deterministic=False):
    """Map a requested strategy to the one that runs; collective over ``comm`` for ``"auto"``.

    Call it only after the agreement: ``native`` is the agreed fact (every rank
    has the compiled op), so every rank resolves ``"auto"`` the same way.
    ``deterministic=True`` turns every strategy but the ring (already
    rank-ordered) into a gather of all states merged in rank order.
    """
    if deterministic and strategy != "ring":
        return "allgather"
    if strategy != "auto":
        return strategy
    size = comm.Get_size()
    if size == 1:
        return "allreduce" if native else "allgather"
    lay = layout(comm, node_size)
    ring_library = "open mpi" in MPI.Get_library_version().lower()
    return auto_strategy(size, native, lay.nodes, lay.ranks_per_node, ring_library)


def auto_strategy(size, native, nodes, ranks_per_node, ring_library):
    """Return the strategy ``"auto"`` runs (README, "Choosing a strategy").

    With the native op: one all-reduce, except across several nodes of several
    ranks under an MPI whose all-reduce for user ops is ring or Rabenseifner
    (Open MPI's tuned component), whose many steps each cross the slow node
    links; two levels cross them log2(nodes) times. MPICH runs recursive
    doubling for user ops, which already crosses node links only log2(nodes)
    times for any regular placement, so there the extra intra-node rounds of
    two levels only cost. Without the native op: see ``ALLGATHER_MAX_RANKS``.
    """
    if not native:
        return "allgather" if size <= ALLGATHER_MAX_RANKS else "allreduce3"
    if nodes > 1 and ranks_per_node > 1 and ring_library:
        return "hierarchical"
    return "allreduce"


from . import allgather, allreduce, allreduce3, hierarchical, ring  # noqa: E402, F401

assert set(REGISTRY) == set(STRATEGIES) - {"auto"}, sorted(REGISTRY)
