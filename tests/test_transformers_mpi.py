"""mpitree.adapters.transformers under real ranks: generate == one process, token for token."""

import copy
import os
import subprocess
import sys

import mpitree.adapters.transformers as mtt
import numpy as np
import pytest
import torch
import transformers
from helpers import counting, world
from models import VOCAB, float64_logits, greedy, positions, prompt, tiny_llama, tiny_mistral
from mpi4py import MPI
from mpitree.adapters.transformers import _cache, _prefill
from numpy.testing import assert_allclose

from mpitree import RankError, extend, spec
from mpitree._strategies import allreduce

NEW_TOKENS = 12
LOGIT_ATOL = 1e-4  # the bound for float32 logits


def generate(model, ids, mask, impl, cache=None):
    model.set_attn_implementation(impl)
    return greedy(model, ids, mask, cache, NEW_TOKENS)


def but_last(mask):
    return None if mask is None else mask[:, :-1]


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
    if sharded_prefill:  # all but the last token: generate runs it and goes on
        mtt.prefill(model, ids[:, :-1], cache, attention_mask=but_last(mask))
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
        model = tiny_mistral(6)
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
    ids, mask = prompt(7, True)  # 5 sharded tokens, then 1, in blocks of 4: ranks >= 2 own none
    ref = generate(model, ids, mask, "eager")
    cache = mtt.ShardedCache(model.config, block_size=4)
    model.set_attn_implementation("mpitree")
    mtt.prefill(model, ids[:, :-1], cache, attention_mask=mask[:, :-1])
    assert cache.local_length() == [4, 2, 0, 0][world().rank]
    got = generate(model, ids, mask, "mpitree", cache)
    assert torch.equal(got.sequences, ref.sequences)
    assert_allclose(
        torch.stack(got.logits, 1).numpy(), torch.stack(ref.logits, 1).numpy(), atol=LOGIT_ATOL
    )


@pytest.mark.parallel(nprocs=[2, 3])
def test_prefill_layer_of_another_dtype_on_one_rank_raises_on_every_rank():
    """A later layer's float64 query on one rank: its buffers keep the agreed dtype.

    Sized by that rank's own dtype, its query all-gather sent twice the bytes the
    others expected (MPI aborted on a truncated message).
    """
    model = tiny_llama(layers=3)
    if world().rank == world().size - 1:
        model.model.layers[1].self_attn.q_proj.register_forward_hook(lambda m, i, o: o.double())
    ids, mask = prompt(23, True)
    cache = mtt.ShardedCache(model.config, block_size=4)
    model.set_attn_implementation("mpitree")
    with pytest.raises(ValueError, match="differs from the step's first layer"):
        mtt.prefill(model, ids, cache, attention_mask=mask)


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize(
    "where", ["keys and values", "second layer's attention", "second layer's cache update"]
)
def test_prefill_out_of_memory_on_one_rank_raises_on_every_rank(where, monkeypatch):
    """Running out of memory on one rank, for the all-gather's buffer or later in a layer.

    The buffer is allocated in the agreement (allocated after it, the failing rank
    raised alone and the others waited in the all-gather for ever); a failure in a
    layer's local attention, after its all-gather, rides in the layer's flag, and so
    does one in a later layer's cache update (that rank took the decode path and
    raised alone, the others waited in the layer's all-gather).
    """
    comm = world()
    if comm.rank == comm.size - 1 and where == "keys and values":
        scratch = _prefill._scratch

        def short(prefill_step, name, *args):
            if name == where:
                raise MemoryError(f"no room for {name}")
            return scratch(prefill_step, name, *args)

        monkeypatch.setattr(_prefill, "_scratch", short)
    elif comm.rank == comm.size - 1 and where == "second layer's cache update":
        append = _cache.ShardedLayer._append

        def failing_append(layer, *args):
            if layer is cache.layers[1] and layer.sharding.pending is not None:
                raise MemoryError(f"no room for {where}")
            return append(layer, *args)

        monkeypatch.setattr(_cache.ShardedLayer, "_append", failing_append)
    elif comm.rank == comm.size - 1:
        attend, layers = _prefill._attend, []

        def failing(*args):
            layers.append(1)
            if len(layers) == 2:
                raise MemoryError(f"no room for {where}")
            return attend(*args)

        monkeypatch.setattr(_prefill, "_attend", failing)
    model = tiny_llama(layers=2)
    ids, mask = prompt(23, True)
    cache = mtt.ShardedCache(model.config, block_size=4)
    model.set_attn_implementation("mpitree")
    with pytest.raises(Exception) as info:
        mtt.prefill(model, ids, cache, attention_mask=mask)
    if comm.rank == comm.size - 1:
        assert info.type is MemoryError
    else:
        assert info.type is RankError
        assert f"MemoryError: no room for {where}" in str(info.value)
    assert cache.get_seq_length() == 0
    monkeypatch.undo()  # and the next prefill goes through
    mtt.prefill(model, ids, cache, attention_mask=mask)
    assert cache.get_seq_length() == ids.shape[1]


