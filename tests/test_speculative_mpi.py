"""Speculative decoding over a ShardedCache under real ranks: plain greedy's tokens and cache."""

import copy
import sys

import mpitree.adapters.transformers as mtt
import pytest
import torch
import transformers
from helpers import world
from launch import run
from models import VOCAB, prompt, tiny_llama
from numpy.testing import assert_allclose

import mpitree

NEW = 16
KV_ATOL = 1e-5  # K/V computed in a verification pass vs one token at a time


def greedy(model, ids, mask, impl, cache=None, new=NEW):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=mask,
            cache=cache,
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )


def other_model():
    """A different random Llama (one layer): its drafts are mostly rejected."""
    torch.manual_seed(7)
    cfg = copy.deepcopy(tiny_llama().config)
    cfg.num_hidden_layers = 1
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("eager")
    return model


def draft_of(model):
    """A copy of the target under eager attention: its first branch is always accepted."""
    twin = copy.deepcopy(model)
    twin.set_attn_implementation("eager")
    return twin


def case_inputs(case, model):
    """Prompt, mask and drafter of a test case; the prompt is batch 2, row 1 left-padded."""
    ids, mask = prompt(13 if case == "lookup-rejecting" else 29, True)
    if case == "lookup-accepting":  # the model's own looping continuation: lookups hit
        more = greedy(model, ids, mask, "eager", new=12)[:, ids.shape[1] :]
        ids, mask = torch.cat([ids, more], 1), torch.cat([mask, torch.ones_like(more)], 1)
    drafter = {
        "lookup-accepting": lambda: mtt.PromptLookup(num_tokens=4),
        "lookup-rejecting": lambda: mtt.PromptLookup(num_tokens=4),
        "draft-accepting": lambda: mtt.DraftModel(draft_of(model), num_tokens=4, top_k=2),
        "draft-rejecting": lambda: mtt.DraftModel(other_model(), num_tokens=3, top_k=3),
    }[case]()
    return ids, mask, drafter


def assert_same_cache(cache, plain):
    """Same global indices on this rank, same positions, same K/V (to float rounding)."""
    assert cache.get_seq_length() == plain.get_seq_length()
    assert torch.equal(cache.sharding.history, plain.sharding.history)
    for ours, theirs in zip(cache.layers, plain.layers, strict=True):
        assert torch.equal(ours.positions, theirs.positions)
        assert_allclose(ours.keys.numpy(), theirs.keys.numpy(), atol=KV_ATOL, rtol=0)
        assert_allclose(ours.values.numpy(), theirs.values.numpy(), atol=KV_ATOL, rtol=0)


def shards_partition(cache, total):
    held = world().allgather([layer.positions.tolist() for layer in cache.layers])
    for layer in range(len(cache.layers)):
        assert sorted(p for rank in held for p in rank[layer]) == list(range(total))


@pytest.mark.parallel(nprocs=[1, 2, 3, 4])
@pytest.mark.parametrize("budget", ["every step", "adaptive"])
@pytest.mark.parametrize("placement", mtt.PLACEMENTS)
@pytest.mark.parametrize(
    "case", ["lookup-accepting", "lookup-rejecting", "draft-accepting", "draft-rejecting"]
)
def test_tokens_and_cache_equal_plain_greedy(placement, case, budget):
    """Drafting every step (node_cost=None), or under the adaptive budget: plain greedy."""
    model = tiny_llama()
    ids, mask, drafter = case_inputs(case, model)
    eager, sdpa = (greedy(model, ids, mask, impl) for impl in ("eager", "sdpa"))
    assert torch.equal(eager, sdpa)
    plain = mtt.ShardedCache(model.config, placement=placement, block_size=4)
    assert torch.equal(greedy(model, ids, mask, "mpitree", plain), eager)
    cache = mtt.ShardedCache(model.config, placement=placement, block_size=4)
    cost = {"node_cost": None} if budget == "every step" else {}
    out = mtt.generate(
        model, ids, cache, drafter=drafter, max_new_tokens=NEW, attention_mask=mask, **cost
    )
    assert torch.equal(out.sequences, eager)
    assert_same_cache(cache, plain)
    shards_partition(cache, ids.shape[1] + NEW - 1)
    assert int(out.committed.sum()) == NEW - 1  # the first token comes from the prompt's step
    assert out.accepted.shape == (len(out.committed), 2)
    assert bool((out.committed == out.accepted.min(-1).values + 1).all())
    if budget == "adaptive":  # plain steps where drafts did not pay: one node, one token
        plain_steps = out.tree_nodes == 1
        assert bool((out.committed[plain_steps] == 1).all())
        if case.endswith("-rejecting"):
            assert int(plain_steps.sum()) > len(out.committed) // 2, out.tree_nodes
        return
    rate = out.accepted.float().mean()
    if case.endswith("-accepting"):
        assert rate >= 2, out.accepted
    else:
        assert rate <= 0.5, out.accepted
    if case.startswith("draft"):  # top-k branching: a tree, not a chain of 1 + 4 nodes
        assert int(out.tree_nodes[0]) > 1 + 4


