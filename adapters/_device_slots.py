"""The torch half of the ``device-node`` strategy: a node's shared record slots and its kernel.

``mpitree._strategies.device_node`` merges a node's records on the device; what
touches torch is here, imported when such a merger is built. A node communicator's
ranks share two alternating stacks of ``ranks + 1`` record slots (one per rank,
then the result slot), opened once per node communicator and kept with it:

- CUDA tensors: one device allocation of the node's first rank, which every other
  rank opens through a CUDA IPC handle (torch's own handles, as
  ``torch.multiprocessing`` shares CUDA tensors: ``reductions.reduce_tensor``),
  handed round by one broadcast. Synchronised by this rank's stream, then
  ``MPI_Barrier``.
- CPU tensors (the stand-in of device memory that tests register as a device kind):
  the ``node`` strategy's MPI-3 shared-memory window, viewed as tensors.
  Synchronised as ``node`` does (``MPI_Win_sync``, barrier, ``MPI_Win_sync``); the
  kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``).

Also the ``"device"`` buffer kind of CUDA tensors' records (:class:`Device`), which
the torch adapter registers.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import torch
from mpi4py import MPI

from mpitree._buffers import BufferKind
from mpitree._strategies.node import window_of
from mpitree._topology import CommCache

_TRITON = []  # whether triton is installed, looked up once


def triton_installed():
    """Return whether Triton can be imported (looked up once, without importing it)."""
    if not _TRITON:
        _TRITON.append(importlib.util.find_spec("triton") is not None)
    return _TRITON[0]


class Device(BufferKind):
    """CUDA tensors' records in device memory, with a pinned host mirror: the ``"device"`` kind.

    It serves CUDA tensors where Triton is installed (a ``device-node`` merge runs
    its kernel): elsewhere no kind serves the call, an error on every rank agreed
    before any communication.
    """

    name = "device"
    host_memory = False
    arrays = "CUDA tensors where Triton is installed"

    def __init__(self, shape, dtype, like=None):
        super().__init__(shape, dtype, like)
        mirror = torch.empty(tuple(shape), dtype=getattr(torch, dtype), pin_memory=True)
        self.host, self._mirror = mirror.numpy(), mirror

    @classmethod
    def serves(cls, like):
        """CUDA tensors, where Triton is installed."""
        return isinstance(like, torch.Tensor) and like.device.type == "cuda" and triton_installed()

    def allocate(self, shape, dtype, like):
        """Return a tensor on ``like``'s device."""
        return torch.empty(tuple(shape), dtype=getattr(torch, dtype), device=like.device)

    def to_host(self):
        """Copy the records into the pinned mirror (one device-to-host copy); return it."""
        self._mirror.copy_(self.buf)
        return self.host


