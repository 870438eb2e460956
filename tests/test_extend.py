"""mpitree.extend: its small surface, and its measuring names (phase timers, traffic, tools)."""

import ast
import ctypes
import inspect
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest

import mpitree
from mpitree import _decode_plan, _guard, _invariant_merger, _steps, _timers, _traffic, extend
from mpitree._guard import agree as bound_before  # a name bound before any block opens
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


_KINDS = (types.FunctionType, type, staticmethod, classmethod, property)


def originals():
    """Return every function and class of mpitree's loaded modules and of their classes.

    Each read from its owner's own namespace: phase_times replaces none of them,
    while a block is open or after (the code reports its phases to the hook).
    """
    found = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("mpitree"):
            continue
        owners = [module]
        owners += [c for c in vars(module).values() if isinstance(c, type) and c.__module__ == name]
        for owner in owners:
            for attr, value in vars(owner).items():
                if isinstance(value, _KINDS):
                    found[(name, getattr(owner, "__qualname__", ""), attr)] = value
    return found


def unchanged(before):
    """Whether every callable in ``before`` is still its owner's (modules imported since aside)."""
    now = originals()
    return all(now.get(key) is value for key, value in before.items())


def timers_on():
    """Whether an observer is on the phase hook (some block is open)."""
    return _traffic.hook.observer is not None


def test_the_surface_is_small_and_every_name_documented():
    """At most 15 public names; a function or class has a docstring, data a ``#:`` comment."""
    assert len(extend.__all__) <= 15, extend.__all__
    source = inspect.getsource(extend)
    commented = {  # module-level assignments with a ``#:`` comment right above them
        node.targets[0].id
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign) and source.splitlines()[node.lineno - 2].startswith("#:")
    }
    for name in extend.__all__:
        obj = getattr(extend, name)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            assert inspect.getdoc(obj), name
        else:
            assert name in commented, name
    for name in vars(extend.tools):  # each tool named in the ``#:`` comment
        assert f"tools.{name}" in source.split("tools = _Tools(")[0], name


@pytest.mark.parametrize("strategy", mpitree.STRATEGIES)
def test_options_say_whether_the_strategy_moves_keys_and_values(strategy):
    """``Options.needs_kv``: what an adapter that merges records refuses (``ring``), as the
    strategy's own class says; ``"auto"`` never picks one."""
    from mpitree import _registry

    cls = _registry.REGISTRY.get(strategy)
    assert extend.Options.resolve(8, strategy).needs_kv is bool(cls and cls.needs_kv)
    assert extend.Options.resolve(8, "ring").needs_kv and not extend.Options.resolve(8).needs_kv


def test_phase_times_times_each_phase_and_leaves_nothing_behind():
    q, k, v = arrays()
    before = originals()
    with mpitree.DecodePlan(*SHAPE) as plan:
        plain = plan.decode(q, k, v)
        with extend.phase_times() as times:
            assert timers_on()
            timed = plan.decode(q, k, v)
            mpitree.tree_decode(q, k, v)
            assert unchanged(before)
        after = plan.decode(q, k, v)
    assert unchanged(before) and not timers_on()
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
        with extend.tools.full_checks():
            assert _decode_plan.FAST_PATH is False
            with extend.tools.full_checks():
                full = plan.decode(q, k, v)
            assert _decode_plan.FAST_PATH is False  # blocks nest
        assert _decode_plan.FAST_PATH is True
    np.testing.assert_array_equal(full, fast)


def test_plan_merger_merges_a_plans_records():
    q, k, v = arrays()
    with mpitree.DecodePlan(*SHAPE) as plan:
        merger = extend.tools.plan_merger(plan)
        rows, d = SHAPE[0] * SHAPE[1], SHAPE[3]
        assert merger.buf.shape == (rows + 1, d + 2)
        want = np.empty((rows, d + 2), np.float32)
        extend.tools.Prepared.of(q, k, v, d**-0.5).run(q, k, v, None, want)

        def fill(records):
            records[...] = want

        out = extend.finish(merger.merge(fill).reshape(1, SHAPE[1], 1, d + 2), q)
    np.testing.assert_allclose(out, reference(q, k, v), rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="DecodePlan"):
        extend.tools.plan_merger(object())