class Oracle:
    """A user's drafter (the protocol): the true continuation, wrong from a depth per row."""

    def __init__(self, truth, prompt_len, wrong_from):
        self.truth, self.prompt_len, self.wrong_from = truth, prompt_len, wrong_from
        self.calls = 0

    def propose(self, tokens, attention_mask, depth):
        width = min(4, depth)
        start = tokens.shape[1]
        right = self.truth[:, start : start + width]
        beam = torch.stack([right, right.clone()], 1)  # (2, 2, width): a second branch...
        beam[:, 1, -1] = (beam[:, 1, -1] + 1) % VOCAB  # ...that leaves the first at the end
        for row, wrong_from in enumerate(self.wrong_from):
            cut = wrong_from[self.calls % len(wrong_from)]
            beam[row, :, cut:] = (beam[row, :, cut:] + 2) % VOCAB
        self.calls += 1
        return beam


@pytest.mark.parallel(nprocs=[1, 2, 3, 4])
@pytest.mark.parametrize("placement", mtt.PLACEMENTS)
@pytest.mark.parametrize("prefilled", [False, True], ids=["fresh", "prefilled"])
def test_rows_that_accept_different_counts_stay_exact(placement, prefilled):
    """Ragged acceptance: row 0 accepts all, row 1 a varying few; a prefilled cache too."""
    model = tiny_llama()
    ids, mask = prompt(23, True)
    truth = greedy(model, ids, mask, "eager", new=NEW + 4)
    eager = truth[:, : ids.shape[1] + NEW]
    plain = mtt.ShardedCache(model.config, placement=placement, block_size=4)
    cache = mtt.ShardedCache(model.config, placement=placement, block_size=4)
    model.set_attn_implementation("mpitree")
    if prefilled:
        for c in (plain, cache):
            mtt.prefill(model, ids[:, :-1], c, attention_mask=mask[:, :-1])
    assert torch.equal(greedy(model, ids, mask, "mpitree", plain), eager)
    oracle = Oracle(truth, ids.shape[1], [[4], [2, 0, 3, 1]])
    model.set_attn_implementation("mpitree")
    out = mtt.generate(model, ids, cache, drafter=oracle, max_new_tokens=NEW, attention_mask=mask)
    assert torch.equal(out.sequences, eager)
    assert_same_cache(cache, plain)
    assert bool((out.accepted[:, 0] > out.accepted[:, 1]).any())  # really ragged
    assert bool((out.committed == out.accepted.min(-1).values + 1).all())


@pytest.mark.parallel(nprocs=[1, 2, 3, 4])
@pytest.mark.parametrize("new", [1, 2])
def test_the_last_tokens_need_no_draft(new):
    """``max_new_tokens`` 1: the prompt's step alone; 2: one step with no room for a draft."""
    model = tiny_llama()
    ids, mask = prompt(11, True)
    eager = greedy(model, ids, mask, "eager", new=new)
    cache = mtt.ShardedCache(model.config, block_size=4)
    model.set_attn_implementation("mpitree")
    out = mtt.generate(
        model, ids, cache, drafter=mtt.PromptLookup(), max_new_tokens=new, attention_mask=mask
    )
    assert torch.equal(out.sequences, eager)
    assert out.tree_nodes.tolist() == [1] * (new - 1)
    assert cache.get_seq_length() == ids.shape[1] + new - 1


@pytest.mark.parallel(nprocs=[1])
def test_prompt_lookup_makes_a_tree_of_its_matches():
    tokens = torch.tensor([[5, 6, 7, 1, 5, 6, 8, 2, 9, 5, 6]])
    beam = mtt.PromptLookup(num_tokens=3, max_ngram=2, max_matches=4).propose(
        tokens, torch.ones_like(tokens), depth=2
    )
    # "5 6" was followed by "8 2" and by "7 1"; then "6" by the same: no new candidate
    assert beam.tolist() == [[[8, 2], [7, 1]]]
    none = torch.tensor([[1, 2, 3]])  # no earlier match in any row: no draft (a plain step)
    assert mtt.PromptLookup().propose(none, torch.ones_like(none), 4).shape == (1, 1, 0)
    rows = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 5]])  # row 0 has none: its last token again
    assert mtt.PromptLookup().propose(rows, torch.ones_like(rows), 2).tolist() == [
        [[4, 4]],
        [[6, 7]],
    ]


