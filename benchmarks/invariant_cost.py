"""What ``deterministic="invariant"`` costs against the default all-reduce, side by side.

For a Llama-3.1-8B layer (32 q heads, 8 kv heads, D = 128, float32, B = 1, Sq = 1)
with T keys per rank, contiguous shards, times in one run, interleaved (median over
steps, slowest rank):

- ``step``: a :class:`~mpitree.DecodePlan` step (default mode, and invariant mode
  with ``kv_start``), no per-step agreement;
- ``kernel``: the local work alone: the C kernel over the shard (default), the
  leaf states of its blocks reduced to its canonical-tree pieces, the placement
  check included (invariant: ``mpitree.extend.tools.invariant_pieces``);
- ``merge``: the communication and combining alone, local work already done.

Shards sit on the power-of-two block grid ("aligned": each rank's T / block_size
blocks form whole tree nodes) or one block off it ("off-grid").

    .venv/bin/mpiexec -n 8 .venv/bin/python benchmarks/invariant_cost.py
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from mpitree import DecodePlan, default_comm, extend
from mpitree.extend import traffic

tools = getattr(extend, "tools", extend)  # trees before extend.tools (8d5d047): extend's own
Prepared, invariant_pieces, kernel_isa, merger_for, plan_merger, prepare_attention = (
    tools.Prepared,
    tools.invariant_pieces,
    tools.kernel_isa,
    tools.merger_for,
    tools.plan_merger,
    tools.prepare_attention,
)
INVARIANT = "invariant"  # deterministic="invariant": the canonical tree's merger

HEAD_DIM = 128


def measure(comm, t, block, offset, steps):
    """Return {name: slowest rank's median microseconds} and bytes per rank per method."""
    rng = np.random.default_rng([3, comm.rank])
    q = np.random.default_rng(3).standard_normal((1, 32, 1, HEAD_DIM), dtype=np.float32)
    k = rng.standard_normal((1, 8, t, HEAD_DIM), dtype=np.float32)
    v = rng.standard_normal((1, 8, t, HEAD_DIM), dtype=np.float32)
    start = offset + comm.rank * t
    plain = DecodePlan(1, 32, 8, HEAD_DIM, comm=comm)
    inv = DecodePlan(1, 32, 8, HEAD_DIM, comm=comm, deterministic="invariant", block_size=block)
    prepared = Prepared.of(q, k, v, plain.scale)
    records = np.empty((32, HEAD_DIM + 2), np.float32)
    step = prepare_attention(q, k, v, None, None, None, None, {"scale": plain.scale})[2]

    def pieces():
        return invariant_pieces(step, block, start, None, "float32")

    mine = pieces()
    merger = merger_for(comm, 32, HEAD_DIM, "float32", INVARIANT)
    plain_merger = plan_merger(plain)
    methods = {
        "step": lambda: plain.decode(q, k, v),
        "step inv": lambda: inv.decode(q, k, v, kv_start=start),
        "kernel": lambda: prepared.run(q, k, v, None, records),
        "kernel inv": pieces,
        "merge": lambda: plain_merger.merge(lambda rec: None),
        "merge inv": lambda: merger.merge(lambda: mine),
    }
    sent = {}
    for name, fn in methods.items():
        traffic.reset()
        fn()
        sent[name] = traffic.bytes
    times = np.zeros((len(methods), steps))
    for i_step in range(steps + 10):
        for i, fn in enumerate(methods.values()):
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            if i_step >= 10:
                times[i, i_step - 10] = time.perf_counter() - t0
    plain.free()
    inv.free()
    med = np.median(times, axis=1) * 1e6
    slow = np.empty_like(med)
    comm.Allreduce(med, slow, op=MPI.MAX)
    most = comm.allreduce(max(sent["merge inv"], 1), op=MPI.MAX)
    return dict(zip(methods, slow.tolist(), strict=True)), sent["merge"], most


def main():
    """Print one row per (block size, grid, round)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=8192, help="keys per rank")
    parser.add_argument("--blocks", default="1024,256", help="block sizes")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    blocks = [int(b) for b in args.blocks.split(",")]
    if any(b < 1 or args.tokens % b for b in blocks):
        # every rank parses the same arguments, so every rank stops here alike
        parser.error(f"--tokens {args.tokens} must be a multiple of every block size {blocks}")
    comm = default_comm()
    if comm.rank == 0:
        print(
            f"ranks {comm.size}, T = {args.tokens} keys per rank, kernel {kernel_isa()}; "
            "microseconds, slowest rank's median; ratio = invariant / default"
        )
        print(
            f"{'block':>6} {'grid':>8} {'step':>7} {'inv':>7} {'ratio':>6} {'kernel':>7} "
            f"{'inv':>7} {'ratio':>6} {'merge':>7} {'inv':>7} {'ratio':>6} "
            f"{'bytes':>7} {'inv':>7}"
        )
    for block in blocks:
        for grid, offset in (("aligned", 0), ("off-grid", block)):
            for _ in range(args.rounds):
                m, sent, most = measure(comm, args.tokens, block, offset, args.steps)
                if comm.rank == 0:
                    cells = []
                    for name in ("step", "kernel", "merge"):
                        a, b = m[name], m[f"{name} inv"]
                        cells.append(f"{a:>7.1f} {b:>7.1f} {b / a:>5.2f}x")
                    print(f"{block:>6} {grid:>8} " + " ".join(cells) + f" {sent:>7} {most:>7}")


if __name__ == "__main__":
    main()
