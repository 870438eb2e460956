"""A decode layer's attention call, timed from outside only: any mpitree tree, old or new.

The same random-weight Llama as ``decode_overhead.py`` (8 query / 2 KV heads,
D = 32, float32, one thread a rank) decodes over a ``ShardedCache``; the one
timer wraps the attention function transformers calls, so the figures hold for
any commit of mpitree put first on ``PYTHONPATH`` (``decode_overhead.py``'s
finer timers need the current ``mpitree.extend``). After each step every rank
also times the tree's C kernel alone over as many keys as its shard held in that
step (random K/V; the third call in a row: warm) and a bare ``MPI.SUM``
all-reduce of the merge's bytes.
Prints the slowest rank's medians: a step's first layer (it runs the step's
agreement), its later layers, the kernel, the all-reduce, and a later layer's
overhead (call - kernel - all-reduce). At a short ``--context`` the kernel is a
few microseconds, so the call is nearly all overhead; at longer contexts the
kernel inside the call runs on caches the dense layers cooled, and the warm
kernel alone understates it (the overhead then includes that difference).

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/layer_cost.py --context 16
    PYTHONPATH=OLD_TREE .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/layer_cost.py

``OLD_TREE``: a checkout of another commit with its extension built in place and
``mpitree/adapters`` linked to its ``adapters/`` (an editable install maps
``mpitree.adapters`` to this checkout's folder otherwise).
"""

from __future__ import annotations

import argparse
import statistics
import time

import mpitree.adapters.transformers as mtt
import numpy as np
import torch
import transformers
from mpi4py import MPI
from tiny_llama import tiny_llama  # this folder: the model, written once

import mpitree


def kernel_class():
    """Return the tree's bound-kernel class (``extend.tools.Prepared``; see below for older)."""
    from mpitree import extend

    tools = getattr(extend, "tools", extend)  # 8d5d047: ``extend.Prepared``
    if hasattr(tools, "Prepared"):
        return tools.Prepared
    from mpitree._kernel import Prepared  # a tree older than extend.Prepared (e.g. fe6c268)

    return Prepared


def main():
    """Time decode steps; print the medians on rank 0."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--context", type=int, default=16, help="prompt tokens")
    parser.add_argument("--steps", type=int, default=300, help="timed decode steps")
    parser.add_argument("--warmup", type=int, default=30, help="untimed steps first")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    positions = args.context + args.steps + args.warmup + 8
    cfg, model, ids = tiny_llama(args.layers, args.context, positions)
    cache = mtt.ShardedCache(cfg)
    model.set_attn_implementation("mpitree")
    mtt.prefill(model, ids, cache)
    funcs = transformers.AttentionInterface._global_mapping
    inner, calls = funcs["mpitree"], []

    def outer(module, *a, **kw):
        start = time.perf_counter_ns()
        try:
            return inner(module, *a, **kw)
        finally:
            calls.append((module.layer_idx, time.perf_counter_ns() - start))

    funcs["mpitree"] = outer
    rng = np.random.default_rng(comm.rank)
    q = rng.standard_normal((1, 8, 1, 32), dtype=np.float32)
    k, v = rng.standard_normal((2, 1, 2, positions, 32), dtype=np.float32)  # any shard fits
    records, merged = np.empty((8, 34), np.float32), np.zeros((9, 34), np.float32)
    kernel = kernel_class().of(q, k, v, 32**-0.5)  # bound once; each run may be shorter
    tok, kernels, sums = ids[:, -1:], [], []
    for i in range(args.warmup + args.steps):
        comm.Barrier()
        seen = len(calls)
        with torch.no_grad():
            model(input_ids=tok, cache=cache, use_cache=True)
        t = cache.layers[0].keys.shape[2]  # this rank's shard, as the step's layers saw it
        kt, vt = k[:, :, :t], v[:, :, :t]
        kernel.run(q, kt, vt, None, records)
        kernel.run(q, kt, vt, None, records)
        t0 = time.perf_counter_ns()
        kernel.run(q, kt, vt, None, records)
        t1 = time.perf_counter_ns()
        comm.Barrier()
        t2 = time.perf_counter_ns()
        if comm.size > 1:
            comm.Allreduce(MPI.IN_PLACE, merged, op=MPI.SUM)
        t3 = time.perf_counter_ns()
        if i < args.warmup:
            del calls[seen:]
        else:
            kernels.append(t1 - t0)
            sums.append(t3 - t2 if comm.size > 1 else 0)
    first = statistics.median(t for layer, t in calls if layer == 0)
    later = statistics.median(t for layer, t in calls if layer > 0)
    mine = np.array([first, later, statistics.median(kernels), statistics.median(sums)]) / 1e3
    slow = np.empty_like(mine)
    comm.Allreduce(mine, slow, op=MPI.MAX)
    if comm.rank == 0:
        first, later, kern, coll = slow
        print(
            f"{mpitree.__file__.rsplit('/mpitree/', 1)[0]}: p = {comm.size}, context "
            f"{args.context}; slowest rank's median us of {args.steps} steps: first layer "
            f"{first:.1f}, later layer {later:.1f}, kernel alone {kern:.1f}, MPI.SUM {coll:.1f}, "
            f"later layer's overhead {later - kern - coll:.1f}"
        )


if __name__ == "__main__":
    main()
