"""An alpha-beta cost model of one decode step of one attention layer, to plan past one machine.

A rank holds ``t = N / p`` tokens of K/V. A step costs local attention over the
shard plus the strategy's communication on a two-level topology (ranks inside a
node share a fast link, nodes share a slower one). Each link is an
alpha-beta model: a message of ``n`` bytes costs ``latency + n / bandwidth``.
The collectives use the textbook algorithms an MPI or NCCL library picks between
(recursive doubling for latency, ring/Rabenseifner for bandwidth), taking the
cheaper one, and arranged in two levels when the ranks span nodes.

Nothing here is fitted to the paper's numbers. The presets are nominal hardware
figures derated by a stated efficiency, and :func:`calibrate` fits a machine to
one of mpitree's own benchmark runs. See the README, "Cost model", for the
predictions beside the paper's measurements.

Examples
--------
>>> from mpitree import model
>>> t = model.predict(model.WORKLOADS["llama3-8b"], 32768, 8, model.MACHINES["dgx-h100"])
>>> round(t["ring"] / t["allreduce"], 1) > 1
True
"""

import math
from dataclasses import dataclass, replace

__all__ = [
    "DEVICES",
    "LINKS",
    "MACHINES",
    "STRATEGIES",
    "WORKLOADS",
    "Device",
    "Link",
    "Machine",
    "Workload",
    "calibrate",
    "predict",
]

STRATEGIES = ("allreduce", "allgather", "ring", "hierarchical")


@dataclass(frozen=True)
class Link:
    """One interconnect level, per rank and per direction.

    Parameters
    ----------
    name : str
        Description.
    latency : float
        Seconds per message (alpha), software included.
    bandwidth : float
        Bytes per second per rank per direction (1 / beta).
    """

    name: str
    latency: float
    bandwidth: float

    def time(self, nbytes):
        """Seconds to send ``nbytes`` in one message."""
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Device:
    """The local attention kernel of one rank: a read-bandwidth-bound stream over K/V.

    Parameters
    ----------
    name : str
        Description.
    throughput : float
        Bytes of K/V the local decode kernel reads per second.
    overhead : float
        Fixed seconds per local call (kernel launches, small ops).
    """

    name: str
    throughput: float
    overhead: float

    def time(self, nbytes):
        """Seconds for local attention over ``nbytes`` of K/V."""
        return self.overhead + nbytes / self.throughput


@dataclass(frozen=True)
class Machine:
    """Ranks grouped into nodes: ``ranks_per_node`` ranks share ``intra``, nodes share ``inter``."""

    name: str
    ranks_per_node: int
    intra: Link
    inter: Link
    device: Device


@dataclass(frozen=True)
class Workload:
    """One attention layer's decode step: shapes and dtypes.

    ``kv_itemsize`` is the K/V element size (2 for bf16); the merged state is
    float32 records of ``D + 2`` numbers per (batch, query head) row.
    """

    name: str
    q_heads: int
    kv_heads: int
    head_dim: int
    batch: int = 1
    kv_itemsize: int = 2

    def kv_bytes(self, tokens):
        """Bytes of K and V for ``tokens`` tokens."""
        return 2 * self.batch * self.kv_heads * self.head_dim * tokens * self.kv_itemsize

    @property
    def state_bytes(self):
        """Bytes of the (m, d, n) records of one step (the paper's eq. 34, in float32)."""
        return self.batch * self.q_heads * (self.head_dim + 2) * 4


# Nominal figures derated to what collectives typically achieve (80% of link
# bandwidth; flash-decoding at ~70% of HBM3's 3.35 TB/s). Latencies include the
# communication library's software path.
LINKS = {
    "nvlink4": Link("NVLink 4 via NVSwitch (450 GB/s per direction nominal)", 3e-6, 360e9),
    "ib-ndr400": Link("InfiniBand NDR 400 Gb/s, one NIC per GPU", 6e-6, 40e9),
    "pcie4": Link("PCIe 4.0 x16 (32 GB/s nominal)", 8e-6, 25e9),
    "shm": Link("shared memory inside one CPU node (MPI)", 2e-6, 8e9),
}
DEVICES = {
    "h100": Device("H100 SXM, flash-decoding (bf16)", 2.3e12, 15e-6),
    "cpu-core": Device("one x86 core, mpitree's C kernel (fp32)", 18e9, 30e-6),
}
MACHINES = {
    "dgx-h100": Machine(
        "DGX H100 nodes: 8 GPUs on NVLink 4, 8 x NDR 400 between nodes",
        8,
        LINKS["nvlink4"],
        LINKS["ib-ndr400"],
        DEVICES["h100"],
    ),
    "pcie-gpus": Machine(
        "GPUs on PCIe 4.0, nodes on NDR 400", 8, LINKS["pcie4"], LINKS["ib-ndr400"], DEVICES["h100"]
    ),
    "cpu-node": Machine(
        "CPU ranks, one per core, MPI over shared memory",
        64,
        LINKS["shm"],
        LINKS["ib-ndr400"],
        DEVICES["cpu-core"],
    ),
}
WORKLOADS = {
    "llama3-8b": Workload("Llama-3.1-8B attention layer", 32, 8, 128),
    "paper-block": Workload("the paper's block: 16 heads x 128", 16, 16, 128),
}


def _log2(p):
    """Return the rounds of a recursive-doubling collective over ``p`` ranks."""
    return math.ceil(math.log2(p)) if p > 1 else 0


