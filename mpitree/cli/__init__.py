"""Command line: ``mpiexec -n 4 python -m mpitree demo`` (or ``bench``, ``merge``, ``model``)."""

import argparse
import sys


def main(argv=None):
    """Parse the command line and run the chosen subcommand."""
    parser = argparse.ArgumentParser(prog="python -m mpitree", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from . import bench as bench_cli
    from . import demo as demo_cli
    from . import merge as merge_cli
    from . import model as model_cli

    demo = sub.add_parser("demo", help="check and time every strategy on a synthetic context")
    demo_cli.add_arguments(demo)
    demo.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="exit 1 if any strategy's max error exceeds this",
    )
    bench = sub.add_parser("bench", help="latency, bytes and peak memory of every strategy")
    bench_cli.add_arguments(bench)
    cost = sub.add_parser("model", help="predicted step times from the alpha-beta cost model")
    model_cli.add_arguments(cost)
    merge = sub.add_parser("merge", help="time one cross-rank merge with every method")
    merge_cli.add_arguments(merge)
    args = parser.parse_args(argv)
    if args.command == "merge":
        merge_cli.run(args)
        return 0
    if args.command == "model":
        model_cli.run(args)
        return 0
    if args.command == "bench":
        bench_cli.run(args)
        return 0
    err = demo_cli.run(args)
    if args.tolerance is not None and err is not None and err > args.tolerance:
        print(f"FAILED: max error {err:.3e} > tolerance {args.tolerance:.1e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
