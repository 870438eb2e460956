"""DecodePlan across a decode loop, and allreduce_state."""

import numpy as np
import pytest
from helpers import gathered_identical, make_problem, world
from numpy.testing import assert_allclose

import mpitree
from mpitree import extend, reference_attention

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


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("strategy", ["allreduce", "ring"])
def test_plan_fast_path_matches_full_checks_and_revalidates(strategy):
    """Repeated steps skip re-validation; a changed layout or bad kv_len is still caught."""
    from mpitree import extend

    comm = world()
    rng = np.random.default_rng([5, comm.rank])
    b, hq, hkv, dim, cap = 2, 8, 2, 32, 40
    k_all = rng.standard_normal((b, hkv, cap, dim)).astype(np.float32)
    v_all = rng.standard_normal((b, hkv, cap, dim)).astype(np.float32)
    with mpitree.DecodePlan(b, hq, hkv, dim, comm=comm, strategy=strategy) as plan:
        for t in (10, 11, 12, 12):  # a growing view: same layout, T changes
            q = np.random.default_rng(t).standard_normal((b, hq, 1, dim)).astype(np.float32)
            kv_len = np.array([t, t - 3 - comm.rank % 2])
            k, v = k_all[:, :, :t], v_all[:, :, :t]
            fast = plan.decode(q, k, v, kv_len=kv_len)
            assert plan._step.kernel._layout is not None or strategy == "ring"
            with extend.tools.full_checks():
                full = plan.decode(q, k, v, kv_len=kv_len)
            assert np.array_equal(fast, full)
            assert np.array_equal(
                full, mpitree.tree_decode(q, k, v, kv_len=kv_len, strategy=strategy)
            )
        q = np.ones((b, hq, 1, dim), np.float32)
        k, v = k_all[:, :, :12], v_all[:, :, :12]
        plan.decode(q, k, v)
        bad = {0: np.array([3, 13]), 1: np.array([-1, 2])}.get(comm.rank, np.array([1, 2]))
        with pytest.raises(ValueError, match=r"kv_len|rank 0"):
            plan.decode(q, k, v, kv_len=bad if comm.rank < 2 else np.array([1, 2]))
        wrong = {  # a changed layout on the last rank: re-validated, agreed error everywhere
            "dtype": k.astype(np.float64),
            "D": k_all[..., :16],
            "v length": v_all[:, :, :11],
        }
        for name, kk in wrong.items():
            mine = (kk, v) if name != "v length" else (k, kk)
            args = mine if comm.rank == comm.size - 1 else (k, v)
            with pytest.raises((ValueError, TypeError)):
                plan.decode(q, *args)
        # strided K (a field of a wider buffer) and back: still right
        wide = np.repeat(k_all[:, :, :12], 2, axis=2)[:, :, ::2]
        assert_allclose(plan.decode(q, wide, v), plan.decode(q, k, v), atol=1e-6, rtol=0)


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("mask", [None, "head"])
def test_ring_plan_with_masks_and_rows(mask):
    """A ring plan's steps with per-head masks and two query rows: exact, fast path or not."""
    comm = world()
    sizes = [(5, 0, 9, 3)[r % 4] for r in range(comm.size)]
    prob = make_problem(7, sizes, batch=2, q_heads=8, kv_heads=2, q_len=2, kv_len=True, mask=mask)
    k, v, kw = prob.shard(comm.rank)
    ref_out, _ = prob.reference()
    with mpitree.DecodePlan(2, 8, 2, 16, q_len=2, strategy="ring", comm=comm) as plan:
        for _step in range(3):  # the second and third steps repeat the first's layout
            out = plan.decode(prob.q, k, v, **kw)
            assert_allclose(out, ref_out, atol=2e-5, rtol=0)
            assert gathered_identical(comm, out)


def compiled_expected(comm):
    """Whether a float32 plan's steps run as one compiled call here (test_library's build)."""
    from mpitree._library import native_lib
    from mpitree._strategies.allreduce import _PERSISTENT_OK

    return native_lib() is not None and (_PERSISTENT_OK or comm.size == 1)


