"""Speculative greedy decoding over a sharded KV cache, against plain greedy and transformers'.

    .venv/bin/mpiexec -n 2 .venv/bin/python examples/speculative.py
    .venv/bin/mpiexec -n 2 .venv/bin/python examples/speculative.py --context 2048 --batch 2
    # Llama-3.1-8B attention shapes (32 q / 8 kv heads, D = 128), 2 layers, float32
    .venv/bin/mpiexec -n 4 .venv/bin/python examples/speculative.py --llama8b --context 8192 \
        --new-tokens 64 --json speculative.jsonl

Every rank builds the same random-weight Llama (no downloads) and the same prompt.

Single process, on rank 0 only, every core (the other ranks wait without
spinning): transformers' ``generate`` (sdpa attention), plain greedy, prompt
lookup (``prompt_lookup_num_tokens``) and assisted generation
(``assistant_model``: the draft below, ``--num-tokens`` per step, constant
schedule). Each call runs the whole prompt in its first step (transformers'
assisted generation goes wrong from a prefilled cache: its first token is not
greedy's); the clock starts at the end of that step (a ``StoppingCriteria``) and
counts the tokens gained after it. Assisted generation is batch 1 only in
transformers: those rows are skipped for ``--batch`` > 1.

Sharded, on every rank (cores / local ranks threads each): the same prefix is
prefilled once into a ``ShardedCache`` (``mtt.prefill``, not timed), then from
copies of it: plain ``generate`` under ``attn_implementation="mpitree"``, and
``mtt.generate`` with prompt lookup, with a draft model (the target's first layer
and head, sdpa, on every rank), with the target itself as the draft (every draft
accepted: the bound on acceptance, at a full model's drafting cost, unsharded),
and with a forced-wrong drafter: a tree of the draft model's shape whose every
first token differs from the target's greedy token (known from the plain run), so
nothing is ever accepted: the worst case, a failed tree verified per step.

Sharded, the prompt prefill and the draft models' prefill of it are untimed;
each timed call runs the last prompt token (one plain step), then decodes, and
every new token counts. So tok/s (batch rows included) is decode only for every
row; the sharded speculative rows carry one plain step of their ``--new-tokens``.
Rank 0 prints, per row, whether the tokens equal single-process plain greedy's,
tok/s, mean draft tokens accepted per step, tokens committed per step, verified
tree nodes per step (the pending token included) and time per forward step, then
the speed-up of each drafter over plain sharded greedy and the forced-wrong step's
time over a plain step's. Exits non-zero if any row's tokens differ.

A random model's greedy text soon cycles, which prompt lookup predicts well; its
one-layer draft is a poor guess of the whole model.
"""

import argparse
import copy
import json
import os
import sys
import time

import mpitree.adapters.transformers as mtt
import torch
import transformers
from llama_decode import LLAMA8B_ATTENTION, SMALL, wait_quietly
from mpi4py import MPI


class Steps(transformers.StoppingCriteria):
    """Record the time and sequence length after each forward step of ``generate``."""

    def __init__(self):
        self.start = time.perf_counter()
        self.times, self.lengths = [], []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        self.lengths.append(input_ids.shape[1])
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


class ForcedWrong:
    """A drafter whose drafts are never accepted: the worst case of speculation.

    It knows the target's greedy tokens and proposes ``top_k`` chains of
    ``num_tokens`` tokens whose first tokens all differ from the target's next one:
    a tree of :class:`mtt.DraftModel`'s shape at no drafting cost, rejected at its
    root's children every step.
    """

    def __init__(self, greedy, vocab, num_tokens, top_k):
        self.greedy, self.vocab, self.num_tokens, self.top_k = greedy, vocab, num_tokens, top_k

    def propose(self, tokens, attention_mask, depth):
        """Propose ``(B, top_k, width)`` chains that start with a token the target won't pick."""
        nxt = self.greedy[:, tokens.shape[1]]  # the target's greedy token after tokens[:, -1]
        first = (nxt[:, None] + 1 + torch.arange(self.top_k)) % self.vocab
        return first[:, :, None].expand(-1, -1, min(self.num_tokens, depth)).clone()


def build(args):
    """Return the target model, its one-layer draft and its twin, identical on every rank."""
    shape = dict(LLAMA8B_ATTENTION if args.llama8b else SMALL)
    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab, max_position_embeddings=args.context + args.new_tokens + 64, **shape
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:1]
    draft.config.num_hidden_layers = 1
    draft.set_attn_implementation("sdpa")
    draft.generation_config.num_assistant_tokens = args.num_tokens
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    for m in (model, draft):  # no stop token: exactly --new-tokens, as mtt.generate
        m.generation_config.eos_token_id = None
    twin = copy.deepcopy(model)
    twin.set_attn_implementation("sdpa")
    return model, draft, twin, shape


