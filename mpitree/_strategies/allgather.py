"""``allgather``: gather every rank's records, merge them locally in rank order (reproducible)."""

from __future__ import annotations

import numpy as np

from .._state import merge_records
from .._traffic import traffic
from . import Strategy, flagged, register, set_flag

# Without the native op, gathering p states and merging locally measured as fast as
# or faster than Algorithm 3 for p <= 8 (README, "Choosing a strategy"); past that
# the all-gather's p-fold volume and O(p) merge lose to log-depth all-reduces.
MAX_RANKS = 8


@register
class Allgather(Strategy):
    """One all-gather, then a fixed-order merge: bitwise identical on every rank and run."""

    name = "allgather"
    order = 2
    summary = "one MPI_Allgather of every rank's records, merged locally in rank order"
    label = "allgather + local merge"
    reproducible = True
    auto_priority = 2

    @classmethod
    def auto_fits(cls, size, native, nodes, ranks_per_node, ring_library):
        """Without the native op, up to :data:`MAX_RANKS` ranks."""
        return not native and size <= MAX_RANKS

    def __init__(self, merger, node_size=0, persistent=True):
        super().__init__(merger, node_size, persistent)
        self._gathered = np.empty((self.comm.Get_size(), *self.host.shape), self.host.dtype)

    def reduce(self, local, failed):
        """All-gather records and flags, merge in rank order."""
        buf = self.host
        set_flag(buf, failed)
        if self.comm.Get_size() > 1:
            traffic.add(buf.nbytes)
            self.comm.Allgather(buf, self._gathered)
            buf[...] = merge_records(self._gathered, axis=0)
        return flagged(buf)