@pytest.mark.parallel(nprocs=[1, 2])
def test_prefill_failing_in_its_last_token_step_leaves_the_cache_empty():
    """The prompt's last token runs as an ordinary step after the sharded ones: a failure
    there (on every rank) left the sharded tokens in the cache, and the next prefill
    refused it as not empty."""
    model = tiny_llama(layers=2)
    ids, mask = prompt(23, True)
    cache = mtt.ShardedCache(model.config, block_size=4)
    model.set_attn_implementation("mpitree")
    calls = []

    def fail_second(module, args, out):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the last token's step failed")

    hook = model.model.norm.register_forward_hook(fail_second)
    with pytest.raises(RuntimeError, match="the last token's step failed"):
        mtt.prefill(model, ids, cache, attention_mask=mask)
    assert cache.get_seq_length() == 0 and cache.local_length(0) == 0
    hook.remove()
    logits = mtt.prefill(model, ids, cache, attention_mask=mask)
    assert cache.get_seq_length() == ids.shape[1] and torch.isfinite(logits).all()


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sharded_prefill_moves_each_ranks_keys_and_values_once_per_layer(dtype, monkeypatch):
    """Per layer, a rank hands MPI its own keys and values, in their dtype, and a one-value flag.

    Not every rank's queries and their partial states, as the route before did:
    under Llama-3.1-8B's GQA (32 q / 8 kv heads) that was 4x the bytes and a merge.
    A bfloat16 model's keys and values travel as bfloat16 (they went as float32).
    """
    model = tiny_llama(layers=3).to(dtype)
    ids, mask = prompt(23, True)
    cache = mtt.ShardedCache(model.config, block_size=4)
    model.set_attn_implementation("mpitree")
    step, moved = _prefill._sharded_step, []

    def counted(*args):
        before = extend.traffic.bytes
        step(*args)
        moved.append(extend.traffic.bytes - before)

    monkeypatch.setattr(_prefill, "_sharded_step", counted)
    mtt.prefill(model, ids, cache, attention_mask=mask)
    own = len(_prefill.plan(cache.sharding, 22).mine)  # the last token runs after it
    assert own and cache.local_length(0) in (own, own + 1)
    row = 2 * 2 * 2 * 16 * dtype.itemsize  # K and V, batch 2, 2 kv heads, head_dim 16
    per_layer = own * row + 4  # and the flag (float32)
    assert 3 * per_layer <= moved[0] <= 3 * per_layer + 64  # + the step's agreement


@pytest.mark.parallel(nprocs=[2, 3])
def test_packed_tree_verification_equals_each_candidate_alone():
    model = tiny_llama()
    ids, mask = prompt(23, True)
    cache = mtt.ShardedCache(model.config, block_size=4)
    model.set_attn_implementation("mpitree")
    with torch.no_grad():
        model(ids, attention_mask=mask, position_ids=positions(mask), cache=cache)
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
            nxt, attention_mask=full, position_ids=positions(full)[:, -1:], cache=cache
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
        model(ids, cache=cache)
        if world().rank == 0:
            cache.strategy = "ring"
        with pytest.raises(ValueError, match="ranks disagree on strategy"):
            model(ids[:, :1], cache=cache)


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize("tokens", [1, 3])
def test_position_ids_off_on_one_rank_raise_on_every_rank(tokens):
    """A step's position ids are agreed: one rank's off-by-one is an error there, at once.

    Without it, that step's logits changed silently and the next step's re-feed
    check raised a misleading message.
    """
    model = tiny_llama()
    model.set_attn_implementation("mpitree")
    ids, _ = prompt(9, False)
    cache = mtt.ShardedCache(model.config, block_size=2)
    with torch.no_grad():
        model(ids, cache=cache)
        new = ids[:, :tokens]
        pos = torch.arange(9, 9 + tokens)[None]
        if world().rank == world().size - 1:
            pos = pos + 1
        with pytest.raises(ValueError, match=r"ranks disagree on .*step positions"):
            model(new, cache=cache, position_ids=pos)
        # the failed step left the cache as it was: the agreed step decodes on
        got = model(new, cache=cache, position_ids=torch.arange(9, 9 + tokens)[None]).logits
    assert torch.isfinite(got).all()


