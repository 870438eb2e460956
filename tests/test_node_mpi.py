"""The ``node`` strategy: a shared window per node, merged in rank order, leaders all-reduce."""

import resource

import numpy as np
import pytest
from helpers import gathered_identical, make_problem, world
from mpi4py import MPI
from numpy.testing import assert_allclose

import mpitree
from mpitree._guard import RankError
from mpitree._library import native_lib
from mpitree._merger import Merger, merger_for
from mpitree._state import combine_records
from mpitree._strategies.node import _shared_node

NPROCS = [1, 2, 3, 4]
NODE_SIZES = [0, 1, 2, 3]  # real nodes (one here), one rank per node, uneven virtual nodes


def merge_exp(x):
    """The compiled op's own exponential, elementwise (what the node's fold runs)."""
    x = np.ascontiguousarray(x)
    y = np.empty_like(x)
    native_lib().mpitree_merge_exp(8 * x.itemsize, x.ctypes.data, y.ctypes.data, x.size)
    return y


def folded(parts):
    """``combine_records`` folded over ``parts`` in rank order, with the fold's exponential."""
    exp = None if native_lib() is None else merge_exp
    acc = parts[0]
    with np.errstate(all="ignore"):
        for part in parts[1:]:
            acc = combine_records(acc, part, exp=exp)
    return acc


