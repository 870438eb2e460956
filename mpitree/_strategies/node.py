"""``node``: merge inside each node through one shared-memory window, leaders all-reduce.

The host half of a merge inside a node (issue 50): the ranks of a node (real, or a
virtual node of ``node_size`` ranks) share one MPI-3 shared-memory window holding
every node rank's records. A step writes this rank's records (the flag record with
them) into its slot, synchronises the node (``MPI_Win_sync``, ``MPI_Barrier``,
``MPI_Win_sync``: what the MPI-3 unified model asks of loads after another
process's stores), and every rank folds the node's slots in rank order with the one
merge definition (the compiled op's C combine, else
:func:`~mpitree._state.combine_records`). Across several nodes the leaders then
all-reduce with the native user op and hand the result back through the window.
Two sets of slots alternate, so that one barrier per step suffices on one node: a
rank writing a set again has passed the barrier after which every rank finished
reading it.

The window is opened once per node communicator (the layout's, cached on the
merger's communicator) and shared by every ``node`` merger over it, grown when a
merger with larger records is built, and freed with the node communicator, that is
with the merger's communicator (``MPI_Win_free`` is collective: a merger's own
finalizer runs whenever the garbage collector finds it, at different times on
different ranks, so it cannot free a window). Mergers over one communicator merge
one after another in the same order on every rank (their collectives are over it),
so one window and one alternation serve them all.

It merges in host memory (its buffer kinds: host or pinned): the strategy's
``host`` records ``(rows + 1, D + 2)``, the flag last.

:class:`NodeStrategy`, its base, derives the node layout that ``device-node`` shares.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .._library import address, native_lib
from .._op import record_op
from .._state import combine_records
from .._topology import CommCache, layout
from .._traffic import traffic
from . import Strategy, flagged, register, set_flag


class Window:
    """A node communicator's shared window: two sets of a slot per rank and a result slot."""

    def __init__(self, node):
        self.node = node
        self.ranks = node.Get_size()
        self.win = None
        self.memory = None  # the window's bytes: 2 sets of ranks + 1 slots
        self.slot = 0  # bytes per slot (a multiple of 64)
        self.generation = 0  # counts allocations: a merger's views are of one
        self.parity = 0  # the set the next step writes

    def fit(self, nbytes):
        """Grow the slots to ``nbytes`` at least; collective over the node (agreed sizes)."""
        if nbytes <= self.slot:
            return
        self.free()
        nbytes = -(-nbytes // 64) * 64
        size = 2 * (self.ranks + 1) * nbytes if self.node.Get_rank() == 0 else 0
        win = MPI.Win.Allocate_shared(size, 1, comm=self.node)
        win.Lock_all(MPI.MODE_NOCHECK)
        self.memory, _ = win.Shared_query(0)
        self.win, self.slot = win, nbytes
        self.generation += 1

    def free(self):
        """End the passive epoch and free the window (collective over the node)."""
        win, self.win, self.memory, self.slot = self.win, None, None, 0
        if win is not None and not MPI.Is_finalized():
            win.Unlock_all()
            win.Free()


#: ``window_of(node)``: the node communicator's :class:`Window`, made on first use
window_of = CommCache(Window)


def _shared_node(node, comm):
    """Raise on every rank of ``comm`` unless every node's ranks can share memory."""
    shared = node.Split_type(MPI.COMM_TYPE_SHARED)
    fits = shared.Get_size() == node.Get_size()
    shared.Free()
    if not comm.allreduce(fits, op=MPI.LAND):
        raise ValueError(
            "strategy 'node' needs every node's ranks on one machine (shared memory); "
            "a virtual node of node_size ranks spans machines here"
        )


class NodeStrategy(Strategy):
    """A merge inside each node, then across nodes among their leaders: the node layout.

    The base of the ``node`` and ``device-node`` strategies, which set their node's
    slots up on it and merge in :meth:`reduce`. Building one is collective over the
    merger's communicator on first use of a node size (:func:`~mpitree._topology.layout`).

    Attributes
    ----------
    _one : bool
        The communicator has one rank: nothing else is set, nothing to merge with.
    _node, _leaders : mpi4py.MPI.Intracomm
        This rank's node (real, or a virtual node of ``node_size`` ranks, which must
        share memory: else an error on every rank) and the node leaders'
        communicator (``COMM_NULL`` on other ranks).
    _several : bool
        There is more than one node: the leaders all-reduce their nodes' merges.
    _spec, _op : list, mpi4py.MPI.Op
        On a leader of several nodes: the host buffer's MPI message and the native
        user op, for that all-reduce.
    _me, _ranks : int
        This rank's place in its node, and the node's ranks.
    """

    def __init__(self, merger, node_size=0, persistent=True):
        super().__init__(merger, node_size, persistent)
        self._one = self.comm.Get_size() == 1
        if self._one:
            return
        lay = layout(self.comm, node_size)
        if node_size:
            _shared_node(lay.node, self.comm)
        self._node, self._leaders = lay.node, lay.leaders
        self._several = lay.nodes > 1
        if self._several and self._leaders != MPI.COMM_NULL:
            host = self.host
            rec, op = record_op(host.dtype, host.shape[1])
            self._spec, self._op = [host, host.shape[0], rec], op
        self._me, self._ranks = self._node.Get_rank(), self._node.Get_size()


@register
class Node(NodeStrategy):
    """Every node rank's records in one shared window, merged in rank order by every rank."""

    name = "node"
    order = 4  # beside hierarchical: ties go by name, so before ring
    summary = "a shared-memory window per node merged in rank order, leaders all-reduce"
    label = "node shared window (nodes of {nodes})"
    uses_op = True
    modelled = False

    def __init__(self, merger, node_size=0, persistent=True):
        super().__init__(merger, node_size, persistent)
        if self._one:
            return
        buf = self.host
        self._window = window_of(self._node)
        self._window.fit(buf.nbytes)
        self._generation = -1
        lib = native_lib()
        self._combine = None if lib is None else lib.mpitree_combine
        self._bits, self._count, self._dim = 8 * buf.itemsize, buf.shape[0], buf.shape[1] - 2
        self._buf_address = address(buf)

    def _views(self):
        """Point this merger's slots at the window's current memory (new once it grew)."""
        window, buf, count = self._window, self.host, self._ranks + 1
        strides = (window.slot, *buf.strides)
        self._sets = tuple(
            np.ndarray(
                (count, *buf.shape), buf.dtype, window.memory, k * count * window.slot, strides
            )
            for k in (0, 1)
        )
        self._addresses = tuple([address(s) for s in slots[: self._ranks]] for slots in self._sets)
        self._generation = window.generation

    def _sync(self):
        """Make every node rank's stores visible to every other's loads (MPI-3 unified)."""
        win = self._window.win
        win.Sync()
        self._node.Barrier()
        win.Sync()

    def _fold(self, slots, addresses, buf):
        """Merge the node's slots into ``buf`` in rank order: the one merge definition."""
        buf[...] = slots[0]
        combine = self._combine
        if combine is not None:
            bits, io, count, dim = self._bits, self._buf_address, self._count, self._dim
            for part in addresses[1:]:
                combine(bits, part, io, count, dim)  # io = combine_records(io, part)
        else:
            with np.errstate(all="ignore"):
                for r in range(1, self._ranks):
                    buf[...] = combine_records(buf, slots[r])

    def reduce(self, local, failed):
        """Write into this rank's slot, fold the node's slots; leaders all-reduce across nodes."""
        buf = self.host
        set_flag(buf, failed)
        if self._one:
            return flagged(buf)
        window = self._window
        if window.generation != self._generation:
            self._views()
        parity = window.parity
        window.parity = 1 - parity
        slots = self._sets[parity]
        slots[self._me] = buf
        traffic.add(buf.nbytes)
        self._sync()
        if not self._several:
            self._fold(slots, self._addresses[parity], buf)
            return flagged(buf)
        leader = self._me == 0
        if leader:
            self._fold(slots, self._addresses[parity], buf)
            traffic.add(buf.nbytes)
            self._leaders.Allreduce(MPI.IN_PLACE, self._spec, self._op)
            slots[self._ranks] = buf
        self._sync()
        if not leader:
            buf[...] = slots[self._ranks]
        return flagged(buf)
