"""Per-step decode overhead of a DecodePlan beyond local attention and one merge.

For a Llama-3.1-8B layer (32 q heads, 8 kv heads, D = 128, float32, B = 1, Sq = 1)
with T keys per rank, times side by side, interleaved, in one run (median over
steps, slowest rank):

- ``step``: ``plan.decode`` with the fast path (unchanged layout: no re-validation);
- ``step (full checks)``: the same inside ``mpitree.extend.tools.full_checks()``
  (what every step paid before the fast path);
- ``kernel``: the C kernel alone on preallocated records;
- ``merge``: one merge alone (the plan's merger, records already filled).

overhead = step - kernel - merge.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/plan_overhead.py
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from mpitree import DecodePlan, default_comm, extend

tools = getattr(extend, "tools", extend)  # trees before extend.tools (8d5d047): extend's own
Prepared, full_checks, kernel_isa, plan_merger = (
    tools.Prepared,
    tools.full_checks,
    tools.kernel_isa,
    tools.plan_merger,
)


def measure(comm, t, steps):
    """Return {method: slowest rank's median microseconds} for T = t keys per rank."""
    rng = np.random.default_rng([3, comm.rank])
    q = np.random.default_rng(3).standard_normal((1, 32, 1, 128), dtype=np.float32)
    k = rng.standard_normal((1, 8, t, 128), dtype=np.float32)
    v = rng.standard_normal((1, 8, t, 128), dtype=np.float32)
    plan = DecodePlan(1, 32, 8, 128, comm=comm)
    merger = plan_merger(plan)
    prepared = Prepared.of(q, k, v, plan.scale)
    records = np.empty((32, 130), np.float32)

    def full():
        with full_checks():
            plan.decode(q, k, v)

    methods = {
        "step": lambda: plan.decode(q, k, v),
        "step (full checks)": full,
        "kernel": lambda: prepared.run(q, k, v, None, records),
        "merge": lambda: merger.merge(lambda rec: None),
    }
    times = np.zeros((len(methods), steps))
    for step in range(steps + 20):
        for i, fn in enumerate(methods.values()):
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            if step >= 20:
                times[i, step - 20] = time.perf_counter() - t0
    plan.free()
    med = np.median(times, axis=1) * 1e6
    slow = np.empty_like(med)
    comm.Allreduce(med, slow, op=MPI.MAX)
    return dict(zip(methods, slow.tolist(), strict=True))


def main():
    """Print the per-step breakdown for each T and round."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", default="16,64,256,1024", help="keys per rank")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    comm = default_comm()
    if comm.rank == 0:
        print(f"ranks {comm.size}, kernel ISA: {kernel_isa()}; microseconds, slowest rank's median")
        print(
            f"{'T/rank':>7}{'round':>6}{'step':>8}{'kernel':>8}{'merge':>8}{'overhead':>10}"
            f"{'step(full)':>12}{'overhead(full)':>16}"
        )
    for t in (int(x) for x in args.tokens.split(",")):
        for r in range(args.rounds):
            m = measure(comm, t, args.steps)
            base = m["kernel"] + m["merge"]
            if comm.rank == 0:
                print(
                    f"{t:>7}{r:>6}{m['step']:>8.1f}{m['kernel']:>8.1f}{m['merge']:>8.1f}"
                    f"{m['step'] - base:>10.1f}{m['step (full checks)']:>12.1f}"
                    f"{m['step (full checks)'] - base:>16.1f}"
                )


if __name__ == "__main__":
    main()
