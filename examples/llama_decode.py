"""Greedy generation of a random-weight Llama with its KV cache sharded over MPI ranks.

    # a small Llama, 2K context; then Llama-3.1-8B attention shapes at 16K
    .venv/bin/mpiexec -n 4 .venv/bin/python examples/llama_decode.py
    .venv/bin/mpiexec -n 4 .venv/bin/python examples/llama_decode.py --llama8b --context 16384 \
        --new-tokens 16

Every rank builds the same model (random weights from a fixed seed, no
downloads) and runs ``generate`` with ``attn_implementation="mpitree"`` and a
``ShardedCache``; rank 0 also runs single-process ``generate`` (eager attention;
sdpa with ``--llama8b``, whose eager score matrix would not fit in memory) and
prints the tokens, whether they agree, the largest logit difference, and the
prefill time and decode tokens/s of each run. The strategies run one after the
other from the same prefilled cache (it is cropped back between runs).

A random-weight model's greedy tokens soon cycle through a few ids, so equal tokens
are weak evidence. The check that decides is teacher-forced: from the prefilled
cache, one multi-token step feeds ``--forced`` distinct token ids (a random
permutation of the vocabulary) on p ranks and on one process, and every logit of
every position must agree within ``--tolerance`` (float32). The example prints
``PASS`` or ``FAIL`` and exits non-zero on ``FAIL``.
"""

import argparse
import json
import os
import sys
import time

import mpitree.adapters.transformers as mtt
import torch
import transformers
from mpi4py import MPI

SMALL = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
)
# Llama-3.1-8B's attention (32 q heads, 8 kv heads, D = 128, rope theta 5e5) in a
# few layers, with a small MLP and vocabulary so that decode time is attention's.
LLAMA8B_ATTENTION = dict(
    hidden_size=4096,
    intermediate_size=1024,
    num_hidden_layers=2,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rope_theta=500000.0,
)


class Clock(transformers.StoppingCriteria):
    """Record the time at which each new token is ready; never stops generation."""

    def __init__(self):
        self.start = time.perf_counter()
        self.times = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    def rate(self, batch):
        """Decode tokens/s after the first new token (which finishes the prompt)."""
        return batch * (len(self.times) - 1) / (self.times[-1] - self.times[0])


def generate(model, ids, impl, new_tokens, cache=None):
    """Greedy ``generate``; return (sequences, logits (B, new, V), clock)."""
    model.set_attn_implementation(impl)
    clock = Clock()
    with torch.no_grad():
        out = model.generate(
            ids,
            cache=cache,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            stopping_criteria=[clock],
            pad_token_id=0,
        )
    return out.sequences, torch.stack(out.logits, 1), clock, out.cache


def forced_logits(model, cache, tokens):
    """Logits ``(B, len(tokens), V)`` of one step feeding ``tokens`` after the cache."""
    with torch.no_grad():
        return model(input_ids=tokens, cache=cache, use_cache=True).logits