def timed(fn, comm=MPI.COMM_WORLD):
    """Return ``fn()`` and its wall time, measured from the same start on every rank of comm."""
    comm.Barrier()
    start = time.perf_counter()
    out = fn()
    comm.Barrier()
    return out, time.perf_counter() - start


def hf_generate(model, ids, cache, new, **kwargs):
    """Greedy transformers ``generate`` (from a copy of ``cache``); return (sequences, steps)."""
    steps = Steps()
    with torch.no_grad():
        out = model.generate(
            ids,
            cache=copy.deepcopy(cache),
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            stopping_criteria=[steps],
            **kwargs,
        )
    return out, steps


def row(name, procs, out, args, seconds=None, steps=None):
    """A result row: sequences, tok/s and per-step statistics (``None`` where unknown).

    mpitree rows: ``seconds`` of the whole call after the prefill (the last prompt
    token's step, then decoding), all new tokens. transformers rows (``steps``):
    from the end of the first forward step (the whole prompt's) to the last, the
    tokens gained in between.
    """
    r = dict(method=name, procs=procs, sequences=out, accepted=None, committed=None)
    r["tree_nodes"] = None
    if steps is None:
        tokens, forwards = args.new_tokens, 1
        if isinstance(out, mtt.Speculation):
            r["sequences"] = out.sequences
            forwards += out.committed.numel()  # the last prompt token's step, then one per step
            if out.committed.numel():
                r["accepted"] = float(out.accepted.float().mean())
                r["committed"] = float(out.committed.float().mean())
                r["tree_nodes"] = float(out.tree_nodes.float().mean())
        else:
            forwards = tokens
    else:  # transformers: one stopping-criteria call per forward step
        seconds = steps.times[-1] - steps.times[0]
        tokens, forwards = steps.lengths[-1] - steps.lengths[0], len(steps.times) - 1
        if name != "plain greedy" and forwards:
            r["committed"] = tokens / forwards
            r["accepted"] = r["committed"] - 1
        r["first_step_s"] = steps.times[0] - steps.start
    r.update(seconds=seconds, tok_s=args.batch * tokens / seconds, s_step=seconds / forwards)
    return r


def single_process(args, model, draft, ids):
    """Rank 0's transformers rows (sdpa, one process, every core), first step excluded.

    transformers' assisted generation goes wrong from a prefilled cache (its first
    token differs from greedy's), so each call runs the whole prompt in its first
    step, and the clock starts after it.
    """
    torch.set_num_threads(os.cpu_count() or 1)
    model.set_attn_implementation("sdpa")
    new, rows = args.new_tokens, []
    methods = {"plain greedy": {}}
    if args.batch == 1:
        methods["prompt lookup"] = dict(prompt_lookup_num_tokens=args.num_tokens)
        methods["assistant model"] = dict(assistant_model=draft)
    for name, kwargs in methods.items():
        out, steps = hf_generate(model, ids, None, new, **kwargs)
        rows.append(row(name, "1 (sdpa)", out, args, steps=steps))
    return rows, rows[0]["first_step_s"], torch.get_num_threads()


def sharded(args, model, draft, twin, ids):
    """Every rank's mpitree rows: plain ``generate`` and ``mtt.generate`` per drafter."""
    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    model.set_attn_implementation("mpitree")
    cache = mtt.ShardedCache(model.config, placement=args.placement)
    _, prefill_s = timed(lambda: mtt.prefill(model, ids[:, :-1], cache))
    new, procs = args.new_tokens, f"{comm.size} (mpitree)"
    (plain, _), seconds = timed(lambda: hf_generate(model, ids, cache, new))
    rows = [row("plain greedy", procs, plain, args, seconds)]
    drafters = {
        "prompt lookup": mtt.PromptLookup(num_tokens=args.num_tokens),
        "draft model": mtt.DraftModel(draft, num_tokens=args.num_tokens, top_k=args.top_k),
        "target as draft": mtt.DraftModel(twin, num_tokens=args.num_tokens, top_k=args.top_k),
        "forced wrong": ForcedWrong(plain, args.vocab, args.num_tokens, args.top_k),
    }
    for name, drafter in drafters.items():
        if isinstance(drafter, mtt.DraftModel):  # the draft's own prefill of the prompt, untimed
            drafter.propose(ids, torch.ones_like(ids), 1)
        out, seconds = timed(
            lambda d=drafter: mtt.generate(
                model, ids, copy.deepcopy(cache), drafter=d, max_new_tokens=new
            )
        )
        rows.append(row(name, procs, out, args, seconds))
    return rows, prefill_s, torch.get_num_threads()


