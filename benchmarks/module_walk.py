"""How many mpitree modules one warm call passes through, and how often it goes back to one.

Traces (``sys.setprofile``) one warm ``mpitree.tree_decode`` call and one decode
step's attention call and cache update in the transformers adapter (a step's
first layer and a later one), following which mpitree module holds control:
the innermost frame whose module is ``mpitree`` or under it, as calls enter and
return. It prints, per call, the modules passed through, the number of times
control returns to a module it had left, and the walk itself.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/module_walk.py
"""

from __future__ import annotations

import argparse
import sys

import mpitree.adapters.transformers as mtt
import numpy as np
import torch
import transformers
from mpi4py import MPI

import mpitree


def _ours(frame):
    """Return the innermost mpitree module holding control at ``frame``, or None."""
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name == "mpitree" or name.startswith("mpitree."):
            return name
        frame = frame.f_back
    return None


def walk(fn, *args, **kwargs):
    """Run ``fn`` traced; return (its result, the modules in the order control moved)."""
    seq = []

    def profile(frame, event, arg):
        if event == "call":
            module = _ours(frame)
        elif event == "return":
            module = _ours(frame.f_back)
        else:
            return
        if module is not None and (not seq or seq[-1] != module):
            seq.append(module)

    sys.setprofile(profile)
    try:
        result = fn(*args, **kwargs)
    finally:
        sys.setprofile(None)
    return result, seq


def counts(seq):
    """Return (modules passed through, returns to a module already left)."""
    return len(set(seq)), len(seq) - len(set(seq))


def report(name, seq, verbose):
    """Print one call's counts (and walk) on rank 0."""
    if MPI.COMM_WORLD.rank:
        return
    modules, returns = counts(seq)
    print(f"{name:<44} modules {modules:>3}   returns to a module left {returns:>3}")
    if verbose:
        print("    " + " > ".join(m.removeprefix("mpitree.") for m in seq))


def main():
    """Trace the calls and print their counts on rank 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="print each walk")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(comm.rank)
    q = np.random.default_rng(0).standard_normal((1, 8, 1, 32)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 256, 32)).astype(np.float32) for _ in "kv")
    for _ in range(3):  # checked, seen, then the recurring call's bound kernel
        mpitree.tree_decode(q, k, v)
    report("tree_decode (warm)", walk(mpitree.tree_decode, q, k, v)[1], args.verbose)
    with mpitree.DecodePlan(1, 8, 2, 32) as plan:
        for _ in range(2):
            plan.decode(q, k, v)
        report("DecodePlan.decode (warm)", walk(plan.decode, q, k, v)[1], args.verbose)

    torch.set_num_threads(1)
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("mpitree")
    cache = mtt.ShardedCache(cfg)
    ids = torch.randint(1, 128, (1, 64), generator=torch.Generator().manual_seed(1))
    mtt.prefill(model, ids, cache)
    funcs = transformers.AttentionInterface._global_mapping
    attend, update = funcs["mpitree"], mtt.ShardedCache.update
    walks, tracing = {}, [False]

    def traced(key, fn):
        def wrapper(*a, **kw):
            if not tracing[0]:
                return fn(*a, **kw)
            result, seq = walk(fn, *a, **kw)
            walks.setdefault(key, []).append(seq)
            return result

        return wrapper

    funcs["mpitree"] = traced("attention", attend)
    mtt.ShardedCache.update = traced("update", update)
    tok = ids[:, -1:]
    for tracing[0] in (False, False, False, True):  # warm steps, then one traced
        with torch.no_grad():
            model(input_ids=tok, cache=cache, use_cache=True)
    funcs["mpitree"], mtt.ShardedCache.update = attend, update
    for key in ("update", "attention"):
        report(f"transformers layer {key}, a step's first", walks[key][0], args.verbose)
        report(f"transformers layer {key}, a later layer", walks[key][1], args.verbose)


if __name__ == "__main__":
    main()
