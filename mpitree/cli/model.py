"""``python -m mpitree model``: predicted step times per strategy from the cost model."""

import json

from .. import model


def add_arguments(parser):
    """Register the model command's options."""
    parser.add_argument("--machine", default="dgx-h100", choices=sorted(model.MACHINES))
    parser.add_argument(
        "--calibrate",
        metavar="BENCH_JSON",
        help="use a machine fitted to a 'python -m mpitree bench --json' file",
    )
    parser.add_argument("--workload", default="llama3-8b", choices=sorted(model.WORKLOADS))
    parser.add_argument(
        "--kv-itemsize",
        type=int,
        default=None,
        help="bytes per K/V element (default 2, bf16; 4 with --calibrate)",
    )
    parser.add_argument("--ranks", default="8", help="comma-separated rank counts")
    parser.add_argument(
        "--tokens", default="32768,65536,131072,262144", help="comma-separated sequence lengths"
    )


def run(args):
    """Print one table row per (ranks, tokens)."""
    if args.calibrate:
        with open(args.calibrate) as f:
            machine = model.calibrate(json.load(f))
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
    for p in (int(x) for x in args.ranks.split(",")):
        for n in (int(x) for x in args.tokens.split(",")):
            t = model.predict(workload, n, p, machine)
            print(
                f"{p:>6} {n:>9} "
                + " ".join(f"{t[k] * 1e3:>9.3f} ms" for k in names)
                + f" {t['ring'] / t['allreduce']:>9.2f}x"
            )
