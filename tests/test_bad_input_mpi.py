"""Bad input raises a clear exception on every rank: never a hang, abort or garbage."""

import numpy as np
import pytest
from helpers import make_problem, world
from mpi4py import MPI
from numpy.testing import assert_allclose

import mpitree

STRATEGIES = ["allreduce", "allreduce3", "allgather", "ring"]


def arrays(b=2, hq=4, hkv=2, sq=1, d=8, t=5, dtype=np.float32):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((b, hq, sq, d)).astype(dtype)
    k = rng.standard_normal((b, hkv, t, d)).astype(dtype)
    return q, k, k.copy()


def expect_error_everywhere(fn, match):
    """Every rank must raise a ValueError whose message contains ``match``."""
    with pytest.raises(ValueError) as info:
        fn()
    assert match in str(info.value), str(info.value)


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize(
    "field, kw",
    [
        ("q_heads", dict(hq=8)),
        ("head_dim", dict(d=16)),
        ("batch", dict(b=3)),
        ("q_len", dict(sq=2)),
        ("dtype", dict(dtype=np.float64)),
    ],
)
def test_shape_disagreement(field, kw):
    rank = world().rank
    q, k, v = arrays(**(kw if rank == 1 else {}))
    expect_error_everywhere(lambda: mpitree.tree_decode(q, k, v), match=f"disagree on {field}")


@pytest.mark.parallel(nprocs=[2, 3])
def test_strategy_disagreement():
    q, k, v = arrays()
    s = "ring" if world().rank == 0 else "allreduce"
    expect_error_everywhere(
        lambda: mpitree.tree_decode(q, k, v, strategy=s), match="disagree on strategy"
    )


@pytest.mark.parallel(nprocs=[2, 3])
def test_scale_disagreement():
    q, k, v = arrays()
    scale = 0.5 if world().rank == 0 else None
    expect_error_everywhere(
        lambda: mpitree.tree_decode(q, k, v, scale=scale), match="disagree on scale"
    )


BAD_ON_ONE_RANK = {
    "kv_len too long": lambda q, k, v: dict(kv_len=np.array([2, 9])),
    "heads not a multiple": lambda q, k, v: dict(
        q=np.zeros((2, 4, 1, 8), np.float32),
        k=np.zeros((2, 3, 5, 8), np.float32),
        v=np.zeros((2, 3, 5, 8), np.float32),
    ),
    "non-contiguous": lambda q, k, v: dict(k=np.zeros((2, 2, 5, 16), np.float32)[..., ::2]),
    "wrong rank": lambda q, k, v: dict(k=k[0], v=v[0]),
    "positions shape": lambda q, k, v: dict(
        q_pos=np.zeros((2, 1), int), k_pos=np.zeros((2, 4), int)
    ),
    "mask shape": lambda q, k, v: dict(mask=np.ones((2, 3, 1, 5), bool)),
    "bad strategy": lambda q, k, v: dict(strategy="tree"),
}


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize("case", list(BAD_ON_ONE_RANK))
def test_invalid_on_one_rank(case):
    comm = world()
    q, k, v = arrays()
    kw = dict(q=q, k=k, v=v)
    bad = comm.size - 1
    if comm.rank == bad:
        kw.update(BAD_ON_ONE_RANK[case](q, k, v))
    with pytest.raises((ValueError, TypeError)) as info:
        mpitree.tree_decode(**kw)
    if comm.rank != bad:
        assert f"invalid input on rank {bad}" in str(info.value)


@pytest.mark.parallel(nprocs=[1, 2])
@pytest.mark.parametrize("comm", [MPI.COMM_NULL, "world", None.__class__])
def test_not_an_intracommunicator(comm):
    q, k, v = arrays()
    with pytest.raises(TypeError, match="intracommunicator"):
        mpitree.tree_decode(q, k, v, comm)


@pytest.mark.parallel(nprocs=[1, 2])
def test_a_freed_communicator_is_named_so():
    """A communicator freed since (mpi4py sets it to COMM_NULL) is named for what it is."""
    comm = world().Dup()
    comm.Free()
    q, k, v = arrays()
    with pytest.raises(TypeError, match=r"comm is MPI.COMM_NULL \(freed, or never made\)"):
        mpitree.tree_decode(q, k, v, comm)


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_plan_step_error_reaches_every_rank_and_plan_recovers(strategy):
    comm = world()
    prob = make_problem(
        1, [4 + r for r in range(comm.size)], batch=2, q_heads=4, kv_heads=2, head_dim=8
    )
    k, v, _ = prob.shard(comm.rank)
    with mpitree.DecodePlan(2, 4, 2, 8, comm=comm, strategy=strategy) as plan:
        bad_len = np.array([0, k.shape[2] + 1]) if comm.rank == 0 else None
        with pytest.raises(ValueError) as info:
            plan.decode(prob.q, k, v, kv_len=bad_len)
        if comm.rank == 0:
            assert "kv_len must lie" in str(info.value)
        else:
            assert "invalid input on rank 0" in str(info.value)
        wrong = np.zeros((2, 4, 1, 16), np.float32) if comm.rank == 1 else prob.q
        with pytest.raises(ValueError):
            plan.decode(wrong, k, v)
        out = plan.decode(prob.q, k, v)  # the plan still works after failed steps
    assert_allclose(out, prob.reference()[0], atol=2e-5, rtol=0)


@pytest.mark.parallel(nprocs=[2, 3])
def test_plan_constructor_disagreement():
    heads = 8 if world().rank == 0 else 4
    with pytest.raises(ValueError, match="disagree on q_heads"):
        mpitree.DecodePlan(1, heads, 2, 8)


@pytest.mark.parallel(nprocs=[2, 3])
def test_allreduce_state_checks():
    rank = world().rank
    dim = 8 if rank == 0 else 6
    with pytest.raises(ValueError, match="disagree on head_dim"):
        mpitree.allreduce_state(mpitree.State.empty((3,), dim))
    with pytest.raises(ValueError, match="ring"):
        mpitree.allreduce_state(mpitree.State.empty((3,), 8), strategy="ring")
    with pytest.raises(TypeError, match=r"mpitree\.State"):
        mpitree.allreduce_state(np.zeros((3, 10)))
