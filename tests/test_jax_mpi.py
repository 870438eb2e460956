"""mpitree.adapters.jax under real ranks: exact, jitted, differentiable, recompilation-free."""

import dataclasses
import gc
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import counted_lane_calls, lane_expected, make_problem, world
from numpy.testing import assert_allclose

import mpitree
from mpitree._library import StepLocal

jax.config.update("jax_enable_x64", True)  # float64 inputs and the float64 gradient reference

from mpitree.adapters import _jax_ffi  # noqa: E402
from mpitree.adapters import jax as mj  # noqa: E402

DTYPES = {"float32": 2e-5, "float64": 1e-12, "float16": 2e-3, "bfloat16": 2e-2}
CASES = {
    "gqa": dict(q_heads=8, kv_heads=2),
    "positions": dict(batch=3, q_len=3, positions=True),
    "mask_per_head_ragged": dict(q_len=2, mask="head", kv_len=True),
}
SIZES = [5, 0, 7, 3]  # rank r holds SIZES[r] keys: ragged, and an empty shard from p = 2


def sizes():
    return SIZES[: world().size]


def jax_kwargs(kw):
    return {name: None if x is None else jnp.asarray(x) for name, x in kw.items()}


def rounded(prob, dtype):
    """Round the problem's inputs to ``dtype`` (the reference sees what the ranks see)."""
    for name in ("q", "k", "v"):
        x = np.asarray(jnp.asarray(getattr(prob, name), dtype).astype(jnp.float64))
        setattr(prob, name, x)
    return prob


# every dtype jitted; eagerly (the same code op by op: slow to warm up) the masked case
RUNS = [(case, dtype, True) for case in CASES for dtype in DTYPES]
RUNS += [("mask_per_head_ragged", "float32", False)]