def _allreduce_flat(nbytes, p, link):
    """All-reduce over one link level: the cheaper of recursive doubling and Rabenseifner."""
    if p <= 1:
        return 0.0
    doubling = _log2(p) * link.time(nbytes)
    rabenseifner = 2 * _log2(p) * link.latency + 2 * (p - 1) / p * nbytes / link.bandwidth
    return min(doubling, rabenseifner)


def _allgather_flat(nbytes, p, link):
    """All-gather of ``nbytes`` per rank over one link level (recursive doubling)."""
    if p <= 1:
        return 0.0
    return _log2(p) * link.latency + (p - 1) * nbytes / link.bandwidth


def _levels(p, machine):
    """(ranks per node used, number of nodes) for ``p`` ranks packed onto nodes."""
    per_node = min(p, machine.ranks_per_node)
    return per_node, math.ceil(p / per_node)


def allreduce_time(nbytes, p, machine):
    """Seconds for one all-reduce of ``nbytes`` over ``p`` ranks, two levels when nodes > 1.

    Inside a node a reduce-scatter, across nodes an all-reduce of each rank's
    ``1 / ranks_per_node`` slice (all NICs in parallel), then an all-gather inside.
    """
    per_node, nodes = _levels(p, machine)
    if nodes == 1:
        return _allreduce_flat(nbytes, p, machine.intra)
    intra = machine.intra
    scatter = _log2(per_node) * intra.latency + (per_node - 1) / per_node * nbytes / intra.bandwidth
    return 2 * scatter + _allreduce_flat(nbytes / per_node, nodes, machine.inter)


def hierarchical_time(nbytes, p, machine):
    """Reduce to a leader per node, all-reduce among leaders, broadcast inside each node."""
    per_node, nodes = _levels(p, machine)
    tree_in_node = _log2(per_node) * machine.intra.time(nbytes)
    return 2 * tree_in_node + _allreduce_flat(nbytes, nodes, machine.inter)


def allgather_time(nbytes, p, machine):
    """Seconds to gather every rank's ``nbytes`` on every rank, two levels when nodes > 1."""
    per_node, nodes = _levels(p, machine)
    if nodes == 1:
        return _allgather_flat(nbytes, p, machine.intra)
    return _allgather_flat(nbytes, per_node, machine.intra) + _allgather_flat(
        nbytes * per_node, nodes, machine.inter
    )


def predict(workload, tokens, p, machine, *, overlap_ring=True):
    """Predict one decode step of one attention layer, per strategy.

    Parameters
    ----------
    workload : Workload
        Shapes and dtypes.
    tokens : int
        Total sequence length N, split evenly over the ranks.
    p : int
        Ranks (1 to any number; nodes fill ``machine.ranks_per_node`` at a time).
    machine : Machine
        Topology, links and local kernel.
    overlap_ring : bool, optional
        Let the ring overlap each block's transfer with the previous block's
        attention (its best case; mpitree's own ring does not overlap).

    Returns
    -------
    dict
        Seconds per step for ``"local"`` (attention on the shard alone) and each of
        :data:`STRATEGIES`.
    """
    if p < 1 or tokens < 0:
        raise ValueError(f"need p >= 1 and tokens >= 0, got p={p}, tokens={tokens}")
    dev = machine.device
    block = workload.kv_bytes(tokens / p)
    local = dev.time(block)
    state = workload.state_bytes
    merge = p * state / dev.throughput if p > 1 else 0.0  # merge p gathered states
    _, nodes = _levels(p, machine)
    hop = (machine.inter if nodes > 1 else machine.intra).time(block)  # slowest ring link
    ring_step = max(local, hop) if overlap_ring else local + hop
    return {
        "local": local,
        "allreduce": local + allreduce_time(state, p, machine),
        "allgather": local + allgather_time(state, p, machine) + merge,
        "ring": local + (p - 1) * ring_step if p > 1 else local,
        "hierarchical": local + hierarchical_time(state, p, machine),
    }


def calibrate(bench, *, ranks_per_node=None, name="calibrated from mpitree bench"):
    """Fit a one-node :class:`Machine` to a ``python -m mpitree bench --json`` result.

    The local kernel's throughput and overhead come from the local-attention
    timings across N; the link's bandwidth from the ring's time per byte over
    local attention; its latency from the all-reduce's overhead over local
    attention at the smallest N.

    Parameters
    ----------
    bench : dict
        The parsed JSON file.
    ranks_per_node : int, optional
        Default: the run's rank count.
    name : str, optional
        The machine's description.

    Returns
    -------
    Machine
    """
    cells = bench["results"]
    p = cells[0]["ranks"]
    xs = [c["paper"]["eq31_ring_bytes"] / p for c in cells]  # K/V bytes per rank
    ys = [c["times"]["local (C kernel)"]["median_ms"] / 1e3 for c in cells]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=False)) / var if var else my / mx
    overhead = max(my - slope * mx, 0.0)
    device = Device("calibrated local kernel", 1.0 / slope, overhead)
    ring_extra = [
        (c["times"]["ring"]["median_ms"] - c["times"]["local (C kernel)"]["median_ms"] * p) / 1e3
        for c in cells
    ]
    sent = [c["bytes_sent_per_rank"]["ring"] for c in cells]
    bandwidth = sum(sent) / max(sum(ring_extra), 1e-12)
    small = min(cells, key=lambda c: c["tokens"])
    hops = max(_log2(p), 1)
    latency = max(
        (small["times"]["allreduce"]["median_ms"] - small["times"]["local (C kernel)"]["median_ms"])
        / 1e3
        / hops,
        1e-7,
    )
    link = Link("calibrated intra-node link", latency, bandwidth)
    return Machine(name, ranks_per_node or p, link, replace(link, name="(unused)"), device)
