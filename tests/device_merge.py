"""A device-side merge as one file: a buffer kind and a strategy over it (a test's stand-in).

What docs/strategies.md says adding a device-side merge takes: one buffer kind
(:class:`DeviceTensor`, a merger's records in a torch tensor on the arrays'
device) and one strategy declaring ``buffers = ("device",)`` (:class:`DeviceGather`).
There is no GPU in CI, so the kind serves CPU tensors, standing in for device
memory: the strategy never treats its buffer as numpy, and MPI sees only the
kind's host mirror. tests/test_buffers_mpi.py registers both and runs them.
"""

from typing import ClassVar

import numpy as np
import torch
from mpi4py import MPI

from mpitree._buffers import BufferKind
from mpitree._state import combine_records
from mpitree._strategies import Strategy, flagged, set_flag


class DeviceTensor(BufferKind):
    """Records in a torch tensor on the arrays' device (CPU tensors: the stand-in)."""

    name = "device"
    host_memory = False
    arrays = "CPU torch tensors (the tests' stand-in for device memory)"

    @classmethod
    def serves(cls, like):
        """CPU torch tensors (a CUDA kind would serve CUDA tensors)."""
        return isinstance(like, torch.Tensor) and like.device.type == "cpu"

    def allocate(self, shape, dtype, like):
        """Return a tensor on ``like``'s device."""
        return torch.empty(tuple(shape), dtype=getattr(torch, dtype), device=like.device)

    def to_host(self):
        """Copy the tensor into the host mirror (a CUDA kind: a device-to-host copy)."""
        torch.from_numpy(self.host).copy_(self.buf)
        return self.host


class DeviceGather(Strategy):
    """One all-gather of the mirrored records, then a rank-ordered merge on the device."""

    name = "devgather"
    order = 90
    summary = "a test's device merge: one all-gather through the host, merged on the device"
    buffers = ("device",)
    reproducible = True
    modelled = False
    built: ClassVar[list] = []  # every instance, for the test to look at

    def __init__(self, merger, node_size=0, persistent=True):
        super().__init__(merger, node_size, persistent)
        p, buf = self.comm.Get_size(), self.kind.buf
        self._gathered = np.empty((p, *self.host.shape), self.host.dtype)
        self._parts = torch.empty((p, *buf.shape), dtype=buf.dtype, device=buf.device)
        DeviceGather.built.append(self)

    def reduce(self, local, failed):
        """All-gather records and flags through the host, merge them on the device in rank order."""
        buf = self.kind.buf
        set_flag(buf, failed)
        if self.comm.Get_size() > 1:
            self.comm.Allgather([self.kind.to_host(), MPI.BYTE], [self._gathered, MPI.BYTE])
            parts = self._parts
            parts.copy_(torch.from_numpy(self._gathered))
            merged = parts[0]
            for part in parts[1:]:  # rank order: the same bits on every rank
                merged = combine_records(merged, part)
            buf.copy_(merged)
        return flagged(buf)
