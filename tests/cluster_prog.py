"""Every strategy across an emulated cluster, checked on every rank; run by tests/test_cluster.py.

    python -m mpitree cluster --nodes 3 --ranks-per-node 2 -- \
        python tests/cluster_prog.py --nodes 3 --ranks-per-node 2

Checks each strategy (and ``deterministic="invariant"``) against the float64
reference on uneven and empty shards, the hierarchical strategy's node layout
against the node each rank runs on (its host name, set per node by the harness,
and the harness's placement: rank ``r`` on node ``r // ranks_per_node``), and
that ``"auto"`` resolves as documented. Every rank's failures are gathered: rank
0 prints them all and every rank exits 1 on any failure, 0 otherwise.
"""

import argparse
import os
import socket
import sys

import numpy as np
from helpers import atol, make_problem, report_failures
from mpi4py import MPI

import mpitree
from mpitree._strategies import auto_strategy

STRATEGIES = ["allreduce", "allreduce3", "allgather", "ring", "hierarchical", "auto"]
BLOCK = 4  # invariant block size: every shard below is a whole number of blocks
SIZES = [8, 0, 12, 4, 16, 4, 8, 0]  # per rank, uneven, with empty shards


def check_layout(plan, comm, nodes, rpn, failures):
    """Compare the hierarchical plan's node split with where the ranks really run."""
    lay = plan._merger._impl.layout
    mine = comm.rank // rpn
    expected = list(range(mine * rpn, (mine + 1) * rpn))
    members = lay.node.allgather(comm.rank)
    if members != expected:
        failures.append(f"node communicator holds ranks {members}, expected {expected}")
    hosts = comm.allgather(socket.gethostname())
    same_host = [r for r, h in enumerate(hosts) if h == hosts[comm.rank]]
    if same_host != members:
        failures.append(f"ranks on my host {hosts[comm.rank]}: {same_host}; node comm: {members}")
    if len(set(hosts)) != nodes:
        failures.append(f"{len(set(hosts))} distinct host names, expected {nodes}")
    if (lay.nodes, lay.ranks_per_node) != (nodes, rpn):
        failures.append(f"layout says {lay.nodes} nodes x {lay.ranks_per_node}, not {nodes}x{rpn}")
    leader = lay.leaders != MPI.COMM_NULL
    if leader != (comm.rank % rpn == 0):
        failures.append(f"rank {comm.rank} leader={leader}")
    if leader and lay.leaders.allgather(comm.rank) != list(range(0, nodes * rpn, rpn)):
        failures.append(f"leaders communicator holds {lay.leaders.allgather(comm.rank)}")


def check_result(name, out, lse, ref_out, ref_lse, dtype, failures):
    """Append a failure unless ``out``/``lse`` match the float64 reference."""
    err = float(np.max(np.abs(out.astype(np.float64) - ref_out)))
    empty = np.isneginf(ref_lse)
    if np.isnan(out).any() or err > atol(dtype):
        failures.append(f"{name}: max |out - reference| = {err:.3g} > {atol(dtype):g}")
    if not np.array_equal(np.isneginf(lse), empty):
        failures.append(f"{name}: empty rows differ from the reference")
    lse_err = float(np.max(np.abs(lse[~empty] - ref_lse[~empty]), initial=0))
    if lse_err > 1e-5:
        failures.append(f"{name}: max |lse - reference| = {lse_err:.3g}")


def run_strategies(comm, nodes, rpn, failures):
    """Decode with every strategy and dtype; compare with the reference; return auto's pick."""
    sizes = [SIZES[r % len(SIZES)] for r in range(comm.size)]
    chosen = None
    for dtype in (np.float32, np.float64):
        prob = make_problem(7, sizes, batch=2, q_heads=8, kv_heads=2, q_len=2, dtype=dtype,
                            kv_len=True, mask="head")  # fmt: skip
        k, v, kw = prob.shard(comm.rank)
        ref_out, ref_lse = prob.reference()
        for strategy in STRATEGIES:
            name = f"{strategy} {np.dtype(dtype).name}"
            try:
                shape = dict(q_len=2, dtype=dtype, strategy=strategy)
                with mpitree.DecodePlan(2, 8, 2, 16, **shape) as plan:
                    for _step in range(2):  # a second step reuses the merger
                        out, lse = plan.decode(prob.q, k, v, return_lse=True, **kw)
                    check_result(name, out, lse, ref_out, ref_lse, dtype, failures)
                    if strategy == "hierarchical":
                        check_layout(plan, comm, nodes, rpn, failures)
                    if strategy == "auto":
                        chosen = plan.strategy
            except Exception as exc:  # raised on every rank alike (mpitree's contract)
                failures.append(f"{name}: {type(exc).__name__}: {exc}")
    return chosen


def run_invariant(comm, failures):
    """deterministic="invariant": the reference, and the very bits of one process."""
    sizes = [SIZES[r % len(SIZES)] for r in range(comm.size)]
    prob = make_problem(11, sizes, batch=2, q_heads=4, kv_heads=2, dtype=np.float32)
    k, v, _ = prob.shard(comm.rank)
    start = sum(sizes[: comm.rank])
    kw = {"deterministic": "invariant", "block_size": BLOCK, "return_lse": True}
    out, lse = mpitree.tree_decode(prob.q, k, v, kv_start=start, **kw)
    ref_out, ref_lse = prob.reference()
    check_result("invariant", out, lse, ref_out, ref_lse, np.float32, failures)
    one, one_lse = mpitree.tree_decode(prob.q, prob.k, prob.v, comm=MPI.COMM_SELF, kv_start=0, **kw)
    if not (np.array_equal(out, one) and np.array_equal(lse, one_lse)):
        failures.append("invariant: not bitwise equal to one process on the whole cache")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--ranks-per-node", type=int, required=True)
    args = parser.parse_args()
    comm, nodes, rpn = MPI.COMM_WORLD, args.nodes, args.ranks_per_node
    failures = []
    if comm.size != nodes * rpn:
        failures.append(f"{comm.size} ranks, expected {nodes} x {rpn}")
    if os.environ.get("MPITREE_NODE_SIZE"):
        failures.append("MPITREE_NODE_SIZE is set: the layout would not come from MPI")
    chosen = run_strategies(comm, nodes, rpn, failures)
    run_invariant(comm, failures)
    native = mpitree.native_op_available()
    ring_library = "open mpi" in MPI.Get_library_version().lower()
    if chosen != auto_strategy(comm.size, native, nodes, rpn, ring_library):
        failures.append(f"auto ran {chosen!r}")
    return report_failures(
        comm, failures, f"cluster_prog: {nodes} nodes x {rpn} ranks: all exact; auto ran {chosen}"
    )


if __name__ == "__main__":
    sys.exit(main())
