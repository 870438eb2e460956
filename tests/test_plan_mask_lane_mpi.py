"""A plan's compiled lane with a boolean mask (a draft tree's, verified step after step).

A C-contiguous bool ``(B, Hm, Sq, T)`` mask is what the kernel reads: a plan step with
one runs as the one compiled call, pointing the kernel at the mask, and must give the
guarded path's bits. Cases: per-head and shared masks with ``kv_len``, NaN and Inf in
every slot a row does not see, rows that see nothing on a rank, a mask updated in
place, layouts switching (no mask, a broadcast mask, a non-contiguous one, K growing),
and a mask of the wrong length on one rank beside compiled steps.
"""

import numpy as np
import pytest
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
B, HQ, HKV, SQ, DIM = 2, 4, 2, 4, 8


def shard(comm, cap, seed):
    """This rank's clean ``(B, HKV, cap, DIM)`` K and V."""
    return rank_cache(comm, (B, HKV, cap, DIM), seed)


def tree_mask(comm, heads, t, seed):
    """A random bool ``(B, heads, SQ, t)`` mask; on rank 1, query row 0 sees none of its keys."""
    mask = np.random.default_rng([seed, comm.rank]).random((B, heads, SQ, t)) < 0.6
    if comm.rank == 1:
        mask[:, :, 0] = False
    return mask


def seen(mask, used):
    """``(B, Hm, SQ, T)``: the keys a row sees, the mask and ``kv_len`` both."""
    keep = np.arange(mask.shape[-1])[None, :] < np.asarray(used, np.int64)[:, None]
    return mask & keep[:, None, None, :]


def poisoned(k, v, visible):
    """K and V with NaN and Inf in every slot no query row of its batch sees.

    Copies of the whole buffers ``k`` and ``v`` are views of (a fixed-capacity cache's),
    so the returned views keep their strides: the layout a bound step needs.
    """
    t = k.shape[2]
    hidden = ~visible.any(axis=(1, 2))  # (B, T)
    k, v = (x.base.copy()[:, :, :t] if x.base is not None else x.copy() for x in (k, v))
    k[np.broadcast_to(hidden[:, None, :, None], k.shape)] = np.nan
    v[np.broadcast_to(hidden[:, None, :, None], v.shape)] = np.inf
    return k, v


def query(step):
    """The step's ``(B, HQ, SQ, DIM)`` float32 queries, the same on every rank."""
    q = np.random.default_rng([71, step]).standard_normal((B, HQ, SQ, DIM))
    return q.astype(np.float32)


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("heads", [1, HQ])
@pytest.mark.parametrize("lengths", [False, True])
def test_a_mask_runs_compiled_with_the_guarded_bits(heads, lengths):
    """A shared or per-head mask, with or without kv_len, runs the lane after the binding
    step (the keys a view of a cache growing by one a step), with the Python merge's and
    the full checks' bits, the same on every rank, garbage in unseen slots unread, and
    the float64 reference's values."""
    comm = world()
    with (
        mpitree.DecodePlan(B, HQ, HKV, DIM, q_len=SQ, comm=comm) as plan,
        mpitree.DecodePlan(B, HQ, HKV, DIM, q_len=SQ, comm=comm) as python,
    ):
        python._compiled = None
        runs = compiled_runs(plan)
        whole_k, whole_v = shard(comm, 12, 72)  # a cache of fixed capacity, filling up
        for step in range(4):
            t = 5 + step + comm.rank
            clean_k, clean_v = whole_k[:, :, :t], whole_v[:, :, :t]
            mask = tree_mask(comm, heads, t, 73 + step)
            used = [t - 1, comm.rank % (t + 1)] if lengths else [t, t]
            kv_len = np.array(used, np.int64) if lengths else None
            visible = seen(mask, used)
            k, v = poisoned(clean_k, clean_v, visible)
            q = query(step)
            out, lse = plan.decode(q, k, v, kv_len=kv_len, mask=mask, return_lse=True)
            out_py, lse_py = python.decode(q, k, v, kv_len=kv_len, mask=mask, return_lse=True)
            with extend.tools.full_checks():
                full, full_lse = plan.decode(q, k, v, kv_len=kv_len, mask=mask, return_lse=True)
            assert np.array_equal(out, out_py) and np.array_equal(lse, lse_py)
            assert np.array_equal(out, full) and np.array_equal(lse, full_lse)
            assert gathered_identical(comm, out)
            assert_gathered_reference(comm, q, clean_k, clean_v, visible, out, lse)
    # each full-checks step binds again: every step after the first runs compiled
    assert len(runs) == (3 if plan._compiled is not None else 0), runs


