"""What a merge costs through mpitree's entry points, against a plain MPI.SUM all-reduce.

For one record layout (``B x Hq x Sq`` rows of ``D + 2`` float32, plus the flag
record every mpitree merge carries), times side by side, interleaved, in one run
(slowest rank per iteration, median after warm-up):

- ``MPI.SUM``: ``comm.Allreduce(IN_PLACE, buf, SUM)`` of a numpy buffer of the
  same bytes as the merge buffer: the floor;
- ``agreement + SUM``: a bare all-reduce (MIN) of four int64, then that ``MPI.SUM``,
  with no Python between: the floor of a one-shot call, which must agree before it
  merges;
- ``plan merge``: a :class:`~mpitree.DecodePlan` step's merge (the plan's merger,
  local work a no-op): what a decode step pays beyond its kernel and output;
- ``plan step - kernel``: ``plan.decode`` over a ``--keys`` shard minus the C
  kernel alone on the same shard (merge, checks and the output ``n / d``);
- ``allreduce_state``: the one-shot public call on a :class:`~mpitree.State`
  (its agreement, its merge, the returned copy);
- ``tree_decode - kernel``: one-shot ``tree_decode`` over the same shard minus
  the kernel alone (agreement, checks, merge, output);
- ``paper 3 allreduces``: the paper's Algorithm 3 on preallocated buffers:
  MAX of ``m``, then SUM of the rescaled ``d`` and SUM of the rescaled ``n``
  (the rescale by ``exp(m_local - m)`` included);
- ``allreduce3 strategy``: mpitree's own implementation of Algorithm 3.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/merge_cost.py
    .venv/bin/mpiexec -n 4 .venv/bin/python benchmarks/merge_cost.py
"""

from __future__ import annotations

import argparse
import importlib
import time

import numpy as np
from mpi4py import MPI

import mpitree

SHAPES = {"llama": (1, 32, 8, 1, 128), "tiny": (1, 1, 1, 1, 8)}  # B, Hq, Hkv, Sq, D


def paper_allreduce3(comm, buf):
    """Return the paper's Algorithm 3 on ``buf``'s records: MAX of m, SUMs of rescaled d, n."""
    m_local = buf[:, 0].copy()
    m = m_local.copy()
    w = np.empty_like(m)
    d = np.empty_like(m)
    n = np.empty_like(buf[:, 2:])

    def run():
        m[:] = m_local
        comm.Allreduce(MPI.IN_PLACE, m, op=MPI.MAX)
        np.exp(m_local - m, out=w)
        np.multiply(buf[:, 1], w, out=d)
        np.multiply(buf[:, 2:], w[:, None], out=n)
        comm.Allreduce(MPI.IN_PLACE, d, op=MPI.SUM)
        comm.Allreduce(MPI.IN_PLACE, n, op=MPI.SUM)

    return run


def baseline_compat(pkg, plan):
    """Return ``plan``'s merger and the bound-kernel class of ``pkg``, however old.

    Trees from fe6c268 (issue 25's start) on: those before ``extend.tools`` (8d5d047)
    had ``extend.plan_merger`` and ``extend.Prepared``; those before them kept them as
    private names.
    """
    tools = getattr(pkg.extend, "tools", pkg.extend)
    if hasattr(tools, "plan_merger"):
        return tools.plan_merger(plan), tools.Prepared
    kernel = importlib.import_module(f"{pkg.__name__}._kernel")
    return plan._merger, kernel.Prepared


def package_methods(pkg, comm, shape, keys, rank):
    """Return (methods, cleanup) timing ``pkg`` (mpitree, or a copy under another name)."""
    b, hq, hkv, sq, dim = shape
    rows = b * hq * sq
    rng = np.random.default_rng([5, rank])
    q = np.random.default_rng(5).standard_normal((b, hq, sq, dim), dtype=np.float32)
    k = rng.standard_normal((b, hkv, keys, dim), dtype=np.float32)
    v = rng.standard_normal((b, hkv, keys, dim), dtype=np.float32)
    state = pkg.State(rng.standard_normal((b, hq, sq, dim + 2)).astype(np.float32))
    plan = pkg.DecodePlan(b, hq, hkv, dim, q_len=sq, comm=comm)
    merger, prepared_class = baseline_compat(pkg, plan)
    merger_class = getattr(pkg.extend, "tools", pkg.extend).Merger  # 8d5d047: extend.Merger
    paper = merger_class(comm, rows, dim, "float32", "allreduce3")
    for buf in (merger.buf, paper.buf):
        buf[:-1] = rng.standard_normal((rows, dim + 2))
    records = np.empty((rows, dim + 2), np.float32)
    prepared = prepared_class.of(q, k, v, plan.scale)

    def noop(rec):
        return None

    methods = {
        "plan merge": lambda: merger.merge(noop),
        "plan step": lambda: plan.decode(q, k, v),
        "allreduce_state": lambda: pkg.allreduce_state(state, comm),
        "tree_decode": lambda: pkg.tree_decode(q, k, v, comm),
        "kernel": lambda: prepared.run(q, k, v, None, records),
        "allreduce3 strategy": lambda: paper.merge(noop),
    }

    def cleanup():
        plan.free()
        paper.free()

    return methods, cleanup