@pytest.mark.parallel(nprocs=[1, 2, 3, 4])
@pytest.mark.parametrize(
    "case, dtype, jit", RUNS, ids=[f"{c}-{d}-{'jit' if j else 'eager'}" for c, d, j in RUNS]
)
def test_exact_against_float64_reference(case, dtype, jit):
    rank = world().rank
    prob = rounded(make_problem(3, sizes(), dtype=np.float64, **CASES[case]), dtype)
    k, v, kw = prob.shard(rank)
    args = [jnp.asarray(x, dtype) for x in (prob.q, k, v)]
    decode = mj.tree_decode
    if jit:
        decode = jax.jit(mj.tree_decode, static_argnames="return_lse")
    out, lse = decode(*args, return_lse=True, **jax_kwargs(kw))
    assert out.dtype == jnp.dtype(dtype) and lse.dtype == jnp.float32
    ref, ref_lse = prob.reference()
    got = np.asarray(out.astype(jnp.float64))
    assert not np.isnan(got).any()
    assert_allclose(got, ref, atol=DTYPES[dtype], rtol=0)
    fin = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(np.asarray(lse)), fin)
    assert_allclose(np.asarray(lse)[fin], ref_lse[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.parallel(nprocs=[1, 2, 3, 4])
@pytest.mark.parametrize("local", ["kernel", "xla"])
def test_float32_local_state_kernel_or_xla(local, monkeypatch):
    """float32 runs the C kernel's custom call by default, XLA's attention when switched."""
    monkeypatch.setenv(mj.LOCAL_ENV, local)
    rank = world().rank
    prob = rounded(
        make_problem(5, sizes(), dtype=np.float64, **CASES["mask_per_head_ragged"]), "float32"
    )
    k, v, kw = prob.shard(rank)
    args = [jnp.asarray(x, jnp.float32) for x in (prob.q, k, v)]
    kw = jax_kwargs(kw)
    decode = jax.jit(lambda q, k, v, kw: mj.tree_decode(q, k, v, return_lse=True, **kw))
    uses_kernel = local == "kernel" and sizes()[rank] > 0
    assert kernel_calls(decode, *args, kw) == int(uses_kernel)
    out, lse = decode(*args, kw)
    ref, ref_lse = prob.reference()
    assert_allclose(np.asarray(out, np.float64), ref, atol=DTYPES["float32"], rtol=0)
    fin = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(np.asarray(lse)), fin)
    assert_allclose(np.asarray(lse)[fin], ref_lse[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("local", ["float64", "float32 xla"])
def test_visible_nan_value_stays_in_its_column_beside_garbage(local, monkeypatch):
    """A visible key's NaN value makes its own output column NaN, never the others.

    The last key scores -inf (weight 0: ``0 * NaN`` is NaN) and has a NaN in column
    2; each shard also has unused slots full of NaN/Inf, excluded by ``kv_len``.
    XLA's local state took ``p @ v`` over every key for a row that saw a non-finite
    value, so the excluded garbage made every column NaN.
    """
    monkeypatch.setenv(mj.LOCAL_ENV, "xla")
    dtype = np.float64 if local == "float64" else np.float32
    rank, sz = world().rank, [2 + r for r in range(world().size)]
    rng = np.random.default_rng(3)
    n = sum(sz)
    q = np.abs(rng.standard_normal((1, 4, 2, 8))) + 0.1  # positive: a -inf key scores -inf
    k, v = rng.standard_normal((2, 1, 2, n, 8))
    k[:, :, -1], v[:, :, -1, 2] = -np.inf, np.nan
    lo = sum(sz[:rank])
    garbage = np.full((1, 2, 3, 8), np.nan)
    ks, vs = (np.concatenate([x[:, :, lo : lo + sz[rank]], garbage], 2) for x in (k, v))
    args = [jnp.asarray(x, dtype) for x in (q, ks, vs)]
    decode = lambda q, k, v, n: mj.tree_decode(q, k, v, kv_len=n, return_lse=True)  # noqa: E731
    for run in (jax.jit(decode), decode):
        out, lse = run(*args, jnp.asarray([sz[rank]]))
        ref, ref_lse = mpitree.reference_attention(q, k, v)
        got = np.asarray(out, np.float64)
        assert np.array_equal(np.isnan(got), np.isnan(ref)) and np.isnan(ref[..., 2]).all()
        keep = ~np.isnan(ref)
        assert_allclose(got[keep], ref[keep], atol=DTYPES[np.dtype(dtype).name], rtol=0)
        assert_allclose(np.asarray(lse), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("strategy", ["allreduce", "allreduce3", "allgather", "hierarchical"])
def test_every_merging_strategy(strategy):
    rank = world().rank
    prob = make_problem(5, sizes(), q_heads=8, kv_heads=2)
    k, v, _ = prob.shard(rank)
    step = jax.jit(lambda q, k, v: mj.tree_decode(q, k, v, strategy=strategy))
    out = step(*(jnp.asarray(x) for x in (prob.q, k, v)))
    assert_allclose(np.asarray(out), prob.reference()[0], atol=2e-5, rtol=0)


def garbage_problem(dtype):
    """Positions, GQA and kv_len, NaN/Inf in every shard's unused slots; every row sees keys."""
    rank = world().rank
    prob = make_problem(7, sizes(), batch=2, q_heads=4, kv_heads=2, q_len=2, positions=True)
    lens = prob.kv_len = [rng_lens(s, r) for r, s in enumerate(prob.sizes)]
    k, v, kw = prob.shard(rank)
    k, v = k.copy(), v.copy()
    for b, n in enumerate(lens[rank]):
        k[b, :, n:], v[b, :, n:] = np.nan, np.inf
    kw["kv_len"] = lens[rank]
    prob.q, prob.k, prob.v = (np.asarray(x, dtype) for x in (prob.q, prob.k, prob.v))
    return prob, np.asarray(k, dtype), np.asarray(v, dtype), kw


def rng_lens(size, rank):
    """Per-batch valid lengths; rank 0 keeps key 0, which every query's position sees."""
    lens = np.random.default_rng(11 + rank).integers(0, size + 1, size=2)
    return np.maximum(lens, 1) if rank == 0 else lens


def naive_attention(q, k, v, visible, scale):
    """Single-process softmax attention over all keys (GQA by repetition), autodiff's reference."""
    g = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, g, 1), jnp.repeat(v, g, 1)
    s = jnp.where(visible, scale * q @ jnp.swapaxes(k, -1, -2), -jnp.inf)
    return jax.nn.softmax(s, -1) @ v, jax.nn.logsumexp(s, -1)


@pytest.mark.parallel(nprocs=[1, 2, 3, 4])
@pytest.mark.parametrize("dtype, tol", [("float64", 1e-10), ("float32", 2e-5)])
def test_grad_equals_single_process_grad(dtype, tol):
    """jax.grad through the sharded decode (output and lse) equals autodiff of one process."""
    rank = world().rank
    prob, k, v, kw = garbage_problem(dtype)
    lo = sum(prob.sizes[:rank])
    hi = lo + prob.sizes[rank]
    scale = 1 / np.sqrt(prob.q.shape[-1])
    rng = np.random.default_rng(2)
    w_out = jnp.asarray(rng.standard_normal(prob.q.shape), dtype)
    w_lse = jnp.asarray(rng.standard_normal(prob.q.shape[:3]), jnp.float32)

    def loss(q, k, v):
        out, lse = mj.tree_decode(q, k, v, return_lse=True, **jax_kwargs(kw))
        return jnp.sum(out * w_out) + jnp.sum(lse * w_lse)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*(jnp.asarray(x) for x in (prob.q, k, v)))

    def ref_loss(q, k, v):
        out, lse = naive_attention(q, k, v, prob.visible(), scale)
        return jnp.sum(out * w_out.astype(jnp.float64)) + jnp.sum(lse * w_lse)

    full = (np.asarray(x, np.float64) for x in (prob.q, prob.k, prob.v))
    want = jax.jit(jax.grad(ref_loss, argnums=(0, 1, 2)))(*full)
    err = 0.0
    for got, ref in zip(grads, (want[0], want[1][:, :, lo:hi], want[2][:, :, lo:hi]), strict=True):
        got = np.asarray(got, np.float64)
        assert np.isfinite(got).all()
        err = max(err, float(np.abs(got - np.asarray(ref)).max(initial=0)))
    assert err < tol, err


@pytest.mark.parallel(nprocs=[1, 2, 3, 4])
def test_decode_loop_compiles_once():
    """100 jitted steps over preallocated ragged shards: one trace, one XLA compilation, exact."""
    comm = world()
    rank, size = comm.rank, comm.size
    steps, b, hq, hkv, d = 100, 1, 4, 2, 16
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((b, hkv, steps, d)).astype(np.float32)
    values = rng.standard_normal((b, hkv, steps, d)).astype(np.float32)
    queries = rng.standard_normal((steps, b, hq, 1, d)).astype(np.float32)
    owner = np.arange(steps) % size  # token i lives on rank i % p; capacities differ by rank
    mine = np.flatnonzero(owner == rank)
    capacity = len(mine) + rank
    k_cache = np.zeros((b, hkv, capacity, d), np.float32)
    v_cache = np.full((b, hkv, capacity, d), np.nan, np.float32)  # unused slots: garbage
    k_cache[:, :, : len(mine)], v_cache[:, :, : len(mine)] = keys[:, :, mine], values[:, :, mine]
    traces = []

    @jax.jit
    def step(q, k, v, n):
        traces.append(1)
        return mj.tree_decode(q, k, v, kv_len=n)

    k_cache, v_cache = jnp.asarray(k_cache), jnp.asarray(v_cache)
    filled = np.cumsum(owner[:, None] == rank, axis=0).astype(np.int32)  # (steps, 1)
    inputs = [(jnp.asarray(queries[i]), jnp.asarray(np.repeat(filled[i], b))) for i in range(steps)]
    compiles = []

    def listen(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        for i, (q, n) in enumerate(inputs):
            out = step(q, k_cache, v_cache, n)
            if i in (0, 1, 37, steps - 1):
                ref = mpitree.reference_attention(
                    queries[i], keys[:, :, : i + 1], values[:, :, : i + 1]
                )
                assert_allclose(np.asarray(out), ref[0], atol=2e-5, rtol=0)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert len(traces) == 1 and step._cache_size() == 1 and len(compiles) == 1, compiles


@pytest.mark.parallel(nprocs=[1, 2, 3, 4])
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_a_recurring_merge_is_one_compiled_call_exactly(jit, monkeypatch):
    """From its second call on, a step's merge runs as the core's one compiled step
    (the agreement, the records copied in, the merge, copied out): the same bits as
    its guarded calls, exact against the reference over ragged and empty shards."""
    calls = counted_lane_calls(monkeypatch, StepLocal.COPY)
    prob = make_problem(9, sizes(), q_heads=8, kv_heads=2, kv_len=True)
    k, v, kw = prob.shard(world().rank)
    decode = jax.jit(mj.tree_decode) if jit else mj.tree_decode
    args = [jnp.asarray(x) for x in (prob.q, k, v)]
    outs = [np.asarray(decode(*args, **jax_kwargs(kw))) for _ in range(5)]
    assert_allclose(outs[0], prob.reference()[0], atol=2e-5, rtol=0)
    for out in outs[1:]:
        assert np.array_equal(out, outs[0])
    assert len(calls) == (3 if lane_expected() else 0)


@pytest.mark.parallel(nprocs=[2, 3])
def test_a_failing_rank_after_the_merge_recurred_raises_on_every_rank(monkeypatch):
    """The last rank's kv_len is out of range (checked in the program) after the merge
    became one compiled call on every rank: every rank raises, and the next call works."""
    calls = counted_lane_calls(monkeypatch, StepLocal.COPY)
    comm = world()
    prob = make_problem(1, [4] * comm.size)
    k, v, _ = prob.shard(comm.rank)
    step = jax.jit(lambda q, k, v, n: mj.tree_decode(q, k, v, kv_len=n))
    args = [jnp.asarray(x) for x in (prob.q, k, v)]
    good = jnp.asarray(np.array([4, 4]))
    for _ in range(3):
        out = step(*args, good)
    bad = np.array([4, 9]) if comm.rank == comm.size - 1 else np.array([4, 4])
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        step(*args, jnp.asarray(bad)).block_until_ready()
    last = str(info.value).strip().splitlines()[-1]
    if comm.rank == comm.size - 1:
        assert last.startswith("ValueError: kv_len must lie in [0, 4]"), last
    else:
        assert last.startswith(f"RankError: mpitree: invalid input on rank {comm.size - 1}"), last
    assert np.array_equal(np.asarray(step(*args, good)), np.asarray(out))
    assert len(calls) == (1 + (comm.rank != comm.size - 1) + 1 if lane_expected() else 0)


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize("bad", ["q heads", "kv_len too long", "strategy ring", "scale differs"])
def test_bad_input_inside_jit_raises_on_every_rank(bad):
    """Traced checks and in-program value checks: every rank's jitted call raises, none hangs."""
    comm = world()
    is_bad = comm.rank == comm.size - 1
    prob = make_problem(1, [4] * comm.size)
    k, v, _ = prob.shard(comm.rank)
    q, kv_len, options = prob.q, np.array([4, 4]), {}
    if is_bad and bad == "q heads":
        q = q[:, :3]  # 3 query heads over 2 kv heads
    if is_bad and bad == "kv_len too long":
        kv_len = np.array([4, 9])
    if is_bad and bad == "strategy ring":
        options = dict(strategy="ring")
    if is_bad and bad == "scale differs":
        options = dict(scale=0.5)
    step = jax.jit(lambda q, k, v, n: mj.tree_decode(q, k, v, kv_len=n, **options))
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        step(*(jnp.asarray(x) for x in (q, k, v, kv_len))).block_until_ready()
    good = jax.jit(mj.tree_decode)(*(jnp.asarray(x) for x in (prob.q, k, v)))
    assert_allclose(np.asarray(good), prob.reference()[0], atol=2e-5, rtol=0)
    last = str(info.value).strip().splitlines()[-1]  # the host step's own exception
    if bad == "scale differs":
        assert last.startswith("ValueError: mpitree: ranks disagree on scale"), last
    elif is_bad:
        assert last.startswith("ValueError: ") and "mpitree" not in last, last
    else:
        assert last.startswith(f"RankError: mpitree: invalid input on rank {comm.size - 1}"), last


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize("form", ["jit", "vmap", "eager"])
def test_kernel_error_raises_on_every_rank(form, monkeypatch):
    """The kernel's custom call failing on one rank: every rank raises, none waits in the merge."""
    comm = world()
    is_bad = comm.rank == comm.size - 1
    prob = make_problem(1, [4] * comm.size)
    k, v, _ = prob.shard(comm.rank)
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (prob.q, k, v))
    if is_bad:

        def fail(*args):
            raise MemoryError("no room")

        monkeypatch.setattr(_jax_ffi, "attend", fail)
    decode = {
        "jit": jax.jit(mj.tree_decode),
        "vmap": jax.jit(jax.vmap(mj.tree_decode, in_axes=(0, None, None))),
        "eager": mj.tree_decode,
    }[form]
    args = (q[None].repeat(2, 0), k, v) if form == "vmap" else (q, k, v)
    with pytest.raises(Exception) as info:
        decode(*args).block_until_ready()
    monkeypatch.undo()
    good = jax.jit(mj.tree_decode)(q, k, v)
    assert_allclose(np.asarray(good), prob.reference()[0], atol=2e-5, rtol=0)
    cause = "mpitree: local kernel failed: MemoryError: no room"
    kind, message = "RuntimeError", cause
    if not is_bad:
        message = f"mpitree: invalid input on rank {comm.size - 1}: {kind}: {cause}"
        kind = "RankError"
    if form == "eager":
        assert (type(info.value).__name__, str(info.value)) == (kind, message)
    else:
        assert isinstance(info.value, jax.errors.JaxRuntimeError), repr(info.value)
        last = str(info.value).strip().splitlines()[-1]
        assert last == f"{kind}: {message}", last


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_an_eager_local_error_on_one_rank_raises_on_every_rank(phase, monkeypatch):
    """Eagerly, XLA's local part (the path of float16, float64 and accelerator arrays) failing
    on one rank: every rank raises, and a rank holding no keys does not wait in the merge."""
    comm = world()
    is_bad = comm.rank == 0
    prob = make_problem(2, [4] + [0] * (comm.size - 1))  # the others hold no keys
    k, v, _ = prob.shard(comm.rank)
    q, k, v = (jnp.asarray(x, jnp.float16) for x in (prob.q, k, v))
    if is_bad:

        def fail(*args):
            raise MemoryError("no room on the device")

        monkeypatch.setattr(mj, "_local_records" if phase == "forward" else "_scores", fail)
    call = {
        "forward": lambda: mj.tree_decode(q, k, v),
        "backward": lambda: jax.grad(lambda q: mj.tree_decode(q, k, v).sum())(q),
    }[phase]
    with pytest.raises(MemoryError if is_bad else mpitree.RankError, match="no room"):
        call()
    monkeypatch.undo()
    assert np.isfinite(np.asarray(call(), np.float32)).all()  # the next call works


@pytest.mark.parallel(nprocs=[1, 2])
def test_reloading_the_ffi_module_keeps_its_callback():
    """importlib.reload (IPython's autoreload) keeps the callback XLA calls alive: no crash."""
    importlib.reload(_jax_ffi)
    gc.collect()
    prob = make_problem(2, sizes())
    k, v, _ = prob.shard(world().rank)
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (prob.q, k, v))
    out = jax.jit(lambda q, k, v: mj.tree_decode(q, k + 0, v))(q, k, v)
    assert_allclose(np.asarray(out), prob.reference()[0], atol=2e-5, rtol=0)


@pytest.mark.parallel(nprocs=[2, 3])
def test_pmax_psum_peer_check():
    """The Zyphra reference's collective pattern (MAX of m, then SUM of rescaled d and n) agrees.

    Each rank's local (m, d, n) from the adapter's own local step, merged by the
    paper's pmax/psum written with mpi4py, equals the adapter's merged output.
    """
    from mpi4py import MPI

    comm = world()
    prob = make_problem(9, [3 + 2 * r for r in range(comm.size)], q_heads=8, kv_heads=2, q_len=2)
    k, v, _ = prob.shard(comm.rank)
    rec = mpitree.local_state(prob.q, k, v).records.astype(np.float64)
    m = np.empty(rec.shape[:-1])
    comm.Allreduce(np.ascontiguousarray(rec[..., 0]), m, op=MPI.MAX)  # pmax
    w = np.exp(rec[..., 0] - m)
    dn = np.ascontiguousarray(rec[..., 1:] * w[..., None])
    comm.Allreduce(MPI.IN_PLACE, dn, op=MPI.SUM)  # psum of the rescaled (d, n)
    d, n = dn[..., 0], dn[..., 1:]
    out, lse = jax.jit(mj.tree_decode, static_argnames="return_lse")(
        *(jnp.asarray(x) for x in (prob.q, k, v)), return_lse=True
    )
    assert_allclose(np.asarray(out), n / d[..., None], atol=2e-6, rtol=0)
    assert_allclose(np.asarray(lse), m + np.log(d), atol=2e-6, rtol=0)


def stacked(case, count, rank):
    """``count`` problems of one case (seeds differ, shards alike): the problems and the
    rank's q, k, v and masking arguments stacked on a new leading axis."""
    probs = [make_problem(20 + i, sizes(), dtype=np.float64, **CASES[case]) for i in range(count)]
    shards = [prob.shard(rank) for prob in probs]
    q = np.stack([prob.q for prob in probs])
    k, v = (np.stack([shard[j] for shard in shards]) for j in (0, 1))
    names = [name for name, x in shards[0][2].items() if x is not None]
    kw = {name: np.stack([shard[2][name] for shard in shards]) for name in names}
    return probs, q, k, v, kw


def callbacks(fn, *args):
    """How many merge calls (collective steps) one call of ``fn`` runs."""
    return str(jax.make_jaxpr(fn)(*args)).count("mpitree_merge[")


VMAPS = [(case, "jit") for case in CASES] + [
    ("gqa", "eager"),
    ("positions", "q only, axis 1"),
    ("gqa", "nested"),
]


def kernel_calls(fn, *args):
    """How many C-kernel custom calls (the float32 forward's local state) ``fn`` runs."""
    return str(jax.make_jaxpr(fn)(*args)).count("mpitree_attend_f32")


def check_vmap(case, form, dtype, tol):
    """A vmapped axis becomes extra rows of the one merge: exact per element, one callback."""
    rank = world().rank
    probs, q, k, v, kw = stacked(case, 4, rank)
    for prob in probs:
        rounded(prob, dtype)
    q, k, v = (np.asarray(jnp.asarray(x, dtype)) for x in (q, k, v))
    names = list(kw)

    def decode(q, k, v, *masking):
        return mj.tree_decode(q, k, v, return_lse=True, **dict(zip(names, masking, strict=True)))

    args = [jnp.asarray(x) for x in (q, k, v, *kw.values())]
    want = [prob.reference() for prob in probs]
    if form == "q only, axis 1":  # q mapped along its axis 1; element 0's K/V for every q
        fn = jax.jit(jax.vmap(decode, in_axes=(1, *[None] * (len(args) - 1)), out_axes=2))
        args = [jnp.moveaxis(args[0], 0, 1), *(x[0] for x in args[1:])]
        want = [dataclasses.replace(probs[0], q=prob.q).reference() for prob in probs]
        unstack = lambda x, i: x[:, :, i]  # noqa: E731
    elif form == "nested":  # (2, 2) elements
        fn = jax.jit(jax.vmap(jax.vmap(decode)))
        args = [x.reshape(2, 2, *x.shape[1:]) for x in args]
        unstack = lambda x, i: x[i // 2, i % 2]  # noqa: E731
    else:
        fn = jax.vmap(decode) if form == "eager" else jax.jit(jax.vmap(decode))
        unstack = lambda x, i: x[i]  # noqa: E731
    assert callbacks(fn, *args) == 1
    has_keys = sizes()[rank] > 0
    assert kernel_calls(fn, *args) == (1 if dtype == "float32" and has_keys else 0)
    out, lse = fn(*args)
    for i, (ref, ref_lse) in enumerate(want):
        got, got_lse = np.asarray(unstack(out, i)), np.asarray(unstack(lse, i))
        assert_allclose(got, ref, atol=tol, rtol=0)
        fin = np.isfinite(ref_lse)
        assert np.array_equal(np.isfinite(got_lse), fin)
        lse_tol = 1e-6 if dtype == "float64" else 1e-5  # the lse is float32
        assert_allclose(got_lse[fin], ref_lse[fin], rtol=lse_tol, atol=lse_tol)


@pytest.mark.parallel(nprocs=[1, 2, 3, 4])
@pytest.mark.parametrize("case, form", VMAPS, ids=[f"{c}-{f}" for c, f in VMAPS])
def test_vmap_exact_against_float64_reference(case, form):
    """float64: XLA's local attention under jax.vmap."""
    check_vmap(case, form, "float64", 1e-12)


KERNEL_VMAPS = [("mask_per_head_ragged", "jit"), ("positions", "q only, axis 1")]
KERNEL_VMAPS += [("gqa", "nested")]


@pytest.mark.parallel(nprocs=[1, 2, 3, 4])
@pytest.mark.parametrize("case, form", KERNEL_VMAPS, ids=[f"{c}-{f}" for c, f in KERNEL_VMAPS])
def test_vmap_float32_runs_the_c_kernel(case, form):
    """float32: the C kernel's custom call, its vmapped axes folded into the kernel's batch."""
    check_vmap(case, form, "float32", DTYPES["float32"])


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_vmap_over_queries_reads_the_shared_cache_in_place():
    """Only q mapped: its axis becomes query rows of one kernel call, K/V never broadcast."""
    rank = world().rank
    prob = make_problem(6, sizes(), dtype=np.float64, **CASES["mask_per_head_ragged"])
    k, v, kw = prob.shard(rank)
    queries = np.stack([prob.q * (1 + i / 4) for i in range(4)])
    args = [jnp.asarray(x, jnp.float32) for x in (queries, k, v)]
    kw = jax_kwargs(kw)
    shared = (0, None, None, None)  # K/V and masking shared by every query
    decode = jax.jit(jax.vmap(lambda q, k, v, kw: mj.tree_decode(q, k, v, **kw), shared))
    out = np.asarray(decode(*args, kw), np.float64)  # the collective first: asserts after
    jaxpr = str(jax.make_jaxpr(decode)(*args, kw))
    assert jaxpr.count("mpitree_attend_f32") == int(sizes()[rank] > 0)
    assert f"f32[4,{','.join(map(str, k.shape))}]" not in jaxpr  # no per-query copy of K/V
    for i, q in enumerate(queries):
        want = dataclasses.replace(prob, q=np.asarray(jnp.asarray(q, jnp.float32), np.float64))
        assert_allclose(out[i], want.reference()[0], atol=DTYPES["float32"], rtol=0)


@pytest.mark.parallel(nprocs=[1, 2, 3, 4])
def test_grad_through_vmap_equals_single_process_grad():
    """grad of a vmapped decode (and vmap of its grad): the backward's sum folds the same way."""
    rank = world().rank
    probs, q, k, v, kw = stacked("positions", 3, rank)
    lo = sum(probs[0].sizes[:rank])
    hi = lo + probs[0].sizes[rank]
    scale = 1 / np.sqrt(q.shape[-1])
    w = jnp.asarray(np.random.default_rng(3).standard_normal(q.shape))
    pos = jnp.asarray(kw["q_pos"]), jnp.asarray(kw["k_pos"])

    def loss_one(q, k, v, w, q_pos, k_pos):
        return jnp.sum(mj.tree_decode(q, k, v, q_pos=q_pos, k_pos=k_pos) * w)

    args = [jnp.asarray(x) for x in (q, k, v)]
    grad_one = jax.grad(loss_one, argnums=(0, 1, 2))
    forms = {
        "grad of vmap": jax.jit(
            jax.grad(lambda *a: jax.vmap(loss_one)(*a, w, *pos).sum(), argnums=(0, 1, 2))
        )(*args),
        "vmap of grad": jax.jit(jax.vmap(grad_one))(*args, w, *pos),
    }

    def ref_loss(q, k, v, visible, w):
        return jnp.sum(naive_attention(q, k, v, visible, scale)[0] * w)

    full = [np.stack([getattr(prob, name) for prob in probs]) for name in ("k", "v")]
    visible = np.stack([prob.visible() for prob in probs])
    want = jax.jit(jax.vmap(jax.grad(ref_loss, argnums=(0, 1, 2))))(q, *full, visible, w)
    want = (want[0], want[1][..., lo:hi, :], want[2][..., lo:hi, :])
    for name, grads in forms.items():
        for got, ref in zip(grads, want, strict=True):
            assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-12, rtol=0, err_msg=name)


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize(
    "bad", ["not vmapped", "axis sizes differ", "axis of size 0", "size 0 everywhere"]
)
def test_vmap_must_agree_on_every_rank(bad):
    """A rank that vmaps differently (or not at all, or over nothing) fails on every rank."""
    comm = world()
    is_bad = comm.rank == comm.size - 1
    probs, q, k, v, _ = stacked("gqa", 2, comm.rank)
    decode = jax.jit(jax.vmap(mj.tree_decode))
    args = [jnp.asarray(x) for x in (q, k, v)]
    if bad == "size 0 everywhere" or (is_bad and bad == "axis of size 0"):
        args = [x[:0] for x in args]
    elif is_bad and bad == "axis sizes differ":
        args = [jnp.concatenate([x, x[:1]]) for x in args]
    elif is_bad and bad == "not vmapped":  # the same rows in the same order, one batch axis
        decode = jax.jit(mj.tree_decode)
        args = [x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]) for x in args]
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        decode(*args).block_until_ready()
    last = str(info.value).strip().splitlines()[-1]
    if bad in ("not vmapped", "axis sizes differ"):
        assert last.startswith("ValueError: mpitree: ranks disagree on vmap"), last
    elif is_bad or bad == "size 0 everywhere":
        assert last == "ValueError: jax.vmap over an axis of size 0: there is no row to merge"
    else:
        assert last.startswith(f"RankError: mpitree: invalid input on rank {comm.size - 1}"), last
    out = jax.jit(jax.vmap(mj.tree_decode))(*(jnp.asarray(x) for x in (q, k, v)))
    for i, prob in enumerate(probs):
        assert_allclose(np.asarray(out[i]), prob.reference()[0], atol=1e-12, rtol=0)


