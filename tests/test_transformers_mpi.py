"""mpitree.adapters.transformers under real ranks: generate == one process, token for token."""

import copy

import mpitree.adapters.transformers as mtt
import numpy as np
import pytest
import torch
import transformers
from helpers import world
from models import VOCAB, positions, prompt, tiny_llama
from numpy.testing import assert_allclose

from mpitree import spec

NEW_TOKENS = 12
LOGIT_ATOL = 1e-4  # the bound for float32 logits


def generate(model, ids, mask, impl, cache=None):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=mask,
            past_key_values=cache,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )


def float64_logits(model, sequences, mask, prompt_len):
    """Teacher-forced float64 logits at every generated step.

    sdpa, not eager: float64 eager turns left-padded rows into NaN (its additive
    mask ``finfo.min`` plus a negative score overflows to -inf on fully masked rows).
    """
    m64 = copy.deepcopy(model).double()
    m64.set_attn_implementation("sdpa")
    full = None
    if mask is not None:
        full = torch.cat([mask, torch.ones_like(sequences[:, prompt_len:])], 1)
    with torch.no_grad():
        logits = m64(sequences, attention_mask=full).logits
    return logits[:, prompt_len - 1 : -1]


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize("placement", mtt.PLACEMENTS)
@pytest.mark.parametrize("strategy", ["allreduce", "ring"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
@pytest.mark.parametrize("sharded_prefill", [False, True], ids=["replicated", "sharded"])
def test_generate_equals_single_process_eager(placement, strategy, padded, sharded_prefill):
    model = tiny_llama()
    ids, mask = prompt(29, padded)
    ref = generate(model, ids, mask, "eager")
    cache = mtt.ShardedCache(model.config, placement=placement, block_size=4, strategy=strategy)
    model.set_attn_implementation("mpitree")
    if sharded_prefill:
        mtt.prefill(model, ids, cache, attention_mask=mask)
    got = generate(model, ids, mask, "mpitree", cache)
    assert torch.equal(got.sequences, ref.sequences)
    ours = torch.stack(got.logits, 1)
    assert_allclose(ours.numpy(), torch.stack(ref.logits, 1).numpy(), atol=LOGIT_ATOL, rtol=0)
    exact = float64_logits(model, got.sequences, mask, ids.shape[1])
    assert_allclose(ours.double().numpy(), exact.numpy(), atol=LOGIT_ATOL, rtol=0)
    # the shards partition the sequence: every token stored exactly once
    total = ids.shape[1] + NEW_TOKENS - 1
    held = world().allgather(cache.layers[0].positions.tolist())
    assert sorted(p for rank in held for p in rank) == list(range(total))
    assert cache.get_seq_length() == total


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize("family", ["qwen2", "mistral-window-6"])
def test_other_model_families_through_the_same_interface(family):
    """Qwen2 (biased projections), and Mistral with a sliding window that bites."""
    torch.manual_seed(0)
    shape = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    if family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shape)).eval()
    else:
        cfg = transformers.MistralConfig(sliding_window=6, **shape)
        model = transformers.MistralForCausalLM(cfg).eval()
    ids, mask = prompt(21, True)
    ref = generate(model, ids, mask, "eager")
    got = generate(model, ids, mask, "mpitree", mtt.ShardedCache(model.config, block_size=4))
    assert torch.equal(got.sequences, ref.sequences)
    ours = torch.stack(got.logits, 1)
    assert_allclose(ours.numpy(), torch.stack(ref.logits, 1).numpy(), atol=LOGIT_ATOL, rtol=0)
    if family != "qwen2":  # the window changed the result: it really was applied
        model.config.sliding_window = None
        unwindowed = torch.stack(generate(model, ids, mask, "eager").logits, 1)
        assert (unwindowed - ours).abs().max() > 1e-2


@pytest.mark.parallel(nprocs=[3, 4])
def test_sharded_prefill_with_ranks_that_own_no_prompt_token():
    model = tiny_llama()
    ids, mask = prompt(6, True)  # 5 prefilled tokens in blocks of 4: ranks >= 2 own none
    ref = generate(model, ids, mask, "eager")
    cache = mtt.ShardedCache(model.config, block_size=4)
    model.set_attn_implementation("mpitree")
    mtt.prefill(model, ids, cache, attention_mask=mask)
    assert cache.local_length() == [4, 1, 0, 0][world().rank]
    got = generate(model, ids, mask, "mpitree", cache)
    assert torch.equal(got.sequences, ref.sequences)
    assert_allclose(
        torch.stack(got.logits, 1).numpy(), torch.stack(ref.logits, 1).numpy(), atol=LOGIT_ATOL
    )