def counted(plan):
    """Count ``plan``'s compiled calls (its bound step's ``run``) in the returned list."""
    runs = []
    compiled = plan._compiled
    if compiled is not None:
        run = compiled.run
        compiled.run = lambda out: runs.append(1) or run(out)
    return runs


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("strategy", ["auto", "allreduce", "allgather"])
def test_a_plans_compiled_step_gives_the_python_paths_bits(strategy):
    """A plan's fast form (its step bound once, one compiled call) over uneven shards,
    one of them empty, growing in place: the bits of the Python merge (the lane off) and
    of the full checks, step after step. Only a persistent all-reduce, or one rank, binds."""
    comm = world()
    cap, dim = 24, 16
    sizes = [(5, 0, 9, 3)[r % 4] for r in range(comm.size)]
    rng = np.random.default_rng([8, comm.rank])
    k_all = rng.standard_normal((2, 2, cap, dim)).astype(np.float32)
    v_all = rng.standard_normal((2, 2, cap, dim)).astype(np.float32)
    with (
        mpitree.DecodePlan(2, 8, 2, dim, comm=comm, strategy=strategy) as plan,
        mpitree.DecodePlan(2, 8, 2, dim, comm=comm, strategy=strategy) as python,
    ):
        python._compiled = None  # the Python merge, as every step ran before
        fused = plan._compiled is not None
        assert fused == (strategy != "allgather" and compiled_expected(comm)), plan.strategy
        runs = counted(plan)
        for step in range(6):
            t = sizes[comm.rank] + (step if comm.rank == comm.size - 1 else 0)
            k, v = k_all[:, :, :t], v_all[:, :, :t]  # the same layout as T grows
            q = np.random.default_rng([9, step]).standard_normal((2, 8, 1, dim))
            q = q.astype(np.float32)
            got, want = plan.decode(q, k, v), python.decode(q, k, v)
            (out, lse), (out_py, lse_py) = (
                x.decode(q, k, v, return_lse=True) for x in (plan, python)
            )
            with extend.tools.full_checks():
                full = plan.decode(q, k, v)  # binds its kernel again: the step re-aimed
            assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
            assert np.array_equal(got, want) and np.array_equal(got, full)
            assert np.array_equal(out, got) and np.array_equal(out_py, got)
            assert np.array_equal(lse, lse_py)
            assert lse.dtype == np.float32 and lse.shape == (2, 8, 1)
            assert gathered_identical(comm, got)
            ref, _ = reference_attention(q, *gathered_shards(comm, k, v))
            assert_allclose(got, ref, atol=2e-5, rtol=0)
    assert len(runs) == (11 if fused else 0), runs  # the first step checks, then binds


KV_LENS = {  # kv_len as a fixed-capacity cache's caller may hold it
    "int64": lambda x: x.astype(np.int64),
    "int32": lambda x: x.astype(np.int32),
    "strided int64": lambda x: np.repeat(x.astype(np.int64), 2)[::2],
}


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("lengths", list(KV_LENS))
@pytest.mark.parametrize("strategy", ["auto", "allgather"])
def test_a_plans_compiled_step_with_kv_len_gives_the_python_paths_bits(lengths, strategy):
    """A fixed-capacity cache: every step passes the whole buffer and ``kv_len`` (per row,
    per rank; 0 and the capacity included), NaN/Inf past it. The compiled call runs
    (after the first step, which checks and binds) and gives the Python merge's bits
    and the full checks', lse too; a step without kv_len re-binds, and back."""
    comm = world()
    b, hq, hkv, dim, cap = 3, 8, 2, 16, 12
    rng = np.random.default_rng([11, comm.rank])
    k = rng.standard_normal((b, hkv, cap, dim)).astype(np.float32)
    v = rng.standard_normal((b, hkv, cap, dim)).astype(np.float32)
    clean_k, clean_v = k.copy(), v.copy()
    with (
        mpitree.DecodePlan(b, hq, hkv, dim, comm=comm, strategy=strategy) as plan,
        mpitree.DecodePlan(b, hq, hkv, dim, comm=comm, strategy=strategy) as python,
    ):
        python._compiled = None
        fused = plan._compiled is not None
        assert fused == (strategy != "allgather" and compiled_expected(comm)), plan.strategy
        runs = counted(plan)
        for step in range(5):
            used = np.array([(3 * comm.rank + step) % (cap + 1), 0, cap]) if step != 4 else None
            k[...], v[...] = clean_k, clean_v
            if used is not None:  # garbage in every slot past a row's kv_len
                hidden = np.arange(cap)[None, :] >= used[:, None]
                k[np.broadcast_to(hidden[:, None, :, None], k.shape)] = np.nan
                v[np.broadcast_to(hidden[:, None, :, None], v.shape)] = np.inf
            kw = {} if used is None else {"kv_len": KV_LENS[lengths](used)}
            q = np.random.default_rng([12, step]).standard_normal((b, hq, 1, dim))
            q = q.astype(np.float32)
            out, lse = plan.decode(q, k, v, return_lse=True, **kw)
            out_py, lse_py = python.decode(q, k, v, return_lse=True, **kw)
            got = plan.decode(q, k, v, **kw)
            with extend.tools.full_checks():
                full = plan.decode(q, k, v, **kw)  # binds its kernel again: the step re-aimed
            assert not np.isnan(out).any() and out.shape == (b, hq, 1, dim)
            assert np.array_equal(out, out_py) and np.array_equal(out, got)
            assert np.array_equal(out, full) and np.array_equal(lse, lse_py)
            assert gathered_identical(comm, out)
            n = cap if used is None else used
            rows = np.arange(cap)[None, :] < np.broadcast_to(n, (b,))[:, None]
            visible = np.concatenate(comm.allgather(rows), axis=1)[:, None, None]
            shards = gathered_shards(comm, clean_k, clean_v)
            ref, ref_lse = reference_attention(q, *shards, visible=visible)
            assert_allclose(out, ref, atol=2e-5, rtol=0)
            seen = np.isfinite(ref_lse)
            assert_allclose(lse[seen], ref_lse[seen], atol=1e-5, rtol=1e-6)
            assert (lse[~seen] == -np.inf).all() and not out[~seen].any()
    # steps 0 and 4 (a new layout) check and bind first, then run compiled: 1 + 2 * 3 + 1
    assert len(runs) == (8 if fused else 0), runs


