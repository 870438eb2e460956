"""Hierarchical reduction, auto's choice, deterministic mode and validate mode."""

import numpy as np
import pytest
from helpers import gathered_identical, make_problem, world
from mpi4py import MPI
from numpy.testing import assert_allclose

import mpitree
from mpitree._state import merge_records

NPROCS = [1, 2, 3, 4]


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("node_size", [0, 1, 2, 3])
def test_hierarchical_any_node_layout(node_size):
    """Real nodes (0), one rank per node (1), uneven virtual nodes (2, 3): all exact."""
    comm = world()
    prob = make_problem(21, [3 + 2 * r for r in range(comm.size)], q_len=2, mask="head")
    k, v, kw = prob.shard(comm.rank)
    with mpitree.DecodePlan(
        2, 4, 2, 16, q_len=2, strategy="hierarchical", node_size=node_size
    ) as plan:
        for _ in range(2):  # the cached sub-communicators are reused
            out = plan.decode(prob.q, k, v, **kw)
            assert_allclose(out, prob.reference()[0], atol=2e-5, rtol=0)
            assert gathered_identical(comm, out)


@pytest.mark.parallel(nprocs=NPROCS)
def test_auto_choice_on_virtual_nodes():
    open_mpi = "open mpi" in MPI.Get_library_version().lower()
    with mpitree.DecodePlan(1, 4, 2, 8, node_size=2) as plan:
        several = world().size > 2  # more than one node of more than one rank
        assert plan.strategy == ("hierarchical" if several and open_mpi else "allreduce")
    with mpitree.DecodePlan(1, 4, 2, 8) as plan:  # one real node
        assert plan.strategy == "allreduce"


@pytest.mark.parametrize(
    "args, expect",
    [
        ((8, True, 1, 8, True), "allreduce"),  # one node
        ((16, True, 2, 8, False), "allreduce"),  # nodes, recursive doubling (MPICH)
        ((16, True, 2, 8, True), "hierarchical"),  # nodes, ring/Rabenseifner (Open MPI)
        ((16, True, 16, 1, True), "allreduce"),  # one rank per node: nothing to group
        ((4, False, 1, 4, True), "allgather"),  # no native op, few ranks
        ((64, False, 8, 8, False), "allreduce3"),  # no native op, many ranks
    ],
)
def test_auto_rule(args, expect):
    from mpitree._strategies import auto_strategy

    assert auto_strategy(*args) == expect


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("strategy", ["allreduce", "allreduce3", "hierarchical", "ring", "auto"])
def test_deterministic_is_the_rank_ordered_merge(strategy):
    """deterministic=True equals merging every rank's local state in rank order, bitwise."""
    comm = world()
    prob = make_problem(8, [4 + r for r in range(comm.size)], batch=2, q_len=3, positions=True)
    k, v, kw = prob.shard(comm.rank)
    outs = [
        mpitree.tree_decode(
            prob.q, k, v, strategy=strategy, deterministic=True, node_size=2, return_lse=True, **kw
        )
        for _ in range(3)
    ]
    local = mpitree.local_state(prob.q, k, v, **kw).records
    merged = mpitree.State(merge_records(np.stack(comm.allgather(local)), axis=0))
    for out, lse in outs:
        assert np.array_equal(out, merged.output(np.float32))
        assert np.array_equal(lse, merged.lse())
    assert gathered_identical(comm, outs[0][0])


@pytest.mark.parallel(nprocs=[2, 3])
def test_deterministic_must_agree():
    q = np.ones((1, 2, 1, 4), np.float32)
    kv = np.ones((1, 1, 3, 4), np.float32)
    with pytest.raises(ValueError, match="disagree on deterministic"):
        mpitree.tree_decode(q, kv, kv, deterministic=world().rank == 0)


@pytest.mark.parallel(nprocs=[2, 3])
def test_node_size_must_agree():
    q = np.ones((1, 2, 1, 4), np.float32)
    kv = np.ones((1, 1, 3, 4), np.float32)
    with pytest.raises(ValueError, match="disagree on node size"):
        mpitree.tree_decode(q, kv, kv, strategy="hierarchical", node_size=1 + world().rank)


@pytest.mark.parallel(nprocs=[2, 3])
def test_validate_catches_q_differing_across_ranks():
    comm = world()
    q = np.ones((1, 2, 1, 4), np.float32)
    if comm.rank == 1:
        q[0, 0, 0, 0] = 1.0001
    kv = np.ones((1, 1, 3, 4), np.float32)
    with pytest.raises(ValueError, match=r"disagree on q \(checksum\)"):
        mpitree.tree_decode(q, kv, kv, validate=True)
    with mpitree.DecodePlan(1, 2, 1, 4, validate=True) as plan:
        with pytest.raises(ValueError, match=r"disagree on q \(checksum\)"):
            plan.decode(q, kv, kv)
        assert plan.decode(np.ones_like(q), kv, kv).shape == q.shape  # recovers


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_validate_catches_nan_and_inf(where, bad):
    comm = world()
    arrays = {
        "q": np.ones((1, 2, 1, 4), np.float32),
        "k": np.ones((1, 1, 3, 4), np.float32),
        "v": np.ones((1, 1, 3, 4), np.float32),
    }
    if comm.rank == comm.size - 1:
        arrays[where][0, 0, 0, 1] = bad
    with pytest.raises(ValueError) as info:
        mpitree.tree_decode(**arrays, validate=True)
    if comm.rank == comm.size - 1:
        assert f"{where} contains NaN or Inf" in str(info.value)
    with mpitree.DecodePlan(1, 2, 1, 4, validate=True) as plan:
        with pytest.raises(ValueError):
            plan.decode(**arrays)


@pytest.mark.parallel(nprocs=[1, 2])
def test_without_validate_nan_propagates_but_never_hangs():
    """Documented behaviour: outside validate mode a NaN in k/v yields NaN rows."""
    q = np.ones((1, 2, 1, 4), np.float32)
    k = np.ones((1, 1, 3, 4), np.float32)
    k[0, 0, 1, 0] = np.nan
    out = mpitree.tree_decode(q, k, k)
    assert np.isnan(out).any()


def test_layout_is_freed_with_its_communicator():
    from mpitree._topology import layout

    comm = MPI.COMM_WORLD.Dup()
    lay = layout(comm, 1)
    assert lay.node.Get_size() == 1
    comm.Free()  # the attribute's delete callback frees the sub-communicators
    assert lay.node == MPI.COMM_NULL
