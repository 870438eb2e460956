"""Non-finite inputs: a NaN is never turned into a number, on any path, rank count or placement.

One definition serves every kernel build, strategy and the invariant tree: a row's
max ``m`` is NaN as soon as one visible score is NaN (the kernels' max lets NaN
win, as numpy's does), and the merge is plain IEEE arithmetic that skips nothing
(only the shift is 0 where both sides are empty), so ``0 * NaN`` stays NaN and a
NaN ``m`` poisons the whole record. ``m == -inf`` is the one meaning of "empty".

Each case puts a *poison* key into a global cache and shards it two ways:
``"alone"`` (the poison key is the last rank's whole shard, so that rank's rows
see only the poison) and ``"shared"`` (it sits among finite keys). The result on
every rank must match the float64 reference on the concatenated cache, NaN for
NaN, for every strategy (the invariant tree included), dtype and rank count.
"""

import numpy as np
import pytest
import torch
from helpers import atol, world
from numpy.testing import assert_allclose

import mpitree
from mpitree import reference_attention

NPROCS = [1, 2, 3, 4]
STRATEGIES = ["auto", "allreduce", "allreduce3", "allgather", "hierarchical", "ring", "invariant"]
MERGES = ["allreduce", "allreduce3", "allgather", "hierarchical"]  # the flash adapter's, no ring
PLACEMENTS = ["alone", "shared"]
B, HQ, HKV, D = 1, 4, 2, 8


def cache(kind, placement, dtype):
    """Return (q, k, v, sizes): a global cache with one poison key, and its shard sizes.

    kinds: ``"nan key"`` (NaN scores), ``"inf key"`` (+inf key, mixed-sign query:
    inf - inf = NaN scores), ``"nan value"`` (a key scoring -inf, weight exactly 0,
    with a NaN value: 0 * NaN = NaN, as plain arithmetic gives), ``"all -inf"``
    (every key scores -inf: the row sees no key; output 0, lse -inf).
    """
    p = world().size
    rng = np.random.default_rng(7)
    sizes = [3] * (p - 1) + ([1] if placement == "alone" else [4])
    n = sum(sizes)
    q = np.abs(rng.standard_normal((B, HQ, 1, D))) + 0.1  # positive: -inf keys score -inf
    k = rng.standard_normal((B, HKV, n, D))
    v = rng.standard_normal((B, HKV, n, D))
    poison = n - 1  # the last rank's last key
    if kind == "nan key":
        k[:, :, poison] = np.nan
    elif kind == "inf key":
        q[..., 1] = -1.0
        k[:, :, poison] = np.inf
    elif kind == "nan value":
        k[:, :, poison] = -np.inf
        v[:, :, poison, 2] = np.nan
    else:
        assert kind == "all -inf"
        k[...] = -np.inf
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), sizes


def shard(k, v, sizes, rank):
    lo = sum(sizes[:rank])
    return k[:, :, lo : lo + sizes[rank]].copy(), v[:, :, lo : lo + sizes[rank]].copy(), lo


def decode(q, k, v, sizes, strategy, **kw):
    """Every rank's tree_decode of its shard; ``"invariant"`` runs the canonical tree."""
    ks, vs, lo = shard(k, v, sizes, world().rank)
    if strategy == "invariant":
        kw.update(deterministic="invariant", block_size=1, kv_start=lo)
    else:
        kw["strategy"] = strategy
    return mpitree.tree_decode(q, ks, vs, return_lse=True, **kw)


