"""Speculative greedy decoding over a sharded KV cache, against plain sharded greedy.

    .venv/bin/mpiexec -n 2 .venv/bin/python examples/speculative.py
    .venv/bin/mpiexec -n 2 .venv/bin/python examples/speculative.py --context 2048 --batch 2

Every rank builds the same random-weight Llama (no downloads) and the same
prompt, prefills a ``ShardedCache`` with it (sharded prefill), and generates
``--new-tokens`` tokens four ways from copies of that cache: plain ``generate``,
and ``mtt.generate`` with prompt lookup, with a draft model (the target's first
layer and head, under eager attention, on every rank), and with the target itself
as the draft (every draft accepted: the bound on acceptance, at a full model's
drafting cost, unsharded). Rank 0 prints, per
method, whether the tokens equal plain greedy's, decode tokens/s (batch rows
included), mean draft tokens accepted per step, tokens committed per step and
verified tree nodes per step.

A random model's greedy text soon cycles, which prompt lookup predicts well; its
one-layer draft is a poor guess of the whole model. Exits non-zero if any
method's tokens differ from plain greedy's.
"""

import argparse
import copy
import sys
import time

import mpitree.adapters.transformers as mtt
import torch
import transformers
from mpi4py import MPI


def build(args):
    """Return the target model, its one-layer draft and its eager twin, identical on every rank."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=args.context + args.new_tokens + 64,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:1]
    draft.config.num_hidden_layers = 1
    draft.set_attn_implementation("eager")
    twin = copy.deepcopy(model)
    twin.set_attn_implementation("eager")
    model.set_attn_implementation("mpitree")
    return model, draft, twin


def timed(fn):
    """Return ``fn()`` and its wall time, measured from the same start on every rank."""
    MPI.COMM_WORLD.Barrier()
    start = time.perf_counter()
    out = fn()
    MPI.COMM_WORLD.Barrier()
    return out, time.perf_counter() - start


def main():
    """Run the comparison; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--placement", choices=mtt.PLACEMENTS, default="interleave")
    parser.add_argument("--num-tokens", type=int, default=4, help="draft depth")
    parser.add_argument("--top-k", type=int, default=2, help="draft model branches")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, draft, twin = build(args)
    ids = torch.randint(1, args.vocab, (args.batch, args.context), generator=torch.Generator())
    cache = mtt.ShardedCache(model.config, placement=args.placement)
    _, prefill_s = timed(lambda: mtt.prefill(model, ids[:, :-1], cache))
    new = args.new_tokens

    def plain():
        with torch.no_grad():
            return model.generate(
                ids, past_key_values=copy.deepcopy(cache), max_new_tokens=new, do_sample=False
            )

    reference, plain_s = timed(plain)
    drafters = {
        "prompt lookup": mtt.PromptLookup(num_tokens=args.num_tokens),
        "draft model": mtt.DraftModel(draft, num_tokens=args.num_tokens, top_k=args.top_k),
        "target as draft": mtt.DraftModel(twin, num_tokens=args.num_tokens, top_k=args.top_k),
    }
    rows = [("plain greedy", True, args.batch * new / plain_s, "", "", "")]
    ok = True
    for name, drafter in drafters.items():
        out, seconds = timed(
            lambda d=drafter: mtt.generate(
                model, ids, copy.deepcopy(cache), drafter=d, max_new_tokens=new
            )
        )
        same = torch.equal(out.sequences, reference)
        ok &= same
        accepted = f"{out.accepted.float().mean():.2f}"
        committed = f"{out.committed.float().mean():.2f}"
        nodes = f"{out.tree_nodes.float().mean():.1f}"
        rows.append((name, same, args.batch * new / seconds, accepted, committed, nodes))
    if MPI.COMM_WORLD.rank == 0:
        print(
            f"p={MPI.COMM_WORLD.size} batch={args.batch} context={args.context} new={new} "
            f"placement={args.placement}; sharded prefill {prefill_s:.2f} s"
        )
        print("| method | tokens = plain | tok/s | accepted/step | committed/step | tree nodes |")
        print("|---|:---:|---:|---:|---:|---:|")
        for name, same, rate, accepted, committed, nodes in rows:
            print(
                f"| {name} | {'yes' if same else 'NO'} | {rate:.1f} | {accepted} | {committed} "
                f"| {nodes} |"
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
