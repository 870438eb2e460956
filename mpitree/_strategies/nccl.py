"""``nccl``: every rank's records all-gathered by NCCL into a device stack, one kernel folds it.

A device-side merge for ranks that each hold their own GPU (issue 50): the records
stay in a device buffer kind's memory (``buffers = ("device",)``: torch tensors). A
step all-gathers every rank's ``(rows + 1, D + 2)`` buffer, the flag record with
it, into a ``(p, rows + 1, D + 2)`` stack made once with the merger, then one
launch of the Triton kernel ``merge_stack`` (``mpitree.adapters._triton_merge``)
folds the stack in rank order into this rank's buffer: every rank folds the same
stack the same way, so the merge is the compiled op's combine in rank order, the
same bits on every rank and run (``reproducible``), and a failed rank's flag
reaches every rank in the same collective.

The collective is torch.distributed's, in a process group of this strategy's own,
made once per communicator (cached on the merger's communicator and dropped with
it) and never the default group: a user's ``init_process_group`` is neither needed
nor touched. CUDA tensors run the NCCL backend; CPU tensors (the testable stand-in
of device memory, whose kernel runs under ``TRITON_INTERPRET=1``) run gloo through
the same code. Its rendezvous goes through MPI: rank 0 opens a ``TCPStore`` on a
port the system picks and broadcasts it, so no environment variable is needed.

Refusals, each a ``ValueError`` (or, for a rendezvous that failed, a
``RuntimeError``) on every rank, agreed over MPI before any torch collective:
torch.distributed or the backend missing, Triton missing, CPU tensors without the
interpreter, ranks on different kinds of device, and, with CUDA, two ranks on one
GPU (NCCL refuses them: ``device-node`` merges those). ``"auto"`` never picks it.
"""

from __future__ import annotations

import datetime
import os
import socket

from .._topology import CommCache
from .._traffic import traffic
from . import Strategy, flagged, register, set_flag

#: how long torch waits on the rendezvous or a collective before raising
TIMEOUT = datetime.timedelta(seconds=120)
BACKENDS = {"cuda": "nccl", "cpu": "gloo"}  # the device type -> torch.distributed's backend


@register
class Nccl(Strategy):
    """One NCCL all-gather of every rank's records, folded on the device in rank order."""

    name = "nccl"
    order = 6  # after device-node
    summary = "one NCCL all-gather of the records (gloo: CPU tensors), folded on the device"
    label = "NCCL all-gather + device merge"
    buffers = ("device",)
    reproducible = True
    modelled = False

    def __init__(self, merger, node_size=0, persistent=True):
        super().__init__(merger, node_size, persistent)
        import torch  # the buffer is a torch tensor: torch is imported already

        buf = self.kind.buf
        buf[-1] = 0  # the flag record: its m set each merge, its d and n stay 0
        size = self.comm.Get_size()
        hosts = agreed_setup(self.comm, buf.device)
        self._one = size == 1
        if self._one:
            return
        from mpitree.adapters._device_slots import merge_kernel

        group = groups_of(self.comm).group(BACKENDS[buf.device.type], hosts, buf.device)
        self._stack = torch.empty((size, *buf.shape), dtype=buf.dtype, device=buf.device)
        self._flat = self._stack.view(size * buf.shape[0], buf.shape[1])  # gloo's chunks
        self._gather = group.backend._allgather_base
        self._merge = merge_kernel(buf.device)

    def reduce(self, local, failed):
        """All-gather every rank's records and flag, fold them on the device in rank order."""
        buf = self.kind.buf
        set_flag(buf, failed)
        if self._one:
            return flagged(buf)
        traffic.add(self.host.nbytes)
        self._gather(self._flat, buf).wait()  # NCCL: the current stream waits on it
        self._merge(self._stack, out=buf)
        return flagged(buf)


def refusal(everyone):
    """Return why the strategy cannot run over ranks described by ``everyone``, or "".

    Parameters
    ----------
    everyone : list of tuple
        Each rank's ``(problem, hostname, device type, device index)``, in rank
        order; ``problem`` is what this rank alone lacks ("" for nothing).

    Returns
    -------
    str
        The same message on every rank that gathered the same list.
    """
    for rank, (problem, *_) in enumerate(everyone):
        if problem:
            return f"strategy 'nccl' cannot run on rank {rank}: {problem}"
    types = sorted({kind for _, _, kind, _ in everyone})
    if len(types) > 1:
        return f"strategy 'nccl' needs every rank's tensors on one kind of device, got {types}"
    if types != ["cuda"]:
        return ""
    seen = {}
    for rank, (_, host, _, index) in enumerate(everyone):
        if (host, index) in seen:
            return (
                f"strategy 'nccl' needs a GPU of its own on every rank: ranks {seen[host, index]} "
                f"and {rank} share GPU {index} on {host}, which NCCL refuses (strategy "
                "'device-node' merges ranks that share a GPU)"
            )
        seen[host, index] = rank
    return ""


