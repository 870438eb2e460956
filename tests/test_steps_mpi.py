"""One-shot calls that recur with one layout reuse their checks: still exact, still guarded."""

import contextlib
import gc
import weakref

import numpy as np
import pytest
from helpers import assert_gathered_reference, counted_lane_calls, lane_expected, world
from numpy.testing import assert_allclose

import mpitree
from mpitree import reference_attention
from mpitree._library import StepLocal
from mpitree._state import merge_records

NPROCS = [1, 2, 3, 4]
STRATEGIES = ["auto", "allreduce", "allreduce3", "allgather"]


def growing_cache(comm, steps, b=2, hq=4, hkv=2, d=16, seed=3):
    """Yield (q, k, v, reference) per step: every rank's shard grows in a preallocated cache.

    Shards are uneven and rank 0's starts empty, so the first steps have an empty shard;
    every step's k, v are views of the same buffers: the same layout, a longer ``T``.
    """
    rng = np.random.default_rng(seed)
    p = comm.Get_size()
    sizes = [[max(0, s * (r + 1) - (r == 0) * 2) for r in range(p)] for s in range(steps)]
    cap = max(max(row) for row in sizes)
    keys = rng.standard_normal((p, b, hkv, cap, d)).astype(np.float32)
    values = rng.standard_normal((p, b, hkv, cap, d)).astype(np.float32)
    for row in sizes:
        q = rng.standard_normal((b, hq, 1, d)).astype(np.float32)
        k = np.concatenate([keys[r][:, :, : row[r]] for r in range(p)], axis=2)
        v = np.concatenate([values[r][:, :, : row[r]] for r in range(p)], axis=2)
        t = row[comm.rank]
        yield q, keys[comm.rank][:, :, :t], values[comm.rank][:, :, :t], (q, k, v)


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("deterministic", [False, True])
def test_recurring_tree_decode_exact(strategy, deterministic):
    comm = world()
    for q, k, v, full in growing_cache(comm, 6):
        out, lse = mpitree.tree_decode(
            q, k, v, comm, strategy=strategy, deterministic=deterministic, return_lse=True
        )
        ref_out, ref_lse = reference_attention(*full)
        assert_allclose(out, ref_out, atol=2e-5, rtol=0)
        assert_allclose(lse, ref_lse, atol=2e-5, rtol=0)


@pytest.mark.parallel(nprocs=NPROCS)
def test_recurring_tree_decode_same_bits_as_first_call():
    """A call that reuses a remembered layout gives the bits of one that checks afresh."""
    comm = world()
    steps = list(growing_cache(comm, 4))
    q, k, v, _ = steps[-1]
    first = mpitree.tree_decode(q, k, v, comm, strategy="allgather")
    for _ in range(3):
        again = mpitree.tree_decode(q, k, v, comm, strategy="allgather")
        np.testing.assert_array_equal(again, first)


@pytest.mark.parallel(nprocs=[2, 3, 4])
def test_bad_shard_after_layout_recurred_raises_everywhere():
    """T's own checks still run when the rest of the layout is remembered."""
    comm = world()
    *_, (q, k, v, _) = growing_cache(comm, 4)
    for _ in range(3):
        mpitree.tree_decode(q, k, v, comm)
    bad = comm.Get_size() - 1
    short = v[:, :, : max(0, v.shape[2] - 1)] if comm.rank == bad else v
    with pytest.raises(ValueError) as info:
        mpitree.tree_decode(q, k, short, comm)
    if comm.rank != bad:
        assert f"invalid input on rank {bad}" in str(info.value)
    scale = 0.5 if comm.rank == 0 else 0.25
    with pytest.raises(ValueError, match="disagree on scale"):
        mpitree.tree_decode(q, k, v, comm, scale=scale)
    out = mpitree.tree_decode(q, k, v, comm)  # and the next good call is exact
    assert np.isfinite(out).all()


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_recurring_tree_decode_keeps_no_reference_to_its_arrays():
    comm = world()
    rng = np.random.default_rng(comm.rank)
    q = np.random.default_rng(0).standard_normal((1, 4, 1, 8)).astype(np.float32)
    k = rng.standard_normal((1, 2, 5, 8)).astype(np.float32)
    v = rng.standard_normal((1, 2, 5, 8)).astype(np.float32)
    for _ in range(3):
        mpitree.tree_decode(q, k, v, comm)
    refs = [weakref.ref(x) for x in (q, k, v)]
    del q, k, v
    gc.collect()
    assert all(r() is None for r in refs)


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_a_recurring_call_reuses_its_merger_until_it_is_freed():
    """The agreed merger repeats without a look-up; a freed one is never merged with again."""
    from mpitree import _agreed, _merger

    comm = world()
    steps = list(growing_cache(comm, 5))
    mergers = []
    for i, (q, k, v, ref) in enumerate(steps):
        out = mpitree.tree_decode(q, k, v, comm)
        assert_allclose(out, reference_attention(*ref)[0], atol=2e-5, rtol=0)
        mergers.append(next(reversed(_agreed._recent.values())).merger())
        if i == 2:  # evict it from the communicator's cache, as a 17th merger would
            cache = comm.Get_attr(_merger._keyval)
            (key,) = [key for key, m in cache.items() if m is mergers[-1]]
            cache.pop(key).free()
    assert mergers[0] is mergers[1] is mergers[2]
    assert mergers[3] is mergers[4] and mergers[3] is not mergers[2]
    assert mergers[3].alive and not mergers[2].alive


