"""Cross-rank merge of a record buffer: allreduce (native op), allreduce3, allgather."""

import numpy as np
from mpi4py import MPI

from ._op import native_op_available, record_op
from ._records import merge_records
from ._topology import layout
from ._traffic import traffic

# Without the native op, gathering p states and merging locally measured as fast as
# or faster than Algorithm 3 for p <= 8 (README, "Choosing a strategy"); past that
# the all-gather's p-fold volume and O(p) merge lose to log-depth all-reduces.
_ALLGATHER_MAX_RANKS = 8


def resolve_strategy(strategy, comm, node_size=0, deterministic=False):
    """Map a requested strategy to the one that runs (collective over ``comm`` for "auto").

    ``deterministic=True`` turns every strategy but the ring (already rank-ordered)
    into a gather of all states merged in rank order; ``"auto"`` follows
    :func:`auto_strategy` on the communicator's (cached) node layout.
    """
    if deterministic and strategy != "ring":
        return "allgather"
    if strategy != "auto":
        return strategy
    size = comm.Get_size()
    if size == 1:
        return "allreduce"
    lay = layout(comm, node_size)
    ring_library = "open mpi" in MPI.Get_library_version().lower()
    return auto_strategy(size, native_op_available(), lay.nodes, lay.ranks_per_node, ring_library)


def auto_strategy(size, native, nodes, ranks_per_node, ring_library):
    """Return the strategy ``"auto"`` runs (README, "Choosing a strategy").

    With the native op: one all-reduce, except across several nodes of several
    ranks under an MPI whose all-reduce for user ops is ring or Rabenseifner
    (Open MPI's tuned component), whose many steps each cross the slow node
    links; two levels cross them log2(nodes) times. MPICH runs recursive
    doubling for user ops, which already crosses node links only log2(nodes)
    times for any regular placement, so there the extra intra-node rounds of
    two levels only cost. Without the native op: see ``_ALLGATHER_MAX_RANKS``.
    """
    if not native:
        return "allgather" if size <= _ALLGATHER_MAX_RANKS else "allreduce3"
    if nodes > 1 and ranks_per_node > 1 and ring_library:
        return "hierarchical"
    return "allreduce"


class Reducer:
    """Owns a ``(rows + 1, D + 2)`` record buffer and merges it across ``comm`` in place.

    The extra last row is an error flag: ``m = rank + 1`` on a rank whose input
    was invalid, ``-inf`` otherwise. It rides along with the reduction, so every
    rank learns of a failure without a second collective.
    """

    def __init__(self, comm, rows, dim, dtype, strategy, persistent=False, node_size=0):
        self.comm = comm
        self.strategy = strategy
        self.buf = np.zeros((rows + 1, dim + 2), dtype=dtype)
        self.records = self.buf[:rows]
        self._request = None
        size = comm.Get_size()
        if size == 1:
            return
        if strategy == "allreduce":
            rec, self._op = record_op(dtype, dim)
            self._spec = [self.buf, rows + 1, rec]
            if persistent:
                try:
                    self._request = comm.Allreduce_init(MPI.IN_PLACE, self._spec, self._op)
                except (NotImplementedError, MPI.Exception):
                    self._request = None
        elif strategy == "hierarchical":
            rec, self._op = record_op(dtype, dim)
            self._spec = [self.buf, rows + 1, rec]
            self._layout = layout(comm, node_size)
        elif strategy == "allgather":
            self._gathered = np.empty((size, *self.buf.shape), dtype=dtype)
        elif strategy != "allreduce3":
            raise ValueError(f"Reducer cannot run strategy {strategy!r}")

    def run(self, failed=False):
        """Merge the buffer across ranks; return the lowest failing rank, or None."""
        flag = self.buf[-1]
        flag[:] = 0
        flag[0] = self.comm.Get_rank() + 1 if failed else -np.inf
        if failed:
            self.records[:, 0] = -np.inf
            self.records[:, 1:] = 0
        if self.comm.Get_size() > 1:
            getattr(self, "_" + self.strategy)()
        bad = flag[0]
        return None if np.isneginf(bad) else int(bad) - 1

    def _allreduce(self):
        """One MPI_Allreduce of records with the (m, d, n) user op."""
        traffic.add(self.buf.nbytes)
        if self._request is not None:
            self._request.Start()
            self._request.Wait()
        else:
            self.comm.Allreduce(MPI.IN_PLACE, self._spec, self._op)

    def _allreduce3(self):
        """Run the paper's Algorithm 3: Allreduce(MAX) of m, then Allreduce(SUM) of d and n."""
        buf = self.buf
        m_local = buf[:, 0].copy()
        m = m_local.copy()
        traffic.add(m.nbytes)
        self.comm.Allreduce(MPI.IN_PLACE, m, op=MPI.MAX)
        w = np.exp(m_local - np.where(np.isneginf(m), 0, m))
        d = buf[:, 1] * w
        n = buf[:, 2:] * w[:, None]
        traffic.add(d.nbytes)
        self.comm.Allreduce(MPI.IN_PLACE, d, op=MPI.SUM)
        traffic.add(n.nbytes)
        self.comm.Allreduce(MPI.IN_PLACE, n, op=MPI.SUM)
        buf[:, 0] = m
        buf[:, 1] = d
        buf[:, 2:] = n

    def _hierarchical(self):
        """Reduce to each node's leader, all-reduce among leaders, broadcast inside nodes."""
        node, leaders = self._layout.node, self._layout.leaders
        if node.Get_size() > 1:
            traffic.add(self.buf.nbytes)
            if node.Get_rank() == 0:
                node.Reduce(MPI.IN_PLACE, self._spec, self._op, root=0)
            else:
                node.Reduce(self._spec, None, self._op, root=0)
        if leaders != MPI.COMM_NULL and leaders.Get_size() > 1:
            traffic.add(self.buf.nbytes)
            leaders.Allreduce(MPI.IN_PLACE, self._spec, self._op)
        if node.Get_size() > 1:
            traffic.add(self.buf.nbytes)
            node.Bcast(self._spec, root=0)

    def _allgather(self):
        """Gather every rank's records and merge them locally in rank order."""
        traffic.add(self.buf.nbytes)
        self.comm.Allgather(self.buf, self._gathered)
        self.buf[...] = merge_records(self._gathered, axis=0)

    def free(self):
        """Release the persistent request, if any."""
        if self._request is not None:
            self._request.Free()
            self._request = None