def fmt(value, spec):
    return "" if value is None else format(value, spec)


def main():
    """Run the comparison; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=512, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--llama8b", action="store_true", help="Llama-3.1-8B attention shapes")
    parser.add_argument("--vocab", type=int, help="default 512, 1024 with --llama8b")
    parser.add_argument("--placement", choices=mtt.PLACEMENTS, default="interleave")
    parser.add_argument("--num-tokens", type=int, default=4, help="draft depth")
    parser.add_argument("--top-k", type=int, default=2, help="draft model branches")
    parser.add_argument("--json", help="append this run's figures to this JSON-lines file")
    args = parser.parse_args()
    args.vocab = args.vocab or (1024 if args.llama8b else 512)
    if not 1 <= args.top_k < args.vocab:
        parser.error("--top-k must be in 1..vocab-1")
    comm = MPI.COMM_WORLD
    model, draft, twin, shape = build(args)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, args.vocab, (args.batch, args.context), generator=gen)

    single = None
    if comm.rank == 0:
        single = single_process(args, model, draft, ids)
    wait_quietly(comm)
    rows, prefill_s, threads = sharded(args, model, draft, twin, ids)

    ok = True
    if comm.rank == 0:
        single_rows, single_prefill_s, single_threads = single
        reference = single_rows[0]["sequences"]
        rows = single_rows + rows
        for r in rows:
            r["tokens_equal"] = torch.equal(r.pop("sequences"), reference)
            ok &= r["tokens_equal"]
        print(
            f"p={comm.size} ({threads} threads each) vs 1 process ({single_threads} threads); "
            f"batch={args.batch} context={args.context} new={args.new_tokens} "
            f"{shape['num_hidden_layers']} layers {shape['num_attention_heads']} q / "
            f"{shape['num_key_value_heads']} kv heads D={shape['head_dim']} vocab={args.vocab} "
            f"float32; placement={args.placement}; draft depth {args.num_tokens}, "
            f"top-k {args.top_k}; untimed: sharded prefill {prefill_s:.2f} s, "
            f"1-process first step (prompt) {single_prefill_s:.2f} s"
        )
        print(
            "| processes | method | tokens = 1-proc greedy | tok/s | accepted/step "
            "| committed/step | tree nodes | ms/step |"
        )
        print("|---|---|:---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(
                f"| {r['procs']} | {r['method']} | {'yes' if r['tokens_equal'] else 'NO'} "
                f"| {r['tok_s']:.1f} | {fmt(r['accepted'], '.2f')} | {fmt(r['committed'], '.2f')} "
                f"| {fmt(r['tree_nodes'], '.1f')} | {1e3 * r['s_step']:.1f} |"
            )
        if args.batch > 1:
            print("(transformers' prompt lookup and assistant model: batch 1 only, skipped)")
        mine = {r["method"]: r for r in rows if r["procs"].endswith("(mpitree)")}
        plain = mine["plain greedy"]
        speedup = {
            name: r["tok_s"] / plain["tok_s"] for name, r in mine.items() if name != "plain greedy"
        }
        wrong = mine["forced wrong"]
        ratio = wrong["s_step"] / plain["s_step"]
        print(
            "speed-up over plain sharded greedy: "
            + ", ".join(f"{name} {x:.2f}x" for name, x in speedup.items() if name != "forced wrong")
            + f"; worst case (forced wrong, {wrong['accepted']:.2f} accepted/step, "
            f"{wrong['tree_nodes']:.0f}-node tree): {ratio:.2f}x a plain step's time"
        )
        if args.json:
            record = dict(
                ranks=comm.size,
                threads=threads,
                single_threads=single_threads,
                batch=args.batch,
                context=args.context,
                new_tokens=args.new_tokens,
                vocab=args.vocab,
                placement=args.placement,
                num_tokens=args.num_tokens,
                top_k=args.top_k,
                **shape,
                prefill_s=dict(sharded=prefill_s, single_first_step=single_prefill_s),
                rows=rows,
                speedup=speedup,
                forced_wrong_step_ratio=ratio,
            )
            with open(args.json, "a") as f:
                f.write(json.dumps(record) + "\n")
    return 0 if comm.bcast(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
