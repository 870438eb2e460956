"""Sampling in ``mtt.generate`` under real ranks: the target's distribution, exactly.

The statistical test compares the empirical distribution of generated sequences
(speculative sampling over a sharded cache) with the exact float64 conditional
probabilities of a one-process model, by a G-test at a false-alarm rate of 1e-3
per case; every seed is fixed, so the verdicts are deterministic.
"""

import copy
import math
import sys

import mpitree.adapters.transformers as mtt
import numpy as np
import pytest
import torch
import transformers
from helpers import world
from launch import run
from models import prompt, tiny_llama
from mpitree.adapters.transformers._sampling import Sampler
from numpy.testing import assert_allclose
from test_speculative_mpi import NoDraft, assert_same_cache, draft_of, greedy

import mpitree

ALPHA = 1e-3  # the G-test's false-alarm rate, per case
SMALL_VOCAB = 8


def small_llama():
    """A random Llama over 8 tokens with peaked next-token distributions (drafts get accepted)."""
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(
        vocab_size=SMALL_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None  # no row ends early
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model


def same_on_every_rank(x):
    """Assert that ``x`` (a tensor) is bitwise the same on every rank."""
    every = world().allgather(x.numpy().tobytes())
    assert all(b == every[0] for b in every)


def sample(model, ids, mask, drafter, new, **kw):
    """``mtt.generate`` with sampling over a fresh ShardedCache (block size 2)."""
    model.set_attn_implementation("mpitree")
    cache = mtt.ShardedCache(model.config, block_size=2)
    return mtt.generate(
        model, ids, cache, drafter=drafter, max_new_tokens=new, attention_mask=mask, **kw
    )


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize(
    "settings",
    [dict(do_sample=False, temperature=0.7, top_k=3, seed=5), dict(do_sample=True, temperature=0)],
    ids=["do_sample False", "temperature 0"],
)
def test_greedy_settings_give_greedy_tokens(settings):
    """``do_sample=False`` or temperature 0: greedy's tokens; torch's RNG is left untouched."""
    model = tiny_llama()
    ids, mask = prompt(29, True)
    eager = greedy(model, ids, mask, "eager")
    for drafter in (mtt.PromptLookup(), mtt.DraftModel(draft_of(model), top_k=2), NoDraft()):
        state = torch.get_rng_state()
        out = sample(model, ids, mask, drafter, 16, node_cost=None, **settings)
        assert torch.equal(out.sequences, eager)
        assert torch.equal(torch.get_rng_state(), state)


def one_process_draws(model, ids, mask, new, sampler):
    """Plain sampling in one process (sdpa, no cache): column t of row b uses u(b, t)."""
    model.set_attn_implementation("sdpa")
    seq, full = ids.clone(), mask.clone()
    with torch.no_grad():
        for _ in range(new):
            pos = (full.cumsum(-1) - 1).masked_fill(full == 0, 0)
            logits = model(seq, attention_mask=full, position_ids=pos).logits[:, -1]
            u = sampler.uniforms(seq.shape[1], seq.shape[0])
            nxt = [sampler.draw(logits[b], u[b]) for b in range(seq.shape[0])]
            seq = torch.cat([seq, torch.tensor(nxt)[:, None]], 1)
            full = torch.cat([full, torch.ones_like(full[:, :1])], 1)
    return seq


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (20, 0.9)])
def test_plain_sampling_draws_one_process_tokens(top_k, top_p):
    """No draft: column t of row b is the filtered inverse CDF at u(b, t), as in one process."""
    model = tiny_llama()
    ids, mask = prompt(17, True)
    kw = dict(do_sample=True, temperature=0.8, top_k=top_k, top_p=top_p, seed=2026, eos_token_id=[])
    out = sample(model, ids, mask, NoDraft(), 12, **kw)
    same_on_every_rank(out.sequences)
    want = one_process_draws(model, ids, mask, 12, Sampler(0.8, top_k, top_p, 2026))
    assert torch.equal(out.sequences, want)
    again = sample(model, ids, mask, NoDraft(), 12, **kw)
    assert torch.equal(again.sequences, out.sequences)  # a function of the seed
    other = sample(model, ids, mask, NoDraft(), 12, **{**kw, "seed": 7})
    assert not torch.equal(other.sequences, out.sequences)
    gen = torch.Generator().manual_seed(3)  # a generator gives the key by one draw
    key = int(torch.randint(0, 2**63 - 1, (), generator=torch.Generator().manual_seed(3)))
    drawn = sample(model, ids, mask, NoDraft(), 12, **{**kw, "seed": gen})
    keyed = sample(model, ids, mask, NoDraft(), 12, **{**kw, "seed": key})
    assert torch.equal(drawn.sequences, keyed.sequences)