@pytest.mark.parallel(nprocs=[1, 2, 3, 4])
@pytest.mark.parametrize("dtype, tol", [("float64", 1e-10), ("float32", 2e-5)])
def test_free_energy_grad_equals_single_process_grad(dtype, tol):
    """jax.grad of the sharded energy (q, k, v, zeta) equals autodiff of mpitree.energy's
    single-process free_energy over the whole cache; at zeta = 0 its zeta-gradient is the
    attention output (float64 reference), and the energy is the reference lse."""
    from mpitree.energy import free_energy

    rank = world().rank
    prob, k, v, kw = garbage_problem(dtype)
    lo = sum(prob.sizes[:rank])
    hi = lo + prob.sizes[rank]
    rng = np.random.default_rng(5)
    zeta = jnp.asarray(rng.standard_normal(prob.q.shape) * 0.5, dtype)
    w = jnp.asarray(rng.standard_normal(prob.q.shape[:3]), dtype)
    q = jnp.asarray(prob.q)

    def loss(q, k, v, zeta):
        return jnp.sum(mj.free_energy(q, k, v, zeta, **jax_kwargs(kw)) * w)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, jnp.asarray(k), jnp.asarray(v), zeta)
    visible = jnp.asarray(prob.visible())

    def ref_loss(q, k, v, zeta):
        return jnp.sum(free_energy(q, k, v, zeta, mask=visible) * w.astype(jnp.float64))

    full = [jnp.asarray(x, jnp.float64) for x in (prob.q, prob.k, prob.v, zeta)]
    want = jax.jit(jax.grad(ref_loss, argnums=(0, 1, 2, 3)))(*full)
    want = (want[0], want[1][:, :, lo:hi], want[2][:, :, lo:hi], want[3])
    err = max(
        float(np.abs(np.asarray(got, np.float64) - np.asarray(ref)).max(initial=0))
        for got, ref in zip(grads, want, strict=True)
    )
    assert err < tol, err

    @jax.jit
    def energy_and_attention(q, k, v):
        energy = lambda z: mj.free_energy(q, k, v, z, **jax_kwargs(kw))  # noqa: E731
        f, pull = jax.vjp(energy, jnp.zeros_like(q))
        return f, pull(jnp.ones_like(f))[0]  # dF/dzeta at zeta = 0

    energy, attention = energy_and_attention(q, jnp.asarray(k), jnp.asarray(v))
    ref, ref_lse = prob.reference()
    assert_allclose(np.asarray(attention, np.float64), ref, atol=tol, rtol=0)
    assert_allclose(np.asarray(energy, np.float64), ref_lse, atol=tol * 10, rtol=0)


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize("bad", ["zeta shape", "zeta dtype", "scale differs"])
def test_free_energy_bad_input_raises_on_every_rank(bad):
    """The energy's own checks and its scale ride in the agreement: every rank raises."""
    comm = world()
    is_bad = comm.rank == comm.size - 1
    prob = make_problem(1, [4] * comm.size)
    k, v = (jnp.asarray(x) for x in prob.shard(comm.rank)[:2])
    q = jnp.asarray(prob.q)
    zeta, options = jnp.ones_like(q), {}
    if is_bad and bad == "zeta shape":
        zeta = zeta[:, :1]
    if is_bad and bad == "zeta dtype":
        zeta = zeta.astype(jnp.float16)
    if is_bad and bad == "scale differs":
        options = dict(scale=0.5)
    energy = jax.jit(lambda q, k, v, z: mj.free_energy(q, k, v, z, **options))
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        energy(q, k, v, zeta).block_until_ready()
    last = str(info.value).strip().splitlines()[-1]
    if bad == "scale differs":
        assert last.startswith("ValueError: mpitree: ranks disagree on energy scale"), last
    elif is_bad:
        assert last.startswith("ValueError: zeta must be an array of q's shape"), last
    else:
        assert last.startswith(f"RankError: mpitree: invalid input on rank {comm.size - 1}"), last
    _, ref_lse = prob.reference()
    assert_allclose(np.asarray(mj.free_energy(q, k, v)), ref_lse, atol=2e-5, rtol=0)


