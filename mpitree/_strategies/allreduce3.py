"""``allreduce3``: the paper's Algorithm 3, MPI_Allreduce(MAX) of m, then SUMs of d and n.

The merge of :func:`~mpitree._state.combine_records` spread over three built-in
reductions: the max of step 1, the weights of steps 2 and 3
(:func:`~mpitree._state.merge_weights`), the products and sum of step 4 (for two
ranks, the same bits; tests/test_merge_definition.py).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .._state import merge_weights
from .._traffic import traffic
from . import Strategy, flagged, register, set_flag


@register
class Allreduce3(Strategy):
    """Three all-reduces with built-in ops; the flag rides in the first (a max)."""

    name = "allreduce3"
    order = 1
    summary = "the paper's Algorithm 3: MPI_Allreduce(MAX) of m, then SUMs of d and n"
    label = "allreduce3 (paper's Alg. 3)"
    modelled = False
    auto_priority = 3

    @classmethod
    def auto_fits(cls, size, native, nodes, ranks_per_node, ring_library):
        """Without the native op, anywhere (``allgather`` goes first where it fits)."""
        return not native

    def reduce(self, local, failed):
        """MAX of m (flag included), then SUM of the rescaled d and n."""
        buf = self.host
        set_flag(buf, failed)
        if self.comm.Get_size() == 1:
            return flagged(buf)
        m_local = buf[:, 0].copy()
        m = m_local.copy()
        traffic.add(m.nbytes)
        self.comm.Allreduce(MPI.IN_PLACE, m, op=MPI.MAX)
        if not np.isneginf(m[-1]):
            buf[-1, 0] = m[-1]
            return True
        w = merge_weights(m_local, m)
        d = buf[:, 1] * w
        n = buf[:, 2:] * w[:, None]
        traffic.add(d.nbytes)
        self.comm.Allreduce(MPI.IN_PLACE, d, op=MPI.SUM)
        traffic.add(n.nbytes)
        self.comm.Allreduce(MPI.IN_PLACE, n, op=MPI.SUM)
        buf[:, 0] = m
        buf[:, 1] = d
        buf[:, 2:] = n
        return False