def drafter_of(kind, model):
    """A drafter: prompt lookup, the target's twin (top-2 greedy chains), or always wrong."""
    return {
        "lookup": lambda: mtt.PromptLookup(num_tokens=3),
        "twin": lambda: mtt.DraftModel(draft_of(model), num_tokens=3, top_k=2),
        "wrong": lambda: Wrong(model),
    }[kind]()


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("budget", ["every step", "adaptive"])
@pytest.mark.parametrize("placement", mtt.PLACEMENTS)
@pytest.mark.parametrize("kind", ["lookup", "twin", "wrong"])
def test_speculative_sampling_draws_plain_sampling_tokens(kind, placement, budget):
    """Any drafter, ragged acceptance, lockstep: plain sampling's tokens and cache, same seed."""
    model = small_llama()
    ids = torch.from_numpy(np.random.default_rng(4).integers(1, SMALL_VOCAB, (3, 12)))
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0
    kw = dict(do_sample=True, temperature=0.9, top_k=6, top_p=0.95, seed=99)
    model.set_attn_implementation("mpitree")
    plain = mtt.ShardedCache(model.config, placement=placement, block_size=2)
    want = mtt.generate(
        model, ids, plain, drafter=NoDraft(), max_new_tokens=20, attention_mask=mask, **kw
    )
    assert torch.equal(
        want.sequences, one_process_draws(model, ids, mask, 20, Sampler(0.9, 6, 0.95, 99))
    )
    cache = mtt.ShardedCache(model.config, placement=placement, block_size=2)
    cost = {"node_cost": None} if budget == "every step" else {}
    model.set_attn_implementation("mpitree")
    out = mtt.generate(
        model,
        ids,
        cache,
        drafter=drafter_of(kind, model),
        max_new_tokens=20,
        attention_mask=mask,
        **kw,
        **cost,
    )
    same_on_every_rank(out.sequences)
    assert torch.equal(out.sequences, want.sequences)
    assert_same_cache(cache, plain)
    assert bool((out.committed == out.accepted.min(-1).values + 1).all())
    if kind == "wrong":
        assert int(out.accepted.max()) == 0
    elif kind == "twin" and budget == "every step":  # ragged rows, several tokens a step
        assert int(out.committed.max()) >= 2
        assert bool((out.accepted.max(-1).values > out.accepted.min(-1).values).any())


# --------------------------------------------------------------------------------------
# the distribution, exactly
# --------------------------------------------------------------------------------------
class Wrong:
    """Drafts of two candidates the filtered target never samples: the least likely tokens."""

    def __init__(self, model):
        self.model = draft_of(model)

    def propose(self, tokens, attention_mask, depth):
        with torch.no_grad():
            low = self.model(tokens, attention_mask=attention_mask).logits[:, -1].argsort(-1)
        width = min(2, depth)
        return low[:, :2, None].expand(-1, 2, width).contiguous()


def filtered(logits, temperature, top_k, top_p):
    """transformers' own warpers, in float64: the exact filtered next-token probabilities."""
    from transformers.generation import logits_process as lp

    scores = logits.double()
    if temperature != 1.0:
        scores = lp.TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = lp.TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = lp.TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(-1)


def exact(model, ids, new, settings):
    """The exact probability of every ``new``-token continuation, ``(V,) * new`` float64."""
    m64 = copy.deepcopy(model).double()
    m64.set_attn_implementation("sdpa")
    v, probs = SMALL_VOCAB, torch.ones(())
    prefixes = torch.zeros(1, 0, dtype=torch.long)
    for _ in range(new):
        seqs = torch.cat([ids[:1].expand(len(prefixes), -1), prefixes], 1)
        with torch.no_grad():
            logits = m64(seqs).logits[:, -1]
        step = filtered(logits, **settings).reshape(*probs.shape, v)
        probs = probs[..., None] * step
        grid = torch.cartesian_prod(*[torch.arange(v)] * (prefixes.shape[1] + 1))
        prefixes = grid.reshape(-1, prefixes.shape[1] + 1)
    return probs.numpy()


def chi2_sf(x, df):
    """P(chi-square with ``df`` degrees of freedom > x): the regularised gamma series."""
    a, y = df / 2, x / 2
    term = total = 1.0
    n = 0
    while term > 1e-17 * total:
        n += 1
        term *= y / (a + n)
        total += term
    return max(0.0, 1.0 - math.exp(a * math.log(y) - y - math.lgamma(a + 1)) * total)