def local_problem(device):
    """Return what this rank lacks to run the strategy on ``device``'s tensors, or ""."""
    import torch.distributed as dist

    from mpitree.adapters._device_slots import triton_installed

    backend = BACKENDS.get(device.type)
    if backend is None:
        return f"no torch.distributed backend for {device.type} tensors here (CUDA: NCCL)"
    if not dist.is_available():
        return "this torch has no torch.distributed"
    if not getattr(dist, f"is_{backend}_available")():
        return f"this torch has no {backend.upper()} backend (for {device.type} tensors)"
    if not triton_installed():
        return "Triton is not installed (the merge kernel is Triton's)"
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "CPU tensors need TRITON_INTERPRET=1 (the merge kernel runs under the interpreter)"
    return ""


def agreed_setup(comm, device):
    """Check every rank can run the strategy; collective over ``comm``.

    Returns
    -------
    list of str
        Every rank's hostname, in rank order.

    Raises
    ------
    ValueError
        On every rank, the same message, where any rank cannot (:func:`refusal`).
    """
    try:
        problem = local_problem(device)
    except Exception as exc:  # torch's own checks failing: this rank's problem
        problem = f"{type(exc).__name__}: {exc}"
    everyone = comm.allgather((problem, socket.gethostname(), device.type, device.index))
    why = refusal(everyone)
    if why:
        raise ValueError(why)
    return [host for _, host, _, _ in everyone]


def agreed(comm, error, what):
    """Raise on every rank of ``comm`` if any rank's ``error`` (a str, "" for none) is set."""
    errors = comm.allgather(error)
    for rank, error in enumerate(errors):
        if error:
            raise RuntimeError(f"strategy 'nccl': {what} failed on rank {rank}: {error}")


class Group:
    """One torch.distributed process group of this strategy's own over a communicator."""

    def __init__(self, comm, backend, hosts, device):
        """Rendezvous through MPI, then make the group; collective over ``comm``.

        Raises
        ------
        RuntimeError
            On every rank, where the store or the group could not be made on one.
        """
        import torch
        import torch.distributed as dist

        rank, size = comm.Get_rank(), comm.Get_size()
        one_host = len(set(hosts)) == 1
        address = "127.0.0.1" if one_host else hosts[0]
        self.store = self.backend = port = None
        error = ""
        if rank == 0:
            try:  # port 0: the system picks a free one
                self.store = dist.TCPStore(
                    address, 0, size, True, timeout=TIMEOUT, wait_for_workers=False
                )
                port = self.store.port
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
        agreed(comm, error, "opening the rendezvous store")
        port = comm.bcast(port, root=0)
        if rank:
            try:
                self.store = dist.TCPStore(address, port, size, False, timeout=TIMEOUT)
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
        agreed(comm, error, f"joining the rendezvous store at {address}:{port}")
        try:
            store = dist.PrefixStore("mpitree", self.store)
            self.backend = _backend(dist, store, backend, rank, size, one_host)
            if backend == "nccl":  # NCCL makes its communicator on the first collective
                probe = torch.zeros(1, device=device)
                self.backend._allgather_base(torch.empty(size, device=device), probe).wait()
                torch.cuda.synchronize(device)
        except Exception as exc:  # the others see it below (after gloo's own timeout)
            error = f"{type(exc).__name__}: {exc}"
        agreed(comm, error, f"making its {backend} process group")

    def free(self):
        """Drop the group and its store (torch closes them with the last reference)."""
        self.backend = self.store = None


def _backend(dist, store, backend, rank, size, one_host):
    """Return a new ``backend`` process group of ``size`` ranks over ``store``."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, size, options)
    gloo = dist.ProcessGroupGloo
    options = gloo._Options()
    options._timeout = TIMEOUT
    device = gloo.create_device(hostname="127.0.0.1") if one_host else gloo.create_default_device()
    options._devices = [device]
    return gloo(store, rank, size, options)


class Groups(dict):
    """A communicator's process groups by backend name; dropped with it."""

    def __init__(self, comm):
        super().__init__()
        self.comm = comm

    def group(self, backend, hosts, device):
        """Return the ``backend`` group, made on first use (collective over the communicator)."""
        group = self.get(backend)
        if group is None:
            group = self[backend] = Group(self.comm, backend, hosts, device)
        return group

    def free(self):
        """Drop every group."""
        for group in self.values():
            group.free()
        self.clear()


#: ``groups_of(comm)``: the communicator's :class:`Groups`, made on first use
groups_of = CommCache(Groups)
