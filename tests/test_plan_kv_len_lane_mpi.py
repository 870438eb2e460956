"""A plan's compiled lane with ``kv_len`` (review-lens): the guarded path's bits, always.

Adversarial cases beside test_decode_plan_mpi's: kv_len of every integer kind the
checks accept (unsigned, big-endian, read-only, zero-stride, reversed views), one
array mutated in place step after step, layouts switching under the bound lengths
pointer (another cache buffer, another dtype, none, a query the kernel cannot bind,
freed memory reused), rows empty on every rank, and kv_len the checks refuse on one
rank while the others run their compiled call.
"""

import gc

import numpy as np
import pytest
import torch
from helpers import (
    assert_gathered_reference,
    compiled_runs,
    gathered_identical,
    rank_cache,
    world,
)

import mpitree
from mpitree import extend

NPROCS = [1, 2, 3]
B, HQ, HKV, DIM = 3, 4, 2, 8


def cache(comm, cap, seed):
    """This rank's clean ``(B, HKV, cap, DIM)`` K and V."""
    return rank_cache(comm, (B, HKV, cap, DIM), seed)


def poisoned(k, v, used):
    """Copies of K and V with NaN and Inf in every slot at or past a row's ``used``."""
    k, v = k.copy(), v.copy()
    hidden = np.arange(k.shape[2])[None, :] >= np.asarray(used, np.int64)[:, None]
    k[np.broadcast_to(hidden[:, None, :, None], k.shape)] = np.nan
    v[np.broadcast_to(hidden[:, None, :, None], v.shape)] = np.inf
    return k, v


def check_against_reference(comm, q, k, v, used, out, lse):
    """``out`` and ``lse`` against the float64 reference over every rank's valid keys."""
    seen = np.arange(k.shape[2])[None, :] < np.asarray(used, np.int64)[:, None]
    assert_gathered_reference(comm, q, k, v, seen[:, None, None], out, lse)


KINDS = {
    "uint64": lambda x: x.astype(np.uint64),
    "uint8": lambda x: x.astype(np.uint8),
    "big-endian int64": lambda x: x.astype(">i8"),
    "read-only": lambda x: _read_only(x.astype(np.int64)),
    "reversed view": lambda x: x[::-1].astype(np.int64)[::-1],
    "zero-stride": lambda x: np.broadcast_to(x.astype(np.int64)[:1], x.shape),
}


def _read_only(x):
    x.setflags(write=False)
    return x


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_kv_len_kinds_run_compiled_with_the_guarded_bits(kind):
    """Every integer kv_len the checks accept runs the lane after the binding step and
    gives the full checks' and the Python merge's bits (lse too), garbage unread."""
    comm = world()
    cap = 8
    clean_k, clean_v = cache(comm, cap, 21)
    with (
        mpitree.DecodePlan(B, HQ, HKV, DIM, comm=comm) as plan,
        mpitree.DecodePlan(B, HQ, HKV, DIM, comm=comm) as python,
    ):
        python._compiled = None
        runs = compiled_runs(plan)
        for step in range(3):
            used = np.array([(comm.rank + step + 2) % (cap + 1), 0, cap])
            kv_len = KINDS[kind](used)
            used = np.asarray(kv_len, np.int64)
            k, v = poisoned(clean_k, clean_v, used)
            q = np.random.default_rng([22, step]).standard_normal((B, HQ, 1, DIM))
            q = q.astype(np.float32)
            out, lse = plan.decode(q, k, v, kv_len=kv_len, return_lse=True)
            out_py, lse_py = python.decode(q, k, v, kv_len=kv_len, return_lse=True)
            with extend.tools.full_checks():
                full, full_lse = plan.decode(q, k, v, kv_len=kv_len, return_lse=True)
            assert np.array_equal(out, out_py) and np.array_equal(lse, lse_py)
            assert np.array_equal(out, full) and np.array_equal(lse, full_lse)
            assert gathered_identical(comm, out)
            check_against_reference(comm, q, clean_k, clean_v, used, out, lse)
    # each full-checks step binds again: every step after the first runs compiled
    assert len(runs) == (2 if plan._compiled is not None else 0), runs