def g_test(counts, probs):
    """The G-test's p-value of observed ``counts`` against ``probs`` (cells below 5 pooled)."""
    counts, probs = counts.reshape(-1), probs.reshape(-1)
    assert counts[probs == 0].sum() == 0, "a sequence of probability 0 was sampled"
    expected = probs * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    seen = obs > 0
    g = 2 * float(np.sum(obs[seen] * np.log(obs[seen] / exp[seen])))
    return chi2_sf(g, len(obs) - 1)


CASES = {  # drafter, sampling settings, rows per call
    "prompt lookup": ("lookup", dict(temperature=1.0, top_k=0, top_p=1.0), 4),
    "accepting draft model": ("twin", dict(temperature=0.8, top_k=6, top_p=0.95), 4),
    "always wrong": ("wrong", dict(temperature=1.3, top_k=4, top_p=1.0), 64),
}
SAMPLES = 640
NEW = 4
PROMPT = torch.tensor([[1, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3]])  # the model's greedy loop


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_speculative_sampling_has_the_target_distribution(case):
    """Sequences of 4 tokens: G-test against exact float64 probabilities, false alarm 1e-3.

    Rows of a call share the prompt and accept different numbers of drafts, so
    lockstep commit is exercised (the draft model's steps commit about 2.5 tokens).
    The test also shows its power: the same counts are rejected against the
    distribution at a temperature 25 % higher.
    """
    kind, settings, rows = CASES[case]
    model = small_llama()
    ids = PROMPT.expand(rows, -1).contiguous()
    drafter = drafter_of(kind, model)
    counts = np.zeros((SMALL_VOCAB,) * NEW, dtype=np.int64)
    committed = []
    for call in range(SAMPLES // rows):
        out = sample(
            model, ids, None, drafter, NEW, node_cost=None, do_sample=True, seed=call, **settings
        )
        np.add.at(counts, tuple(out.sequences[:, -NEW:].T.numpy()), 1)
        committed.append(out.committed)
    same_on_every_rank(torch.from_numpy(counts))
    steps = torch.cat(committed)
    if kind == "wrong":
        assert bool((steps == 1).all())
    else:  # drafts really accepted, and some steps commit more than one token
        assert int(steps.max()) >= 2, steps
    assert g_test(counts, exact(model, PROMPT, NEW, settings)) > ALPHA
    hotter = dict(settings, temperature=settings["temperature"] * 1.25)
    assert g_test(counts, exact(model, PROMPT, NEW, hotter)) < ALPHA


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread per rank: the ranks share the machine's cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_public_sampler_is_the_one_generate_draws_with():
    """``mtt.sampler`` (what ``python -m mpitree generate`` shows): the model's defaults
    filled in as :func:`generate` fills them; greedy gives None; bad settings raise."""
    model = small_llama()
    model.generation_config.top_k, model.generation_config.top_p = 7, 0.8
    got = mtt.sampler(model, temperature=0.5, seed=3)
    assert isinstance(got, mtt.Sampler)
    assert (got.temperature, got.top_k, got.top_p, got.key) == (0.5, 7, 0.8, 3)
    assert mtt.sampler(model, temperature=0, seed=3) is None
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        mtt.sampler(model, temperature=1.0, top_p=0.0)


# --------------------------------------------------------------------------------------
# agreement, bad arguments, stopping
# --------------------------------------------------------------------------------------
def good(**change):
    """Sampling arguments, changed on the last rank only."""
    kw = dict(do_sample=True, temperature=0.9, top_k=10, top_p=0.9, seed=11)
    return {**kw, **change} if world().rank == world().size - 1 else kw


BAD = {  # change on the last rank -> what it raises there
    "negative temperature": (dict(temperature=-0.5), ValueError, "temperature must be >= 0"),
    "nan temperature": (dict(temperature=float("nan")), ValueError, "temperature must be finite"),
    "temperature a string": (dict(temperature="hot"), TypeError, "temperature must be a real"),
    "top_p 0": (dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
    "top_p above 1": (dict(top_p=1.5), ValueError, r"top_p must be in \(0, 1\]"),
    "negative top_k": (dict(top_k=-1), ValueError, "top_k must be an int >= 0"),
    "float top_k": (dict(top_k=2.5), ValueError, "top_k must be an int >= 0"),
    "do_sample not a bool": (dict(do_sample="yes"), TypeError, "do_sample must be a bool"),
    "seed out of range": (dict(seed=2**64), ValueError, r"seed must be in \[0, 2\*\*64\)"),
    "seed a float": (dict(seed=1.5), TypeError, "seed must be an int"),
}


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("case", list(BAD))
def test_bad_sampling_arguments_raise_on_every_rank(case):
    model = tiny_llama()
    ids, mask = prompt(11, True)
    change, kind, message = BAD[case]
    with pytest.raises((ValueError, TypeError)) as info:
        sample(model, ids, mask, mtt.PromptLookup(), 6, **good(**change))
    if world().rank == world().size - 1:
        assert info.type is kind and info.match(message)
    else:
        assert isinstance(info.value, mpitree.RankError) and info.match(message)
    out = sample(model, ids, mask, mtt.PromptLookup(), 6, **good())  # the comm still works
    same_on_every_rank(out.sequences)


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize(
    "change, field",
    [
        (dict(seed=12), "sampling seed"),
        (dict(top_p=0.8), "sampling"),
        (dict(do_sample=False), "sampling"),
    ],
    ids=["seeds", "top_p", "greedy on one rank"],
)
def test_ranks_that_sample_differently_raise_on_every_rank(change, field):
    """Different seeds (or torch RNG states, with no seed) or settings: every rank raises."""
    model = tiny_llama()
    ids, mask = prompt(11, True)
    with pytest.raises(ValueError, match=f"ranks disagree on {field}"):
        sample(model, ids, mask, mtt.PromptLookup(), 6, **good(**change))
    torch.manual_seed(world().rank)  # no seed: a draw from each rank's own global RNG
    with pytest.raises(ValueError, match="ranks disagree on sampling seed"):
        sample(model, ids, mask, mtt.PromptLookup(), 6, **{**good(), "seed": None})
    torch.manual_seed(5)  # the same global RNG state everywhere: seed=None agrees
    out = sample(model, ids, mask, mtt.PromptLookup(), 6, **{**good(), "seed": None})
    same_on_every_rank(out.sequences)


class Digits:
    """A tokenizer stand-in for stop strings: token t decodes to "<t>"."""

    def decode(self, ids):
        return "".join(f"<{int(t)}>" for t in ids)


def end_of(row, ended):
    """The length of ``row`` up to and including the first token where ``ended(prefix)``."""
    return next((j + 1 for j in range(len(row)) if ended(row[: j + 1])), len(row))


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("drafter", ["lookup", "draft model"])
def test_sampled_rows_stop_at_eos_and_stop_strings(drafter):
    """A row ends at its first end-of-sequence token or stop string; before it, the same draws."""
    model = tiny_llama()
    ids, mask = prompt(13, True)
    s = ids.shape[1]

    def decode(**kw):
        made = mtt.PromptLookup() if drafter == "lookup" else mtt.DraftModel(draft_of(model))
        out = sample(model, ids, mask, made, 20, node_cost=None, pad_token_id=0, **good(), **kw)
        same_on_every_rank(out.sequences)
        return out.sequences[:, s:]

    free = decode(eos_token_id=[])
    assert free.shape[1] == 20
    eos = int(free[0, 5])  # row 0 ends at its sixth token at the latest
    stop = f"<{int(free[1, 3])}><{int(free[1, 4])}>"  # row 1 at its fifth
    ended = {
        "eos": (dict(eos_token_id=eos), lambda row: int(row[-1]) == eos),
        "stop": (
            dict(eos_token_id=[], stop_strings=stop, tokenizer=Digits()),
            lambda row: stop in Digits().decode(row),
        ),
    }
    for kw, rule in ended.values():
        out = decode(**kw)
        ends = [end_of(free[row], rule) for row in range(2)]
        assert out.shape[1] == max(ends)
        for row, end in enumerate(ends):
            assert torch.equal(out[row, :end], free[row, :end])
            assert bool((out[row, end:] == 0).all())


def test_generate_command_refuses_check_with_sampling():
    """``--check`` is greedy only: with ``--temperature`` every rank stops with the reason."""
    res = run(2, [sys.executable, "-m", "mpitree", "generate", "--check", "--temperature", "0.7"])
    assert res.returncode == 2, res.stdout + res.stderr
    # once, from rank 0 (every rank exits with status 2)
    assert res.stderr.count("--check compares with one process's greedy decode") == 1, res.stderr
    res = run(2, [sys.executable, "-m", "mpitree", "generate", "--seed", "3"])
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.count("--seed only apply when sampling") == 1, res.stderr


@pytest.mark.parallel(nprocs=[1])
@pytest.mark.parametrize("vocab", [8, 97, 5000])
def test_the_filter_is_transformers_own(vocab):
    """Temperature, then top-k, then top-p: the probabilities of transformers' warpers."""
    logits = torch.from_numpy(np.random.default_rng(vocab).standard_normal(vocab) * 3)
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.9), (0.5, 50, 0.8)]:
        w = Sampler(temperature, top_k, top_p, 0).weights(logits.float())
        want = filtered(logits.float()[None], temperature, top_k, top_p)[0].numpy()
        assert_allclose(w / w.sum(), want, atol=1e-12, rtol=0)
        assert np.array_equal(w > 0, want > 0)