EDITS = {  # a crop or batch operation run by one rank only
    "crop": (lambda c: c.crop(-1), "cached tokens"),
    "reorder_cache": (lambda c: c.reorder_cache(torch.tensor([1, 0])), "cache edits"),
    "batch_select_indices": (lambda c: c.batch_select_indices(torch.tensor([1, 0])), "edits"),
    "batch_repeat_interleave": (lambda c: c.batch_repeat_interleave(1), "cache edits"),
}


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize("placement", mtt.PLACEMENTS)
@pytest.mark.parametrize("edit", list(EDITS))
def test_a_cache_edit_on_one_rank_raises_on_every_rank(edit, placement):
    """The step agrees on the cache's length and edits: states of other tokens never merge.

    Without it, a crop or reorder on one rank gave every rank the same wrong logits.
    The same edit on every rank decodes on exactly.
    """
    model = tiny_llama()
    model.set_attn_implementation("mpitree")
    ids, _ = prompt(9, False)
    run, field = EDITS[edit]
    cache = mtt.ShardedCache(model.config, block_size=2, placement=placement)
    twin = mtt.ShardedCache(model.config, block_size=2, placement=placement)
    with torch.no_grad():
        model(ids, cache=cache)
        model(ids, cache=twin)
        if world().rank == world().size - 1:
            run(cache)
        run(twin)
        with pytest.raises(ValueError, match=f"ranks disagree on .*{field}"):
            model(ids[:, :1], cache=cache)
        got = model(ids[:, :1], cache=twin).logits
    model.set_attn_implementation("eager")
    ref = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=ref)
        run(ref)
        want = model(ids[:, :1], cache=ref).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def eager_prefix(model, ids, mask):
    """A DynamicCache holding ``ids`` run by single-process eager (the reference cache)."""
    model.set_attn_implementation("eager")
    cache = transformers.DynamicCache(config=model.config)
    pos = None if mask is None else positions(mask)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, position_ids=pos, cache=cache).logits
    return cache, logits[:, -1]


