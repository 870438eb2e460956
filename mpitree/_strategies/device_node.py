"""``device-node``: a node merged on the device by one kernel in rank order; leaders all-reduce.

The device half of a merge inside a node (issue 50): the records stay in a device
buffer kind's memory (``buffers = ("device",)``: torch tensors). The ranks of a node
(real, or a virtual node of ``node_size`` ranks) share one stack of record slots,
opened once per node communicator: on CUDA one device allocation of the node's
first rank that every other rank opens through a CUDA IPC handle, for CPU tensors
(the testable stand-in of device memory) the ``node`` strategy's shared-memory
window. A step copies this rank's records (the flag record with them) into its
slot, synchronises the node (CUDA: this rank's stream, then ``MPI_Barrier``; the
window: ``MPI_Win_sync``, barrier, ``MPI_Win_sync``), and one launch of the Triton
kernel ``merge_stack`` folds the node's slots in rank order into this rank's
buffer: the compiled op's bits, the same on every rank and run. Across several
nodes the leaders copy their fold to the host mirror, all-reduce it with the native
user op, copy it back and hand it to their node through the result slot.

Two sets of slots alternate, as in ``node``: a rank writes a set again only after
the barrier of the step between, before which every rank's stream, and so its merge
kernel reading the set, was synchronised.

The torch half (the slots, their synchronisation, the kernel) lives in
``mpitree.adapters._device_slots``, imported when such a merger is built: its
buffer is a torch tensor then, so torch is already imported (``import mpitree``
never imports it). The buffer kind it needs is registered by the torch adapter for
CUDA tensors where Triton is installed; elsewhere no kind serves the call, an
agreed error on every rank before any communication.
"""

from __future__ import annotations

from mpi4py import MPI

from .._traffic import traffic
from . import flagged, register, set_flag
from .node import NodeStrategy


@register
class DeviceNode(NodeStrategy):
    """Every node rank's records in one shared device stack, merged by one kernel per rank."""

    name = "device-node"
    order = 5  # after the host strategies
    summary = "device slots per node merged by one kernel in rank order, leaders all-reduce"
    short = "dev. node"
    label = "device node slots (nodes of {nodes})"
    uses_op = True
    buffers = ("device",)
    modelled = False

    def __init__(self, merger, node_size=0, persistent=True):
        from mpitree.adapters import _device_slots  # torch: the buffer is a torch tensor

        buf = merger.kind.buf
        buf[-1] = 0  # the flag record: its m set each merge, its d and n stay 0
        super().__init__(merger, node_size, persistent)
        if self._one:
            return
        self._slots = _device_slots.node_slots(self._node, buf, self.comm)
        self._upload = _device_slots.uploader(self.host)
        self._merge = _device_slots.merge_kernel(buf.device)

    def reduce(self, local, failed):
        """Write this rank's slot, merge the node's slots on the device; leaders all-reduce."""
        buf = self.kind.buf
        set_flag(buf, failed)
        if self._one:
            return flagged(buf)
        slots, ranks = self._slots, self._ranks
        stack = slots.next_set(buf)
        stack[self._me].copy_(buf)
        traffic.add(self.host.nbytes)
        slots.sync(buf)
        if not self._several:
            self._merge(stack[:ranks], out=buf)
            return flagged(buf)
        leader = self._me == 0
        if leader:
            self._merge(stack[:ranks], out=buf)
            self.kind.to_host()
            traffic.add(self.host.nbytes)
            self._leaders.Allreduce(MPI.IN_PLACE, self._spec, self._op)
            self._upload(buf)
            stack[ranks].copy_(buf)
        slots.sync(buf)
        if not leader:
            buf.copy_(stack[ranks])
        return flagged(buf)
