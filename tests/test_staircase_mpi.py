"""Sharded prefill's fused local attention: exact, visible pairs only, and really taken."""

import dataclasses
import gc
import math
import weakref

import mpitree.adapters.transformers as mtt
import numpy as np
import pytest
import torch
import transformers
from helpers import world
from models import positions, prompt, tiny_llama, tiny_mistral
from mpitree.adapters.transformers import _attention
from mpitree.adapters.transformers import _staircase as staircase
from numpy.testing import assert_allclose, assert_array_equal


def reference(q, k, v, scale, q_idx, k_idx, key_ok):
    """Float64 lse and output of the staircase visibility (lse -inf where nothing is seen)."""
    g = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(g, 1) for x in (k, v))
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), k) * scale
    vis = (k_idx[None, :] <= q_idx[:, None])[None, None] & key_ok[:, None, None, :]
    s = s.masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s, -1)
    out = torch.nan_to_num(torch.softmax(s, -1)) @ v
    return lse, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ranks, block", [(1, 64), (3, 64), (4, 1), (2, 500)])
def test_staircase_equals_float64_reference(dtype, ranks, block, monkeypatch):
    monkeypatch.setattr(staircase, "CHUNK", 96)  # several chunks and bands
    gen = torch.Generator().manual_seed(ranks * 1000 + block)
    b, hq, hkv, d, n = 2, 8, 2, 16, 700
    q = torch.randn(b, hq, n, d, generator=gen).to(dtype)
    k, v = (torch.randn(b, hkv, n, d, generator=gen).to(dtype) for _ in range(2))
    key_ok = torch.ones(b, n, dtype=torch.bool)
    key_ok[1, :150] = False  # left padding: row 1's first queries see nothing at all
    for rank in range(ranks):
        k_idx = torch.arange(n)[(torch.arange(n) // block) % ranks == rank]
        q_idx = torch.randperm(n, generator=gen)  # rank-major order is arbitrary to it
        if not k_idx.numel():
            continue
        rec = staircase.staircase_records(
            q[:, :, q_idx], k[:, :, k_idx], v[:, :, k_idx], 0.25, q_idx, k_idx, key_ok[:, k_idx]
        )
        assert rec.dtype == torch.float32 and not torch.isnan(rec).any()
        garbage = torch.full((n, b, hq, d + 2), float("nan"))  # the merge's own layout
        into = staircase.staircase_records(
            q[:, :, q_idx],
            k[:, :, k_idx],
            v[:, :, k_idx],
            0.25,
            q_idx,
            k_idx,
            key_ok[:, k_idx],
            out=garbage.permute(1, 2, 0, 3),
        )
        assert into.data_ptr() == garbage.data_ptr() and torch.equal(into, rec)
        lse_ref, out_ref = reference(
            q[:, :, q_idx], k[:, :, k_idx], v[:, :, k_idx], 0.25, q_idx, k_idx, key_ok[:, k_idx]
        )
        empty = torch.isinf(lse_ref)
        assert empty.any() and torch.equal(torch.isneginf(rec[..., 0]), empty)
        assert (rec[..., 1:][empty] == 0).all()
        seen = ~empty
        lse = rec[..., 0] + torch.log(rec[..., 1])
        out = rec[..., 2:] / rec[..., 1:2]
        assert_allclose(lse[seen].numpy(), lse_ref[seen].numpy(), atol=2e-5, rtol=0)
        assert_allclose(out[seen].numpy(), out_ref[seen].numpy(), atol=2e-5, rtol=0)


def test_staircase_keeps_nan_and_writes_each_query_where_told(monkeypatch):
    """A NaN key or value poisons exactly the rows that see it, through prefix and band alike.

    Garbage at padded keys (seen by no query) poisons nothing; rows that see no key at
    all are empty.
    """
    monkeypatch.setattr(staircase, "CHUNK", 96)  # key 240 in one chunk's band, later prefixes
    gen = torch.Generator().manual_seed(7)
    b, hq, hkv, d, n = 2, 4, 2, 16, 400
    k_idx = torch.arange(0, n, 2)  # rank 0 of 2, interleaved
    q_idx = torch.randperm(n, generator=gen)
    q = torch.randn(b, hq, n, d, generator=gen)
    clean = [torch.randn(b, hkv, n // 2, d, generator=gen) for _ in range(2)]
    k, v = (x.clone() for x in clean)
    v[0, 0, 120] = float("nan")  # row 0, global key 240, kv head 0 (query heads 0 and 1)
    k[0, 1, 30] = float("nan")  # row 0, global key 60, kv head 1 (query heads 2 and 3)
    key_ok = torch.ones(b, n // 2, dtype=torch.bool)
    key_ok[1, :25] = False  # row 1: keys 0..48 are left padding
    v[1, 0, 10] = float("nan")  # ... garbage there: global key 20
    k[1, 1, 5] = float("inf")  # and global key 10
    rec = staircase.staircase_records(q, k, v, 0.25, q_idx, k_idx, key_ok)
    empty = torch.zeros(b, hq, n, dtype=torch.bool)
    empty[1] = q_idx < 50
    assert torch.equal(torch.isneginf(rec[..., 0]), empty) and (rec[empty][:, 1:] == 0).all()
    out = rec[..., 2:] / rec[..., 1:2]
    poisoned = torch.zeros(b, hq, n, dtype=torch.bool)
    poisoned[0, :2] = q_idx >= 240
    poisoned[0, 2:] = q_idx >= 60
    assert torch.equal(torch.isnan(out).all(-1) & ~empty, poisoned)
    fine = ~poisoned & ~empty
    assert not torch.isnan(out[fine]).any()
    lse_ref, out_ref = reference(q, *clean, 0.25, q_idx, k_idx, key_ok)
    assert_allclose(out[fine].numpy(), out_ref[fine].numpy(), atol=2e-5, rtol=0)
    lse = (rec[..., 0] + torch.log(rec[..., 1]))[fine]
    assert_allclose(lse.numpy(), lse_ref[fine].numpy(), atol=2e-5, rtol=0)
    garbage = torch.full((n, b, hq, d + 2), float("nan"))  # another layout, every row written
    into = staircase.staircase_records(
        q, k, v, 0.25, q_idx, k_idx, key_ok, out=garbage.permute(1, 2, 0, 3)
    )
    assert into.data_ptr() == garbage.data_ptr()
    assert_array_equal(into.numpy(), rec.numpy())  # NaN where rec has NaN


@pytest.mark.parametrize("chunk", [1, 2, 384])
def test_staircase_gives_keys_scoring_minus_inf_weight_zero(chunk, monkeypatch):
    """A part whose visible keys all score -inf is empty (the op made them lse 0: a phantom key).

    As the merge defines it (tests/test_nonfinite_mpi.py): weight exactly 0, so the
    row is empty when no other key is seen, and ``0 * NaN`` still poisons the output.
    """
    monkeypatch.setattr(staircase, "CHUNK", chunk)
    gen = torch.Generator().manual_seed(3)
    b, hq, hkv, d, n = 2, 4, 2, 8, 9
    q = torch.rand(b, hq, n, d, generator=gen) + 0.1  # positive: a -inf key scores -inf
    clean = [torch.randn(b, hkv, n, d, generator=gen) for _ in range(2)]
    k, v = (x.clone() for x in clean)
    k[:, :, 0] = -math.inf  # each query's first key: chunks starting there see only it
    k[:, :, 4] = -math.inf
    v[0, 1, 4, 3] = math.nan  # weight 0 times NaN: NaN in that column, for queries >= 4
    idx = torch.arange(n)
    key_ok = torch.ones(b, n, dtype=torch.bool)
    rec = staircase.staircase_records(q, k, v, 0.3, idx, idx, key_ok)
    assert torch.isneginf(rec[:, :, 0, 0]).all() and (rec[:, :, 0, 1:] == 0).all()
    out = rec[..., 2:] / rec[..., 1:2]
    poisoned = torch.zeros(b, hq, n, d, dtype=torch.bool)
    poisoned[0, 2:, 4:, 3] = True  # kv head 1 is query heads 2 and 3
    assert torch.equal(torch.isnan(out[:, :, 1:]), poisoned[:, :, 1:])
    finite = key_ok.clone()
    finite[:, [0, 4]] = False  # weight 0: as if not seen
    lse_ref, out_ref = reference(q, *clean, 0.3, idx, idx, finite)
    fine = ~poisoned[:, :, 1:]
    assert_allclose(out[:, :, 1:][fine].numpy(), out_ref[:, :, 1:][fine].numpy(), atol=2e-5)
    lse = rec[:, :, 1:, 0] + torch.log(rec[:, :, 1:, 1])
    assert_allclose(lse.numpy(), lse_ref[:, :, 1:].numpy(), atol=2e-5, rtol=0)


@pytest.mark.parametrize("chunk", [1, 2, 384])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_staircase_gives_finite_keys_whose_scores_overflow_weight_zero(chunk, dtype, monkeypatch):
    """Finite keys whose q.k overflows float32 to -inf weigh 0, as in the decode kernel.

    The fused op gave a part that saw only such keys lse 0 and output 0: a phantom key
    of score 0 that diluted the keys the row really sees. In float64 those scores are
    about -1e40, so the float64 reference over every key is the answer wherever a row
    sees another key; a row that sees only them is empty.
    """
    monkeypatch.setattr(staircase, "CHUNK", chunk)
    gen = torch.Generator().manual_seed(5)
    b, hq, hkv, d, n = 2, 4, 2, 8, 9
    q = torch.randn(b, hq, n, d, generator=gen)
    q[..., 0] = 1e20
    k, v = (torch.randn(b, hkv, n, d, generator=gen) for _ in range(2))
    k[..., 0] = 0  # the other keys score as they would without that component
    for j in (0, 4, 5):  # query 0 sees only key 0; chunks starting at 4 see only 4 (and 5)
        k[:, :, j] = 0
        k[:, :, j, 0] = -1e20  # q.k = -1e40: finite inputs, -inf in float32
    q, k, v = (x.to(dtype) for x in (q, k, v))
    idx = torch.arange(n)
    key_ok = torch.ones(b, n, dtype=torch.bool)
    rec = staircase.staircase_records(q, k, v, 0.3, idx, idx, key_ok)
    assert torch.isneginf(rec[:, :, 0, 0]).all() and (rec[:, :, 0, 1:] == 0).all()
    lse_ref, out_ref = reference(q, k, v, 0.3, idx, idx, key_ok)
    out = rec[:, :, 1:, 2:] / rec[:, :, 1:, 1:2]
    assert_allclose(out.numpy(), out_ref[:, :, 1:].numpy(), atol=2e-5, rtol=0)
    lse = rec[:, :, 1:, 0] + torch.log(rec[:, :, 1:, 1])
    assert_allclose(lse.numpy(), lse_ref[:, :, 1:].numpy(), atol=2e-5, rtol=0)


def test_key_rows_accepts_staircases_only():
    q_idx, k_idx = torch.tensor([3, 0, 2, 1]), torch.tensor([0, 2])
    causal = (k_idx[None, :] <= q_idx[:, None])[None, None]
    assert torch.equal(staircase.key_rows(causal, q_idx, k_idx), torch.ones(1, 2, dtype=bool))
    padded = causal & torch.tensor([False, True])
    assert torch.equal(staircase.key_rows(padded, q_idx, k_idx), torch.tensor([[False, True]]))
    window = causal.clone()
    window[0, 0, 0, 0] = False  # query 3 no longer sees key 0: a sliding window
    assert staircase.key_rows(window, q_idx, k_idx) is None
    per_head = causal.expand(1, 2, 4, 2)
    assert staircase.key_rows(per_head, q_idx, k_idx) is None
    assert staircase.key_rows(None, q_idx, torch.tensor([2, 1])) is None  # unsorted keys
    assert staircase.key_rows(None, q_idx, k_idx) is None  # all-visible contradicts causality
    # a rank's own queries over every key: keys past its latest query are seen by none
    keys = torch.arange(6)
    later = (keys[None, :] <= q_idx[:, None])[None, None] & torch.tensor([False] + [True] * 5)
    assert torch.equal(staircase.key_rows(later, q_idx, keys), later[:, 0, 0])


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("placement", mtt.PLACEMENTS)
def test_prefill_takes_the_fused_path_and_equals_the_general_kernel(placement, monkeypatch):
    model = tiny_llama()
    ids, mask = prompt(40, True)
    calls = []
    fused = staircase.staircase_records
    monkeypatch.setattr(
        staircase, "staircase_records", lambda *a, **kw: calls.append(1) or fused(*a, **kw)
    )
    built = {"fused": [], "general": []}  # sharded prefill layers whose mask was built
    visible = _attention._visible
    got = []
    for path in ("fused", "general"):
        if path == "general":
            monkeypatch.setattr(staircase, "available", lambda q: False)
        monkeypatch.setattr(  # its last argument: sharded
            _attention,
            "_visible",
            lambda *a, path=path: built[path].append(a[-1]) or visible(*a),
        )
        cache = mtt.ShardedCache(model.config, placement=placement, block_size=4)
        model.set_attn_implementation("mpitree")
        got.append(mtt.prefill(model, ids, cache, attention_mask=mask))
        keys = [layer.keys.numpy().copy() for layer in cache.layers]  # this rank's shard
        got.append(keys)
    n_fused = len(calls)
    assert world().allreduce(n_fused) > 0  # some rank held keys and took the fused path
    # the causal recipe's (N/p, N) bool mask: never built for the staircase, once for the
    # general kernel (one per step, shared by the layers) on a rank that holds keys
    assert True not in built["fused"]
    assert built["general"].count(True) == (1 if n_fused else 0)
    assert_allclose(got[0].numpy(), got[2].numpy(), atol=2e-5, rtol=0)
    for a, b in zip(got[1], got[3], strict=True):
        for ka, kb in zip(a, b, strict=True):
            assert_allclose(ka, kb, atol=2e-5, rtol=0)


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_prefill_visibility_goes_with_the_prefill(monkeypatch):
    """The unbuilt visibility, and the mask the general kernel built from it, die with the
    prefill by reference counting: no cycle through its step keeps them (a GPU's (N/p, N)
    bool mask stayed until Python's garbage collector happened to run)."""
    model = tiny_llama().double()  # float64: the general kernel builds the mask
    ids, mask = prompt(20, True)
    made, built = [], []
    recipe, visible = _attention._causal_recipe, _attention._visible

    def recorded(*args):
        found = recipe(*args)
        made.extend([] if found is None else [weakref.ref(found)])
        return found

    monkeypatch.setattr(_attention, "_causal_recipe", recorded)
    monkeypatch.setattr(_attention, "_visible", lambda *a: built.append(a[-1]) or visible(*a))
    cache = mtt.ShardedCache(model.config, block_size=4)
    model.set_attn_implementation("mpitree")
    gc.collect()
    gc.disable()
    try:
        with torch.no_grad():
            mtt.prefill(model, ids, cache, attention_mask=mask)
        alive = [ref() is not None for ref in made]
    finally:
        gc.enable()
    assert len(made) == 1  # one sharded step, one mask: one recipe
    assert built.count(True) == 1  # and the general kernel built its mask
    assert alive == [False]


@pytest.mark.parallel(nprocs=[1, 3])
@pytest.mark.parametrize("padded", [False, True])
def test_prefill_refuses_a_causal_mask_of_another_batch(padded, monkeypatch):
    """The causal recipe, left unbuilt, still checks its mask's batch: every rank raises."""
    model = tiny_llama()
    ids, mask = prompt(20, padded)
    masks = transformers.masking_utils.AttentionMaskInterface._global_mapping
    made = masks["mpitree"]
    monkeypatch.setitem(
        masks, "mpitree", lambda *a, **kw: dataclasses.replace(made(*a, **kw), batch_size=3)
    )
    cache = mtt.ShardedCache(model.config, block_size=4)
    model.set_attn_implementation("mpitree")
    with pytest.raises(ValueError, match="mask built for batch 3, inputs have 2"):
        mtt.prefill(model, ids, cache, attention_mask=mask)
    assert cache.get_seq_length() == 0


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_prefill_with_an_infinite_query_equals_the_general_kernel(monkeypatch):
    """A query with an infinite entry takes the general kernel: no key it must not see reaches it.

    Such a query scores ``+-inf`` or NaN against nearly any key, and the fused op's
    additive mask lets a masked key's score into its arithmetic (``NaN + -inf`` is
    NaN). Here layer 0's queries 1-7 of row 0 hold ``+inf`` and their keys score
    ``-inf``: they see no key (output 0, no NaN), while the later keys they must
    not see score ``+inf`` or NaN. The fused op made those rows NaN.
    """
    model = tiny_llama()
    model.set_attn_implementation("mpitree")
    attn = model.model.layers[0].self_attn
    d = attn.head_dim
    ids, mask = prompt(24, True)
    pos = {}

    def seen(module, args, kwargs):
        pos["now"] = kwargs["position_ids"].expand(ids.shape[0], -1)[..., None]

    def query(module, args, out):
        o = out.unflatten(-1, (-1, d)).clone()
        first = (pos["now"] >= 1) & (pos["now"] <= 7) & (torch.arange(2)[:, None, None] == 0)
        o[..., d // 2 - 1] = o[..., d // 2 - 1].masked_fill(first, math.inf)
        return o.flatten(-2)

    def key(module, args, out):  # rotated or not, the pair (d/2 - 1, d - 1) meets +inf below 0
        o = out.unflatten(-1, (-1, d)).clone()
        o[..., [d // 2 - 1, d - 1]] = o[..., [d // 2 - 1, d - 1]].masked_fill(
            pos["now"][..., None] <= 7, -1
        )
        return o.flatten(-2)

    model.model.register_forward_pre_hook(seen, with_kwargs=True)
    attn.q_proj.register_forward_hook(query)
    attn.k_proj.register_forward_hook(key)
    got = []
    for path in ("fused", "general"):
        if path == "general":
            monkeypatch.setattr(staircase, "available", lambda q: False)
        cache = mtt.ShardedCache(model.config, block_size=4)
        with torch.no_grad():
            logits = mtt.prefill(model, ids, cache, attention_mask=mask)
        got.append((logits.numpy(), cache.layers[1].keys.numpy().copy()))
    for fused, general in zip(*got, strict=True):
        assert not np.isnan(general).any()
        assert_allclose(fused, general, atol=2e-5, rtol=0)


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("window", [64, 6])
def test_prefill_under_a_window_takes_the_staircase_where_the_window_does_not_cut(
    window, monkeypatch
):
    """A sliding window's mask is built (it is no causal recipe): over a prompt shorter
    than the window it is still causal, and the fused staircase runs; a window that cuts
    takes the general kernel. Both equal one process's eager model."""
    model = tiny_mistral(window)
    ids, mask = prompt(40, True)
    calls = []
    fused = staircase.staircase_records
    monkeypatch.setattr(
        staircase, "staircase_records", lambda *a, **kw: calls.append(1) or fused(*a, **kw)
    )
    cache = mtt.ShardedCache(model.config, block_size=4)
    model.set_attn_implementation("mpitree")
    got = mtt.prefill(model, ids, cache, attention_mask=mask)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, position_ids=positions(mask)).logits[:, -1]
    assert_allclose(got.numpy(), ref.numpy(), atol=1e-4, rtol=0)
    assert (world().allreduce(len(calls)) > 0) == (window > ids.shape[1])