def shards_partition(cache, total):
    held = world().allgather([layer.positions.tolist() for layer in cache.layers])
    for layer in range(len(cache.layers)):
        assert sorted(p for rank in held for p in rank[layer]) == list(range(total))


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("placement", mtt.PLACEMENTS)
def test_prefill_holds_the_whole_prompt_and_returns_its_logits(placement):
    model = tiny_llama()
    ids, mask = prompt(13, True)
    _, last = eager_prefix(model, ids, mask)
    ref = generate(model, ids, mask, "eager")
    cache = mtt.ShardedCache(model.config, placement=placement, block_size=4)
    model.set_attn_implementation("mpitree")
    logits = mtt.prefill(model, ids, cache, attention_mask=mask)
    assert logits.shape == (2, VOCAB)
    assert_allclose(logits.numpy(), last.numpy(), atol=1e-5, rtol=0)
    assert cache.get_seq_length() == 13
    shards_partition(cache, 13)
    held = [layer.keys.clone() for layer in cache.layers]
    # generate(ids) on a cache that holds all of ids would run the prompt a second time
    with pytest.raises(ValueError, match="strict prefix"):
        generate(model, ids, mask, "mpitree", cache)
    assert cache.get_seq_length() == 13  # and the failed step left no trace
    assert all(torch.equal(k, layer.keys) for k, layer in zip(held, cache.layers, strict=True))
    # the prompt plus prefill's next token goes on exactly as one process does
    nxt = ref.sequences[:, 13:14]
    assert torch.equal(nxt[:, 0], last.argmax(-1))
    more = torch.cat([mask, torch.ones_like(nxt)], 1)
    got = generate(model, torch.cat([ids, nxt], 1), more, "mpitree", cache)
    assert torch.equal(got.sequences[:, : 13 + NEW_TOKENS], ref.sequences)
    shards_partition(cache, 13 + NEW_TOKENS)
    with pytest.raises(ValueError, match="strict prefix"):  # the same cache again: re-fed too
        generate(model, torch.cat([ids, nxt], 1), more, "mpitree", cache)


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_beam_search_from_a_prefilled_cache_expanded_per_beam():
    """``batch_repeat_interleave`` before ``num_beams``; beam search then reorders the rows."""
    model = tiny_llama()
    ids, mask = prompt(17, True, batch=3)
    beams = dict(num_beams=3, num_return_sequences=2)
    alone = generate_beams(model, ids, mask, "eager", None, beams)
    reference, _ = eager_prefix(model, ids[:, :-1], mask[:, :-1])
    reference.batch_repeat_interleave(3)
    assert torch.equal(generate_beams(model, ids, mask, "eager", reference, beams), alone)
    cache = mtt.ShardedCache(model.config, block_size=4)
    model.set_attn_implementation("mpitree")
    mtt.prefill(model, ids[:, :-1], cache, attention_mask=mask[:, :-1])
    cache.batch_repeat_interleave(3)
    assert all(layer.keys.shape[0] == 9 for layer in cache.layers)  # on every rank
    assert torch.equal(generate_beams(model, ids, mask, "mpitree", cache, beams), alone)


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_batch_select_indices_keeps_the_chosen_rows_in_order():
    model = tiny_llama()
    ids, mask = prompt(15, True, batch=3)  # row 1 left-padded: its padding follows it
    rows = torch.tensor([2, 1])
    alone = generate(model, ids[rows], mask[rows], "eager")
    reference, _ = eager_prefix(model, ids[:, :-1], mask[:, :-1])
    reference.batch_select_indices(rows)
    ref = generate(model, ids[rows], mask[rows], "eager", reference)
    assert torch.equal(ref.sequences, alone.sequences)
    cache = mtt.ShardedCache(model.config, block_size=4)
    model.set_attn_implementation("mpitree")
    mtt.prefill(model, ids[:, :-1], cache, attention_mask=mask[:, :-1])
    cache.batch_select_indices(rows)
    with pytest.raises(ValueError, match="strict prefix"):  # the rows' positions followed them
        generate(model, ids[rows, :-1], mask[rows, :-1], "mpitree", cache)
    got = generate(model, ids[rows], mask[rows], "mpitree", cache)
    assert torch.equal(got.sequences, alone.sequences)
    ours, theirs = (torch.stack(x.logits, 1).numpy() for x in (got, ref))
    assert_allclose(ours, theirs, atol=LOGIT_ATOL, rtol=0)