def wait_quietly(comm):
    """Barrier that sleeps instead of spinning, so rank 0's reference gets the cores."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.01)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens to generate")
    parser.add_argument("--forced", type=int, default=32, help="teacher-forced distinct tokens")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="max |dlogit| to PASS")
    parser.add_argument("--batch", type=int, default=1, help="prompts (rows) per batch")
    parser.add_argument("--llama8b", action="store_true", help="Llama-3.1-8B attention shapes")
    parser.add_argument("--layers", type=int, help="override the number of layers")
    parser.add_argument("--strategies", default="allreduce,ring", help="comma-separated")
    parser.add_argument("--placement", default="interleave", choices=mtt.PLACEMENTS)
    parser.add_argument("--prefill", default="sharded", choices=["sharded", "replicated"])
    parser.add_argument(
        "--reference", choices=["eager", "sdpa", "none"], help="default: eager, sdpa for --llama8b"
    )
    parser.add_argument("--reference-threads", type=int, help="default: every core")
    parser.add_argument("--json", help="append this run's figures to this JSON-lines file")
    args = parser.parse_args()
    if not 2 <= args.forced + 1 <= 1024:
        parser.error("--forced must be in 1..1023 (distinct ids from a 1024-token vocabulary)")
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    cores = os.cpu_count() or 1
    local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
    reference = args.reference or ("sdpa" if args.llama8b else "eager")

    shape = dict(LLAMA8B_ATTENTION if args.llama8b else SMALL)
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    config = transformers.LlamaConfig(
        vocab_size=1024, max_position_embeddings=args.context + args.new_tokens, **shape
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, config.vocab_size, (args.batch, args.context), generator=gen)
    # the teacher-forced step: the last prompt token, then distinct ids (no repeats)
    forced = torch.randperm(config.vocab_size - 1, generator=gen)[: args.forced] + 1
    forced = torch.cat([ids[:, -1:], forced.expand(args.batch, -1)], 1)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(
        f"llama_decode: {size} ranks, context {args.context}, batch {args.batch}, "
        f"{args.new_tokens} new tokens; {shape['num_hidden_layers']} layers, "
        f"{shape['num_attention_heads']} q / {shape['num_key_value_heads']} kv heads, "
        f"D {shape['head_dim']}, float32; placement {args.placement}"
    )

    ref, record = None, {"ranks": size, "context": args.context, "batch": args.batch, **shape}
    if rank == 0 and reference != "none":
        torch.set_num_threads(args.reference_threads or cores)
        seq, logits, clock, ref_cache = generate(model, ids, reference, args.new_tokens)
        ref_cache.crop(args.context - 1 - ref_cache.get_seq_length())  # back to ids[:, :-1]
        ref = seq, logits, forced_logits(model, ref_cache, forced)
        prompt = clock.times[0] - clock.start
        threads = torch.get_num_threads()
        record["reference"] = dict(
            impl=reference, threads=threads, ttft_s=prompt, tok_s=clock.rate(args.batch)
        )
        say(
            f"1 process, {reference}, {threads} threads: prompt {prompt:.1f} s, "
            f"decode {clock.rate(args.batch):.2f} tok/s"
        )
    wait_quietly(comm)

    torch.set_num_threads(max(1, cores // local))
    strategies = args.strategies.split(",")
    cache = mtt.ShardedCache(config, placement=args.placement, strategy=strategies[0])
    model.set_attn_implementation("mpitree")
    took = 0.0
    if args.prefill == "sharded":
        start = time.perf_counter()
        mtt.prefill(model, ids[:, :-1], cache)  # generate runs the last prompt token
        comm.Barrier()
        took = time.perf_counter() - start
        say(f"mpitree sharded prefill of {args.context - 1} tokens: {took:.1f} s")
    prefilled = cache.get_seq_length()
    rows = []
    for strategy in strategies:
        if cache.get_seq_length() > prefilled:  # back to the prefilled state
            cache.crop(prefilled - cache.get_seq_length())
        cache.strategy = strategy
        seq, logits, clock, _ = generate(model, ids, "mpitree", args.new_tokens, cache)
        cache.crop(args.context - 1 - cache.get_seq_length())  # back to ids[:, :-1]
        teacher = forced_logits(model, cache, forced)
        rows.append((strategy, seq, logits, clock.rate(args.batch), teacher))
        record.setdefault("mpitree_ttft_s", took + clock.times[0] - clock.start)
    record["mpitree_prefill"] = args.prefill

    failed = False
    if rank == 0:
        print("tokens (row 0):", rows[0][1][0, args.context :].tolist())
        if ref is not None:
            print("reference     :", ref[0][0, args.context :].tolist())
        slowest = min(row[3] for row in rows)
        print(
            f"{'strategy':<12}{'tokens == ref':>14}{'max |dlogit|':>14}"
            f"{'forced |dlogit|':>17}{'tok/s':>9}{'speed-up':>10}"
        )
        worst, all_same = 0.0, True
        for strategy, seq, logits, rate, teacher in rows:
            same, diff, tf = "-", "-", "-"
            record[strategy] = {"tok_s": rate}
            if ref is not None:
                same = "yes" if torch.equal(seq, ref[0]) else "NO"
                gap = float((logits - ref[1]).abs().max())
                tf_gap = float((teacher - ref[2]).abs().max())
                worst = max(worst, tf_gap)
                all_same &= same == "yes"
                failed |= same == "NO" or not tf_gap <= args.tolerance
                diff, tf = f"{gap:.1e}", f"{tf_gap:.1e}"
                record[strategy].update(
                    tokens_equal=same == "yes", max_dlogit=gap, forced_dlogit=tf_gap
                )
            print(f"{strategy:<12}{same:>14}{diff:>14}{tf:>17}{rate:>9.2f}{rate / slowest:>9.2f}x")
        if ref is not None:
            verdict = "FAIL" if failed else "PASS"
            print(
                f"{verdict}: teacher-forced logits of {args.forced + 1} positions (distinct ids) "
                f"within {args.tolerance:g} of one process (max |dlogit| {worst:.1e}); greedy "
                f"tokens {'equal' if all_same else 'DIFFER'}"
            )
            ttft = record["mpitree_ttft_s"] / record["reference"]["ttft_s"]
            print(f"time to first token: mpitree / one process = {ttft:.2f}")
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(record) + "\n")
    if comm.allreduce(failed, op=MPI.LOR):
        sys.exit(1)


if __name__ == "__main__":
    main()
