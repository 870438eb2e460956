"""Soak test: a long decode loop must not grow memory or leak MPI objects.

    .venv/bin/mpiexec -n 4 .venv/bin/python examples/soak.py --steps 100000 [--strategy auto]

Runs ``--steps`` decode steps with a DecodePlan, rebuilding the plan every
``--rebuild`` steps (which exercises freeing persistent requests), with a cache
that grows by one token per step on the last rank. Rank 0 prints the resident
memory (RSS), Python-level allocations (tracemalloc), cached MPI ops and live
communicators at checkpoints, with progress on stderr, and exits non-zero if RSS
grew by more than 1 MB after the warm-up or any MPI object count grew.
"""

import argparse
import gc
import resource
import sys
import time
import tracemalloc

import numpy as np
from mpi4py import MPI

import mpitree
from mpitree import _op

parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
)
parser.add_argument("--steps", type=int, default=100_000, help="decode steps in all")
parser.add_argument("--rebuild", type=int, default=10_000, help="steps between new plans")
parser.add_argument("--strategy", default="auto", help="merge strategy of the plans")
parser.add_argument("--node-size", type=int, default=None, help="ranks per node (None: detect)")
parser.add_argument(
    "--warmup",
    type=int,
    default=None,
    help="steps before the memory baseline (None: a tenth of --steps, at most 2000)",
)
args = parser.parse_args()
if args.warmup is None:
    args.warmup = min(2_000, args.steps // 10)
if not 0 <= args.warmup < args.steps or args.rebuild < 1:
    parser.error(f"need 0 <= --warmup ({args.warmup}) < --steps ({args.steps}) and --rebuild >= 1")
checkpoint = max(1, args.steps // 10)


def handle_probe(comm):
    """Create and free a communicator and a datatype; return their Fortran handles.

    A Fortran handle is an index into the library's table of live objects, and a
    new object takes the lowest free slot, so the same indices before and after the
    loop mean no communicator or datatype was left allocated in between. (Open MPI
    indexes a datatype only when its Fortran handle is first asked for, so there
    only the communicator is checked; its C handles are heap pointers, and which
    chunk malloc returns next is no evidence of a leak.)
    """
    gc.collect()  # finalizers of unreachable plans free their objects first
    c = comm.Dup()
    d = MPI.FLOAT.Create_contiguous(3).Commit()
    handles = (c.py2f(), d.py2f())
    c.Free()
    d.Free()
    return handles


def rss_mb():
    """Current resident set size in MB (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 1e6


comm = MPI.COMM_WORLD
rank, last = comm.Get_rank(), comm.Get_size() - 1
rng = np.random.default_rng(rank)
cap = 256 + (args.steps if rank == last else 0)
k_cache = rng.standard_normal((1, 2, cap, 64), dtype=np.float32)
v_cache = rng.standard_normal((1, 2, cap, 64), dtype=np.float32)
q = np.random.default_rng(0).standard_normal((1, 8, 1, 64), dtype=np.float32)
warm = mpitree.DecodePlan(1, 8, 2, 64, strategy=args.strategy, node_size=args.node_size)
warm.free()  # first use creates the cached op, the private comm and its node layout
probe_before = handle_probe(comm)
tracemalloc.start()
plan, marks, t0 = None, [], time.perf_counter()
for step in range(args.steps):
    if step % args.rebuild == 0:
        if plan is not None:
            plan.free()
        plan = mpitree.DecodePlan(1, 8, 2, 64, strategy=args.strategy, node_size=args.node_size)
    t = 256 + (step if rank == last else 0)
    out = plan.decode(q, k_cache[:, :, :t], v_cache[:, :, :t])
    if step == args.warmup or step == args.steps - 1 or step % checkpoint == 0:
        gc.collect()
        marks.append((step, rss_mb(), tracemalloc.get_traced_memory()[0] / 1e6, len(_op._ops)))
        if rank == 0 and step:
            left = (time.perf_counter() - t0) / step * (args.steps - step)
            print(f"step {step}/{args.steps}, about {left:.0f} s left", file=sys.stderr, flush=True)
plan.free()
elapsed = time.perf_counter() - t0
reused = handle_probe(comm) == probe_before
marks = comm.gather(marks)
reused = comm.allreduce(reused, op=MPI.LAND)
if rank == 0:
    print(
        f"{args.steps} steps, strategy {plan.strategy}, {comm.Get_size()} ranks, "
        f"{elapsed:.1f} s ({elapsed / args.steps * 1e6:.0f} us/step), plan rebuilt every "
        f"{args.rebuild} steps; {MPI.Get_library_version().splitlines()[0].strip()}"
    )
    print(f"{'step':>8} {'RSS MB (max over ranks)':>24} {'traced MB':>10} {'cached ops':>10}")
    worst_growth, leaks = 0.0, False
    for i, (step, *_) in enumerate(marks[0]):
        rows = [m[i] for m in marks]
        print(
            f"{step:>8} {max(r[1] for r in rows):>24.2f} {max(r[2] for r in rows):>10.3f} "
            f"{max(r[3] for r in rows):>10}"
        )
    for per_rank in marks:
        base = next(m for m in per_rank if m[0] == args.warmup)
        end = per_rank[-1]
        worst_growth = max(worst_growth, end[1] - base[1])
        leaks |= end[3] > base[3]
    leaks |= not reused
    grew = worst_growth > 1.0
    print(
        f"RSS growth after warm-up (worst rank): {worst_growth:.3f} MB "
        f"({'over' if grew else 'within'} the 1 MB limit); MPI objects: "
        f"{'LEAKED (cached ops grew or handles were not reused)' if leaks else 'no leak'}"
    )
    print("FAIL" if grew or leaks else "PASS")
    sys.exit(1 if grew or leaks else 0)
