"""``python -m mpitree model``: predicted step times per strategy from the cost model."""

import json
import os
import sys

from .. import model
from ._args import count, counts

EXTRAPOLATION = 2  # warn for a requested point this many times beyond the calibrated range


def problem(args):
    """Return what is wrong with the arguments taken together, or None."""
    if args.calibrate is not None and not os.path.isfile(args.calibrate):
        return f"--calibrate: no such file: {args.calibrate}"
    return None


def add_arguments(parser):
    """Register the model command's options."""
    parser.add_argument(
        "--machine",
        default="dgx-h100",
        choices=sorted(model.MACHINES),
        help="preset machine (ignored with --calibrate)",
    )
    parser.add_argument(
        "--calibrate",
        metavar="BENCH_JSON",
        help="use a machine fitted to a 'python -m mpitree bench --json' file",
    )
    parser.add_argument(
        "--workload", default="llama3-8b", choices=sorted(model.WORKLOADS), help="layer shapes"
    )
    parser.add_argument(
        "--kv-itemsize",
        type=count(1),
        default=None,
        help="bytes per K/V element (default: 2, bf16; 4 with --calibrate)",
    )
    parser.add_argument("--ranks", type=counts(1), default=(8,), help="comma-separated rank counts")
    parser.add_argument(
        "--tokens",
        type=counts(1),
        default=(32768, 65536, 131072, 262144),
        help="comma-separated sequence lengths",
    )


def warn_extrapolation(bench, path, ranks, tokens):
    """Warn on stderr about requested ranks or tokens far outside those the bench run measured."""
    cells = bench["results"]
    measured = {"ranks": [c["ranks"] for c in cells], "tokens": [c["tokens"] for c in cells]}
    for name, asked in (("ranks", ranks), ("tokens", tokens)):
        lo, hi = min(measured[name]), max(measured[name])
        far = [x for x in asked if x * EXTRAPOLATION < lo or x > hi * EXTRAPOLATION]
        if far:
            span = f"{lo}" if lo == hi else f"{lo} to {hi}"
            print(
                f"warning: {path} measured {name} = {span}; the predictions for {name} = "
                f"{', '.join(map(str, far))} extrapolate more than {EXTRAPOLATION}x beyond that",
                file=sys.stderr,
            )


def run(args):
    """Print one table row per (ranks, tokens)."""
    ranks, tokens = list(args.ranks), list(args.tokens)
    if args.calibrate:
        with open(args.calibrate) as f:
            bench = json.load(f)
        machine = model.calibrate(bench)
        warn_extrapolation(bench, args.calibrate, ranks, tokens)
        if machine.device.throughput <= 0:
            print(
                f"warning: {args.calibrate} gives a negative kernel throughput (local attention "
                "timed faster on longer shards), so these predictions mean nothing; "
                "rerun the bench with larger --tokens and more --steps",
                file=sys.stderr,
            )
    else:
        machine = model.MACHINES[args.machine]
    workload = model.WORKLOADS[args.workload]
    itemsize = args.kv_itemsize or (4 if args.calibrate else workload.kv_itemsize)
    workload = model.Workload(
        workload.name,
        workload.q_heads,
        workload.kv_heads,
        workload.head_dim,
        workload.batch,
        itemsize,
    )
    print(
        f"{machine.name}: {machine.ranks_per_node} ranks/node; intra {machine.intra.name} "
        f"({machine.intra.latency * 1e6:.1f} us, {machine.intra.bandwidth / 1e9:.1f} GB/s); "
        f"inter {machine.inter.name}; local {machine.device.name} "
        f"({machine.device.throughput / 1e9:.0f} GB/s + {machine.device.overhead * 1e6:.0f} us)"
    )
    print(
        f"{workload.name}: Hq={workload.q_heads} Hkv={workload.kv_heads} D={workload.head_dim} "
        f"B={workload.batch}, K/V {itemsize} bytes/element; one layer, one decode step"
    )
    names = ("local", *model.STRATEGIES)
    print(f"{'ranks':>6} {'N':>9} " + " ".join(f"{n:>12}" for n in names) + f" {'ring/tree':>10}")
    for p in ranks:
        for n in tokens:
            t = model.predict(workload, n, p, machine)
            print(
                f"{p:>6} {n:>9} "
                + " ".join(f"{t[k] * 1e3:>9.3f} ms" for k in names)
                + f" {t['ring'] / t['allreduce']:>9.2f}x"
            )
