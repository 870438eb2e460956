"""``python -m mpitree cluster``: run an mpiexec job across emulated nodes with shaped links.

    python -m mpitree cluster --nodes 2 --ranks-per-node 2 --link 1gbit -- python -m mpitree bench

Needs root and ``ip netns`` (see :mod:`mpitree.cluster`); exits with the job's
exit code, 2 when the cluster cannot be made, 124 on --timeout, 130 on Ctrl-C,
and removes every namespace, link and process it made in every case.
"""

import subprocess
import sys

from ..cluster import MAX_NODES, Cluster, ClusterError, remove_stale

PROG = "python -m mpitree cluster"


def add_arguments(parser):
    """Register the cluster command's options."""
    parser.add_argument("--nodes", type=int, default=2, help=f"emulated nodes (1 to {MAX_NODES})")
    parser.add_argument("--ranks-per-node", type=int, default=1, help="ranks on each node")
    parser.add_argument(
        "--link",
        default="unshaped",
        help="rate of each direction of each node's link, as tc writes it: 100mbit, 1gbit, "
        "10gbit, or unshaped",
    )
    parser.add_argument(
        "--latency",
        help="one-way delay added on each link (e.g. 1ms); needs the kernel's netem qdisc",
    )
    parser.add_argument("--mpiexec", help="mpiexec to launch with (default: the venv's, or PATH's)")
    parser.add_argument(
        "--timeout", type=float, help="stop the job and exit 124 after this many seconds"
    )
    parser.add_argument(
        "--remove-stale",
        action="store_true",
        help="remove what clusters whose harness was killed (SIGKILL) left behind, and exit",
    )
    parser.add_argument(
        "program", nargs="*", metavar="COMMAND", help="the program every rank runs (after --)"
    )


def run(args):
    """Make the cluster, run the program across it, tear it down; return the exit code."""
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    try:
        if args.remove_stale:
            tags = remove_stale()
            names = " ".join(tags)
            print(f"removed {len(tags)} stale cluster(s) {names}".rstrip(), file=sys.stderr)
            return 0
        if not program:
            raise ClusterError("no command to run: give it after --")
        with Cluster(args.nodes, link=args.link, latency=args.latency, mpiexec=args.mpiexec) as c:
            print(
                f"cluster: {len(c.names)} node(s) x {args.ranks_per_node} rank(s), {c.kind} "
                f"mpiexec, links {args.link}: {', '.join(c.names)}",
                file=sys.stderr,
                flush=True,
            )
            return c.run(program, args.ranks_per_node, timeout=args.timeout).returncode
    except ClusterError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except subprocess.TimeoutExpired:
        print(f"{PROG}: the job ran past --timeout {args.timeout:g} s: stopped", file=sys.stderr)
        return 124
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted: the job stopped, the cluster torn down", file=sys.stderr)
        return 130