def gathered_shards(comm, k, v):
    """Every rank's K and V, concatenated in rank order along T."""
    ks, vs = comm.allgather(np.ascontiguousarray(k)), comm.allgather(np.ascontiguousarray(v))
    return np.concatenate(ks, axis=2), np.concatenate(vs, axis=2)


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("lengths", [False, True])
@pytest.mark.parametrize("bad", [0, -1])
def test_bad_input_on_one_rank_beside_compiled_steps_raises_everywhere(bad, lengths):
    """A rank whose step fails its checks runs the flagged Python merge while the others
    run their compiled call: every rank raises (no hang), then the plan steps on, exact.
    ``lengths``: the good ranks' steps pass a valid ``kv_len`` (a fixed-capacity cache's),
    so a bad ``kv_len`` of the same dtype and shape is refused by the lane itself."""
    comm = world()
    bad = bad % comm.size
    dim, t = 16, 4 + comm.rank
    rng = np.random.default_rng([4, comm.rank])
    k_all = rng.standard_normal((1, 2, 16, dim)).astype(np.float32)
    v_all = rng.standard_normal((1, 2, 16, dim)).astype(np.float32)
    k, v = k_all[:, :, :t], v_all[:, :, :t]
    q = np.random.default_rng(1).standard_normal((1, 4, 1, dim)).astype(np.float32)
    wrong = {  # (q, k, v) and keywords on the bad rank
        "dtype": lambda: ((q, k.astype(np.float64), v), {}),
        "head dim": lambda: ((q, k_all[..., :8], v_all[..., :8]), {}),
        "K and V lengths": lambda: ((q, k, v_all[:, :, : t + 1]), {}),
        "q heads": lambda: ((np.ones((1, 8, 1, dim), np.float32), k, v), {}),
        "not an array": lambda: ((q, "k", v), {}),
        "kv_len too long": lambda: ((q, k, v), {"kv_len": np.array([t + 1])}),
        "kv_len negative": lambda: ((q, k, v), {"kv_len": np.array([-1])}),
        "kv_len far too long": lambda: ((q, k, v), {"kv_len": np.array([2**62])}),
        "kv_len shape": lambda: ((q, k, v), {"kv_len": np.array([1, 2])}),
        "kv_len 2-d": lambda: ((q, k, v), {"kv_len": np.array([[1]])}),
        "kv_len dtype": lambda: ((q, k, v), {"kv_len": np.array([1.0])}),
        "mask shape": lambda: ((q, k, v), {"mask": np.ones((1, 4, 1, t + 2), bool)}),
    }
    good = {"kv_len": np.array([t - 1 - comm.rank % 2])} if lengths else {}
    with mpitree.DecodePlan(1, 4, 2, dim, comm=comm) as plan:
        first = plan.decode(q, k, v, **good)  # the full checks bind the kernel
        runs = counted(plan)
        for name, args in wrong.items():
            mine, kw = args() if comm.rank == bad else ((q, k, v), good)
            with pytest.raises(Exception) as raised:
                plan.decode(*mine, **kw)
            if comm.rank == bad:
                assert not isinstance(raised.value, mpitree.RankError), name
            else:
                assert isinstance(raised.value, mpitree.RankError), name
                assert f"rank {bad}" in str(raised.value), name
            # the plan still works
            assert np.array_equal(plan.decode(q, k, v, **good), first), name
    # a good rank's steps all run compiled; the bad rank's failed checks unbind its
    # kernel, so its next step takes the full checks again (and binds)
    compiled = plan._compiled is not None and comm.rank != bad
    assert len(runs) == (2 * len(wrong) if compiled else 0), runs


@pytest.mark.parallel(nprocs=NPROCS)
def test_a_plans_step_after_free_or_under_phase_times_takes_another_path():
    """Under ``phase_times`` a warm step takes the timed Python path; after ``free`` its
    merge is a blocking one (the compiled call's request is gone). The same bits."""
    comm = world()
    rng = np.random.default_rng([6, comm.rank])
    q = np.random.default_rng(6).standard_normal((1, 4, 1, 8)).astype(np.float32)
    k = rng.standard_normal((1, 2, 3, 8)).astype(np.float32)
    v = rng.standard_normal((1, 2, 3, 8)).astype(np.float32)
    plan = mpitree.DecodePlan(1, 4, 2, 8, comm=comm)
    want = plan.decode(q, k, v)
    runs = counted(plan)
    with extend.phase_times() as times:
        timed = plan.decode(q, k, v)
    assert len(times["merge"]) == 1 and len(times["kernel"]) == 1 and not runs
    assert np.array_equal(plan.decode(q, k, v), want)
    plan.free()
    assert np.array_equal(timed, want) and np.array_equal(plan.decode(q, k, v), want)
    calls = 2 if comm.size == 1 else 1  # one rank: no request, the compiled call still runs
    assert len(runs) == (calls if plan._compiled is not None else 0), runs