@pytest.mark.parallel(nprocs=[2, 3])
def test_strict_dtype_promotion_neither_hangs_nor_fails_valid_input():
    """Under jax_numpy_dtype_promotion="strict" (x64 on): an empty shard's path traces, and
    bad input on one rank raises on every rank. Both hung before: a trace-time error on
    one rank (its int64 arange against int32 lengths; its failure placeholder's int32 flag
    added to float32) left the others waiting in the merge."""
    comm = world()
    prob = make_problem(1, [4, 0, 3][: comm.size], q_heads=4, kv_heads=2)
    k, v, _ = prob.shard(comm.rank)
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (prob.q, k, v))
    lens = jnp.full((q.shape[0],), k.shape[2], jnp.int32)
    with jax.numpy_dtype_promotion("strict"):
        out = jax.jit(lambda q, k, v, n: mj.tree_decode(q, k, v, kv_len=n))(q, k, v, lens)
        assert_allclose(np.asarray(out), prob.reference()[0], atol=2e-5, rtol=0)
        bad = q[:, :3] if comm.rank == comm.size - 1 else q
        with pytest.raises(jax.errors.JaxRuntimeError) as info:
            jax.jit(mj.tree_decode)(bad, k, v).block_until_ready()
    last = str(info.value).strip().splitlines()[-1]
    if comm.rank == comm.size - 1:
        assert last.startswith("ValueError: q heads (3) must be a multiple"), last
    else:
        assert last.startswith(f"RankError: mpitree: invalid input on rank {comm.size - 1}"), last