@pytest.mark.parallel(nprocs=[2, 3])
def test_packed_tree_verification_equals_each_candidate_alone():
    model = tiny_llama()
    ids, mask = prompt(23, True)
    cache = mtt.ShardedCache(model.config, block_size=4)
    model.set_attn_implementation("mpitree")
    with torch.no_grad():
        model(ids, attention_mask=mask, position_ids=positions(mask), past_key_values=cache)
    beam = torch.from_numpy(np.random.default_rng(3).integers(1, 4, (2, 5, 4)))
    packed = spec.pack(beam, padding_mask=mask.bool())
    before = [(x.positions.clone(), x.keys.clone()) for x in cache.layers]
    logits = mtt.verify(model, cache, packed, attention_mask=mask)
    assert cache.get_seq_length() == ids.shape[1]  # the tree left no trace
    for (pos, keys), layer in zip(before, cache.layers, strict=False):
        assert torch.equal(pos, layer.positions) and torch.equal(keys, layer.keys)
    assert packed.valid.sum() < beam.numel()  # the tree really shared prefixes
    model.set_attn_implementation("eager")
    n = ids.shape[1]
    with torch.no_grad():
        alone = torch.stack(
            [
                model(
                    torch.cat([ids, beam[:, m]], 1),
                    attention_mask=(full := torch.cat([mask, torch.ones_like(beam[:, m])], 1)),
                    position_ids=positions(full),
                ).logits[:, n:]
                for m in range(beam.shape[1])
            ],
            1,
        )
    assert_allclose(spec.unpack(logits, packed.unpack_map).numpy(), alone.numpy(), atol=1e-5)
    # the cache is as it was: one more token through it matches one process
    nxt = beam[:, 0, :1]
    full = torch.cat([mask, torch.ones_like(nxt)], 1)
    model.set_attn_implementation("mpitree")
    with torch.no_grad():
        step = model(
            nxt, attention_mask=full, position_ids=positions(full)[:, -1:], past_key_values=cache
        ).logits
        model.set_attn_implementation("eager")
        whole = model(torch.cat([ids, nxt], 1), attention_mask=full, position_ids=positions(full))
    assert_allclose(step.numpy(), whole.logits[:, -1:].numpy(), atol=1e-5)


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize(
    "bad",
    [
        dict(world_size=5),
        dict(placement="everywhere"),
        dict(block_size=0),
        dict(strategy="gossip"),
    ],
    ids=lambda d: next(iter(d)),
)
def test_bad_cache_config_raises_on_every_rank(bad):
    rank = world().rank
    kwargs = bad if rank == world().size - 1 else {}  # only the last rank is wrong
    with pytest.raises(ValueError, match=r"world_size=5|placement|block_size|strategy"):
        mtt.ShardedCache(**kwargs)


@pytest.mark.parallel(nprocs=[2])
def test_ranks_disagreeing_on_placement_raise_on_every_rank():
    placement = mtt.PLACEMENTS[world().rank % 2]
    with pytest.raises(ValueError, match="ranks disagree"):
        mtt.ShardedCache(placement=placement)


@pytest.mark.parallel(nprocs=[2, 3])
def test_ranks_diverging_mid_generation_raise_on_every_rank():
    """Each model step re-agrees: a strategy changed on one rank only is caught."""
    model = tiny_llama()
    ids, _ = prompt(9, False)
    cache = mtt.ShardedCache(model.config, block_size=4, strategy="allreduce")
    model.set_attn_implementation("mpitree")
    with torch.no_grad():
        model(ids, past_key_values=cache)
        if world().rank == 0:
            cache.strategy = "ring"
        with pytest.raises(ValueError, match="ranks disagree on strategy"):
            model(ids[:, :1], past_key_values=cache)


@pytest.mark.parallel(nprocs=[2])
def test_mpitree_attention_without_sharded_cache_is_a_clear_error():
    model = tiny_llama()
    model.set_attn_implementation("mpitree")
    ids, _ = prompt(5, False)
    with torch.no_grad(), pytest.raises(TypeError, match="ShardedCache"):
        model(ids)
