"""Sharded prefill's collectives (the private ones too) under real ranks, against float64 numpy."""

import numpy as np
import pytest
from helpers import world
from numpy.testing import assert_allclose, assert_array_equal

from mpitree import RankError, extend
from mpitree._prefill_collectives import reduce_scatter_records, scatter_layout

NPROCS = [1, 2, 3, 4]
R, D = 3, 4  # records per block, head dim


def counts_of(kind, p):
    """Blocks per rank: one each, uneven with empty ranks, or none at all."""
    return {
        "even": [1] * p,
        "uneven": [(3 * r + 2) % 4 for r in range(p)],  # 2, 1, 0, 3
        "one rank": [0] * (p - 1) + [3],
        "none": [0] * p,
    }[kind]


def merge_reference(states):
    """Float64 merge of partial states ``(..., D + 2)``: the native op's arithmetic."""
    m = np.max([s[..., 0] for s in states], 0)
    shift = np.where(np.isneginf(m), 0, m)
    w = [np.exp(s[..., 0] - shift) for s in states]
    d = sum(wi * s[..., 1] for wi, s in zip(w, states, strict=True))
    n = sum(wi[..., None] * s[..., 2:] for wi, s in zip(w, states, strict=True))
    return np.concatenate([m[..., None], d[..., None], n], -1)


def partial_states(counts, dtype):
    """This rank's partial states of every rank's blocks, some empty, some NaN in ``n``."""
    rank = world().rank
    rng = np.random.default_rng(rank)
    states = rng.standard_normal((sum(counts), R, D + 2))
    states[..., 1] = rng.random((sum(counts), R)) + 0.1
    states[rng.random((sum(counts), R)) < 0.3] = [-np.inf, 0] + [0] * D
    if len(states) and rank == world().size - 1:
        states[0, 1, 3] = np.nan  # stays NaN through the merge
    return states.astype(dtype)


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("kind", ["even", "uneven", "one rank", "none"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_reduce_scatter_records_equals_float64_merge(kind, dtype):
    comm = world()
    counts = counts_of(kind, comm.size)
    per_rank, slots = scatter_layout(counts)
    assert per_rank == max(counts) + 1
    assert_array_equal(slots, [r * per_rank + k for r, c in enumerate(counts) for k in range(c)])
    states = partial_states(counts, dtype)
    send = np.full((comm.size, per_rank, R, D + 2), 7.0, dtype)  # garbage in the padding
    recv = np.full((per_rank, R, D + 2), 5.0, dtype)

    def fill(out):
        out.reshape(-1, R, D + 2)[slots] = states

    got = reduce_scatter_records(comm, send, counts, fill, recv=recv)
    start, own = sum(counts[: comm.rank]), counts[comm.rank]
    everyone = comm.allgather(states.astype(np.float64))
    want = merge_reference([s[start : start + own] for s in everyone])
    assert got.shape == (own, R, D + 2) and np.shares_memory(got, recv) == bool(own)
    assert_array_equal(np.isnan(got), np.isnan(want))
    tol = 2e-6 if dtype == np.float32 else 1e-14
    assert_allclose(got, want, atol=tol, rtol=tol)


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("kind", ["uneven", "none"])
def test_reduce_scatter_records_raises_on_every_rank_when_fill_fails_on_one(kind):
    comm = world()
    counts = counts_of(kind, comm.size)
    per_rank, _ = scatter_layout(counts)
    send = np.zeros((comm.size, per_rank, R, D + 2), np.float32)
    for bad in range(comm.size):

        def fill(out, bad=bad):
            if comm.rank == bad:
                raise KeyError("fill failed here")
            out[...] = np.nan  # the failing rank's zeros must not hide this

        with pytest.raises(KeyError if comm.rank == bad else RankError):
            reduce_scatter_records(comm, send, counts, fill)


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("kind", ["even", "uneven", "one rank", "none"])
def test_allgather_rows_in_place_and_not(kind):
    comm = world()
    counts = counts_of(kind, comm.size)
    start, own = sum(counts[: comm.rank]), counts[comm.rank]
    mine = np.random.default_rng(comm.rank).standard_normal((own, 2, 3))
    want = np.concatenate(comm.allgather(mine))
    assert_array_equal(extend.allgather_rows(comm, mine, counts, 6), want)
    out = np.full((sum(counts), 2, 3), np.nan)
    out[start : start + own] = mine
    assert extend.allgather_rows(comm, None, counts, 6, out=out) is out
    assert_array_equal(out, want)


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize(
    "bad",
    ["out too small", "out too large", "out of another dtype", "send of p + 1", "recv too small"],
)
def test_wrong_buffers_raise_on_every_rank_before_any_communication(bad):
    """Wrong on every rank alike: MPI aborted (too small) or mixed dtypes' bytes (dtype)."""
    comm = world()
    counts = [2] * comm.size
    per_rank, _ = scatter_layout(counts)
    send = np.zeros((comm.size, per_rank, 1, 4), np.float32)
    with pytest.raises(ValueError, match="must be"):
        if bad.startswith("out"):
            rows = sum(counts) + {"out too small": -1, "out too large": 1}.get(bad, 0)
            out = np.zeros((rows, 3), np.float64 if "dtype" in bad else np.float32)
            extend.allgather_rows(comm, np.ones((2, 3), np.float32), counts, 3, out=out)
        elif bad == "send of p + 1":
            reduce_scatter_records(comm, send[[0] * (comm.size + 1)], counts, print)
        else:
            recv = np.zeros((per_rank - 1, 1, 4), np.float32)
            reduce_scatter_records(comm, send, counts, print, recv=recv)
    comm.Barrier()  # every rank got here: nothing was left waiting in a collective
