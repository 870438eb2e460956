"""tree_decode under real mpiexec ranks, every strategy against a float64 reference."""

import numpy as np
import pytest
from helpers import atol, gathered_identical, make_problem, world
from numpy.testing import assert_allclose

import mpitree

NPROCS = [1, 2, 3, 4]
STRATEGIES = ["allreduce", "allreduce3", "allgather", "ring", "hierarchical", "node", "auto"]


def shard_sizes(kind, p):
    """Shard-length patterns: uneven, some empty, all but one empty."""
    if kind == "uneven":
        return [7, 1, 12, 4][:p] if p < 4 else [7, 1, 12, 4]
    if kind == "some_empty":
        return [0 if r % 2 else 9 + r for r in range(p)]
    if kind == "one_holds_all":
        return [0] * (p - 1) + [23]
    raise ValueError(kind)


CASES = {
    "gqa": dict(q_heads=8, kv_heads=2),
    "mha": dict(q_heads=4, kv_heads=4),
    "mqa": dict(q_heads=6, kv_heads=1),
    "batch3_sq4_positions": dict(batch=3, q_len=4, positions=True),
    "mask_shared": dict(q_len=2, mask="shared"),
    "mask_per_head": dict(q_len=2, mask="head"),
    "ragged_kv_len": dict(batch=4, kv_len=True),
    "all_combined": dict(batch=3, q_len=3, kv_len=True, positions=True, mask="head"),
    "scale": dict(scale=0.37),
    "float64": dict(dtype=np.float64),
    "float16": dict(dtype=np.float16),
    "d130": dict(head_dim=130, q_heads=2, kv_heads=1),
}


def run_case(strategy, sizes, seed=0, **kw):
    comm = world()
    prob = make_problem(seed, sizes, **kw)
    k, v, extra = prob.shard(comm.rank)
    if strategy in ("hierarchical", "node"):
        extra["node_size"] = 2  # virtual nodes of 2 ranks: p=3 gives nodes of 2 and 1
    out, lse = mpitree.tree_decode(
        prob.q, k, v, scale=prob.scale, strategy=strategy, return_lse=True, **extra
    )
    same = gathered_identical(comm, out) and gathered_identical(comm, lse)
    ref_out, ref_lse = prob.reference()
    return prob, out, lse, ref_out, ref_lse, same


def check(prob, out, lse, ref_out, ref_lse, same):
    dtype = prob.q.dtype
    assert out.dtype == dtype and out.shape == prob.q.shape
    assert lse.dtype == np.float32 and lse.shape == prob.q.shape[:3]
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert_allclose(out.astype(np.float64), ref_out, atol=atol(dtype), rtol=0)
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), empty)
    assert np.all(out[empty] == 0)
    assert_allclose(lse[~empty], ref_lse[~empty], rtol=2e-6, atol=max(atol(dtype), 2e-6))
    assert same, "ranks received different results"


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", list(CASES))
def test_strategy_matches_reference(strategy, case):
    sizes = shard_sizes("uneven", world().size)
    check(*run_case(strategy, sizes, seed=list(CASES).index(case), **CASES[case]))


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("layout", ["some_empty", "one_holds_all"])
def test_empty_shards(strategy, layout):
    sizes = shard_sizes(layout, world().size)
    check(*run_case(strategy, sizes, seed=3, q_len=2, mask="head", kv_len=True))


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_keys_anywhere(strategy):
    """Every shard empty: output 0, lse -inf, never NaN."""
    p = world().size
    _prob, out, lse, *_ = run_case(strategy, [0] * p)
    assert np.all(out == 0) and np.all(np.isneginf(lse))


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_huge_logits_float64_exact(strategy):
    """Logits around 1e4 in magnitude: exact in float64, finite everywhere."""
    sizes = shard_sizes("uneven", world().size)
    prob, out, lse, ref_out, ref_lse, same = run_case(
        strategy, sizes, dtype=np.float64, logit=5000.0, head_dim=16
    )
    assert np.abs(ref_lse).max() > 5e3
    check(prob, out, lse, ref_out, ref_lse, same)


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_huge_logits_float32_finite(strategy):
    sizes = shard_sizes("uneven", world().size)
    _prob, out, lse, ref_out, _ref_lse, same = run_case(strategy, sizes, logit=2500.0)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    # fp32 logits of size 1e4 carry absolute rounding error ~1e-3 (relative 2^-24 * |s| * sqrt(D))
    assert_allclose(out, ref_out, atol=5e-2, rtol=0)
    assert same


@pytest.mark.parallel(nprocs=NPROCS)
def test_strategies_agree_with_each_other():
    comm = world()
    prob = make_problem(
        11, shard_sizes("uneven", comm.size), batch=2, q_len=3, positions=True, mask="shared"
    )
    k, v, kw = prob.shard(comm.rank)
    outs = [mpitree.tree_decode(prob.q, k, v, strategy=s, node_size=2, **kw) for s in STRATEGIES]
    for o in outs[1:]:
        assert_allclose(o, outs[0], atol=1e-6, rtol=0)


@pytest.mark.parallel(nprocs=NPROCS)
def test_user_communicator_subset():
    """A user communicator that is a split of the world works and stays private."""
    world_comm = world()
    sub = world_comm.Split(color=world_comm.rank % 2, key=world_comm.rank)
    try:
        prob = make_problem(5, [3 + r for r in range(sub.size)], q_heads=4, kv_heads=2)
        k, v, kw = prob.shard(sub.rank)
        out = mpitree.tree_decode(prob.q, k, v, sub, **kw)
        assert_allclose(out, prob.reference()[0], atol=2e-5, rtol=0)
    finally:
        sub.Free()


@pytest.mark.parallel(nprocs=NPROCS)
def test_default_comm_is_private_duplicate():
    from mpi4py import MPI

    comm = mpitree.default_comm()
    assert comm is mpitree.default_comm()
    assert MPI.Comm.Compare(comm, MPI.COMM_WORLD) == MPI.CONGRUENT
