"""Command line: ``mpiexec -n 4 python -m mpitree demo`` (or ``bench``, ``merge``, ``model``)."""

import argparse
import sys


def main(argv=None):
    """Parse the command line and run the chosen subcommand."""
    parser = argparse.ArgumentParser(prog="python -m mpitree", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from . import _bench, _demo, _mergebench, _modelcli

    demo = sub.add_parser("demo", help="check and time every strategy on a synthetic context")
    _demo.add_arguments(demo)
    demo.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="exit 1 if any strategy's max error exceeds this",
    )
    bench = sub.add_parser("bench", help="latency, bytes and peak memory of every strategy")
    _bench.add_arguments(bench)
    cost = sub.add_parser("model", help="predicted step times from the alpha-beta cost model")
    _modelcli.add_arguments(cost)
    merge = sub.add_parser("merge", help="time one cross-rank merge with every method")
    _mergebench.add_arguments(merge)
    args = parser.parse_args(argv)
    if args.command == "merge":
        _mergebench.run(args)
        return 0
    if args.command == "model":
        _modelcli.run(args)
        return 0
    if args.command == "bench":
        _bench.run(args)
        return 0
    err = _demo.run(args)
    if args.tolerance is not None and err is not None and err > args.tolerance:
        print(f"FAILED: max error {err:.3e} > tolerance {args.tolerance:.1e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