def test_prepared_runs_this_build_or_another():
    q, k, v = arrays(t=70)
    want = mpitree.local_state(q, k, v).records
    out = np.empty_like(want)
    extend.tools.Prepared.of(q, k, v, SHAPE[3] ** -0.5).run(q, k, v, None, out)
    np.testing.assert_array_equal(out, want)
    real = ctypes.CDLL(library_path())  # "another build", declared as a benchmark does
    real.mpitree_attend_f32.argtypes = [ctypes.c_void_p] * 6
    real.mpitree_attend_scratch.restype = ctypes.c_int64
    real.mpitree_attend_scratch.argtypes = [ctypes.c_int64] * 2
    used = []

    class Other:  # another build: the same functions, seen being called
        def mpitree_attend_scratch(self, *a):
            return real.mpitree_attend_scratch(*a)

        def mpitree_attend_f32(self, *a):
            used.append(1)
            return real.mpitree_attend_f32(*a)

    other = np.empty_like(want)
    extend.tools.Prepared.of(q, k, v, SHAPE[3] ** -0.5, lib=Other()).run(q, k, v, None, other)
    assert used == [1]
    np.testing.assert_array_equal(other, want)
    assert extend.tools.Prepared.of(q.astype(np.float64), k, v, 1.0) is None


def test_kernel_isa_read_seconds_and_traffic():
    assert isinstance(extend.tools.kernel_isa(), str) and extend.tools.kernel_isa()
    assert extend.tools.read_seconds(np.ones(1 << 16, np.float32)) > 0
    traffic = extend.traffic
    traffic.add(24)
    assert traffic.bytes >= 24 and traffic.calls >= 1
    traffic.reset()
    assert (traffic.bytes, traffic.calls) == (0, 0)


def test_read_seconds_refuses_what_it_cannot_stream():
    x = np.ones((64, 64), np.float32)
    with pytest.raises(ValueError, match="C-contiguous"):
        extend.tools.read_seconds(x[:, ::2])
    with pytest.raises(ValueError, match="C-contiguous"):
        extend.tools.read_seconds(x.T)
    with pytest.raises(TypeError, match="float32"):
        extend.tools.read_seconds(x.astype(np.float64))
    with pytest.raises(TypeError, match="float32"):
        extend.tools.read_seconds([1.0, 2.0])
    with pytest.raises(TypeError, match="float32"):
        extend.tools.read_seconds(np.ma.masked_array(x))


def test_phase_times_restores_everything_after_an_exception():
    before = originals()
    q, k, v = arrays()
    with pytest.raises(ZeroDivisionError):
        with extend.phase_times():
            mpitree.tree_decode(q, k, v)
            raise ZeroDivisionError
    assert unchanged(before) and not timers_on()


def test_phase_times_restores_when_blocks_close_out_of_order():
    before = originals()

    def timed_steps():  # a generator holding a block open
        with extend.phase_times() as t:
            yield t

    gen = timed_steps()
    outer = next(gen)
    q, k, v = arrays()
    with extend.phase_times() as inner:
        gen.close()  # the first block ends first: the timers stay on for this one
        assert timers_on()
        mpitree.tree_decode(q, k, v)
    assert unchanged(before) and not timers_on()
    assert len(inner["kernel"]) == 1 and "kernel" not in outer
    mpitree.tree_decode(q, k, v)
    assert len(inner["kernel"]) == 1  # nothing timed after the last block