def measure(comm, packages, shape, keys, iters, warmup, stats=("median",)):
    """Return ({stat: {package: {method: slowest rank's us}}}, record bytes)."""
    b, hq, _, sq, dim = shape
    rows = b * hq * sq
    rng = np.random.default_rng([6, comm.rank])
    plain = rng.standard_normal((rows + 1, dim + 2)).astype(np.float32)
    recs = rng.standard_normal((rows + 1, dim + 2)).astype(np.float32)
    agreement = bytearray(32)

    def bare_one_shot():
        comm.Allreduce(MPI.IN_PLACE, [agreement, MPI.INT64_T], op=MPI.MIN)
        comm.Allreduce(MPI.IN_PLACE, plain, op=MPI.SUM)

    methods = {
        ("", "MPI.SUM"): lambda: comm.Allreduce(MPI.IN_PLACE, plain, op=MPI.SUM),
        ("", "agreement + SUM"): bare_one_shot,
        ("", "paper 3 allreduces"): paper_allreduce3(comm, recs),
    }
    cleanups = []
    for name, pkg in packages.items():
        own, cleanup = package_methods(pkg, comm, shape, keys, comm.rank)
        methods.update({(name, m): fn for m, fn in own.items()})
        cleanups.append(cleanup)
    times = np.zeros((len(methods), iters))
    for it in range(warmup + iters):
        plain[...] = recs  # the SUM would overflow to inf, then NaN, step after step
        for i, fn in enumerate(methods.values()):
            comm.Barrier()
            t0 = time.perf_counter_ns()
            fn()
            if it >= warmup:
                times[i, it - warmup] = time.perf_counter_ns() - t0
    for cleanup in cleanups:
        cleanup()
    slow = np.empty_like(times)
    comm.Allreduce(times, slow, op=MPI.MAX)
    result = {}
    for stat in stats:
        # pNN: a low percentile, the cost with the least interference from other processes
        q = 50 if stat == "median" else int(stat[1:])
        values = (np.percentile(slow, q, axis=1) / 1e3).tolist()
        out = result[stat] = {name: {} for name in packages}
        for (name, method), value in zip(methods, values, strict=True):
            for target in out.values() if name == "" else (out[name],):
                target[method] = value
        for med in out.values():
            med["plan step - kernel"] = med.pop("plan step") - med["kernel"]
            med["tree_decode - kernel"] = med.pop("tree_decode") - med["kernel"]
    return result, plain.nbytes


TARGETS = {"plan merge": 1.2, "allreduce_state": 2.0, "tree_decode - kernel": 2.0}
ORDER = (
    "MPI.SUM",
    "agreement + SUM",
    "plan merge",
    "plan step - kernel",
    "allreduce_state",
    "tree_decode - kernel",
    "paper 3 allreduces",
    "allreduce3 strategy",
    "kernel",
)


def show(name, nbytes, size, r, stat, args, meds):
    """Print one shape's table: each package's times, ratios to MPI.SUM and verdicts."""
    print(
        f"\n{name} (B, Hq, Hkv, Sq, D) = {SHAPES[name]}: {nbytes} bytes, {size} ranks, "
        f"round {r}; {stat} us (slowest rank) of {args.iters} interleaved iterations "
        f"after {args.warmup}; x = / MPI.SUM"
    )
    print(f"  {'':<22}" + "".join(f"{p:>24}" for p in meds))
    for key in ORDER:
        cells = []
        for med in meds.values():
            base, target = med["MPI.SUM"], TARGETS.get(key)
            mark = "" if target is None else (" ok" if med[key] <= target * base else " NO")
            cells.append(f"{med[key]:>10.1f}{med[key] / base:>8.2f}x{mark:>3}")
        print(f"  {key:<22}" + "".join(f"{c:>24}" for c in cells))
    ratios = [m["paper 3 allreduces"] / m["plan merge"] for m in meds.values()]
    print(
        f"  {'paper 3 / plan merge':<22}"
        + "".join(f"{x:>17.2f}x{' ok' if x >= 1.8 else ' NO':>3}    " for x in ratios)
    )


def main():
    """Print each shape's medians, their ratios to MPI.SUM and the targets' verdicts."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="llama,tiny", help=f"from {', '.join(SHAPES)}")
    parser.add_argument("--keys", type=int, default=16, help="keys per rank for the steps")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--stat",
        default="median",
        help="comma-separated: median (default) and/or pNN, that percentile over "
        "iterations (p10, p25: less sensitive to other processes on a loaded machine)",
    )
    parser.add_argument(
        "--baseline",
        metavar="PACKAGE",
        help="also time a copy of mpitree importable under another name (e.g. an older "
        "commit exported as mpitree_before, fe6c268 or later), interleaved in the same loop",
    )
    args = parser.parse_args()
    comm = mpitree.default_comm()
    packages = {"mpitree": mpitree}
    if args.baseline:
        packages = {args.baseline: importlib.import_module(args.baseline), **packages}
    for name in args.shapes.split(","):
        for r in range(args.rounds):
            result, nbytes = measure(
                comm, packages, SHAPES[name], args.keys, args.iters, args.warmup,
                args.stat.split(","),
            )  # fmt: skip
            if comm.rank == 0:
                for stat, meds in result.items():
                    show(name, nbytes, comm.size, r, stat, args, meds)
    if comm.rank == 0:
        print("targets: plan merge <= 1.2x, allreduce_state and tree_decode - kernel <= 2x, ")
        print("paper 3 allreduces >= 1.8x plan merge (ok: met, NO: not met)")


if __name__ == "__main__":
    main()