@pytest.mark.parallel(nprocs=NPROCS)
def test_the_bound_lengths_follow_every_rebinding():
    """Layouts switch under the compiled step's lengths pointer (another cache buffer,
    int32, no kv_len, a query no kernel binds to, freed memory reused): each step
    gives the full checks' bits and the reference, one kv_len array mutated in place."""
    comm = world()
    small, large = cache(comm, 8, 31), cache(comm, 16, 32)
    q = np.random.default_rng(33).standard_normal((B, HQ, 1, DIM)).astype(np.float32)
    unbound = np.zeros((B, HQ, 2, DIM), np.float32)[:, :, :1]  # not C-contiguous
    unbound[...] = q
    lengths = np.zeros(B, np.int64)  # the caller's one array, updated in place
    script = [
        (small, "same", q), (small, "same", q), (large, "same", q), (large, "same", q),
        (small, np.int32, q), (small, np.int32, q), (small, None, q), (small, None, q),
        (small, "same", q), (small, "same", q), (small, "same", unbound), ("gc", None, None),
        (small, "same", q), (small, "same", q), (large, "same", q), (small, "same", q),
    ]  # fmt: skip
    lane = []
    with mpitree.DecodePlan(B, HQ, HKV, DIM, comm=comm) as plan:
        runs = compiled_runs(plan)
        for step, (kv, kind, query) in enumerate(script):
            if kv == "gc":  # the unbound step freed the bound buffers: reuse that memory
                gc.collect()
                junk = [np.full(B, 10**9, np.int64) for _ in range(1000)]
                del junk
                continue
            cap = kv[0].shape[2]
            used = np.array([(comm.rank + step) % (cap + 1), (2 * step) % (cap + 1), cap])
            if kind is None:
                used, kv_len = np.full(B, cap), None
            elif kind == "same":
                lengths[:] = used
                kv_len = lengths
            else:
                kv_len = used.astype(kind)
            k, v = poisoned(*kv, used)
            before = len(runs)
            out, lse = plan.decode(query, k, v, kv_len=kv_len, return_lse=True)
            lane.append(len(runs) - before)
            with extend.tools.full_checks():
                full, full_lse = plan.decode(query, k, v, kv_len=kv_len, return_lse=True)
            assert np.array_equal(out, full) and np.array_equal(lse, full_lse), step
            check_against_reference(comm, q, *kv, used, out, lse)
    if plan._compiled is not None:  # the full-checks step before each binds it again
        assert lane == [0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 0, 1, 0, 0], lane


@pytest.mark.parallel(nprocs=NPROCS)
def test_rows_empty_everywhere_into_out():
    """kv_len 0 for every row on every rank, into ``out``: zeros, lse -inf, no NaN,
    the full checks' bits; then one row with keys again."""
    comm = world()
    clean_k, clean_v = cache(comm, 6, 41)
    q = np.random.default_rng(42).standard_normal((B, HQ, 1, DIM)).astype(np.float32)
    out, full = np.full_like(q, np.nan), np.full_like(q, np.nan)
    with mpitree.DecodePlan(B, HQ, HKV, DIM, comm=comm) as plan:
        runs = compiled_runs(plan)
        for used in ([0, 0, 0], [0, 0, 0], [0, 3, 0], [0, 3, 0]):
            k, v = poisoned(clean_k, clean_v, used)
            kv_len = np.array(used, np.int32)
            got, lse = plan.decode(q, k, v, kv_len=kv_len, return_lse=True, out=out)
            with extend.tools.full_checks():
                _, full_lse = plan.decode(q, k, v, kv_len=kv_len, return_lse=True, out=full)
            assert got is out and np.array_equal(out, full) and np.array_equal(lse, full_lse)
            check_against_reference(comm, q, clean_k, clean_v, used, out, lse)
    assert len(runs) == (3 if plan._compiled is not None else 0), runs  # after the first