@pytest.mark.parallel(nprocs=[1])
def test_a_failed_merge_leaves_the_next_program_working():
    """A merge whose host step raises fails its program, and the next run of the same
    program (a host that no longer raises) works: the error does not stick to the ordered
    effect's token (without the host callback registration it did: the next run raised
    the old error at once, and on other ranks, entering the merge, that was a hang)."""
    state = {"fail": True}

    def host(records, flag, out):
        if state["fail"]:
            raise ValueError("boom")
        out[...] = np.asarray(records) + 1

    def body(x):
        for _ in range(20):  # big enough to be dispatched asynchronously
            x = jnp.sin(x) @ x
        return x

    step, x = jax.jit(lambda x: _jax_ffi.merge(host, body(x), jnp.int32(0)) * 2), jnp.eye(64)
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        step(x).block_until_ready()
    assert str(info.value).strip().splitlines()[-1] == "ValueError: boom"
    state["fail"] = False
    want = (np.asarray(jax.jit(body)(x)) + 1) * 2
    assert_allclose(np.asarray(step(x)), want, rtol=1e-6)


@pytest.mark.parallel(nprocs=[1])
def test_one_device_per_rank_is_a_clear_error():
    """A jitted decode over two local devices (inputs sharded on a mesh) raises a ValueError
    saying one device per rank, when traced (a fresh process: the device count is fixed
    when JAX starts)."""
    import os
    import subprocess
    import sys

    script = (
        "import jax, jax.numpy as jnp\n"
        "from jax.sharding import Mesh, NamedSharding, PartitionSpec as P\n"
        "from mpitree.adapters import jax as mj\n"
        "mesh = Mesh(jax.devices()[:2], ('x',))\n"
        "q = jax.device_put(jnp.ones((2, 2, 1, 4)), NamedSharding(mesh, P('x')))\n"
        "k = jax.device_put(jnp.ones((2, 2, 3, 4)), NamedSharding(mesh, P('x')))\n"
        "try:\n"
        "    jax.jit(mj.tree_decode)(q, k, k)\n"
        "except ValueError as exc:\n"
        "    print('RAISED', exc)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPI"))}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert "RAISED mpitree.adapters.jax runs on one device per rank; this program spans 2" in (
        run.stdout
    ), run.stdout + run.stderr


@pytest.mark.parallel(nprocs=[1, 2])
@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_a_program_compiled_for_an_accelerator_is_a_clear_error(platform):
    """Lowered for a GPU (as jax.jit does for GPU inputs), the merge raises a ValueError
    saying the CPU only, on every rank alike; no collective is entered (tests/test_cuda_mpi.py
    runs the real GPU)."""
    q, k = jnp.ones((1, 4, 1, 8)), jnp.ones((1, 2, 5, 8))
    traced = jax.jit(mj.tree_decode).trace(q, k, k)
    with pytest.raises(ValueError, match=f"CPU only, and this program is compiled for {platform}"):
        traced.lower(lowering_platforms=(platform,))
    assert_allclose(np.asarray(jax.jit(mj.tree_decode)(q, k, k)), 1.0)  # the ranks still agree
