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