BAD = {
    "uint64 past int64": lambda: np.array([2**64 - 1, 1, 1], np.uint64),
    "int64 minimum": lambda: np.array([-(2**63), 1, 1], np.int64),
    "int8 -1": lambda: np.array([-1, 1, 1], np.int8),
    "bool": lambda: np.array([True, False, True]),
    "torch with numpy q": lambda: torch.tensor([1, 1, 1]),
    "object": lambda: np.array([1, 1, 1], object),
    "0-d": lambda: np.array(1, np.int64),
    "(B, 1)": lambda: np.ones((B, 1), np.int64),
    "list": lambda: [1, 1, 1],
}


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("name", list(BAD))
def test_kv_len_refused_on_one_rank_beside_compiled_steps(name):
    """One rank's kv_len the checks refuse while the others run their compiled call with
    a valid one: every rank raises (the bad one its own error), then the plan steps on."""
    comm = world()
    bad = comm.size - 1
    k, v = cache(comm, 6, 51)
    q = np.ones((B, HQ, 1, DIM), np.float32)
    good = np.array([5, 2, 0], np.int64)
    with mpitree.DecodePlan(B, HQ, HKV, DIM, comm=comm) as plan:
        first = plan.decode(q, k, v, kv_len=good)
        with pytest.raises(Exception) as raised:
            plan.decode(q, k, v, kv_len=BAD[name]() if comm.rank == bad else good)
        if comm.rank == bad:
            assert isinstance(raised.value, TypeError | ValueError), raised.value
            assert "kv_len" in str(raised.value)
        else:
            assert isinstance(raised.value, mpitree.RankError), raised.value
            assert f"rank {bad}" in str(raised.value)
        assert np.array_equal(plan.decode(q, k, v, kv_len=good), first)


WIDE = 40  # more rows than the lane checks in Python: numpy checks their lengths
WIDE_BAD = {
    "uint64 2**63 + 1": (np.uint64, 2**63 + 1),  # wraps to a negative int64 in the copy
    "negative": (np.int64, -1),
    "past T": (np.int64, 7),
}


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("name", list(WIDE_BAD))
def test_many_rows_lengths_are_checked_alike(name):
    """With more rows, the compiled call's lengths are copied, then checked by numpy:
    the same bits as the full checks, exact; one bad length on one rank raises on every
    rank; then the plan steps on."""
    comm = world()
    bad = comm.size - 1
    dtype, value = WIDE_BAD[name]
    rng = np.random.default_rng([61, comm.rank])
    clean_k = rng.standard_normal((WIDE, HKV, 6, DIM)).astype(np.float32)
    clean_v = rng.standard_normal(clean_k.shape).astype(np.float32)
    used = (np.arange(WIDE) + comm.rank) % 7
    k, v = poisoned(clean_k, clean_v, used)
    q = np.random.default_rng(62).standard_normal((WIDE, HQ, 1, DIM)).astype(np.float32)
    good = used.astype(dtype)
    with mpitree.DecodePlan(WIDE, HQ, HKV, DIM, comm=comm) as plan:
        runs = compiled_runs(plan)
        first, first_lse = plan.decode(q, k, v, kv_len=good, return_lse=True)
        out, lse = plan.decode(q, k, v, kv_len=good, return_lse=True)
        with extend.tools.full_checks():
            full, full_lse = plan.decode(q, k, v, kv_len=good, return_lse=True)
        assert np.array_equal(out, first) and np.array_equal(out, full)
        assert np.array_equal(lse, first_lse) and np.array_equal(lse, full_lse)
        check_against_reference(comm, q, clean_k, clean_v, used, out, lse)
        wrong = good.copy()
        wrong[WIDE - 3] = value
        plan.decode(q, k, v, kv_len=good)  # compiled again after the full checks' step
        with pytest.raises(Exception) as raised:
            plan.decode(q, k, v, kv_len=wrong if comm.rank == bad else good)
        if comm.rank == bad:
            assert isinstance(raised.value, ValueError) and "kv_len" in str(raised.value)
        else:
            assert isinstance(raised.value, mpitree.RankError), raised.value
        assert np.array_equal(plan.decode(q, k, v, kv_len=good), first)
    if plan._compiled is not None:  # the 2nd and the 4th; the good ranks' 5th and last (the
        assert len(runs) == (2 if comm.rank == bad else 4), runs  # bad rank's checks again)