def records(rank, rows, dim, dtype):
    """This rank's records: ordinary rows, empty states, -inf and NaN rows, per rank."""
    rng = np.random.default_rng([rank, rows, dim])
    rec = np.empty((rows, dim + 2), dtype)
    rec[:, 0] = rng.standard_normal(rows) * 3
    rec[:, 1] = rng.random(rows) * 5 + 0.1
    rec[:, 2:] = rng.standard_normal((rows, dim))
    rec[rank % rows] = 0
    rec[rank % rows, 0] = -np.inf  # this rank's empty row
    rec[-1] = 0
    rec[-1, 0] = -np.inf  # a row empty on every rank
    if rank == 1:
        rec[rows // 2] = np.nan  # a NaN score on one rank poisons its row everywhere
    return rec


def same_bits(got, want):
    """Equal bit for bit, NaN payloads aside."""
    nan = np.isnan(want)
    uint = np.uint32 if got.dtype == np.float32 else np.uint64
    return np.array_equal(np.isnan(got), nan) and np.array_equal(
        got.view(uint)[~nan], want.view(uint)[~nan]
    )


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("node_size", NODE_SIZES)
@pytest.mark.parametrize("layout", ["uneven", "some_empty", "one_holds_all"])
def test_tree_decode_matches_reference(node_size, layout):
    """Exact against the float64 reference on every node layout, the same on every rank."""
    comm = world()
    p = comm.size
    sizes = {
        "uneven": [7, 1, 12, 4][:p],
        "some_empty": [0 if r % 2 else 9 + r for r in range(p)],
        "one_holds_all": [0] * (p - 1) + [23],
    }[layout]
    prob = make_problem(5, sizes, batch=2, q_len=3, positions=True, mask="head")
    k, v, kw = prob.shard(comm.rank)
    out, lse = mpitree.tree_decode(
        prob.q, k, v, strategy="node", node_size=node_size, return_lse=True, **kw
    )
    ref_out, ref_lse = prob.reference()
    assert_allclose(out, ref_out, atol=2e-5, rtol=0)
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), empty)
    assert_allclose(lse[~empty], ref_lse[~empty], rtol=2e-6, atol=2e-6)
    assert gathered_identical(comm, out) and gathered_identical(comm, lse)


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("node_size", NODE_SIZES)
def test_one_node_is_the_rank_ordered_fold(dtype, node_size):
    """On one node (real, or a virtual one of all ranks) the merge is ``combine_records``
    folded in rank order, bit for bit, step after step; across nodes it is the leaders'
    all-reduce of their nodes' folds, the same on every rank."""
    comm = world()
    rows, dim = 9, 6
    mine = records(comm.rank, rows, dim, np.dtype(dtype))
    parts = comm.allgather(mine)
    merger = Merger(comm, rows, dim, dtype, "node", node_size=node_size)
    try:
        for _ in range(3):  # both sets of slots, then the first again
            got = merger.merge(lambda out: out.__setitem__(Ellipsis, mine)).copy()
            one_node = node_size == 0 or node_size >= comm.size
            if one_node:
                assert same_bits(got, folded(parts))
            else:
                nodes = [parts[i : i + node_size] for i in range(0, comm.size, node_size)]
                with np.errstate(invalid="ignore"):
                    want = folded([folded(node) for node in nodes])
                assert np.array_equal(np.isnan(got), np.isnan(want))
                assert_allclose(got, want, rtol=1e-5 if dtype == "float32" else 1e-12)
            assert np.isnan(got[rows // 2]).all() == (comm.size > 1)
            assert gathered_identical(comm, got)
    finally:
        merger.free()


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("node_size", NODE_SIZES)
def test_same_bits_at_any_node_size_on_one_node(node_size):
    """Real node, or virtual nodes as large as the communicator: the same bits, run after run."""
    comm = world()
    prob = make_problem(8, [5 + 3 * r for r in range(comm.size)], q_len=2)
    k, v, kw = prob.shard(comm.rank)
    outs = [
        mpitree.tree_decode(prob.q, k, v, strategy="node", node_size=size, **kw)
        for size in (0, comm.size, 0)
    ]
    assert all(np.array_equal(out.view(np.uint32), outs[0].view(np.uint32)) for out in outs)
    assert gathered_identical(comm, outs[0])


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("node_size", NODE_SIZES)
def test_a_failing_rank_raises_on_every_rank(node_size):
    """One rank's local work fails: its flag rides the window and the leaders' merge."""
    comm = world()
    merger = Merger(comm, 4, 8, "float32", "node", node_size=node_size)
    bad = comm.size - 1

    def local(out):
        if comm.rank == bad:
            raise ValueError("this rank's shard is broken")
        out[...] = 1.0

    try:
        with pytest.raises(ValueError if comm.rank == bad else RankError, match="broken"):
            merger.merge(local)
        out = merger.merge(lambda out: out.__setitem__(Ellipsis, 1.0))  # then it merges again
        assert np.isfinite(out).all()
    finally:
        merger.free()


def rss_mb():
    """This process's resident memory in MB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


@pytest.mark.parallel(nprocs=[2, 3, 4])
@pytest.mark.parametrize("node_size", [0, 2])
def test_windows_are_shared_and_freed_with_the_communicator(node_size):
    """Many mergers, freed or dropped (collected whenever), share their communicator's
    window; it grows with larger records and is freed with the communicator: no growth."""
    comm = world()
    rows, dim = 64, 128  # a window of 2 (p + 1) x 33 KB

    def churn(n):
        for i in range(n):
            merger = Merger(comm, rows, dim, "float32", "node", node_size=node_size)
            merger.merge(lambda out: out.fill(1.0))
            if i % 2:
                merger.free()  # else dropped: freed by its finalizer, at the same point
            del merger

    churn(50)
    before = rss_mb()
    churn(200)
    for _ in range(8):
        cached = comm.Dup()
        windows = set()
        for rows_i in range(1, 40):  # 16 kept, the rest evicted; the window grows
            merger = merger_for(cached, rows_i, 8, "float32", "node", node_size)
            merger.merge(lambda out: out.fill(1.0))
            windows.add(merger._impl._window)
        assert len(windows) == 1 and next(iter(windows)).win is not None
        cached.Free()  # frees its mergers, then its node communicator and the window
        assert next(iter(windows)).win is None
    growth = comm.allreduce(rss_mb() - before, op=MPI.MAX)
    assert growth < 8.0, f"grew {growth:.1f} MB over 200 mergers and 8 communicators"


@pytest.mark.parallel(nprocs=NPROCS)
def test_a_plan_runs_it_and_deterministic_mode_leaves_it():
    """``strategy="node"`` in a plan; ``deterministic=True`` runs the rank-ordered gather."""
    comm = world()
    prob = make_problem(3, [4 + r for r in range(comm.size)])
    k, v, kw = prob.shard(comm.rank)
    with mpitree.DecodePlan(2, 4, 2, 16, strategy="node") as plan:
        assert plan.strategy == "node"
        for _ in range(3):
            assert_allclose(plan.decode(prob.q, k, v, **kw), prob.reference()[0], atol=2e-5)
    with mpitree.DecodePlan(2, 4, 2, 16, strategy="node", deterministic=True) as plan:
        assert plan.strategy == "allgather"


class SpanningNode:
    """A node communicator whose ranks do not all share memory (two machines)."""

    def Get_size(self):
        return 2

    def Split_type(self, kind):
        return MPI.COMM_SELF.Dup()


@pytest.mark.parallel(nprocs=NPROCS)
def test_a_virtual_node_across_machines_is_an_error_on_every_rank():
    """A virtual node that spans machines (faked on rank 0) cannot share a window: every
    rank raises, before any window is opened."""
    comm = world()
    node = SpanningNode() if comm.rank == 0 else MPI.COMM_SELF
    with pytest.raises(ValueError, match="needs every node's ranks on one machine"):
        _shared_node(node, comm)
