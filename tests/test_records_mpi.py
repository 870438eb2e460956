"""mpitree._records.RecordsMerge under real ranks: an adapter's merge of ready records.

Each test makes its own entry point (registered in a throwaway registry, so the
bad-input catalogue's stays as it was), as an adapter of its own would.
"""

import numpy as np
import pytest
from helpers import counted_lane_calls, lane_expected, world
from numpy.testing import assert_allclose

import mpitree
from mpitree import _guard, extend
from mpitree._library import StepLocal
from mpitree._state import merge_records

NPROCS = [1, 2, 3]
DIM = 4


@pytest.fixture
def merge_it(monkeypatch):
    """An adapter's entry point merging ``(rows, DIM + 2)`` records through a RecordsMerge.

    ``merge_it(records, payload=None, strategy=None, signature=True)``: ``strategy``
    this rank's (default "auto"); ``signature=False`` leaves the options out of the
    call's signature (the agreement adds them); ``prepare`` fails where ``records``
    has an ``m`` of NaN (a local check whose verdict depends on values, not on
    the key: such a call has no key, as the JAX adapter's with its flag set).
    """
    monkeypatch.setattr(_guard, "ENTRY_POINTS", {})
    merges = extend.RecordsMerge(f"{__name__}.merge_it.<locals>.merge_it")  # its qualname

    def failed(records):
        return records is not None and bool(np.isnan(records[:, 0]).any())

    def key(records, strategy):  # what the call depends on; None: a verdict to agree on
        return None if failed(records) else ("merge_it", strategy)

    def lane(records, payload=None, strategy="auto", signature=True):
        mine = key(records, strategy)
        return None if mine is None else merges.lane(None, mine, records)

    @extend.entry_point(lane=lane)
    def merge_it(records, payload=None, strategy="auto", signature=True):
        comm = extend.check_comm(None)

        def prepare():
            if failed(records):
                raise ValueError("an m of NaN")
            opts = extend.Options.resolve(DIM, strategy)
            acc = "float32" if records is None else str(records.dtype)
            rows = 3 if records is None else records.shape[0]
            sig = {"rows": rows, **(opts.signature() if signature else {})}
            return extend.Call(
                sig, payload, key=key(records, strategy), merge=(rows, DIM, acc, opts)
            )

        return merges.merge(None, comm, key(records, strategy), records, prepare)

    return merge_it


def mine(seed, dtype=np.float32):
    """Valid ``(3, DIM + 2)`` records, different on every rank."""
    rec = np.random.default_rng([seed, world().rank]).standard_normal((3, DIM + 2))
    rec[:, 1] = np.abs(rec[:, 1])
    return rec.astype(dtype)


def merged_reference(rec):
    """Every rank's ``rec`` merged in float64."""
    return merge_records(np.stack(world().allgather(rec)).astype(np.float64))


@pytest.mark.parallel(nprocs=NPROCS)
def test_a_recurring_merge_is_one_compiled_call_exactly(merge_it, monkeypatch):
    calls = counted_lane_calls(monkeypatch, StepLocal.COPY)
    outs = [merge_it(mine(0)) for _ in range(5)]
    assert_allclose(outs[0], merged_reference(mine(0)), rtol=2e-6, atol=2e-6)
    assert all(np.array_equal(out, outs[0]) for out in outs)
    assert len(calls) == (3 if lane_expected() else 0)


@pytest.mark.parallel(nprocs=NPROCS)
def test_float64_records_with_a_float32_merge_never_take_the_compiled_copy(merge_it, monkeypatch):
    """The merge converts them; the compiled copy would read their bytes as float32."""
    calls = counted_lane_calls(monkeypatch, StepLocal.COPY)
    rec = mine(1, np.float64)
    outs = [merge_it(rec) for _ in range(4)]
    assert_allclose(outs[0], merged_reference(rec), rtol=2e-6, atol=2e-6)
    assert all(np.array_equal(out, outs[0]) for out in outs) and not calls


@pytest.mark.parallel(nprocs=NPROCS)
def test_a_call_with_a_payload_recurs(merge_it):
    outs = [merge_it(mine(2), payload={"mine": 1}) for _ in range(4)]
    assert all(np.array_equal(out, outs[0]) for out in outs)


@pytest.mark.parallel(nprocs=[2, 3])
def test_records_missing_on_one_rank_raise_on_every_rank(merge_it):
    """A rank whose local work failed (no records) while its checks passed: every rank
    raises, none waits; then the merge goes on."""
    comm = world()
    good = merge_it(mine(3))
    merge_it(mine(3))  # recurring: the others take their compiled call next
    with pytest.raises(Exception) as raised:
        merge_it(None if comm.rank == comm.size - 1 else mine(3))
    if comm.rank != comm.size - 1:
        assert isinstance(raised.value, mpitree.RankError), raised.value
    assert np.array_equal(merge_it(mine(3)), good)


@pytest.mark.parallel(nprocs=[2, 3])
def test_a_failed_check_on_one_rank_beside_compiled_calls_raises_on_every_rank(merge_it):
    comm = world()
    good = merge_it(mine(4))
    merge_it(mine(4))
    merge_it(mine(4))
    bad = mine(4)
    bad[1, 0] = np.nan
    with pytest.raises(Exception) as raised:
        merge_it(bad if comm.rank == 0 else mine(4))
    want = ValueError if comm.rank == 0 else mpitree.RankError
    assert isinstance(raised.value, want) and "an m of NaN" in str(raised.value)
    assert np.array_equal(merge_it(mine(4)), good)


@pytest.mark.parallel(nprocs=[2, 3])
def test_options_left_out_of_the_signature_are_agreed_still(merge_it):
    """An adapter whose call agrees on its problem alone: ranks asking for different
    strategies would build different mergers and wait in different collectives (a hang);
    the agreement adds what the merger depends on, and every rank raises."""
    comm = world()
    strategy = "allgather" if comm.rank == comm.size - 1 else "allreduce"
    with pytest.raises(ValueError, match="ranks disagree on strategy"):
        merge_it(mine(5), strategy=strategy, signature=False)
    merge_it(mine(5), signature=False)


@pytest.mark.parallel(nprocs=[1, 2])
def test_a_records_merge_of_no_entry_point_is_refused_on_every_rank(monkeypatch):
    monkeypatch.setattr(_guard, "ENTRY_POINTS", {})
    merges = extend.RecordsMerge(f"{__name__}.nowhere")

    @extend.entry_point
    def merge_it(records):
        comm = extend.check_comm(None)
        opts = extend.Options.resolve(DIM)
        call = extend.Call({"rows": 3}, merge=(3, DIM, "float32", opts))
        return merges.merge(None, comm, "k", records, lambda: call)

    with pytest.raises(RuntimeError, match=r"nowhere'\: no such entry point"):
        merge_it(mine(6))
