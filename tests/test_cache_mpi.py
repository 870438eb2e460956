"""ShardedCache's model step: it begins at a forward's first cached layer, whatever its index."""

import threading

import mpitree.adapters.transformers as mtt
import numpy as np
import pytest
import torch
from helpers import world
from numpy.testing import assert_allclose

from mpitree import _agreed, _guard, reference_attention

B, HQ, HKV, D = 2, 4, 2, 8
CACHED = (1, 3)  # the layers that cache: layer 0 (say a linear-attention layer) does not


def tensors(seed, length):
    """Query ``(B, Hq, length, D)``, new key and value ``(B, Hkv, length, D)``, on every rank."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, length, D, generator=g)
    k, v = (torch.randn(B, HKV, length, D, generator=g) for _ in range(2))
    return q, k, v


def forward(cache, seed, length, whole, scaling=None):
    """One model step over the cached layers; check each layer against float64 attention.

    ``whole[layer]`` holds every key and value fed so far (the unsharded cache).
    """
    start = cache.get_seq_length(CACHED[0]) if cache.layers else 0
    for layer in CACHED:
        q, k, v = tensors(seed + layer, length)
        keys, values = cache.update(k, v, layer)
        out, _ = mtt.attention_interface(None, q, keys, values, None, scaling)
        before = whole.get(layer, (k[:, :, :0], v[:, :, :0]))
        ks, vs = whole[layer] = torch.cat([before[0], k], 2), torch.cat([before[1], v], 2)
        causal = np.arange(start + length) <= np.arange(start, start + length)[:, None]
        want, _ = reference_attention(q.double(), ks.double(), vs.double(), visible=causal)
        assert_allclose(out.transpose(1, 2).numpy(), want, atol=2e-5, rtol=0)


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("placement", mtt.PLACEMENTS)
def test_steps_of_a_cache_whose_layer_0_caches_nothing_stay_exact(placement):
    """A prompt then decode steps: each step agrees afresh though no update has layer_idx 0.

    A step used to begin only at layer 0: the prompt's agreement (7 queries)
    then held every decode step (1 query) to it, and the decode step raised.
    """
    cache = mtt.ShardedCache(placement=placement, block_size=2)
    whole = {}
    forward(cache, 0, 7, whole)
    for step in range(1, 6):
        forward(cache, 10 * step, 1, whole)
    forward(cache, 100, 3, whole)  # a verify-sized step after decode steps
    assert cache.get_seq_length(CACHED[0]) == 7 + 5 + 3
    held = world().allgather(cache.layers[CACHED[0]].positions.tolist())
    assert sorted(p for rank in held for p in rank) == list(range(15))


@pytest.mark.parallel(nprocs=[2, 3])
def test_a_crop_on_one_rank_raises_on_every_rank_when_layer_0_caches_nothing():
    """Each step agrees on the cache's length, also when its first cached layer is not 0.

    A step used to begin only at layer 0: the first step's agreement held every
    later one, so a crop on one rank merged states of different tokens silently.
    """
    cache = mtt.ShardedCache(block_size=2)
    whole = {}
    for step in range(6):  # every step one token: the same signature step after step
        forward(cache, 10 * step, 1, whole)
    if world().rank == world().size - 1:
        cache.crop(-1)
    with pytest.raises(ValueError, match=r"ranks disagree on .*cached tokens"):
        forward(cache, 100, 1, whole)


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_steady_decode_steps_agree_every_step_on_a_kept_encoding(monkeypatch):
    """A decode step like the last but one token longer still runs its agreement, cheaply.

    Its checks' facts repeat, so the agreement's encoding is kept (its key) and the
    cache's length rides in it as a count: no signature is encoded afresh.
    """
    cache = mtt.ShardedCache(block_size=2)
    whole = {}
    forward(cache, 0, 7, whole)
    forward(cache, 10, 1, whole)  # the first decode step: its facts are new
    agreed, encoded = [], []
    agree, encoding = _agreed.agree, _guard._Encoding.__init__
    monkeypatch.setattr(_agreed, "agree", lambda *a: agreed.append(1) or agree(*a))
    monkeypatch.setattr(_guard._Encoding, "__init__", lambda *a: encoded.append(1) or encoding(*a))
    for step in range(2, 7):
        forward(cache, 10 * step, 1, whole)
    assert len(agreed) == 5 and not encoded, (agreed, encoded)


@pytest.mark.parallel(nprocs=[2, 3])
def test_a_scaling_changed_on_one_rank_after_steady_steps_raises_on_every_rank():
    """The kept checks do not hide a change: other facts give another signature."""
    cache = mtt.ShardedCache(block_size=2)
    whole = {}
    for step in range(5):
        forward(cache, 10 * step, 1, whole)
    scaling = 0.5 if world().rank == world().size - 1 else None
    with pytest.raises(ValueError, match=r"ranks disagree on .*scaling"):
        forward(cache, 100, 1, whole, scaling)


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_a_forward_that_failed_midway_raises_on_every_rank_at_the_next_step():
    """Layers a step apart are refused (they silently merged a mix of steps before)."""
    cache = mtt.ShardedCache(block_size=2)
    whole = {}
    for step in range(4):
        forward(cache, 10 * step, 1, whole)
    q, k, v = tensors(50, 1)
    keys, values = cache.update(k, v, CACHED[0])
    mtt.attention_interface(None, q, keys, values, None)  # then the next layer's hook raised
    with pytest.raises(ValueError, match="failed midway"):  # the retry
        for layer in CACHED:
            mtt.attention_interface(None, q, *cache.update(k, v, layer), None)


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("pattern", ["shared", "updates first", "another thread"])
def test_shard_keys_attended_away_from_their_update_raise_on_every_rank(pattern):
    """A layer's K/V attended by another layer's call, after another update, or in another
    thread than their update's, are refused.

    Such calls attended this rank's shard alone as if it were every key, silently
    (one layer's K/V shared with later layers, as Gemma3n's KV sharing does; a call
    in another thread found no update there).
    """
    cache = mtt.ShardedCache(block_size=2)
    whole = {}
    for step in range(3):
        forward(cache, 10 * step, 1, whole)
    q, k, v = tensors(70, 1)
    first = cache.update(k, v, CACHED[0])
    with pytest.raises(ValueError, match="K/V other than"):
        if pattern == "shared":
            mtt.attention_interface(None, q, *first, None)
            mtt.attention_interface(None, q, *first, None)  # the next layer reuses them
        elif pattern == "updates first":
            cache.update(k, v, CACHED[1])
            mtt.attention_interface(None, q, *first, None)
        else:
            raised = []

            def attend():
                try:
                    mtt.attention_interface(None, q, *first, None)
                except Exception as exc:
                    raised.append(exc)

            thread = threading.Thread(target=attend)
            thread.start()
            thread.join()
            if raised:
                raise raised[0]


@pytest.mark.parallel(nprocs=[2, 3])
def test_a_batch_kept_by_mask_on_one_rank_and_by_indices_on_another_raises():
    """``[True, True]`` keeps rows 0 and 1; ``[1, 1]`` doubles row 1: the edits differ."""
    cache = mtt.ShardedCache(block_size=2)
    whole = {}
    for step in range(3):
        forward(cache, 10 * step, 1, whole)
    last = world().rank == world().size - 1
    cache.batch_select_indices(torch.tensor([1, 1]) if last else torch.tensor([True, True]))
    with pytest.raises(ValueError, match=r"ranks disagree on .*cache edits"):
        forward(cache, 100, 1, whole)