def generate_beams(model, ids, mask, impl, cache, beams):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=mask,
            cache=cache,
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=0,
            **beams,
        )


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_deepcopy_reuses_a_prefilled_prompt_for_several_continuations():
    """transformers' prompt reuse: prefill once, ``copy.deepcopy`` per continuation."""
    model = tiny_llama()
    ids, mask = prompt(14, True)
    reference, _ = eager_prefix(model, ids, mask)
    cache = mtt.ShardedCache(model.config, block_size=4)
    model.set_attn_implementation("mpitree")
    mtt.prefill(model, ids, cache, attention_mask=mask)
    held = [(layer.positions.clone(), layer.keys.clone()) for layer in cache.layers]
    rng = np.random.default_rng(5)
    for _ in range(2):
        suffix = torch.from_numpy(rng.integers(1, VOCAB, (2, 3)))
        longer = torch.cat([ids, suffix], 1)
        more = torch.cat([mask, torch.ones_like(suffix)], 1)
        ref = generate(model, longer, more, "eager", copy.deepcopy(reference))
        assert torch.equal(ref.sequences, generate(model, longer, more, "eager").sequences)
        twin = copy.deepcopy(cache)
        assert twin.comm is cache.comm and twin.layers[0].sharding is twin.sharding
        got = generate(model, longer, more, "mpitree", twin)
        assert torch.equal(got.sequences, ref.sequences)
        ours, theirs = (torch.stack(x.logits, 1).numpy() for x in (got, ref))
        assert_allclose(ours, theirs, atol=LOGIT_ATOL, rtol=0)
        assert twin.get_seq_length() == 16 + NEW_TOKENS
    assert cache.get_seq_length() == 14  # the copies grew, the prompt cache did not
    for (pos, keys), layer in zip(held, cache.layers, strict=True):
        assert torch.equal(pos, layer.positions) and torch.equal(keys, layer.keys)


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("family", ["llama", "mistral-window-6"])
def test_without_a_sharded_cache_every_rank_attends_locally(family):
    """``use_cache=False`` and transformers' own cache: exact, with no merge."""
    model = tiny_llama() if family == "llama" else tiny_mistral(6)
    ids, mask = prompt(19, True)
    real = mask.bool().numpy()  # padded queries see no key: their outputs are arbitrary
    logits = {}
    for impl in ("eager", "mpitree"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            logits[impl] = model(ids, attention_mask=mask, use_cache=False).logits.numpy()
    assert_allclose(logits["mpitree"][real], logits["eager"][real], atol=1e-5, rtol=0)
    ref = generate(model, ids, mask, "eager")
    got = generate(model, ids, mask, "mpitree")  # transformers' DynamicCache
    assert torch.equal(got.sequences, ref.sequences)
    ours = torch.stack(got.logits, 1).numpy()
    assert_allclose(ours, torch.stack(ref.logits, 1).numpy(), atol=LOGIT_ATOL, rtol=0)
    model.set_attn_implementation("mpitree")
    with torch.no_grad():
        kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, use_cache=False)
        uncached = model.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(uncached, ref.sequences[:, : ids.shape[1] + 4])


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize("bad_rank", ["first", "last"])
def test_a_rank_without_the_sharded_cache_raises_on_every_rank(bad_rank):
    model = tiny_llama()
    model.set_attn_implementation("mpitree")
    ids, _ = prompt(9, False)
    cache = mtt.ShardedCache(model.config, block_size=4)
    bad = world().rank == (0 if bad_rank == "first" else world().size - 1)
    with torch.no_grad(), pytest.raises(ValueError, match="ranks disagree on cache"):
        model(ids, cache=None if bad else cache, use_cache=not bad)
    assert cache.get_seq_length() == 0  # the failed step left the cache empty
    with torch.no_grad():  # the communicator still works: the same step, now on every rank
        got = model(ids, cache=cache).logits
    model.set_attn_implementation("eager")
    with torch.no_grad():
        assert_allclose(got.numpy(), model(ids).logits.numpy(), atol=1e-5, rtol=0)


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("layers", [1, 2])
def test_a_sharded_cache_under_another_attention_raises_on_every_rank(layers):
    """sdpa over a ShardedCache attended each rank's shard alone, silently:
    the next update (the next layer's, or a one-layer model's next forward's) raises on
    every rank, before it stores anything. Reset, under mpitree's attention, it is exact."""
    model = tiny_llama(layers)
    ids, _ = prompt(9, False)
    cache = mtt.ShardedCache(model.config, block_size=4)
    model.set_attn_implementation("sdpa")
    with torch.no_grad(), pytest.raises(ValueError, match="without mpitree's attention"):
        model(ids, cache=cache)
        model(ids[:, -1:], cache=cache)
    assert [layer.length for layer in cache.layers] == [ids.shape[1]] + [0] * (layers - 1)
    with torch.no_grad(), pytest.raises(ValueError, match="without mpitree's attention"):
        model(ids[:, -1:], cache=cache)  # until the cache is reset
    cache.reset()
    model.set_attn_implementation("mpitree")
    with torch.no_grad():
        got = [model(ids[:, :-1], cache=cache).logits, model(ids[:, -1:], cache=cache).logits]
    model.set_attn_implementation("eager")
    with torch.no_grad():
        want = model(ids).logits
    assert_allclose(torch.cat(got, 1).numpy(), want.numpy(), atol=1e-5, rtol=0)


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize("with_config", [True, False])
def test_a_cache_reset_on_one_rank_after_another_attention_raises_on_every_rank(with_config):
    """After sdpa's error, a reset on rank 0 alone: rank 0's cache is clean, the others'
    still hold the unattended step. Under mpitree's attention the next forward raises on
    every rank (the others' verdict rides in the step's agreement), never a hang; reset on
    every rank, it is exact."""
    model = tiny_llama(2)
    ids, _ = prompt(9, False)
    cache = mtt.ShardedCache(model.config if with_config else None, block_size=4)
    model.set_attn_implementation("sdpa")
    with torch.no_grad(), pytest.raises(ValueError, match="without mpitree's attention"):
        model(ids, cache=cache)
    model.set_attn_implementation("mpitree")
    if MPI.COMM_WORLD.rank == 0:
        cache.reset()
    with torch.no_grad(), pytest.raises(Exception) as info:
        model(ids, cache=cache)
    if MPI.COMM_WORLD.rank:
        assert "without mpitree's attention" in str(info.value)
    else:
        assert isinstance(info.value, RankError), info.value
    cache.reset()
    with torch.no_grad():
        got = model(ids, cache=cache).logits
    model.set_attn_implementation("eager")
    with torch.no_grad():
        want = model(ids).logits
    assert_allclose(got.numpy(), want.numpy(), atol=1e-5, rtol=0)


