"""extend.phase_times and extend.traffic across ranks: every rank's phases, exact results."""

import numpy as np
import pytest
from helpers import gathered_identical, make_problem, world
from numpy.testing import assert_allclose

import mpitree
from mpitree import _merger, extend


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize("strategy", ["allreduce", "allgather", "ring"])
def test_phase_times_and_traffic_over_uneven_and_empty_shards(strategy):
    comm = world()
    sizes = [0, *(5 + 3 * r for r in range(1, comm.size))]  # rank 0 holds nothing
    prob = make_problem(21, sizes)
    k, v, _ = prob.shard(comm.rank)
    merge = _merger.Merger.merge
    with mpitree.DecodePlan(2, 4, 2, 16, comm=comm, strategy=strategy) as plan:
        plain = plan.decode(prob.q, k, v)
        extend.traffic.reset()
        with extend.phase_times() as times:
            timed = plan.decode(prob.q, k, v)
        sent = extend.traffic.bytes
        after = plan.decode(prob.q, k, v)
    assert _merger.Merger.merge is merge
    assert len(times["merge"]) == 1 and len(times["collective"]) == 1
    assert sent > 0 and extend.traffic.bytes > sent  # counted on every step, hook or not
    np.testing.assert_array_equal(timed, plain)
    np.testing.assert_array_equal(after, plain)
    assert_allclose(plain, prob.reference()[0], atol=2e-5, rtol=0)
    assert gathered_identical(comm, plain)
