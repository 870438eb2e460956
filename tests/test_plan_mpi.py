"""DecodePlan across a decode loop, and allreduce_state."""

import numpy as np
import pytest
from helpers import gathered_identical, make_problem, world
from numpy.testing import assert_allclose

import mpitree
from mpitree import reference_attention

NPROCS = [1, 2, 3, 4]
STRATEGIES = ["allreduce", "allreduce3", "allgather", "ring"]


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_decode_loop_with_growing_cache(strategy):
    """A plan reused over steps while the last rank's shard grows by one token per step."""
    comm = world()
    p, last = comm.size, comm.size - 1
    steps, dim = 5, 16
    sizes = [6 + 2 * r for r in range(p)]
    final = make_problem(7, [*sizes[:-1], sizes[-1] + steps], head_dim=dim)
    k_all, v_all, _ = final.shard(comm.rank)
    rng = np.random.default_rng(99)
    with mpitree.DecodePlan(2, 4, 2, dim, comm=comm, strategy=strategy) as plan:
        for step in range(1, steps + 1):
            t = sizes[comm.rank] + (step if comm.rank == last else 0)
            k, v = k_all[:, :, :t], v_all[:, :, :t]
            q = rng.standard_normal((2, 4, 1, dim)).astype(np.float32)
            out = plan.decode(q, k, v)
            n = sum(sizes) + step  # the last rank's keys come last in the concatenation
            ref, _ = reference_attention(q, final.k[:, :, :n], final.v[:, :, :n])
            assert_allclose(out, ref, atol=2e-5, rtol=0)
            assert np.array_equal(out, mpitree.tree_decode(q, k, v, strategy=strategy))
            assert gathered_identical(comm, out)


@pytest.mark.parallel(nprocs=NPROCS)
def test_plan_shapes_and_repr():
    plan = mpitree.DecodePlan(1, 8, 2, 32, q_len=3, dtype=np.float16)
    try:
        assert plan.problem.rows == 24 and plan.problem.acc == "float32"
        assert "DecodePlan" in repr(plan)
        assert plan.strategy == "allreduce"  # the native op is built (test_native_op_is_built)
    finally:
        plan.free()


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("strategy", ["auto", "allreduce", "allreduce3", "allgather"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_allreduce_state(strategy, dtype):
    comm = world()
    prob = make_problem(
        4, [3, 0, 5, 2][: comm.size] if comm.size < 4 else [3, 0, 5, 2], q_len=2, dtype=dtype
    )
    k, v, _ = prob.shard(comm.rank)
    local = mpitree.local_state(prob.q, k, v)
    merged = mpitree.allreduce_state(local, strategy=strategy)
    assert merged.records.dtype == dtype and merged.shape == local.shape
    assert_allclose(
        merged.output(), prob.reference()[0], atol=2e-5 if dtype == np.float32 else 1e-12, rtol=0
    )
    again = mpitree.allreduce_state(local, strategy=strategy)  # the cached merger, reused
    assert np.array_equal(again.records, merged.records)
    assert gathered_identical(comm, merged.records)


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("strategy", ["allreduce", "ring"])
def test_plan_fast_path_matches_full_checks_and_revalidates(strategy):
    """Repeated steps skip re-validation; a changed layout or bad kv_len is still caught."""
    from mpitree import extend

    comm = world()
    rng = np.random.default_rng([5, comm.rank])
    b, hq, hkv, dim, cap = 2, 8, 2, 32, 40
    k_all = rng.standard_normal((b, hkv, cap, dim)).astype(np.float32)
    v_all = rng.standard_normal((b, hkv, cap, dim)).astype(np.float32)
    with mpitree.DecodePlan(b, hq, hkv, dim, comm=comm, strategy=strategy) as plan:
        for t in (10, 11, 12, 12):  # a growing view: same layout, T changes
            q = np.random.default_rng(t).standard_normal((b, hq, 1, dim)).astype(np.float32)
            kv_len = np.array([t, t - 3 - comm.rank % 2])
            k, v = k_all[:, :, :t], v_all[:, :, :t]
            fast = plan.decode(q, k, v, kv_len=kv_len)
            assert plan._step.kernel._layout is not None or strategy == "ring"
            with extend.tools.full_checks():
                full = plan.decode(q, k, v, kv_len=kv_len)
            assert np.array_equal(fast, full)
            assert np.array_equal(
                full, mpitree.tree_decode(q, k, v, kv_len=kv_len, strategy=strategy)
            )
        q = np.ones((b, hq, 1, dim), np.float32)
        k, v = k_all[:, :, :12], v_all[:, :, :12]
        plan.decode(q, k, v)
        bad = {0: np.array([3, 13]), 1: np.array([-1, 2])}.get(comm.rank, np.array([1, 2]))
        with pytest.raises(ValueError, match=r"kv_len|rank 0"):
            plan.decode(q, k, v, kv_len=bad if comm.rank < 2 else np.array([1, 2]))
        wrong = {  # a changed layout on the last rank: re-validated, agreed error everywhere
            "dtype": k.astype(np.float64),
            "D": k_all[..., :16],
            "v length": v_all[:, :, :11],
        }
        for name, kk in wrong.items():
            mine = (kk, v) if name != "v length" else (k, kk)
            args = mine if comm.rank == comm.size - 1 else (k, v)
            with pytest.raises((ValueError, TypeError)):
                plan.decode(q, *args)
        # strided K (a field of a wider buffer) and back: still right
        wide = np.repeat(k_all[:, :, :12], 2, axis=2)[:, :, ::2]
        assert_allclose(plan.decode(q, wide, v), plan.decode(q, k, v), atol=1e-6, rtol=0)


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("mask", [None, "head"])
def test_ring_plan_with_masks_and_rows(mask):
    """A ring plan's steps with per-head masks and two query rows: exact, fast path or not."""
    comm = world()
    sizes = [(5, 0, 9, 3)[r % 4] for r in range(comm.size)]
    prob = make_problem(7, sizes, batch=2, q_heads=8, kv_heads=2, q_len=2, kv_len=True, mask=mask)
    k, v, kw = prob.shard(comm.rank)
    ref_out, _ = prob.reference()
    with mpitree.DecodePlan(2, 8, 2, 16, q_len=2, strategy="ring", comm=comm) as plan:
        for _step in range(3):  # the second and third steps repeat the first's layout
            out = plan.decode(prob.q, k, v, **kw)
            assert_allclose(out, ref_out, atol=2e-5, rtol=0)
            assert gathered_identical(comm, out)