@pytest.mark.parallel(nprocs=[2, 3])
def test_a_reused_merger_is_evicted_alike_on_every_rank():
    """A merger reused on some ranks and looked up on others stays in step in every cache.

    Rank 0's last call ran on another communicator, so it looks the kept merger up
    where the others reuse it: both must mark it used, or the caches' LRU orders
    part and a later call rebuilds (a collective) a merger on some ranks only: a hang.
    """
    from mpitree import _merger

    comm = world().Dup()
    sub = comm.Split(int(comm.rank == 0), comm.rank)
    q, k, v, ref = list(growing_cache(comm, 3))[-1]
    expected = reference_attention(*ref)[0]
    for _ in range(3):  # the third call repeats the kept template's merge tuple
        mpitree.tree_decode(q, k, v, comm)
    _merger.merger_for(comm, 7, 8, "float32", "allgather")  # used after it, not remembered
    if comm.rank == 0:
        mpitree.tree_decode(q, k, v, sub)
    assert_allclose(mpitree.tree_decode(q, k, v, comm), expected, atol=2e-5, rtol=0)
    orders = comm.allgather(list(comm.Get_attr(_merger._keyval)))
    assert all(order == orders[0] for order in orders), orders
    for b in range(1, 17):  # 16 more mergers: the LRU evicts the two above
        kv = np.zeros((b, 1, 2, 16), np.float32)
        mpitree.tree_decode(kv[:, :, :1], kv, kv, comm)
    assert_allclose(mpitree.tree_decode(q, k, v, comm), expected, atol=2e-5, rtol=0)
    sub.Free()
    comm.Free()


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_freeing_a_communicator_frees_and_releases_its_mergers(strategy):
    """A freed communicator's mergers are freed with it, and nothing keeps them after.

    A persistent request holds its communicator, and MPICH runs a communicator's
    delete callbacks (which free the requests) only when nothing holds it: freed
    after an "allreduce" merge, it and its mergers stayed for good (about 2000
    such communicators exhausted MPICH's context ids). And the kept mergers of
    agree_merger held up to 8 freed ones with their buffers.
    """
    from mpitree import _merger

    comm = world().Dup()
    mine = np.ones((2, 3, 10), np.float32)
    for _ in range(2):  # the second call repeats the first's merge tuple: it is kept
        mpitree.allreduce_state(mpitree.State(mine), comm, strategy)
    cache = comm.Get_attr(_merger._keyval)
    mergers = list(cache.values())
    kept = [weakref.ref(merger) for merger in mergers]
    comm.Free()
    assert not cache and mergers and not any(merger.alive for merger in mergers)
    del mergers
    gc.collect()
    assert all(ref() is None for ref in kept)


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_calls_in_turn_each_reuse_their_merger(monkeypatch):
    """One-shot calls made in turn each keep their merger: no look-up once they recur.

    With one kept merger, ``tree_decode`` and ``allreduce_state`` in turn looked
    theirs up (and resolved the strategy) on every call.
    """
    from mpitree import _agreed

    comm = world()
    q, k, v, ref = list(growing_cache(comm, 4))[-1]  # no empty shard: its call is remembered
    expected = reference_attention(*ref)[0]
    mine = np.random.default_rng([7, comm.rank]).standard_normal((2, 3, 10)).astype(np.float32)
    mine[..., 1] = np.abs(mine[..., 1])
    every = np.stack(comm.allgather(mine)).astype(np.float64)
    looked = []
    real = _agreed.merger_for
    monkeypatch.setattr(_agreed, "merger_for", lambda *a: looked.append(a[1:3]) or real(*a))
    for turn in range(6):
        if turn == 3:  # both have recurred: their merge tuples are kept
            before = len(looked)
        assert_allclose(mpitree.tree_decode(q, k, v, comm), expected, atol=2e-5, rtol=0)
        merged = mpitree.allreduce_state(mpitree.State(mine), comm)
        assert_allclose(merged.records, merge_records(every), rtol=2e-6, atol=2e-6)
    assert before and len(looked) == before


