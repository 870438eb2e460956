"""``python -m mpitree merge``: the cost of one cross-rank merge, every way, side by side."""

import time

import numpy as np
from mpi4py import MPI

from .._merger import Merger
from .._op import native_op_available, python_op
from .._registry import host_strategies
from .._runtime import default_comm
from .._strategies import REGISTRY
from ._args import count


def add_arguments(parser):
    """Register the merge benchmark's options."""
    parser.add_argument("--rows", type=count(1), default=32, help="(batch, head, query) rows")
    parser.add_argument("--head-dim", type=count(1), default=128, help="head dimension D")
    parser.add_argument("--iters", type=count(1), default=2000, help="timed merges per method")
    parser.add_argument("--warmup", type=count(0), default=200, help="untimed warm-up merges")
    parser.add_argument(
        "--node-size",
        type=count(0),
        default=2,
        help="virtual node size for the hierarchical strategy (0: real nodes)",
    )


def merged(node_size, op=None):
    """Return ``(name, row label)`` of every strategy that merges records, in registry order.

    A strategy that moves keys and values (``needs_kv``) has no records-only merge to time.
    A label's ``{op}`` names the user op the merge runs: ``op`` (:func:`ops_run`), by
    default this rank's own, ``native`` or ``numpy``.
    """
    nodes = node_size or "real"
    if op is None:
        op = "native" if native_op_available() else "numpy"
    return [
        (name, (cls.label or name).format(nodes=nodes, op=op))
        for name, cls in REGISTRY.items()
        if not cls.needs_kv and name in host_strategies()
    ]


def ops_run(comm):
    """Return the user op a merge with the native op runs, over every rank (collective).

    Each rank runs its own: the compiled op where it has it, else the numpy op
    (``MPITREE_NATIVE_OP=0``, or no build). So a merge runs ``"native"`` where every
    rank has it, ``"numpy"`` where none has, ``"mixed"`` otherwise; and, for the
    header, how many ranks have it.
    """
    have = sum(comm.allgather(native_op_available()))
    size = comm.Get_size()
    op = "native" if have == size else "numpy" if have == 0 else "mixed"
    return op, f"on {have} of {size} ranks"


def run(args):
    """Time each method (slowest rank per iteration); rank 0 prints medians and ratios."""
    comm = default_comm()
    rows, dim = args.rows, args.head_dim
    rng = np.random.default_rng(comm.Get_rank())
    data = rng.standard_normal((rows + 1, dim + 2)).astype(np.float32)
    data[-1, 0] = -np.inf  # the error-flag row every mpitree merge carries

    def reducer(strategy, persistent=False):
        merger = Merger(
            comm, rows, dim, "float32", strategy, persistent=persistent, node_size=args.node_size
        )
        return merger.buf, lambda: merger.merge(lambda records: None)

    op, native = ops_run(comm)
    plain, pybuf = data.copy(), data.copy()
    pyrec, pyop = python_op(np.float32, dim + 2)
    methods = {  # name -> (buffer restored before each merge, merge)
        "MPI.SUM allreduce (same bytes)": (
            plain,
            lambda: comm.Allreduce(MPI.IN_PLACE, plain, MPI.SUM),
        ),
    }
    for name, label in merged(args.node_size, op):
        methods[label] = reducer(name)
        if REGISTRY[name].persistent:
            methods[f"{label}, persistent"] = reducer(name, persistent=True)
        if name == "allreduce":  # its op in numpy, beside it: what the compiled op saves
            methods["allreduce, numpy Python op"] = (
                pybuf,
                lambda: comm.Allreduce(MPI.IN_PLACE, [pybuf, rows + 1, pyrec], pyop),
            )
    names = list(methods)
    times = np.zeros((len(names), args.iters))
    for it in range(args.warmup + args.iters):
        for i, name in enumerate(names):
            buf, merge = methods[name]
            buf[...] = data
            comm.Barrier()
            t0 = time.perf_counter()
            merge()
            if it >= args.warmup:
                times[i, it - args.warmup] = time.perf_counter() - t0
    slow = np.empty_like(times)
    comm.Allreduce(times, slow, op=MPI.MAX)
    pyop.Free()
    pyrec.Free()
    if comm.Get_rank() == 0:
        med = np.median(slow, axis=1) * 1e6
        base = med[0]
        print(
            f"merge of {rows} records x {dim + 2} float32 ({(rows + 1) * (dim + 2) * 4} bytes) "
            f"on {comm.Get_size()} ranks; native op: {native}; "
            f"{MPI.Get_library_version().splitlines()[0].strip()}"
        )
        print(f"{'method':<34} {'median us':>10} {'vs MPI.SUM':>11}")
        for name, m in zip(names, med, strict=False):
            print(f"{name:<34} {m:>10.1f} {m / base:>10.2f}x")
        print(
            f"slowest rank per merge, median of {args.iters} interleaved merges after "
            f"{args.warmup} warm-up merges"
        )