NO_TORCH = "raise ImportError('torch is not installed here')\n"


@pytest.mark.parametrize("absent", ["torch", "transformers"])
def test_import_without_torch_or_transformers_says_what_to_install(absent, tmp_path):
    (tmp_path / f"{absent}.py").write_text(NO_TORCH.replace("torch", absent))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "MPI", "HYDRA"))}
    env["PYTHONPATH"] = str(tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", "import mpitree.adapters.transformers"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: mpitree.adapters.transformers needs"), last
    assert "pip install -e '.[transformers]' from the checkout" in last
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in last
    assert f"{absent} is not installed here" in last


@pytest.mark.parallel(nprocs=[1, 2])
@pytest.mark.parametrize("placement", mtt.PLACEMENTS)
def test_decode_steps_append_in_place_and_stay_exact(placement):
    """A decode step copies its one token into spare room: no new shard tensors per step."""
    model = tiny_llama()
    ids, mask = prompt(30, False)
    ref = generate(model, ids, mask, "eager")
    cache = mtt.ShardedCache(model.config, placement=placement, block_size=2)
    model.set_attn_implementation("mpitree")
    mtt.prefill(model, ids[:, :-1], cache)  # no padding: mask is None
    tokens, storages = ids, set()
    for _ in range(NEW_TOKENS):
        with torch.no_grad():
            logits = model(tokens[:, -1:], cache=cache).logits[:, -1]
        tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], 1)
        storages.add(cache.layers[0].keys.untyped_storage().data_ptr())
    assert torch.equal(tokens, ref.sequences)
    assert len(storages) == 1  # one buffer for every step (its room: 256 tokens)
    cache.crop(-3)  # a crop keeps the buffer too; the next step overwrites the dropped room
    with torch.no_grad():
        model(tokens[:, -3:-2], cache=cache)
    assert cache.layers[0].keys.untyped_storage().data_ptr() in storages


@pytest.mark.parallel(nprocs=[1, 2])
def test_decode_layers_reuse_their_bound_kernel_arguments(monkeypatch):
    """Each layer binds its one-call decode step once per buffer, then runs it every step."""
    from mpitree import _steps

    binds, real_of = [], _steps.Bound.layer
    bind = lambda *a, **k: binds.append(1) or real_of(*a, **k)  # noqa: E731
    monkeypatch.setattr(_steps.Bound, "layer", bind)
    runs = counting(monkeypatch)  # the kernel inside the merge (1), or the one call (2)
    model = tiny_llama()
    ids, _ = prompt(30, False)
    ref = generate(model, ids, None, "eager")
    cache = mtt.ShardedCache(model.config, placement="last")
    model.set_attn_implementation("mpitree")
    mtt.prefill(model, ids[:, :-1], cache)
    binds.clear()
    tokens = ids
    for _ in range(NEW_TOKENS):
        with torch.no_grad():
            logits = model(tokens[:, -1:], cache=cache).logits[:, -1]
        tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], 1)
    assert torch.equal(tokens, ref.sequences)
    layers = len(cache.layers)  # every rank holds prompt keys: prefill's last step binds
    assert len(runs) == NEW_TOKENS * layers and not binds, (binds, runs)
    twin = copy.deepcopy(cache)  # a copy binds afresh (bound arguments hold raw pointers)
    assert twin.layers[0].kernel is not cache.layers[0].kernel and twin.layers[0].fast is None


