"""The measuring names of mpitree.extend: phase timers, traffic, the kernel, a plan's merger."""

import ctypes

import numpy as np
import pytest

import mpitree
from mpitree import _decode_plan, _kernel, _local, _merger, extend
from mpitree._library import library_path

SHAPE = (1, 4, 2, 16)  # B, Hq, Hkv, D


def arrays(t=37, seed=0):
    """Return float32 q (B, Hq, 1, D), k and v (B, Hkv, t, D)."""
    b, hq, hkv, d = SHAPE
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, hq, 1, d), dtype=np.float32)
    k = rng.standard_normal((b, hkv, t, d), dtype=np.float32)
    v = rng.standard_normal((b, hkv, t, d), dtype=np.float32)
    return q, k, v


def reference(q, k, v):
    """Return the float64 single-process answer."""
    return mpitree.reference_attention(q.astype(np.float64), k, v)[0]


def originals():
    """Return the callables phase_times may wrap, to check they come back unchanged."""
    return (
        _merger.Merger.merge,
        _local.attend_native,
        _kernel.Prepared.run,
        _kernel.Prepared.run_raw,
        _kernel.BoundLayer.fill,
    )


def test_phase_times_times_each_phase_and_leaves_nothing_behind():
    q, k, v = arrays()
    before = originals()
    with mpitree.DecodePlan(*SHAPE) as plan:
        plain = plan.decode(q, k, v)
        with extend.phase_times() as times:
            timed = plan.decode(q, k, v)
            mpitree.tree_decode(q, k, v)
        after = plan.decode(q, k, v)
    assert originals() == before
    assert {"merge", "collective", "kernel", "agreement"} <= set(times)
    assert len(times["merge"]) == 2 and len(times["kernel"]) == 2  # nested calls count once
    assert len(times["agreement"]) == 1  # tree_decode's; a plan step agrees on nothing
    assert all(x > 0 for xs in times.values() for x in xs)
    np.testing.assert_array_equal(timed, plain)
    np.testing.assert_array_equal(after, plain)
    np.testing.assert_allclose(plain, reference(q, k, v), rtol=1e-5, atol=1e-5)


def test_phase_times_appends_to_the_callers_dict():
    q, k, v = arrays()
    mine = {"other": [1.0]}
    with extend.phase_times(mine) as times:
        mpitree.tree_decode(q, k, v)
    assert times is mine and mine["other"] == [1.0] and len(mine["kernel"]) == 1


def test_full_checks_turns_the_fast_path_off_inside_only():
    q, k, v = arrays()
    with mpitree.DecodePlan(*SHAPE) as plan:
        fast = plan.decode(q, k, v)
        with extend.full_checks():
            assert _decode_plan.FAST_PATH is False
            with extend.full_checks():
                full = plan.decode(q, k, v)
            assert _decode_plan.FAST_PATH is False  # blocks nest
        assert _decode_plan.FAST_PATH is True
    np.testing.assert_array_equal(full, fast)


def test_plan_merger_merges_a_plans_records():
    q, k, v = arrays()
    with mpitree.DecodePlan(*SHAPE) as plan:
        merger = extend.plan_merger(plan)
        rows, d = SHAPE[0] * SHAPE[1], SHAPE[3]
        assert merger.buf.shape == (rows + 1, d + 2)
        want = np.empty((rows, d + 2), np.float32)
        extend.Prepared.of(q, k, v, d**-0.5).run(q, k, v, None, want)

        def fill(records):
            records[...] = want

        out = extend.finish(merger.merge(fill).reshape(1, SHAPE[1], 1, d + 2), q)
    np.testing.assert_allclose(out, reference(q, k, v), rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="DecodePlan"):
        extend.plan_merger(object())


def test_prepared_runs_this_build_or_another():
    q, k, v = arrays(t=70)
    want = mpitree.local_state(q, k, v).records
    out = np.empty_like(want)
    extend.Prepared.of(q, k, v, SHAPE[3] ** -0.5).run(q, k, v, None, out)
    np.testing.assert_array_equal(out, want)
    lib = ctypes.CDLL(library_path())  # "another build", declared as a benchmark does
    lib.mpitree_attend_f32.argtypes = [ctypes.c_void_p] * 6
    lib.mpitree_attend_scratch.restype = ctypes.c_int64
    lib.mpitree_attend_scratch.argtypes = [ctypes.c_int64] * 2
    other = np.empty_like(want)
    extend.Prepared.of(q, k, v, SHAPE[3] ** -0.5, lib=lib).run(q, k, v, None, other)
    np.testing.assert_array_equal(other, want)
    assert extend.Prepared.of(q.astype(np.float64), k, v, 1.0) is None


def test_kernel_isa_read_seconds_and_traffic():
    assert isinstance(extend.kernel_isa(), str) and extend.kernel_isa()
    assert extend.read_seconds(np.ones(1 << 16, np.float32)) > 0
    traffic = extend.traffic
    traffic.add(24)
    assert traffic.bytes >= 24 and traffic.calls >= 1
    traffic.reset()
    assert (traffic.bytes, traffic.calls) == (0, 0)