def check(out, lse, q, k, v, tol):
    """Against the float64 reference: values within ``tol``, NaN exactly where it has NaN."""
    ref, ref_lse = reference_attention(q, k, v)
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    assert np.array_equal(np.isnan(out), np.isnan(ref)), (out, ref)
    assert_allclose(out, ref, atol=tol, rtol=0)  # NaN positions equal, the rest close
    assert np.array_equal(np.isnan(lse), np.isnan(ref_lse))
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    lse_tol = max(tol, atol(np.float32)) * 10  # lse is float32 for every input (documented)
    assert_allclose(lse[fin], ref_lse[fin], atol=lse_tol, rtol=0)
    return ref


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_nan_key_poisons_every_row(strategy, dtype, placement):
    q, k, v, sizes = cache("nan key", placement, dtype)
    out, lse = decode(q, k, v, sizes, strategy)
    ref = check(out, lse, q, k, v, atol(dtype))
    assert np.isnan(ref).all() and np.isnan(out).all() and np.isnan(lse).all()


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_nan_key_bfloat16_torch(strategy, placement):
    q, k, v, sizes = cache("nan key", placement, np.float32)
    ks, vs, lo = shard(k, v, sizes, world().rank)
    t = (torch.from_numpy(x).to(torch.bfloat16) for x in (q, ks, vs))
    kw = {"strategy": strategy}
    if strategy == "invariant":
        kw = dict(deterministic="invariant", block_size=1, kv_start=lo)
    out, lse = mpitree.tree_decode(*t, return_lse=True, **kw)
    assert out.dtype == torch.bfloat16
    assert torch.isnan(out).all() and torch.isnan(lse).all()


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_inf_keys_under_mixed_sign_query_give_nan(strategy, dtype, placement):
    q, k, v, sizes = cache("inf key", placement, dtype)
    out, lse = decode(q, k, v, sizes, strategy)
    ref = check(out, lse, q, k, v, atol(dtype))
    assert np.isnan(ref).all()


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_weight_zero_key_keeps_its_nan_value(strategy, dtype, placement):
    """A visible key scoring -inf has weight 0; its NaN value still gives NaN (0 * NaN)."""
    q, k, v, sizes = cache("nan value", placement, dtype)
    out, lse = decode(q, k, v, sizes, strategy)
    ref = check(out, lse, q, k, v, atol(dtype))
    assert np.isnan(ref[..., 2]).all() and not np.isnan(np.delete(ref, 2, axis=-1)).any()
    assert np.isfinite(lse).all() or (world().size == 1 and placement == "alone")


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("exclusion", ["mask", "kv_len", "positions"])
@pytest.mark.parametrize("weight", ["-inf score", "underflow"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_weight_zero_key_keeps_its_nan_value_beside_excluded_keys(dtype, weight, exclusion):
    """A visible key of weight 0 keeps its NaN value when its shard also has excluded keys.

    Its weight is 0 because it scores -inf, or because it scores so far below the
    row's max that float32's exp gives 0 (float64 still gives a tiny weight): either
    way ``0 * NaN`` is NaN. The C kernel took weight 0 to mean "excluded" in a chunk
    with excluded keys, and skipped it: the NaN became a number.
    """
    comm = world()
    q, k, v, sizes = cache("nan value", "shared", dtype)
    poison = k.shape[2] - 1
    if weight == "underflow":  # q > 0: a score about -130 below the others
        k[:, :, poison] = -50
    ks, vs, lo = shard(k, v, sizes, comm.rank)
    t = ks.shape[2]
    garbage = np.full((B, HKV, 2, D), np.nan, dtype)  # a cache's unused slots
    ks, vs = (np.concatenate([x, garbage], 2) for x in (ks, vs))
    kw = {}
    if exclusion == "mask":
        kw["mask"] = np.arange(t + 2)[None, None, None, :] < t
    elif exclusion == "kv_len":
        kw["kv_len"] = np.full(B, t)
    else:
        kw["q_pos"] = np.full((B, 1), k.shape[2])
        kw["k_pos"] = np.concatenate([np.arange(lo, lo + t), [10**6, 10**6]])[None]
    out, lse = mpitree.tree_decode(q, ks, vs, return_lse=True, **kw)
    ref = check(out, lse, q, k, v, atol(dtype))
    assert np.isnan(ref[..., 2]).all() and not np.isnan(np.delete(ref, 2, axis=-1)).any()


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_score_neg_inf_sees_no_key(strategy, dtype):
    """Documented: a row whose every visible score is -inf gets output 0 and lse -inf."""
    q, k, v, sizes = cache("all -inf", "shared", dtype)
    out, lse = decode(q, k, v, sizes, strategy)
    check(out, lse, q, k, v, atol(dtype))
    assert (np.asarray(out) == 0).all() and np.isneginf(lse).all()


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("deterministic", [False, "invariant"])
def test_decode_plan_and_allreduce_state(placement, deterministic):
    q, k, v, sizes = cache("nan key", placement, np.float32)
    ks, vs, lo = shard(k, v, sizes, world().rank)
    kw = dict(deterministic=deterministic)
    step = {}
    if deterministic:
        kw["block_size"] = 1
        step["kv_start"] = lo
    with mpitree.DecodePlan(B, HQ, HKV, D, **kw) as plan:
        for _ in range(2):  # the second step takes the plan's bound-kernel fast path
            out = plan.decode(q, ks, vs, **step)
            assert np.isnan(out).all()
    if not deterministic:
        merged = mpitree.allreduce_state(mpitree.local_state(q, ks, vs))
        assert np.isnan(merged.output()).all() and np.isnan(merged.lse()).all()


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("node_size", [1, 2])
def test_hierarchical_over_several_nodes(node_size, placement):
    """The issue's hierarchical case with ranks grouped into nodes of 1 or 2 (leaders merge)."""
    for kind in ("nan key", "inf key"):
        q, k, v, sizes = cache(kind, placement, np.float32)
        out, lse = decode(q, k, v, sizes, "hierarchical", node_size=node_size)
        ref = check(out, lse, q, k, v, atol(np.float32))
        assert np.isnan(ref).all() and np.isnan(out).all()


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("strategy", [*MERGES, "ring"])
def test_decode_plan_every_strategy(strategy, placement):
    q, k, v, sizes = cache("nan key", placement, np.float32)
    ks, vs, _ = shard(k, v, sizes, world().rank)
    with mpitree.DecodePlan(B, HQ, HKV, D, strategy=strategy) as plan:
        for _ in range(2):
            out, lse = plan.decode(q, ks, vs, return_lse=True)
            assert np.isnan(out).all() and np.isnan(lse).all()


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("exclusion", ["none", "mask", "kv_len"])
@pytest.mark.parametrize("algorithm", ["fused", "paper"])
def test_energy_with_a_source_keeps_a_nan_value(algorithm, exclusion, placement):
    """``zeta . v`` of a visible key with a NaN value is a NaN logit: energy and gradient NaN.

    Before, a mask or ``kv_len`` (any exclusion at all) made the logits use values with
    every non-finite entry zeroed, visible keys included: a finite energy where
    :func:`mpitree.energy.free_energy` on the whole cache gives NaN.
    """
    q, k, v, sizes = cache("nan key", placement, np.float32)
    k = np.random.default_rng(8).standard_normal(k.shape).astype(np.float32)
    v[:, :, -1, 3] = np.nan  # the poison key's value, its score finite
    zeta = np.random.default_rng(9).standard_normal(q.shape).astype(np.float32)
    ks, vs, _ = shard(k, v, sizes, world().rank)
    kw = {}
    if exclusion == "mask":
        kw["mask"] = np.ones((B, 1, 1, ks.shape[2]), bool)
    elif exclusion == "kv_len":
        kw["kv_len"] = np.full(B, ks.shape[2])
    f, grad = mpitree.energy.tree_energy(q, ks, vs, zeta=zeta, algorithm=algorithm, **kw)
    want = mpitree.energy.free_energy(*(x.astype(np.float64) for x in (q, k, v, zeta)))
    assert np.isnan(want).all()
    assert np.isnan(f).all() and np.isnan(grad).all()
    mean, var = mpitree.energy.attention_variance(q, ks, vs, **kw)  # no source: dim 3 only
    for x in (mean, var):
        assert np.isnan(x[..., 3]).all() and np.isfinite(np.delete(x, 3, axis=-1)).all()


def test_free_energy_with_a_fixed_shift_keeps_nan():
    """A fixed ``shift`` (a number or an array) must not turn a NaN partition sum into -inf."""
    q, k, v, _ = cache("nan key", "alone", np.float64)
    for shift in (0.0, np.zeros(q.shape[:-1]), "max"):
        assert np.isnan(mpitree.energy.free_energy(q, k, v, shift=shift)).all()
        t = (torch.from_numpy(x) for x in (q, k, v))
        s = torch.from_numpy(shift) if isinstance(shift, np.ndarray) else shift
        assert torch.isnan(mpitree.energy.free_energy(*t, shift=s)).all()
    k[...] = -np.inf  # every score -inf: the row sees no key, -inf whatever the shift
    assert np.isneginf(mpitree.energy.free_energy(q, k, v, shift=0.0)).all()


@pytest.fixture
def flash_adapter(monkeypatch):
    """mpitree.adapters.flash_attn over the stand-in kernel (tests/standins.py)."""
    import importlib
    import sys

    from standins import fake_flash_attn

    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn())
    monkeypatch.delitem(sys.modules, "mpitree.adapters.flash_attn", raising=False)
    yield importlib.import_module("mpitree.adapters.flash_attn")
    sys.modules.pop("mpitree.adapters.flash_attn", None)


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("kind", ["nan key", "inf key"])
@pytest.mark.parametrize("strategy", ["auto", *MERGES])
def test_flash_attn_nan_row_is_not_read_as_empty(flash_adapter, strategy, kind, placement):
    """flash-attn gives a row whose score sum is NaN lse +inf (as for no key) and a NaN output.

    Before, the adapter read that lse as "saw no key" and dropped the row's NaN: finite
    output from the other ranks' keys, or 0 on one rank.
    """
    q, k, v, sizes = cache(kind, placement, np.float32)
    ks, vs, _ = shard(k, v, sizes, world().rank)
    flash = [torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1, 3))) for x in (q, ks, vs)]
    out, lse = flash_adapter.tree_decode(*flash, strategy=strategy, return_lse=True)
    ref = check(out.transpose(1, 2).numpy(), lse.numpy(), q, k, v, atol(np.float32))
    assert np.isnan(ref).all() and torch.isnan(out).all()


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("deterministic", [False, "invariant"])
@pytest.mark.parametrize("placement", ["interleave", "last"])
def test_nan_embedding_row_through_prefill(placement, deterministic):
    """mtt.prefill (the staircase's torch merge, or invariant's whole prompt): NaN as sdpa."""
    import mpitree.adapters.transformers as mtt
    from models import prompt, tiny_llama

    model = tiny_llama()
    ids, _ = prompt(12, False, batch=2)
    with torch.no_grad():
        model.model.embed_tokens.weight[int(ids[0, 6])] = float("nan")
        model.set_attn_implementation("sdpa")
        want = model(ids).logits[:, -1]
        model.set_attn_implementation("mpitree")
        block = {"block_size": 1} if deterministic else {}
        cache = mtt.ShardedCache(
            model.config, placement=placement, deterministic=deterministic, **block
        )
        got = mtt.prefill(model, ids, cache)
    assert torch.isnan(want[0]).all() and not torch.isnan(want[1]).any()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-4)


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("deterministic", [False, "invariant"])
@pytest.mark.parametrize("placement", ["interleave", "last"])
def test_nan_embedding_row_gives_nan_logits_as_sdpa_does(placement, deterministic):
    """End to end: a token whose embedding is NaN poisons every later position (sdpa: NaN too)."""
    import mpitree.adapters.transformers as mtt
    from models import greedy, prompt, tiny_llama

    model = tiny_llama()
    ids, _ = prompt(12, False, batch=1)
    with torch.no_grad():
        model.model.embed_tokens.weight[int(ids[0, 6])] = float("nan")
    model.set_attn_implementation("sdpa")
    want = torch.stack(greedy(model, ids, None, None, 3).logits)
    model.set_attn_implementation("mpitree")
    block = {"block_size": 1} if deterministic else {}
    cache = mtt.ShardedCache(
        model.config, placement=placement, deterministic=deterministic, **block
    )
    got = torch.stack(greedy(model, ids, None, cache, 3).logits)
    assert torch.isnan(want).all()  # every generated step sees the NaN key
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    with torch.no_grad():  # the prompt's own positions: finite before the token, NaN after
        # (sdpa leaks it into earlier rows too: its causal mask is added to a NaN score;
        # mpitree's excluded keys contribute nothing, whatever they hold)
        cache = mtt.ShardedCache(
            model.config, placement=placement, deterministic=deterministic, **block
        )
        out = model(ids, cache=cache).logits
    assert torch.isnan(out[0, 6:]).all() and not torch.isnan(out[0, :6]).any()