@pytest.mark.parallel(nprocs=[1])
def test_a_row_slice_of_the_shard_is_not_mistaken_for_its_buffer():
    cache = mtt.ShardedCache()
    cache.update(torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4), 0)
    cache.batch_select_indices(slice(0, 1))  # a view at the buffer's address, one row
    token = torch.randn(1, 2, 1, 4)
    keys, _ = cache.update(token, token, 0)
    assert keys.shape == (1, 2, 6, 4) and torch.equal(keys[:, :, -1:], token)


@pytest.mark.parallel(nprocs=[1, 2, 3, 4])
@pytest.mark.parametrize("placement", mtt.PLACEMENTS)
@pytest.mark.parametrize("length", [2, 9])
def test_mask_check_does_not_depend_on_placement(placement, length):
    """A 4-D mask with Hkv heads (neither 1 nor Hq) is refused on every rank, keys or none.

    With block 4, ``"interleave"`` leaves rank 3 without keys at p = 4, and ``"last"``
    with a 2-token prompt leaves ranks 1 and 3 without (before, those ranks and every
    rank of a placement whose shards were all-visible accepted it, and the kernel read
    the 2-head mask as if it had 4 heads).
    """
    model = tiny_llama()
    model.set_attn_implementation("mpitree")
    ids, _ = prompt(length, False)
    cache = mtt.ShardedCache(model.config, block_size=4, placement=placement)
    bad = torch.ones(2, 2, length, length, dtype=torch.bool).tril()
    with torch.no_grad(), pytest.raises(ValueError, match="4-D attention_mask must be"):
        model(ids, cache=cache, attention_mask=bad)
    with torch.no_grad():  # the prompt again, then a decode step with a bad mask
        model(ids, cache=cache)
        step = torch.ones(2, 2, 1, length + 1, dtype=torch.bool)
        with pytest.raises(ValueError, match="4-D attention_mask must be"):
            model(ids[:, :1], cache=cache, attention_mask=step)
        good = torch.ones(2, 1, 1, length + 1, dtype=torch.bool)
        model(ids[:, :1], cache=cache, attention_mask=good)  # still usable


@pytest.mark.parallel(nprocs=[1, 2])
def test_cache_tensors_save_and_keep_no_layer_alive(tmp_path):
    """Keys and values handed out by a ShardedCache are plain tensors, as DynamicCache's are."""
    import gc
    import io
    import pickle
    import weakref

    model = tiny_llama()
    model.set_attn_implementation("mpitree")
    ids, _ = prompt(9, False)
    cache = mtt.ShardedCache(model.config, block_size=4)
    with torch.no_grad():
        model(ids, cache=cache)
    keys, values = cache.layers[0].keys, cache.layers[0].values
    assert not keys.__dict__ and not values.__dict__  # nothing attached
    buf = io.BytesIO()
    torch.save((keys, values), buf)  # before: "cannot serialize Intracomm"
    buf.seek(0)
    k2, v2 = torch.load(buf)
    assert torch.equal(k2, keys) and torch.equal(v2, values)
    assert torch.equal(pickle.loads(pickle.dumps(keys)), keys)
    layer = weakref.ref(cache.layers[0])
    del cache
    gc.collect()
    assert layer() is None  # the tensors outlive the cache without keeping it


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("placement", mtt.PLACEMENTS)
def test_crop_keeps_a_view_as_documented(placement):
    """Documented (ShardedCache.crop, docs/transformers.md): unlike DynamicCache's, a key
    tensor taken before a crop may see a token appended after it, in the cropped-off
    range only; what the crop kept never changes, and a clone never does."""
    model = tiny_llama()
    model.set_attn_implementation("mpitree")
    ids, _ = prompt(9, False)
    cache = mtt.ShardedCache(model.config, block_size=4, placement=placement)
    with torch.no_grad():
        model(ids, cache=cache)
    before = cache.layers[0].keys
    kept = before.clone()
    cache.crop(-3)  # positions 6..8 dropped; the next token is position 6 again
    n = cache.layers[0].keys.shape[2]
    with torch.no_grad():
        model((ids[:, 6:7] + 1) % model.config.vocab_size, cache=cache)
    assert torch.equal(before[:, :, :n], kept[:, :, :n])  # the kept range never changes
    changed = world().allreduce(int(not torch.equal(before, kept)))
    # interleave: position 6 goes back to its block's rank, into the dropped room
    assert changed == 1 if placement == "interleave" else changed <= 1
    assert "clone()" in mtt.ShardedCache.crop.__doc__  # and the docs say so


