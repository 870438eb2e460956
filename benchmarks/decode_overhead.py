"""Per-layer decode overhead of attn_implementation="mpitree", broken down, vs transformers' sdpa.

Every rank runs the same random-weight Llama decode steps over a ``ShardedCache``;
timers wrap the attention entry point, the merge, the layer's local work inside it
and the C kernel, so each layer's time splits into the kernel, local checks and
visibility, the merge's communication and the rest of the call (the overhead is
everything but the kernel and the communication). With one
rank the same steps also run with ``sdpa`` over a ``DynamicCache``, interleaved, and
the table adds sdpa's attention call and whole-step times.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/decode_overhead.py --context 2048
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import mpitree.adapters.transformers as mtt
import torch
import transformers
from mpi4py import MPI
from mpitree.adapters.transformers._attention import LayerStep

from mpitree import _merger, _plan
from mpitree._plan import Attention

TIMES = defaultdict(list)


def timed(name, fn):
    """Wrap ``fn`` so each call's duration is appended to ``TIMES[name]``."""

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name].append(time.perf_counter() - start)

    return wrapper


def main():
    """Time decode steps and print the per-layer breakdown on rank 0."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    cfg = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=args.context + args.steps + args.warmup + 8,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(1, 1024, (1, args.context), generator=torch.Generator().manual_seed(1))
    cache = mtt.ShardedCache(cfg)
    model.set_attn_implementation("mpitree")
    mtt.prefill(model, ids, cache)
    dynamic = None
    if comm.size == 1:
        model.set_attn_implementation("sdpa")
        with torch.no_grad():
            dynamic = model(ids, use_cache=True).past_key_values
    funcs = transformers.AttentionInterface._global_mapping
    funcs["mpitree"] = timed("mpitree call", funcs["mpitree"])
    funcs["sdpa"] = timed("sdpa call", funcs["sdpa"])
    _merger.Merger.merge = timed("merge", _merger.Merger.merge)
    Attention.fill = timed("kernel", Attention.fill)  # the unbound path
    _plan.Prepared.run = timed("kernel", _plan.Prepared.run)  # a plan's bound kernel
    _plan.Prepared.run_raw = timed("kernel", _plan.Prepared.run_raw)  # a layer's bound kernel
    LayerStep.fill = timed("local", LayerStep.fill)
    tok = ids[:, -1:]

    def step(impl, c):
        model.set_attn_implementation(impl)
        start = time.perf_counter()
        with torch.no_grad():
            model(input_ids=tok, past_key_values=c, use_cache=True)
        TIMES[f"{impl} step"].append(time.perf_counter() - start)

    runs = [("mpitree", cache)] + ([("sdpa", dynamic)] if dynamic is not None else [])
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            TIMES.clear()
        comm.Barrier()
        for impl, c in runs:
            step(impl, c)
    med = {k: statistics.median(v) * 1e6 for k, v in TIMES.items()}
    every = comm.gather(med)
    if comm.rank:
        return
    med = {k: max(m[k] for m in every) for k in med}
    call, merge, local, kernel = (med[k] for k in ("mpitree call", "merge", "local", "kernel"))
    print(
        f"{comm.size} rank(s), context {args.context}, Llama 8 q / 2 kv heads, D 32, float32; "
        f"slowest rank's median of {args.steps} steps, us per layer"
    )
    rows = [
        ("local attention: the C kernel", kernel),
        ("local checks and visibility", local - kernel),
        ("merge communication (merge - local)", merge - local),
        ("the rest of the call (signature, finish)", call - merge),
        ("overhead: checks + visibility + rest", call - merge + local - kernel),
        ("mpitree attention call", call),
    ]
    if "sdpa call" in med:
        rows.append(("sdpa attention call (1 process)", med["sdpa call"]))
        rows.append(("whole step, mpitree / sdpa (us)", None))
    for name, value in rows:
        if value is None:
            print(f"  {name:<42} {med['mpitree step']:>9.0f} / {med['sdpa step']:.0f}")
        else:
            print(f"  {name:<42} {value:>9.1f}")


if __name__ == "__main__":
    main()