@pytest.mark.parallel(nprocs=[2, 3])
def test_nan_after_layout_recurred_stays_nan():
    """A NaN value on one rank poisons its rows everywhere, on a remembered layout too."""
    comm = world()
    *_, (q, k, v, _) = growing_cache(comm, 4)
    for _ in range(3):
        mpitree.tree_decode(q, k, v, comm)
    if comm.rank == 1:
        v[0, 0, 0, 0] = np.nan  # in the cache: the same view, the remembered layout
    out = mpitree.tree_decode(q, k, v, comm)
    assert np.isnan(out[0, :2, :, 0]).all()  # query heads 0, 1 share kv head 0
    assert np.isfinite(out[0, :, :, 1:]).all() and np.isfinite(out[0, 2:]).all()
    assert np.isfinite(out[1]).all()


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_recurring_allreduce_state_exact(strategy):
    comm = world()
    for step in range(4):
        rng = np.random.default_rng([step, comm.rank])
        mine = rng.standard_normal((2, 3, 10)).astype(np.float32)
        mine[..., 1] = np.abs(mine[..., 1])
        if step == 1:
            mine[0, 0] = [-np.inf, 0, *np.zeros(8)]  # an empty row on every rank
        merged = mpitree.allreduce_state(mpitree.State(mine), comm, strategy=strategy)
        every = np.stack(comm.allgather(mine)).astype(np.float64)
        assert_allclose(merged.records, merge_records(every), rtol=2e-6, atol=2e-6)
        assert merged.records.dtype == np.float32


@pytest.mark.parallel(nprocs=[2, 3])
def test_allreduce_state_bad_input_after_recurring():
    comm = world()
    state = mpitree.State.empty((3,), 8)
    for _ in range(3):
        mpitree.allreduce_state(state, comm)
    bad = comm.Get_size() - 1
    with pytest.raises((TypeError, ValueError)) as info:
        mpitree.allreduce_state(state.records if comm.rank == bad else state, comm)
    if comm.rank == bad:
        assert isinstance(info.value, TypeError)
    else:
        assert f"invalid input on rank {bad}" in str(info.value)
    rows = (4,) if comm.rank == 0 else (3,)
    with pytest.raises(ValueError, match="disagree on rows"):
        mpitree.allreduce_state(mpitree.State.empty(rows, 8), comm)
    det = comm.rank == 0
    with pytest.raises(ValueError, match="disagree on deterministic"):
        mpitree.allreduce_state(state, comm, deterministic=det)
    merged = mpitree.allreduce_state(state, comm)
    assert np.isneginf(merged.m).all()


@pytest.fixture
def lane_calls(monkeypatch):
    """Count ``allreduce_state``'s lane calls (its one compiled call) on this rank.

    The test starts with no lane kept (earlier tests' calls left some).
    """
    return counted_lane_calls(monkeypatch, StepLocal.COPY)


@pytest.fixture
def decode_lane_calls(monkeypatch):
    """Count ``tree_decode``'s lane calls on this rank, from no lane kept."""
    return counted_lane_calls(monkeypatch, StepLocal.KERNEL)


