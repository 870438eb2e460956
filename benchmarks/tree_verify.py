"""What a verification step costs against a plain decode step, split into attention and the rest.

Every rank holds its shard of a ``ShardedCache`` of ``--context`` random keys
(Llama-3.1-8B attention shapes: 32 query heads, 8 KV heads, D = 128, float32;
``--layers`` layers, a small MLP). Interleaved after a warm-up, the ranks time
a plain 1-token step and ``mtt.verify`` of a draft chain of n nodes (the
pending token and n - 1 draft tokens, the tree mask over the cache plus the
nodes, as ``mtt.generate`` verifies it), and a branching tree of n nodes.
Timers wrap the attention entry point, the layer's checked local work, the C
kernel (with its ctypes call) and the merge strategy's collective, so each
step splits into

* attention: the kernel and the collective (every layer);
* attention's own Python: checks, visibility, the merge's bookkeeping;
* the rest: the model's dense layers (projections, MLP, logits) and
  transformers' own work, which grow with the node count on every rank.

Ratios are against the plain step of the same run (medians of the slowest
rank). The derived rows: a fully rejected step of n nodes commits one token, so
it costs ``verify(n) / plain``; a perfect chain of depth n - 1 commits n tokens
(n - 1 accepted plus the bonus), so it runs at ``n * plain / verify(n)`` plain
tokens/s (the commit of the accepted K/V and the argmax, not timed here, are
small next to a step).

With ``--whole`` no timer runs inside the attention call, and each step is split only
into the attention call and the rest: so is any tree older than
``mpitree.extend.phase_times`` timed (``PYTHONPATH=OLD_TREE``), and the two compare alike.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/tree_verify.py --context 16384
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import defaultdict

import mpitree.adapters.transformers as mtt
import torch
import transformers
from mpi4py import MPI
from timers import timed  # this folder: the timer, written once

from mpitree import extend, spec

LLAMA8B_ATTENTION = dict(
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0
)


TIMES = defaultdict(list)  # name -> durations (seconds) within one step


def instrument():
    """Put a timer on the attention call; mpitree's own time the rest (``phase_times``)."""
    funcs = transformers.AttentionInterface._global_mapping
    funcs["mpitree"] = timed("call", funcs["mpitree"], lambda: TIMES)


def check_split(parser, whole):
    """Refuse a tree older than ``extend.phase_times`` unless ``--whole``, before any work.

    Its table would leave the split out (fe6c268, issue 25's start, is such a tree).
    """
    if not whole and not hasattr(extend, "phase_times"):
        parser.error("this mpitree has no extend.phase_times (a tree before it): use --whole")


def fill_cache(cfg, context, seed=2):
    """Return a ``ShardedCache`` holding ``context`` tokens of random K/V (no prefill)."""
    cache = mtt.ShardedCache(cfg)
    gen = torch.Generator().manual_seed(seed)
    shape = (1, cfg.num_key_value_heads, context, cfg.head_dim)
    keys = [torch.randn(shape, generator=gen) for _ in range(cfg.num_hidden_layers)]
    values = [torch.randn(shape, generator=gen) for _ in range(cfg.num_hidden_layers)]
    cache._commit(keys, values, torch.arange(context)[None])
    return cache


def chain(n, vocab, seed):
    """Return a beam ``(1, 1, n - 1)``: with the pending token, a chain of n nodes."""
    return torch.randint(1, vocab, (1, 1, n - 1), generator=torch.Generator().manual_seed(seed))


def tree(n, vocab, seed):
    """Return two candidates sharing their first token: with the pending token, n nodes."""
    gen = torch.Generator().manual_seed(seed)
    depth = (n - 1) // 2 + 1  # two candidates of `depth` tokens sharing the first: 2 depth - 1
    beam = torch.randint(1, vocab, (1, 2, depth), generator=gen)
    beam[:, 1, 0] = beam[:, 0, 0]
    return beam


def packed_step(beam, pending):
    """Pack the pending token ahead of every candidate, as ``mtt.generate`` does."""
    lead = pending.expand(beam.shape[0], beam.shape[1], 1)
    return spec.pack(torch.cat([lead, beam], dim=2))


