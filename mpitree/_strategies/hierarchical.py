"""``hierarchical``: reduce inside each node, all-reduce among node leaders, broadcast back."""

from __future__ import annotations

from mpi4py import MPI

from .._op import record_op
from .._topology import layout
from .._traffic import traffic
from . import Strategy, flagged, register, set_flag


@register
class Hierarchical(Strategy):
    """Two levels of the native op, on real nodes or virtual nodes of ``node_size`` ranks."""

    name = "hierarchical"
    order = 3
    summary = (
        "the native op in two levels: reduce in each node, all-reduce among leaders, broadcast"
    )
    short = "hierarch."
    label = "hierarchical (nodes of {nodes})"
    uses_op = True
    auto_priority = 0

    @classmethod
    def auto_fits(cls, size, native, nodes, ranks_per_node, ring_library):
        """With the native op, across several nodes of several ranks, under a ring library."""
        return native and nodes > 1 and ranks_per_node > 1 and ring_library

    def __init__(self, merger, node_size=0, persistent=True):
        super().__init__(merger, node_size, persistent)
        if self.comm.Get_size() == 1:
            return
        buf = self.host
        rec, self._op = record_op(buf.dtype, buf.shape[1])
        self._spec = [buf, buf.shape[0], rec]
        self.layout = layout(self.comm, node_size)

    def reduce(self, local, failed):
        """Reduce to each node's leader, all-reduce among leaders, broadcast inside nodes."""
        buf = self.host
        set_flag(buf, failed)
        if self.comm.Get_size() == 1:
            return flagged(buf)
        node, leaders = self.layout.node, self.layout.leaders
        if node.Get_size() > 1:
            traffic.add(buf.nbytes)
            if node.Get_rank() == 0:
                node.Reduce(MPI.IN_PLACE, self._spec, self._op, root=0)
            else:
                node.Reduce(self._spec, None, self._op, root=0)
        if leaders != MPI.COMM_NULL and leaders.Get_size() > 1:
            traffic.add(buf.nbytes)
            leaders.Allreduce(MPI.IN_PLACE, self._spec, self._op)
        if node.Get_size() > 1:
            traffic.add(buf.nbytes)
            node.Bcast(self._spec, root=0)
        return flagged(buf)
