"""Sharded prefill's fused local attention: exact, visible pairs only, and really taken."""

import math

import mpitree.adapters.transformers as mtt
import pytest
import torch
from helpers import world
from models import prompt, tiny_llama
from mpitree.adapters.transformers import _staircase as staircase
from numpy.testing import assert_allclose


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
    got = []
    for path in ("fused", "general"):
        if path == "general":
            monkeypatch.setattr(staircase, "available", lambda q: False)
        cache = mtt.ShardedCache(model.config, placement=placement, block_size=4)
        model.set_attn_implementation("mpitree")
        got.append(mtt.prefill(model, ids, cache, attention_mask=mask))
        keys = [layer.keys.numpy().copy() for layer in cache.layers]  # this rank's shard
        got.append(keys)
    n_fused = len(calls)
    assert world().allreduce(n_fused) > 0  # some rank held keys and took the fused path
    assert_allclose(got[0].numpy(), got[2].numpy(), atol=2e-5, rtol=0)
    for a, b in zip(got[1], got[3], strict=True):
        for ka, kb in zip(a, b, strict=True):
            assert_allclose(ka, kb, atol=2e-5, rtol=0)
