"""Hypothesis fuzzing under real ranks: random p, shapes, dtypes, shards, masks, logits.

Every rank runs the same derandomized hypothesis engine, so every rank draws the
same examples; the verdict of each example is agreed with an all-reduce before
asserting, so all ranks pass, fail and shrink together (no rank can wander off into
a different example and hang the others). Random p: each example runs on a
sub-communicator of a drawn size; the other ranks wait at the verdict.

MPITREE_FUZZ_EXAMPLES sets the number of examples per rank count (CI: 30; run
``MPITREE_FUZZ_EXAMPLES=10000 python tests/run.py -k fuzz`` for a long campaign).
"""

import os

import numpy as np
import pytest
from helpers import atol, make_problem, world
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from mpi4py import MPI

import mpitree

EXAMPLES = int(os.environ.get("MPITREE_FUZZ_EXAMPLES", "30"))
STRATEGIES = ["allreduce", "allreduce3", "allgather", "ring", "hierarchical", "auto"]


@st.composite
def problems(draw):
    world_size = world().size
    p = draw(st.integers(1, world_size))
    q_len = draw(st.integers(1, 3))
    kv = draw(st.sampled_from([1, 2, 3]))
    return dict(
        p=p,
        sizes=draw(st.lists(st.integers(0, 9), min_size=p, max_size=p)),
        strategy=draw(st.sampled_from(STRATEGIES)),
        node_size=draw(st.integers(0, 3)),
        deterministic=draw(st.booleans()),
        kw=dict(
            batch=draw(st.integers(1, 3)),
            kv_heads=kv,
            q_heads=kv * draw(st.integers(1, 3)),
            q_len=q_len,
            head_dim=draw(st.sampled_from([1, 4, 16, 33])),
            dtype=draw(st.sampled_from([np.float16, np.float32, np.float64])),
            kv_len=draw(st.booleans()),
            positions=draw(st.booleans()),
            mask=draw(st.sampled_from([None, "shared", "head"])),
            logit=draw(st.sampled_from([0.1, 1.0, 30.0])),
        ),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def run_example(ex):
    """Run one example on a sub-communicator; return (ok, message) on the ranks that ran it."""
    comm = world()
    color = 0 if comm.rank < ex["p"] else MPI.UNDEFINED
    sub = comm.Split(color=color, key=comm.rank)
    if sub == MPI.COMM_NULL:
        return True, ""
    try:
        prob = make_problem(ex["seed"], ex["sizes"], **ex["kw"])
        k, v, extra = prob.shard(sub.rank)
        out, lse = mpitree.tree_decode(
            prob.q,
            k,
            v,
            sub,
            strategy=ex["strategy"],
            node_size=ex["node_size"],
            deterministic=ex["deterministic"],
            return_lse=True,
            **extra,
        )
        ref, ref_lse = prob.reference()
        tol = atol(prob.q.dtype) * max(1.0, ex["kw"]["logit"] / 3)
        err = float(np.abs(out.astype(np.float64) - ref).max(initial=0))
        empty_ok = np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
        if np.isnan(out).any() or np.isnan(lse).any():
            return False, f"NaN in output: {ex}"
        if err > tol or not empty_ok:
            return False, f"max err {err:.3e} > {tol:.1e} or empty rows differ: {ex}"
        return True, ""
    finally:
        sub.Free()


@pytest.mark.parallel(nprocs=[1, 2, 3, 4])
@settings(
    max_examples=EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
    suppress_health_check=list(HealthCheck),
)
@given(ex=problems())
def test_fuzz_against_float64_reference(ex):
    ok, message = run_example(ex)
    verdicts = world().allgather((ok, message))
    failures = [m for good, m in verdicts if not good]
    assert not failures, failures[0]