class IpcWindow:
    """A node communicator's shared device allocation: 2 sets of ``ranks + 1`` slots."""

    def __init__(self, node):
        self.node = node
        self.ranks = node.Get_size()
        self.memory = None  # uint8 tensor: this process's own, or opened from a handle
        self.slot = 0  # bytes per slot (a multiple of 64)
        self.generation = 0  # counts allocations: a merger's views are of one
        self.parity = 0  # the set the next step writes

    def fit(self, nbytes, device):
        """Grow the slots to ``nbytes`` at least; collective over the node (agreed sizes).

        Raises
        ------
        RuntimeError
            On every node rank where the first could not allocate or share the memory.
        """
        if nbytes <= self.slot:
            return
        self.free()
        nbytes = -(-nbytes // 64) * 64
        shared = None
        if self.node.Get_rank() == 0:
            from torch.multiprocessing.reductions import reduce_tensor

            try:
                memory = torch.empty(
                    2 * (self.ranks + 1) * nbytes, dtype=torch.uint8, device=device
                )
                shared = reduce_tensor(memory)
            except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
                shared = f"{type(exc).__name__}: {exc}"
        shared = self.node.bcast(shared, root=0)
        if isinstance(shared, str):
            raise RuntimeError(f"device-node: the node's shared device slots failed: {shared}")
        self.memory = memory if self.node.Get_rank() == 0 else shared[0](*shared[1])
        self.slot = nbytes
        self.generation += 1

    def free(self):
        """Drop this process's reference (torch closes an opened handle with its storage)."""
        self.memory, self.slot = None, 0


#: ``ipc_window_of(node)``: the node communicator's :class:`IpcWindow`, made on first use
ipc_window_of = CommCache(IpcWindow)


class Slots:
    """One merger's views of its node's two alternating stacks of record slots."""

    def __init__(self, window, buf, cuda):
        self.window, self.shape, self.dtype = window, tuple(buf.shape), buf.dtype
        self.nbytes = buf.numel() * buf.element_size()
        self.generation = -1
        self._sets = ()
        self.sync = self._stream_sync if cuda else self._window_sync
        self._stream = torch.cuda.current_stream(buf.device) if cuda else None

    def next_set(self, buf):
        """Return the ``(ranks + 1, rows + 1, D + 2)`` stack this step writes; flip the parity."""
        window = self.window
        if window.generation != self.generation:
            self._views()
        parity = window.parity
        window.parity = 1 - parity
        return self._sets[parity]

    def _views(self):
        """Point the stacks at the window's current memory (new once it grew)."""
        window, count = self.window, self.window.ranks + 1
        memory = window.memory
        if not isinstance(memory, torch.Tensor):  # the MPI window's bytes
            memory = torch.frombuffer(memory, dtype=torch.uint8)
        self._sets = tuple(
            memory[k * count * window.slot :][: count * self.nbytes]
            .view(self.dtype)
            .view(count, *self.shape)
            for k in (0, 1)
        )
        self.generation = window.generation

    def _stream_sync(self, buf):
        """Wait for this rank's copies and kernels, then for every node rank's (CUDA)."""
        self._stream.synchronize()
        self.window.node.Barrier()

    def _window_sync(self, buf):
        """Every node rank's stores visible to every other's loads (MPI-3 unified model)."""
        win = self.window.win
        win.Sync()
        self.window.node.Barrier()
        win.Sync()


def node_slots(node, buf, comm):
    """Return a merger's :class:`Slots` over ``node``'s shared slots; collective over ``comm``.

    Raises
    ------
    ValueError
        On every rank of ``comm``: CPU tensors without ``TRITON_INTERPRET=1`` (the
        kernel cannot run on them), or a node whose CUDA ranks are on several devices.
    """
    cuda = buf.device.type == "cuda"
    nbytes = buf.numel() * buf.element_size()
    if cuda:
        ok = node.allreduce(buf.device.index, op=MPI.MAX) == node.allreduce(
            buf.device.index, op=MPI.MIN
        )
        why = "its node's ranks on one GPU (CUDA IPC slots of several GPUs are not built yet)"
    else:
        ok = os.environ.get("TRITON_INTERPRET") == "1"
        why = "TRITON_INTERPRET=1 for CPU tensors (the merge kernel runs under the interpreter)"
    if not comm.allreduce(ok, op=MPI.LAND):
        raise ValueError(f"strategy 'device-node' needs {why}")
    if cuda:
        window = ipc_window_of(node)
        window.fit(nbytes, buf.device)
    else:
        window = window_of(node)
        window.fit(nbytes)
    return Slots(window, buf, cuda)


def uploader(host):
    """Return ``upload(buf)``: copy the host records ``host`` into the device buffer ``buf``."""
    source = torch.from_numpy(host)
    return lambda buf: buf.copy_(source)


def merge_kernel(device):
    """Return ``merge(stack, out)``: ``_triton_merge.merge_stack`` (imports Triton).

    On CPU tensors the interpreter runs it in numpy, whose warnings for the
    infinities and NaNs of the merge's own rules (an empty state's ``0 * inf``) are
    silenced as the compiled op's C is silent.
    """
    from ._triton_merge import merge_stack

    if device.type != "cpu":
        return merge_stack

    def interpreted(stack, out):
        with np.errstate(all="ignore"):
            return merge_stack(stack, out=out)

    return interpreted