def random_records(seed, shape=(2, 3, 10), dtype=np.float32):
    """Return valid records ``shape`` (d >= 0), different on every rank."""
    mine = np.random.default_rng([seed, world().rank]).standard_normal(shape).astype(dtype)
    mine[..., 1] = np.abs(mine[..., 1])
    return mine


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("which", ["default", "world", "split"])
def test_recurring_allreduce_state_takes_its_lane_exactly(which, lane_calls):
    """From its second call on, a recurring call is one compiled call: still exact.

    Uneven ranks (a split of ranks 0 and the rest), an empty row, -inf/NaN rows.
    """
    comm = {"default": None, "world": world(), "split": world().Split(world().rank == 0)}[which]
    group = world() if comm is None else comm
    for step in range(5):
        mine = random_records(step)
        if step == 2:
            mine[0, 0] = [-np.inf, 0, *np.zeros(8)]  # an empty row on every rank
        if step == 3 and group.rank == group.Get_size() - 1:
            mine[1, 2, 4] = np.nan  # a NaN stays NaN
        merged = mpitree.allreduce_state(mpitree.State(mine), comm)
        every = np.stack(group.allgather(mine)).astype(np.float64)
        assert_allclose(merged.records, merge_records(every), rtol=2e-6, atol=2e-6)
        assert merged.records.dtype == np.float32 and merged.records is not mine
    assert np.isnan(merged.records[1, 2, 4]) or step != 3
    assert len(lane_calls) == (3 if lane_expected(group) else 0)  # kept by the 2nd call
    if which == "split":
        comm.Free()


@pytest.mark.parallel(nprocs=[2, 3])
def test_allreduce_state_lane_failures_reach_every_rank(lane_calls):
    """On a kept lane, one rank's bad input, a disagreement or a changed environment
    raise on every rank or are merged as the guarded path would; the lane goes on."""
    comm = world()
    last = comm.Get_size() - 1
    state = mpitree.State(random_records(1))
    for _ in range(4):
        mpitree.allreduce_state(state, comm)
    taken = len(lane_calls)
    assert taken == (2 if lane_expected() else 0)
    with pytest.raises((TypeError, ValueError)) as info:
        mpitree.allreduce_state(state.records if comm.rank == last else state, comm)
    assert isinstance(info.value, TypeError) == (comm.rank == last)
    with pytest.raises(ValueError, match="disagree on rows"):
        rows = (2, 4, 10) if comm.rank == 0 else (2, 3, 10)
        mpitree.allreduce_state(mpitree.State(random_records(2, rows)), comm)
    with pytest.raises(ValueError, match="disagree on dtype"):
        dtype = np.float64 if comm.rank == last else np.float32
        mpitree.allreduce_state(mpitree.State(random_records(2, dtype=dtype)), comm)
    with pytest.raises(ValueError, match="disagree on strategy"):
        mpitree.allreduce_state(state, comm, "allgather" if comm.rank == 0 else "auto")
    every = np.stack(comm.allgather(state.records)).astype(np.float64)
    if comm.rank == 0:  # a strided copy: the guarded path here, the lane elsewhere
        state.records = np.asfortranarray(state.records)
    merged = mpitree.allreduce_state(state, comm)
    assert_allclose(merged.records, merge_records(every), rtol=2e-6, atol=2e-6)
    state.records = np.ascontiguousarray(state.records)
    merged = mpitree.allreduce_state(state, comm)
    assert_allclose(merged.records, merge_records(every), rtol=2e-6, atol=2e-6)
    if lane_expected():  # the lane ran where its rank sent the agreed vector
        # each call's lane ran on the ranks whose own call could take it
        assert len(lane_calls) - taken == 2 * (comm.rank != last) + 3 * (comm.rank != 0) + 1


@pytest.mark.parallel(nprocs=[2, 3])
def test_allreduce_state_lane_survives_its_communicator(lane_calls):
    """A freed communicator's lane is never taken again; a new one gets its own."""
    for turn in range(3):
        comm = world().Dup()
        mine = random_records(turn)
        every = np.stack(comm.allgather(mine)).astype(np.float64)
        for _ in range(3):
            merged = mpitree.allreduce_state(mpitree.State(mine), comm)
            assert_allclose(merged.records, merge_records(every), rtol=2e-6, atol=2e-6)
        comm.Free()
    assert len(lane_calls) == (3 if lane_expected() else 0)  # each kept by its 2nd call