def _attend_by_hand(kw, last_only=False, mask=False):
    """Decode steps over two layers by hand, each call given ``kw`` (or only the last step's
    later layer, which runs in the lane, its one compiled call): the outputs."""
    torch.manual_seed(0)
    cache = mtt.ShardedCache(tiny_llama().config, block_size=1)
    q = torch.randn(2, 4, 1, 16)
    outs, steps = [], world().size + 2  # every rank holds keys, and its later layer is bound
    for step in range(steps):
        for layer in range(2):
            keys, values = cache.update(torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16), layer)
            given = kw if not last_only or (step, layer) == (steps - 1, 1) else {}
            seen = torch.ones(2, 1, 1, step + 1, dtype=torch.bool) if mask else None
            with torch.no_grad():
                outs.append(mtt.attention_interface(None, q, keys, values, seen, **given)[0])
    return torch.stack(outs)


ARGUMENTS = {
    "output flags": ({"use_cache": True, "output_attentions": False}, None),
    "hidden states": ({"output_hidden_states": True}, None),
    "a MoE flag": ({"output_router_logits": False}, None),
    "a loss's item count": ({"num_items_in_batch": 4}, None),
    "packed-sequence lengths": ({"cu_seq_lens_q": torch.tensor([0, 1]), "max_length_q": 1}, None),
    "packed-sequence index": ({"seq_idx": torch.zeros(2, 1, dtype=torch.int32)}, None),
    "causal, as a tensor": ({"is_causal": torch.tensor(True)}, None),
    "unset features": ({"softcap": None, "s_aux": None, "position_bias": None, "new": None}, None),
    "an unknown argument": ({"attention_bias": torch.zeros(4)}, "argument 'attention_bias'"),
    "position bias": ({"position_bias": torch.zeros(2, 4, 1, 3)}, "position bias"),
    "not causal, no mask": ({"is_causal": False}, "not causal"),
    "not causal, a tensor": ({"is_causal": torch.tensor(False)}, "not causal"),
    "softcap": ({"softcap": 30.0}, "softcap"),
    "attention sinks": ({"s_aux": torch.zeros(4)}, "attention sinks"),
}


@pytest.mark.parallel(nprocs=[1, 2])
@pytest.mark.parametrize("last_only", [False, True], ids=["every call", "a bound later layer"])
@pytest.mark.parametrize("name", ARGUMENTS)
def test_attention_arguments_change_nothing_or_are_refused(name, last_only, monkeypatch):
    """transformers' extra attention arguments: flags and unset features change no bit;
    anything the attention would have to apply but does not is refused, never ignored."""
    kw, refused = ARGUMENTS[name]
    if refused is None:
        plain = _attend_by_hand({})
        runs = counting(monkeypatch)
        assert torch.equal(_attend_by_hand(kw, last_only), plain)
        one_call = world().size == 1 or allreduce._PERSISTENT_OK  # Open MPI: blocking
        assert runs[-1] == (2 if one_call else 1), runs  # the last layer ran its bound step
    else:
        with pytest.raises(ValueError, match=refused):
            _attend_by_hand(kw, last_only)


@pytest.mark.parallel(nprocs=[1, 2])
def test_not_causal_with_a_mask_is_the_masks_attention():
    """is_causal=False beside a mask is allowed: the mask decides, as in sdpa."""
    assert torch.equal(
        _attend_by_hand({"is_causal": False}, mask=True), _attend_by_hand({}, mask=True)
    )