@pytest.mark.parallel(nprocs=NPROCS)
def test_the_bound_mask_follows_every_layout():
    """One mask array updated in place runs compiled with its new contents each step;
    no mask, a broadcast mask, a non-contiguous one and a per-head one each take the
    checked path or bind again, with the full checks' bits and the reference's values."""
    comm = world()
    t = 6
    clean_k, clean_v = shard(comm, t, 81)
    k, v = clean_k, clean_v
    mask = np.zeros((B, 1, SQ, t), bool)  # the caller's one array, rewritten in place
    wide = np.zeros((B, 1, SQ, 2 * t), bool)
    script = [
        "same", "same", "same", None, None, "same", "same",
        "broadcast", "broadcast", "strided", "strided", "heads", "heads", "same", "same",
    ]  # fmt: skip
    lane = []
    with mpitree.DecodePlan(B, HQ, HKV, DIM, q_len=SQ, comm=comm) as plan:
        runs = compiled_runs(plan)
        for step, kind in enumerate(script):
            fresh = tree_mask(comm, 1, t, 82 + step)
            if kind == "same":
                mask[...] = fresh
                given = mask
            elif kind == "broadcast":  # (SQ, T): every batch row and head alike
                given = fresh[0, 0]
            elif kind == "strided":
                wide[..., ::2] = fresh
                given = wide[..., ::2]
            elif kind == "heads":
                given = np.ascontiguousarray(np.repeat(fresh, HQ, axis=1))
            else:
                given = None
            visible = np.ones((B, 1, SQ, t), bool) if given is None else seen(fresh, [t, t])
            if kind == "broadcast":
                visible = np.broadcast_to(fresh[:1], visible.shape) & True
            q = query(step)
            before = len(runs)
            out, lse = plan.decode(q, k, v, mask=given, return_lse=True)
            lane.append(len(runs) - before)
            with extend.tools.full_checks():
                full, full_lse = plan.decode(q, k, v, mask=given, return_lse=True)
            assert np.array_equal(out, full) and np.array_equal(lse, full_lse), step
            assert_gathered_reference(comm, q, clean_k, clean_v, visible, out, lse)
    if plan._compiled is not None:  # the full-checks step before each binds it again
        assert lane == [0, 1, 1, 0, 1, 0, 1, 0, 0, 0, 0, 0, 1, 0, 1], lane


BAD = {
    "one key short": lambda mask: np.ascontiguousarray(mask[..., :-1]),
    "one key more": lambda mask: np.concatenate([mask, mask[..., :1]], axis=-1),
    "float": lambda mask: mask.astype(np.float32),
}


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("name", list(BAD))
def test_a_mask_refused_on_one_rank_beside_compiled_steps(name):
    """One rank's mask the checks refuse while the others run their compiled call with a
    valid one: every rank raises (the bad one its own error), then the plan steps on."""
    comm = world()
    bad = comm.size - 1
    t = 7
    k, v = shard(comm, t, 91)
    mask = tree_mask(comm, 1, t, 92)
    q = query(93)
    with mpitree.DecodePlan(B, HQ, HKV, DIM, q_len=SQ, comm=comm) as plan:
        first = plan.decode(q, k, v, mask=mask)
        assert np.array_equal(plan.decode(q, k, v, mask=mask), first)
        with pytest.raises(Exception) as raised:
            plan.decode(q, k, v, mask=BAD[name](mask) if comm.rank == bad else mask)
        if comm.rank == bad:
            assert isinstance(raised.value, TypeError | ValueError), raised.value
            assert "mask" in str(raised.value)
        else:
            assert isinstance(raised.value, mpitree.RankError), raised.value
            assert f"rank {bad}" in str(raised.value)
        assert np.array_equal(plan.decode(q, k, v, mask=mask), first)


def broadcast_mask(which, t):
    """A C-contiguous mask with a size-1 B or Sq, whose memory runs on into other bytes."""
    whole = np.random.default_rng(3).random(B * SQ * t) < 0.5
    first = (1, 1, SQ, t) if which == "batch" else (B, 1, 1, t)
    n = int(np.prod(first))
    whole[n:] = ~whole[: len(whole) - n]  # what lies past it differs from it
    return whole[:n].reshape(first)


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("which", ["batch", "query"])
@pytest.mark.parametrize("entry", ["plan", "tree_decode"])
def test_a_mask_the_checks_broadcast_keeps_their_bits(which, entry):
    """A 4-D mask with a size-1 B or Sq (the checks broadcast it) never runs a compiled
    call, which would read past it: every call gives the full checks' bits."""
    comm = world()
    t = 6
    k, v = shard(comm, t, 101)
    q = query(102)
    mask = broadcast_mask(which, t)
    if entry == "plan":
        with mpitree.DecodePlan(B, HQ, HKV, DIM, q_len=SQ, comm=comm) as plan:
            runs = compiled_runs(plan)
            with extend.tools.full_checks():
                want = plan.decode(q, k, v, mask=mask)
            outs = [plan.decode(q, k, v, mask=mask) for _ in range(4)]
        assert not runs
    else:
        want = mpitree.tree_decode(q, k, v, comm, mask=mask, validate=True)
        outs = [mpitree.tree_decode(q, k, v, comm, mask=mask) for _ in range(4)]
    assert all(np.array_equal(out, want) for out in outs)
    visible = np.broadcast_to(mask, (B, 1, SQ, t))
    assert_gathered_reference(comm, q, k, v, visible, want)