@pytest.mark.parallel(nprocs=[1, 2])
def test_allreduce_state_lane_only_for_the_outermost_call(lane_calls):
    """Called inside another entry point, ``allreduce_state`` agrees under that entry
    point's name: it takes the guarded path, never its lane."""
    from mpitree import _guard

    state = mpitree.State(random_records(3))
    for _ in range(3):
        mpitree.allreduce_state(state)
    taken = len(lane_calls)
    token = _guard._entry.set("tests.outer")
    try:
        merged = mpitree.allreduce_state(state)
        nested = mpitree.State(random_records(4, (2, 5, 10)))  # a layout of its own
        for _ in range(3):  # a nested call keeps no lane: its vector names the outer call
            mpitree.allreduce_state(nested)
    finally:
        _guard._entry.reset(token)
    every = np.stack(world().allgather(state.records)).astype(np.float64)
    assert_allclose(merged.records, merge_records(every), rtol=2e-6, atol=2e-6)
    assert len(lane_calls) == taken
    merged = mpitree.allreduce_state(nested)  # outermost, guarded here, beside any rank
    every = np.stack(world().allgather(nested.records)).astype(np.float64)
    assert_allclose(merged.records, merge_records(every), rtol=2e-6, atol=2e-6)
    assert len(lane_calls) == taken


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("which", ["default", "world", "split"])
def test_recurring_tree_decode_takes_its_lane_exactly(which, decode_lane_calls):
    """From its second call on, a recurring decode is one compiled call: still exact.

    A cache growing in place, uneven shards, rank 0's empty at first.
    """
    comm = {"default": None, "world": world(), "split": world().Split(world().rank == 0)}[which]
    group = world() if comm is None else comm
    steps = list(growing_cache(group, 5))
    for q, k, v, ref in steps:
        out = mpitree.tree_decode(q, k, v, comm)
        assert_allclose(out, reference_attention(*ref)[0], atol=2e-5, rtol=0)
        assert out.dtype == np.float32 and out.shape == q.shape
    assert len(decode_lane_calls) == (len(steps) - 2 if lane_expected(group) else 0)
    if which == "split":
        comm.Free()


@pytest.mark.parallel(nprocs=[2, 3])
def test_tree_decode_lane_failures_reach_every_rank(decode_lane_calls):
    """On a kept decode lane, one rank's bad input or a disagreement raises on every
    rank; local options the lane does not take (return_lse, kv_len) run guarded beside
    it; the lane goes on."""
    comm = world()
    last = comm.Get_size() - 1
    *_, (q, k, v, ref) = growing_cache(comm, 4)
    expected = reference_attention(*ref)[0]
    for _ in range(4):
        mpitree.tree_decode(q, k, v, comm)
    taken = len(decode_lane_calls)
    assert taken == (2 if lane_expected() else 0)
    with pytest.raises(ValueError) as info:  # K and V lengths differ on the last rank
        mpitree.tree_decode(q, k, v[:, :, 1:] if comm.rank == last else v, comm)
    assert ("invalid input on rank" in str(info.value)) == (comm.rank != last)
    with pytest.raises(ValueError, match="disagree on"):
        mpitree.tree_decode(q, k, v, comm, scale=0.5 if comm.rank == 0 else None)
    with pytest.raises(ValueError, match="disagree on"):
        mpitree.tree_decode(q[:, :2].copy() if comm.rank == 0 else q, k, v, comm)
    # the same call, its return_lse only on rank 0 (a local choice): merged alike
    got = mpitree.tree_decode(q, k, v, comm, return_lse=comm.rank == 0)
    assert_allclose(got[0] if comm.rank == 0 else got, expected, atol=2e-5, rtol=0)
    lens = np.full(q.shape[0], k.shape[2]) if comm.rank == last else None  # local too
    assert_allclose(mpitree.tree_decode(q, k, v, comm, kv_len=lens), expected, atol=2e-5, rtol=0)
    assert_allclose(mpitree.tree_decode(q, k, v, comm), expected, atol=2e-5, rtol=0)
    if lane_expected():  # each call's lane ran on the ranks whose own call could take it
        assert len(decode_lane_calls) - taken == 2 * (comm.rank != last) + 3 * (comm.rank != 0) + 1


