"""mpitree.adapters.jax under real ranks: exact, jitted, differentiable, recompilation-free."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_problem, world
from numpy.testing import assert_allclose

import mpitree

jax.config.update("jax_enable_x64", True)  # float64 inputs and the float64 gradient reference

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
    """100 jitted steps over preallocated ragged shards: one trace, one compilation, exact."""
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
    for i in range(steps):
        n = jnp.full((b,), np.count_nonzero(owner[: i + 1] == rank), jnp.int32)
        out = step(jnp.asarray(queries[i]), k_cache, v_cache, n)
        if i in (0, 1, 37, steps - 1):
            ref = mpitree.reference_attention(
                queries[i], keys[:, :, : i + 1], values[:, :, : i + 1]
            )
            assert_allclose(np.asarray(out), ref[0], atol=2e-5, rtol=0)
    assert len(traces) == 1 and step._cache_size() == 1


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


@pytest.mark.parallel(nprocs=[1])
def test_vmap_is_refused_clearly():
    """An ordered callback has no batching rule: vmap raises when traced, before any collective."""
    prob = make_problem(1, [4])
    with pytest.raises(Exception, match=r"(?i)batch|vmap|ordered"):
        jax.vmap(lambda q: mj.tree_decode(q, jnp.asarray(prob.k), jnp.asarray(prob.v)))(
            jnp.asarray(prob.q)[None]
        )
