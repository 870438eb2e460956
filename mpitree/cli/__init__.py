"""Command line: ``mpiexec -n 4 python -m mpitree demo`` (or ``generate``, ``bench``, ...)."""

import argparse
import sys

import mpi4py
from mpi4py import MPI

from .. import __version__
from .._runtime import default_comm
from . import bench as bench_cli
from . import cluster as cluster_cli
from . import demo as demo_cli
from . import generate as generate_cli
from . import merge as merge_cli
from . import model as model_cli

COMMANDS = {
    "demo": (demo_cli, "check and time every strategy on a synthetic context"),
    "generate": (generate_cli, "decode a real model's text over a sharded KV cache"),
    "bench": (bench_cli, "latency, bytes and peak memory of every strategy"),
    "model": (model_cli, "predicted step times from the alpha-beta cost model"),
    "merge": (merge_cli, "time one cross-rank merge with every method"),
    "cluster": (cluster_cli, "run an mpiexec job across emulated nodes with shaped links"),
}
PLOT_HINT = (
    "--plot needs matplotlib, which failed to import on at least one rank: install it with "
    "pip install -e '.[bench]' from the mpitree checkout, or pip install matplotlib"
)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Show each option's default (not None, not a flag's False); keep descriptions' lines."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, but only rank 0 prints (help, usage, errors): once per job."""

    def _print_message(self, message, file=None):
        if default_comm().Get_rank() == 0:
            super()._print_message(message, file)


def version_text():
    """Return mpitree's version, the MPI library's first version line and mpi4py's version."""
    library = " ".join(MPI.Get_library_version().splitlines()[0].split())
    return f"mpitree {__version__}\nMPI library: {library}\nmpi4py {mpi4py.__version__}"


def build_parser():
    """Return the parser of ``python -m mpitree`` and its subcommands."""
    parser = ArgumentParser(
        prog="python -m mpitree", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--version",
        action="version",
        version=version_text(),
        help="print the versions of mpitree, the MPI library and mpi4py, and exit",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.commands = {}  # each subcommand's parser, for its own usage line in errors
    for name, (module, text) in COMMANDS.items():
        command = sub.add_parser(name, help=text, description=text, formatter_class=HelpFormatter)
        module.add_arguments(command)
        parser.commands[name] = command
    return parser


def main(argv=None):
    """Parse the command line and run the chosen subcommand; return the exit code."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    command = parser.commands[args.command]
    if unknown:  # the subcommand's usage, not the top level's
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    problem = getattr(COMMANDS[args.command][0], "problem", None)
    message = problem(args) if problem is not None else None
    if message:  # arguments that are wrong together: every rank stops here, rank 0 says why
        command.error(message)
    if args.command == "bench" and args.plot:
        # before any work, and agreed: if one rank cannot plot, every rank stops
        if default_comm().allreduce(not bench_cli.matplotlib_importable(), op=MPI.LOR):
            if default_comm().Get_rank() == 0:
                print(f"python -m mpitree bench: error: {PLOT_HINT}", file=sys.stderr)
            return 2
    if args.command == "demo":
        return 1 if demo_cli.run(args) else 0
    if args.command == "generate":
        return generate_cli.run(args)
    if args.command == "cluster":
        return cluster_cli.run(args)
    COMMANDS[args.command][0].run(args)
    return 0