@pytest.mark.timeout(60)
@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize("failure", ["rows differ", "bad input"])
def test_a_failed_call_on_a_lane_keeps_every_ranks_mergers_alike(failure, lane_calls):
    """A failed agreement marks no merger used on any rank, on a lane or not: after it,
    a new merger evicts the same one everywhere, and nothing hangs (a lane that marked
    its merger before the agreement made the ranks evict different ones)."""
    comm = world().Dup()  # a communicator of its own: 16 mergers, none of other tests

    def state(rows):
        return mpitree.State(random_records(rows, (rows, 10)))

    for rows in range(1, 17):  # 16 mergers, each with a lane; rows=1's the least recent
        for _ in range(2):
            mpitree.allreduce_state(state(rows), comm)
    with pytest.raises((TypeError, ValueError)):  # every rank; ranks 1... on rows=2's lane
        if failure == "rows differ":
            mpitree.allreduce_state(state(1 if comm.rank == 0 else 2), comm)
        else:
            mpitree.allreduce_state(state(2).records if comm.rank == 0 else state(2), comm)
    mpitree.allreduce_state(state(17), comm)  # evicts rows=1's merger on every rank
    mine = state(1)
    merged = mpitree.allreduce_state(mine, comm)
    every = np.stack(comm.allgather(mine.records)).astype(np.float64)
    assert_allclose(merged.records, merge_records(every), rtol=2e-6, atol=2e-6)
    comm.Free()


@pytest.mark.parallel(nprocs=[1, 2])
def test_one_shot_lanes_keep_the_guarded_calls_errors_counts_and_phases(lane_calls):
    """Arguments that fit no call raise the entry point's TypeError, not the lane's; a
    lane call counts the guarded call's bytes; inside phase_times the guarded path runs,
    and its phases are timed."""
    from mpitree import extend

    comm = world()
    state = mpitree.State(random_records(5))
    for _ in range(2):
        mpitree.allreduce_state(state, comm)
    with pytest.raises(TypeError, match="allreduce_state"):
        mpitree.allreduce_state(state, comm, "auto", True)
    with pytest.raises(TypeError, match="allreduce_state"):
        mpitree.allreduce_state(state, comm, bogus=1)
    *_, (q, k, v, _) = growing_cache(comm, 3)
    with pytest.raises(TypeError, match="tree_decode"):
        mpitree.tree_decode(q, k, v, comm, "auto")
    counts = []
    for lane in (True, False):
        extend.traffic.reset()
        with extend.phase_times() if not lane else contextlib.nullcontext() as times:
            taken = len(lane_calls)
            mpitree.allreduce_state(state, comm)
        counts.append((extend.traffic.bytes, extend.traffic.calls))
        assert len(lane_calls) - taken == (lane and lane_expected())
    assert counts[0] == counts[1]
    assert comm.Get_size() == 1 or counts[0][1] == 1
    assert {"agreement", "merge"} <= set(times)


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_allreduce_state_of_no_rows():
    """A State with no rows merges to one with no rows (its reshape raised)."""
    for _ in range(3):
        merged = mpitree.allreduce_state(mpitree.State.empty((0,), 8), world())
        assert merged.records.shape == (0, 10)


@pytest.mark.timeout(60)
@pytest.mark.parallel(nprocs=[2, 3])
def test_ranks_whose_arrays_live_in_different_frameworks_raise():
    """Torch tensors on one rank, numpy arrays on the others: every rank raises (each
    would look up another merger, cached per staging: after a numpy call had cached
    one, rank 0 built a torch one while the others started theirs, and it hung)."""
    torch = pytest.importorskip("torch")
    comm = world()
    *_, (q, k, v, ref) = growing_cache(comm, 3)
    for _ in range(3):
        mpitree.tree_decode(q, k, v, comm)
    mixed = [torch.from_numpy(x) for x in (q, k, v)] if comm.rank == 0 else (q, k, v)
    with pytest.raises(ValueError, match="disagree"):
        mpitree.tree_decode(*mixed, comm)
    assert_allclose(mpitree.tree_decode(q, k, v, comm), reference_attention(*ref)[0], atol=2e-5)
    every = [torch.from_numpy(x) for x in (q, k, v)]  # torch on every rank: agreed
    assert_allclose(
        mpitree.tree_decode(*every, comm).numpy(), reference_attention(*ref)[0], atol=2e-5
    )


