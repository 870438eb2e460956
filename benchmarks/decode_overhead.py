"""Per-layer decode overhead of attn_implementation="mpitree", broken down, vs transformers' sdpa.

Every rank runs the same random-weight Llama decode steps over a ``ShardedCache``;
timers wrap the attention entry point and (``mpitree.extend.phase_times``) the
step's agreement, the merge, the merge strategy's collective (with its failure
flag), the layer's checked local work inside the merge (when a layer takes that
path rather than its one-call step) and the C kernel (with its ctypes call), so
each layer's time splits into the kernel, the collective, the
merge's own Python, the layer's checks and the rest of the call. The overhead is
everything but the kernel and the collective. A step's first layer also runs the
step's agreement (its checks and one 4-int64 MIN all-reduce), timed on its own
next to a bare all-reduce of the same four int64 run before each step. With one
rank the same steps also run with ``sdpa`` over a ``DynamicCache``, interleaved,
and the table adds sdpa's attention call and whole-step times. Each timer adds
about a microsecond to the calls around it.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/decode_overhead.py --context 2048
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import mpitree.adapters.transformers as mtt
import numpy as np
import torch
import transformers
from mpi4py import MPI

from mpitree.extend import phase_times

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


def per_step(times, steps):
    """Each step's mean over its layers of the call less its kernel and collective (seconds)."""
    calls, kernels, colls = (times[k] for k in ("mpitree call", "kernel", "collective"))
    layers = len(calls) // steps
    if len(kernels) != len(calls) or len(colls) != len(calls):
        raise RuntimeError("a layer ran no kernel or no collective: the breakdown does not apply")
    return [
        (sum(calls[i : i + layers]) - sum(kernels[i : i + layers]) - sum(colls[i : i + layers]))
        / layers
        for i in range(0, len(calls), layers)
    ]


def by_layer(times, steps):
    """Medians of the call less its kernel and collective: the step's first layer, the others."""
    calls, kernels, colls = (times[k] for k in ("mpitree call", "kernel", "collective"))
    layers = len(calls) // steps
    rest = [c - k - x for c, k, x in zip(calls, kernels, colls, strict=True)]
    later = [x for i, x in enumerate(rest) if i % layers]
    return statistics.median(rest[::layers]), statistics.median(later or [float("nan")])


def main():
    """Time decode steps and print the per-layer breakdown on rank 0."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first")
    parser.add_argument(
        "--layers", type=int, default=4, help="decoder layers (Llama-3.1-8B has 32)"
    )
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    cfg = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=args.layers,
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
            dynamic = model(ids, use_cache=True).cache
    funcs = transformers.AttentionInterface._global_mapping
    funcs["mpitree"] = timed("mpitree call", funcs["mpitree"])
    funcs["sdpa"] = timed("sdpa call", funcs["sdpa"])
    tok = ids[:, -1:]

    def step(impl, c):
        model.set_attn_implementation(impl)
        start = time.perf_counter()
        with torch.no_grad():
            model(input_ids=tok, cache=c, use_cache=True)
        TIMES[f"{impl} step"].append(time.perf_counter() - start)

    def bare_agreement():
        if comm.size == 1:  # one rank agrees with no collective
            return
        buf = np.zeros(4, np.int64)
        start = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MIN)
        TIMES["bare collective"].append(time.perf_counter() - start)

    runs = [("mpitree", cache)] + ([("sdpa", dynamic)] if dynamic is not None else [])
    # mpitree's own timers: the merge, a step's one agreement (checks included), the
    # collective and its failure flag, the C kernel, a layer's checked step ("local")
    with phase_times(TIMES):
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                TIMES.clear()
            comm.Barrier()
            bare_agreement()
            for impl, c in runs:
                step(impl, c)
    med = {k: statistics.median(v) * 1e6 for k, v in TIMES.items()}
    med["per step"] = statistics.median(per_step(TIMES, args.steps)) * 1e6
    first, later = by_layer(TIMES, args.steps)
    med["first layer"], med["later layers"] = first * 1e6, later * 1e6
    every = comm.gather(med)
    if comm.rank:
        return
    med = {k: max(m[k] for m in every) for k in med}
    call, merge, kernel, coll = (med[k] for k in ("mpitree call", "merge", "kernel", "collective"))
    local = med.get("local", kernel)  # no checked step: every layer ran its one call
    print(
        f"{comm.size} rank(s), context {args.context}, {args.layers} layers, Llama 8 q / 2 kv "
        f"heads, D 32, float32; "
        f"slowest rank's median of {args.steps} steps, us per layer"
    )
    rows = [
        ("local attention: the C kernel", kernel),
        ("the collective and its flag", coll),
        ("local checks and visibility", local - kernel),
        ("the merge's own Python", merge - local - coll),
        ("the rest of the call (signature, finish)", call - merge),
        ("overhead: all but kernel and collective", call - kernel - coll),
        ("  the same, a step's layers' mean", med["per step"]),
        ("  the step's first layer (its agreement)", med["first layer"]),
        ("    its agreement call: checks + collective", med["agreement"]),
        ("    a bare 4-int64 MIN all-reduce", med.get("bare collective", float("nan"))),
        ("  each later layer", med["later layers"]),
        ("  (earlier definition: checks + rest)", call - merge + local - kernel),
        ("mpitree attention call", call),
    ]
    if "local" in med:
        print(f"  (the checked path ran {len(TIMES['local'])} of {len(TIMES['merge'])} layers)")
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