def test_phase_times_blocks_of_two_threads_ending_in_either_order():
    before = originals()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def first():
        with extend.phase_times(), extend.tools.full_checks():
            a_in.set()
            b_in.wait(30)
        a_out.set()

    def second():
        a_in.wait(30)
        with extend.phase_times(), extend.tools.full_checks():
            b_in.set()
            a_out.wait(30)

    threads = [threading.Thread(target=f) for f in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert a_out.is_set() and not any(t.is_alive() for t in threads)
    assert unchanged(before) and not timers_on() and _decode_plan.FAST_PATH is True


def test_phase_times_same_block_reentered_counts_once_and_stays_on():
    before = originals()
    q, k, v = arrays()
    block = extend.phase_times()
    with block as times:
        with block:
            with block:
                mpitree.tree_decode(q, k, v)  # three entries of one dict: counted once
            mpitree.tree_decode(q, k, v)
        assert timers_on()  # the outer entry is still open
        mpitree.tree_decode(q, k, v)
    assert unchanged(before) and not timers_on()
    assert len(times["kernel"]) == 3 and len(times["agreement"]) == 3


def test_phase_times_enter_failing_midway_leaves_the_timers_off(monkeypatch):
    before = originals()

    def fail(dicts):
        raise ImportError("entering failed")

    monkeypatch.setattr(_timers, "_distinct", fail)
    with pytest.raises(ImportError):
        with extend.phase_times():
            pass
    monkeypatch.undo()
    assert unchanged(before) and not timers_on() and _timers._open == []
    q, k, v = arrays()
    with extend.phase_times() as times:  # and the next block works
        assert timers_on()
        mpitree.tree_decode(q, k, v)
    assert unchanged(before) and not timers_on()
    assert len(times["kernel"]) == 1


@pytest.mark.parametrize(
    "times",
    [[], {"agreement": ()}, {"merge": None}, {"kernel": 1.0}],
    ids=["list", "tuple", "none", "float"],
)
def test_phase_times_refuses_a_bad_dict_before_any_timer_is_on(times):
    before = originals()
    with pytest.raises(TypeError, match="phase_times"):
        extend.phase_times(times)
    assert unchanged(before) and not timers_on()


def test_phase_times_counts_a_validating_plans_agreement():
    q, k, v = arrays()
    with mpitree.DecodePlan(*SHAPE, validate=True) as plan:
        with extend.phase_times() as times:
            plan.decode(q, k, v)
    assert len(times["agreement"]) == 1


def test_phase_times_counts_an_adapters_extend_agree(monkeypatch):
    monkeypatch.setattr(_guard, "ENTRY_POINTS", {})  # the catalogue's registry stays as it was

    @extend.entry_point
    def my_call():
        return extend.agree(extend.check_comm(None), lambda: extend.Call({"rows": 4}))

    with extend.phase_times() as times:
        my_call()
    assert len(times["agreement"]) == 1


def test_phase_times_counts_an_agreement_by_any_name(monkeypatch):
    """The agreement times itself: a name bound before the block is timed too."""
    monkeypatch.setattr(_guard, "ENTRY_POINTS", {})

    @extend.entry_point
    def my_call():
        return bound_before(extend.check_comm(None), lambda: extend.Call({"rows": 4}))

    with extend.phase_times() as times:
        my_call()
    assert len(times["agreement"]) == 1


def test_the_observer_slot_is_the_bottom_and_nothing_patches():
    """``_traffic`` imports nothing of mpitree; no module of the package sets attributes by name."""
    root = Path(mpitree.__file__).parent
    tree = ast.parse((root / "_traffic.py").read_text())
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert all(isinstance(n, ast.ImportFrom) and n.module == "__future__" for n in imports)
    for path in [*root.rglob("*.py"), *(root.parent / "adapters").rglob("*.py")]:
        calls = [
            n
            for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setattr"
        ]
        assert not calls, path


def test_phase_times_counts_the_invariant_merge():
    q, k, v = arrays()
    before = vars(_invariant_merger.InvariantMerger)["merge"]
    with mpitree.DecodePlan(*SHAPE, deterministic="invariant") as plan:
        with extend.phase_times() as times:
            out = plan.decode(q, k, v, kv_start=0)
    assert len(times["merge"]) == 1 and len(times["kernel"]) >= 1
    assert vars(_invariant_merger.InvariantMerger)["merge"] is before
    np.testing.assert_allclose(out, reference(q, k, v), rtol=1e-5, atol=1e-5)


def test_full_checks_takes_the_full_path(monkeypatch):
    q, k, v = arrays()
    calls = []
    real = _steps.Step.check
    monkeypatch.setattr(_steps.Step, "check", lambda s, a: calls.append(1) or real(s, a))
    with mpitree.DecodePlan(*SHAPE) as plan:
        plan.decode(q, k, v)  # binds the kernel
        calls.clear()
        plan.decode(q, k, v)
        assert calls == []  # the fast path
        with extend.tools.full_checks():
            plan.decode(q, k, v)
        assert calls == [1]


def test_full_checks_same_instance_and_out_of_order():
    checks = extend.tools.full_checks()
    with checks:
        with checks:
            pass
        assert _decode_plan.FAST_PATH is False
    assert _decode_plan.FAST_PATH is True

    def checked():
        with extend.tools.full_checks():
            yield

    gen = checked()
    next(gen)
    with extend.tools.full_checks():
        gen.close()
        assert _decode_plan.FAST_PATH is False
    assert _decode_plan.FAST_PATH is True