def fixed_capacity(comm, steps, b=2, hq=4, hkv=2, sq=3, d=16, cap=9, seed=5):
    """Yield (q, k, v, kv_len, mask, visible) per step over one fixed-capacity cache.

    Every rank's whole ``(b, hkv, cap, d)`` buffer is passed each step with a ``kv_len``
    (uneven, rank 0's 0 at first) and a fresh C-contiguous bool ``(b, 1, sq, cap)`` mask
    (a draft tree's); NaN and Inf fill every slot past ``kv_len``.
    """
    rng = np.random.default_rng([seed, comm.rank])
    clean_k = rng.standard_normal((b, hkv, cap, d)).astype(np.float32)
    clean_v = rng.standard_normal((b, hkv, cap, d)).astype(np.float32)
    k, v = clean_k.copy(), clean_v.copy()
    for step in range(steps):
        used = np.array([min(cap, step * (comm.rank + 1)), min(cap, step + comm.rank)])
        past = np.arange(cap)[None, :] >= used[:, None]
        k[...], v[...] = clean_k, clean_v
        k[np.broadcast_to(past[:, None, :, None], k.shape)] = np.nan
        v[np.broadcast_to(past[:, None, :, None], v.shape)] = np.inf
        mask = rng.random((b, 1, sq, cap)) < 0.7
        q = np.random.default_rng([seed, step]).standard_normal((b, hq, sq, d))
        yield q.astype(np.float32), k, v, used, mask, ~past, (clean_k, clean_v)


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("with_mask", [False, True])
def test_a_recurring_tree_decode_with_kv_len_takes_its_lane(with_mask, decode_lane_calls):
    """A recurring decode over a fixed-capacity cache with ``kv_len`` (and a draft tree's
    mask) is one compiled call from its third call: the guarded calls' bits, exact against
    the float64 reference, garbage past ``kv_len`` unread."""
    comm = world()
    for q, k, v, used, mask, keep, clean in fixed_capacity(comm, 6):
        given = mask if with_mask else None
        visible = keep[:, None, None, :] & (mask if with_mask else True)
        out = mpitree.tree_decode(q, k, v, comm, kv_len=used, mask=given)
        # return_lse takes the guarded path (its local step the same bound kernel)
        guarded, _ = mpitree.tree_decode(q, k, v, comm, kv_len=used, mask=given, return_lse=True)
        assert np.array_equal(out, guarded)
        assert_gathered_reference(comm, q, *clean, visible, out)
    assert len(decode_lane_calls) == (4 if lane_expected(comm) else 0)


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize("bad", ["kv_len past T", "negative kv_len", "mask one key short"])
def test_a_bad_kv_len_or_mask_beside_compiled_decodes_raises_everywhere(bad, decode_lane_calls):
    """One rank's kv_len or mask the checks refuse while the others run their compiled
    call: every rank raises (the bad one its own error), then the lane goes on."""
    comm = world()
    last = comm.Get_size() - 1
    *_, (q, k, v, used, mask, _, _) = fixed_capacity(comm, 4)
    first = mpitree.tree_decode(q, k, v, comm, kv_len=used, mask=mask)
    for _ in range(2):
        assert np.array_equal(mpitree.tree_decode(q, k, v, comm, kv_len=used, mask=mask), first)
    taken = len(decode_lane_calls)
    lens, given = used, mask
    if comm.rank == last:
        if bad == "kv_len past T":
            lens = used + k.shape[2] + 1
        elif bad == "negative kv_len":
            lens = used - 100
        else:
            given = np.ascontiguousarray(mask[..., :-1])
    with pytest.raises(ValueError) as info:
        mpitree.tree_decode(q, k, v, comm, kv_len=lens, mask=given)
    assert ("invalid input on rank" in str(info.value)) == (comm.rank != last)
    assert np.array_equal(mpitree.tree_decode(q, k, v, comm, kv_len=used, mask=mask), first)
    if lane_expected(comm):  # the good ranks' failed call and the last call ran compiled
        assert len(decode_lane_calls) - taken == 1 + (comm.rank != last)
