"""mpitree.adapters.flash_attn under real ranks.

flash-attn needs a CUDA GPU. Without one, the adapter's edge conversions (layouts,
paged caches, ``cache_seqlens``, the ``+inf`` lse of rows without keys) are tested
against a torch stand-in implementing ``flash_attn_with_kvcache``'s documented
semantics; the real kernel is tested by ``test_real_flash_attn_on_cuda``.
"""

import importlib
import sys

import numpy as np
import pytest
import torch
from helpers import make_problem, world
from numpy.testing import assert_allclose
from standins import fake_flash_attn


@pytest.fixture
def adapter(monkeypatch):
    """The adapter imported over the stand-in flash_attn module."""
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn())
    monkeypatch.delitem(sys.modules, "mpitree.adapters.flash_attn", raising=False)
    yield importlib.import_module("mpitree.adapters.flash_attn")
    sys.modules.pop("mpitree.adapters.flash_attn", None)


def paged(x, order, page):
    """(B, Hkv, T, D) -> flash-layout pages (num_blocks, page, Hkv, D) placed by ``order``."""
    b, h, t, d = x.shape
    flash = torch.zeros(b, order.shape[1] * page, h, d, dtype=x.dtype)
    flash[:, :t] = x.transpose(1, 2)
    cache = torch.zeros(order.numel() + 1, page, h, d, dtype=x.dtype)  # one spare page
    cache[order.flatten().long()] = flash.reshape(-1, page, h, d)
    return cache


def run(fa, strategy, dtype, paged_cache, device="cpu", page=4):
    comm = world()
    prob = make_problem(11, [7, 0, 12, 5][: comm.size], q_heads=8, kv_heads=2, kv_len=True)
    rounded = [torch.from_numpy(x).to(dtype).double().numpy() for x in (prob.q, prob.k, prob.v)]
    prob.q, prob.k, prob.v = rounded
    k, v, kw = prob.shard(comm.rank)
    q = torch.from_numpy(prob.q).to(dtype).transpose(1, 2)  # flash layout (B, Sq, Hq, D)
    k, v = (torch.from_numpy(x).to(dtype) for x in (k, v))
    seqlens = torch.from_numpy(kw["kv_len"]).int()
    table = None
    if paged_cache:  # pages of the shard scattered over the cache in a random order
        pages = max(-(-k.shape[2] // page), 1)
        rng = np.random.default_rng(comm.rank)
        table = torch.from_numpy(rng.permutation(2 * pages)).int().reshape(2, pages)
        k, v = paged(k, table, page), paged(v, table, page)
    else:
        k, v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    on = [x.to(device) for x in (q, k, v)]
    out, lse = fa.tree_decode(
        on[0].contiguous(),
        on[1],
        on[2],
        cache_seqlens=seqlens.to(device),
        block_table=None if table is None else table.to(device),
        strategy=strategy,
        return_lse=True,
    )
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (2, 8, 1)
    ref, ref_lse = prob.reference()
    got = out.double().cpu().transpose(1, 2).numpy()
    assert not np.isnan(got).any()
    assert_allclose(got, ref, atol=2e-3 if dtype == torch.float16 else 2e-2, rtol=0)
    fin = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse.cpu().numpy()), fin)
    assert_allclose(lse.cpu().numpy()[fin], ref_lse[fin], rtol=1e-4, atol=1e-4)


@pytest.mark.parallel(nprocs=[1, 2, 3, 4])
@pytest.mark.parametrize("strategy", ["allreduce", "allgather"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("paged_cache", [False, True], ids=["contiguous", "paged"])
def test_flash_layout_paged_cache_and_empty_rows(adapter, strategy, dtype, paged_cache):
    run(adapter, strategy, dtype, paged_cache)


def test_rows_without_keys_become_the_empty_state(adapter):
    out = torch.ones(1, 2, 3, 4)
    lse = torch.tensor([[[0.5, torch.inf], [-torch.inf, 1.0], [2.0, 3.0]]])
    rec = adapter.records_from_lse(out, lse)
    assert rec.shape == (1, 3, 2, 6) and rec.dtype == torch.float32
    empty = ~torch.isfinite(lse)
    assert torch.all(rec[..., 0][empty] == -torch.inf)
    assert torch.all(rec[..., 1:][empty] == 0)
    assert torch.equal(rec[..., 0][~empty], lse[~empty]) and torch.all(rec[..., 1][~empty] == 1)


@pytest.mark.parallel(nprocs=[2])
def test_ring_is_refused_on_every_rank(adapter):
    q = torch.zeros(1, 1, 4, 8, dtype=torch.float16)
    kv = torch.zeros(1, 5, 2, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"ring|invalid input"):
        adapter.tree_decode(q, kv, kv, strategy="ring")


@pytest.mark.cuda
@pytest.mark.parallel(nprocs=[1, 2])
@pytest.mark.parametrize("paged_cache", [False, True], ids=["contiguous", "paged"])
def test_real_flash_attn_on_cuda(paged_cache):
    pytest.importorskip("flash_attn")
    from mpitree.adapters import flash_attn as fa

    run(
        fa, "allreduce", torch.bfloat16, paged_cache, device="cuda", page=256
    )  # flash-attn's minimum