class Bad:
    """A drafter that misbehaves on the last rank only."""

    def __init__(self, kind, draft):
        self.kind, self.draft = kind, draft

    def propose(self, tokens, attention_mask, depth):
        beam = self.draft.propose(tokens, attention_mask, depth)
        if world().rank != world().size - 1:
            return beam
        b, m = beam.shape[:2]
        return {
            "out of vocabulary": lambda: beam + VOCAB,
            "negative id": lambda: beam - VOCAB,
            "no candidates": lambda: beam[:, :0],
            "deeper than what is left": lambda: torch.ones(b, m, depth + 1, dtype=torch.long),
            "float ids": lambda: beam.float(),
            "wrong batch": lambda: beam[:1],
            "not a tensor": lambda: beam.tolist(),
            "drafter raises": lambda: 1 / 0,
        }[self.kind]()


BAD = {
    "out of vocabulary": "outside \\[0, 97\\)",
    "negative id": "outside \\[0, 97\\)",
    "no candidates": "empty draft",
    "deeper than what is left": "deep, but only",
    "float ids": "integer token ids",
    "wrong batch": "\\(B=2, M, C\\)",
    "not a tensor": "must return a torch tensor",
    "drafter raises": "division by zero",
}


def still_works(model):
    ids, _ = prompt(9, False)
    cache = mtt.ShardedCache(model.config, block_size=4)
    out = mtt.generate(model, ids, cache, drafter=mtt.PromptLookup(), max_new_tokens=6)
    assert torch.equal(out.sequences, greedy(model, ids, None, "eager", new=6))


@pytest.mark.parallel(nprocs=[1, 2, 3, 4])
@pytest.mark.parametrize("kind", list(BAD))
def test_a_bad_draft_on_one_rank_raises_on_every_rank(kind):
    model = tiny_llama()
    ids, mask = prompt(15, True)
    cache = mtt.ShardedCache(model.config, block_size=4)
    model.set_attn_implementation("mpitree")
    drafter = Bad(kind, mtt.PromptLookup())
    with pytest.raises((ValueError, TypeError, ZeroDivisionError)) as info:
        mtt.generate(model, ids, cache, drafter=drafter, max_new_tokens=8, attention_mask=mask)
    if world().rank == world().size - 1:
        assert info.match(BAD[kind])
    else:
        assert isinstance(info.value, mpitree.RankError)
        assert info.value.rank == world().size - 1 and info.match(BAD[kind])
    still_works(model)


class Differs:
    """Drafts that differ on the last rank (a drafter with its own randomness, say)."""

    def propose(self, tokens, attention_mask, depth):
        beam = torch.ones(tokens.shape[0], 2, min(depth, 3), dtype=torch.long)
        return beam + (world().rank == world().size - 1)


@pytest.mark.parallel(nprocs=[2, 3, 4])
def test_ranks_whose_drafts_differ_raise_on_every_rank():
    model = tiny_llama()
    ids, mask = prompt(15, True)
    cache = mtt.ShardedCache(model.config, block_size=4)
    model.set_attn_implementation("mpitree")
    with pytest.raises(ValueError, match="ranks disagree on draft tokens"):
        mtt.generate(model, ids, cache, drafter=Differs(), max_new_tokens=8, attention_mask=mask)
    other = ids.clone()
    other[0, -1] += world().rank == 0  # and prompts that differ
    with pytest.raises(ValueError, match="ranks disagree on prompt"):
        mtt.generate(
            model,
            other,
            mtt.ShardedCache(model.config, block_size=4),
            drafter=mtt.PromptLookup(),
            max_new_tokens=8,
            attention_mask=mask,
        )
    still_works(model)


def test_speculative_example_runs_and_matches_plain_greedy():
    args = ["examples/speculative.py", "--context", "64", "--new-tokens", "12", "--batch", "2"]
    res = run(2, [sys.executable, *args], timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    # batch 2: single-process plain greedy, then plain and 4 drafters sharded (transformers'
    # assisted generation is batch 1 only)
    assert res.stdout.count("| yes |") == 6, res.stdout
    assert "| NO |" not in res.stdout, res.stdout


class NoDraft:
    """A drafter with nothing to propose: every step is the plain one."""

    def propose(self, tokens, attention_mask, depth):
        return tokens.new_empty(tokens.shape[0], 1, 0)


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_no_draft_steps_are_plain_greedy():
    model = tiny_llama()
    ids, mask = prompt(15, True)
    eager = greedy(model, ids, mask, "eager")
    model.set_attn_implementation("mpitree")
    cache = mtt.ShardedCache(model.config, block_size=4)
    out = mtt.generate(
        model, ids, cache, drafter=NoDraft(), max_new_tokens=NEW, attention_mask=mask
    )
    assert torch.equal(out.sequences, eager)
    assert bool((out.tree_nodes == 1).all()) and bool((out.committed == 1).all())