def main():
    """Time plain and verification steps, interleaved; print the table on rank 0."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--context", type=int, default=16384, help="cached tokens")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size")
    parser.add_argument("--intermediate", type=int, default=1024, help="MLP size")
    parser.add_argument("--nodes", default="2,4,5,8", help="chain lengths (nodes) to verify")
    parser.add_argument("--steps", type=int, default=15, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    parser.add_argument(
        "--whole",
        action="store_true",
        help="no timers inside the attention call (their cost is not in the steps): what "
        "a tree older than extend.phase_times gets, so that two trees compare alike",
    )
    args = parser.parse_args()
    check_split(parser, args.whole)
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    cfg = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        max_position_embeddings=args.context + 64,
        **LLAMA8B_ATTENTION,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("mpitree")
    cache = fill_cache(cfg, args.context)
    pending = torch.tensor([[7]])
    nodes = [int(x) for x in args.nodes.split(",")]
    cases = [("plain", None)]
    for n in nodes:
        cases.append((f"chain {n}", packed_step(chain(n, cfg.vocab_size, n), pending)))
    for n in nodes:
        if n >= 4 and (n - 1) % 2 == 0:
            cases.append((f"tree {n}", packed_step(tree(n, cfg.vocab_size, n), pending)))
    instrument()
    steps = defaultdict(list)
    parts = defaultdict(lambda: defaultdict(list))

    def run(name, packed):
        TIMES.clear()
        comm.Barrier()
        start = time.perf_counter()
        with torch.no_grad():
            if packed is None:
                model(input_ids=pending, cache=cache, use_cache=True)
            else:
                mtt.verify(model, cache, packed)
        elapsed = time.perf_counter() - start
        if packed is None:
            cache.crop(-1)
        return elapsed, {k: sum(v) for k, v in TIMES.items()}

    # mpitree's timers: the local step, the kernel, the collective
    with contextlib.nullcontext() if args.whole else extend.phase_times(TIMES):
        for i in range(args.warmup + args.steps):
            for name, packed in cases if i % 2 else cases[::-1]:
                elapsed, split = run(name, packed)
                if i >= args.warmup:
                    steps[name].append(elapsed)
                    for k, v in split.items():
                        parts[name][k].append(v)
    med = {
        name: {
            "step": statistics.median(steps[name]),
            **{k: statistics.median(v) for k, v in parts[name].items()},
        }
        for name in steps
    }
    every = comm.gather(med)
    if comm.rank:
        return
    keys = ("step", "call", "local", "kernel", "collective")
    med = {name: {k: max(m[name].get(k, 0.0) for m in every) for k in keys} for name in med}
    base = med["plain"]

    def attention(m):
        return m["kernel"] + m["collective"]

    print(
        f"{comm.size} rank(s), {args.context} cached keys, {args.layers} layers, 32 q / 8 kv "
        f"heads, D 128, hidden {args.hidden}, MLP {args.intermediate}, float32, "
        f"{torch.get_num_threads()} thread per rank; slowest rank's median of {args.steps} "
        "interleaved rounds; ms per step (ratio to the plain step)"
    )
    print(
        f"  {'step':<10} {'whole':>14} {'attention':>10} {'kernel':>14} {'collective':>11} "
        f"{'attn Python':>12} {'rest (dense)':>14} {'rest/node':>10}"
    )
    for name, m in med.items():
        rest = m["step"] - m["call"]
        nodes_n = 1 if name == "plain" else int(name.split()[1])
        extra = (rest - (base["step"] - base["call"])) / max(nodes_n - 1, 1)
        if not args.whole:
            att_py = m["call"] - m["kernel"] - m["collective"]
            split = (
                f" {m['kernel'] * 1e3:>6.1f} ({m['kernel'] / base['kernel']:.2f}x)"
                f" {m['collective'] * 1e3:>11.2f} {att_py * 1e3:>12.2f}"
            )
        else:
            split = f" {'-':>14} {'-':>11} {'-':>12}"
        print(
            f"  {name:<10} {m['step'] * 1e3:>7.1f} ({m['step'] / base['step']:.2f}x)"
            f" {m['call'] * 1e3:>10.1f}{split}"
            f" {rest * 1e3:>7.1f} ({rest / (base['step'] - base['call']):.2f}x)"
            f" {extra * 1e3 if nodes_n > 1 else 0:>9.2f}"
        )
    for n in nodes:
        v = med.get(f"chain {n}")
        if v:
            att = (
                f"attention (kernel + collective) {attention(v) / attention(base):.2f}x"
                if not args.whole
                else f"attention call {v['call'] / base['call']:.2f}x"
            )
            print(
                f"  chain {n}: fully rejected {v['step'] / base['step']:.2f}x a plain step; "
                f"perfect depth {n - 1}: {n * base['step'] / v['step']:.2f}x plain tokens/s; " + att
            )


if __name__ == "__main__":
    main()
