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

With ``--unfused``, every step also runs a second time with the layers' one
compiled call off (the kernel inside the merge, then finishing: two C calls and
the merge's Python around its collective), interleaved, and a second table
gives that path's breakdown.

With ``--c-timers``, every step also runs with one timer around each attention call
and none inside (phase_times's own timers cost several microseconds a layer): a later
layer's call is split by the one compiled call's own clock into its kernel, its
collective and the rest, the overhead. It runs twice, interleaved: as the model calls
it (a step's later layers in the entry point's lane, before the guard) and with every
layer through the guard.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/decode_overhead.py --context 2048
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict

import mpitree.adapters.transformers as mtt
import numpy as np
import torch
import transformers
from mpi4py import MPI
from timers import timed  # this folder: the timer, written once
from tiny_llama import tiny_llama  # this folder: the model, written once

from mpitree import extend
from mpitree.extend import phase_times

TIMES = {"one call": defaultdict(list), "unfused": defaultdict(list)}
NOW = ["one call"]  # the variant being timed


def now():
    """Return the dict of the variant being timed: name -> durations (seconds)."""
    return TIMES[NOW[0]]


def struct(bound):
    """Return a bound layer's step struct (``Bound.struct``; ``BoundLayer.call`` before)."""
    return bound.struct if hasattr(bound, "struct") else bound.call


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
    parser.add_argument(
        "--unfused", action="store_true", help="also time each step with the one call off"
    )
    parser.add_argument(
        "--c-timers",
        action="store_true",
        help="also time each step with no Python timer inside the call: the one compiled "
        "call's own clock splits it (kernel, collective); and, interleaved, the same with "
        "every layer through the guard (the entry point's lane off)",
    )
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    positions = args.context + args.steps + args.warmup + 8
    cfg, model, ids = tiny_llama(args.layers, args.context, positions)
    cache = mtt.ShardedCache(cfg)
    model.set_attn_implementation("mpitree")
    mtt.prefill(model, ids, cache)
    dynamic = None
    if comm.size == 1:
        model.set_attn_implementation("sdpa")
        with torch.no_grad():
            dynamic = model(ids, use_cache=True).cache
    funcs = transformers.AttentionInterface._global_mapping
    timed_call = funcs["mpitree"] = timed("mpitree call", funcs["mpitree"], now)
    funcs["sdpa"] = timed("sdpa call", funcs["sdpa"], now)
    tok = ids[:, -1:]

    def step(impl, c):
        model.set_attn_implementation(impl)
        start = time.perf_counter()
        with torch.no_grad():
            model(input_ids=tok, cache=c, use_cache=True)
        TIMES[NOW[0]][f"{impl} step"].append(time.perf_counter() - start)

    def bare_agreement():
        if comm.size == 1:  # one rank agrees with no collective
            return
        buf = np.zeros(4, np.int64)
        start = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MIN)
        TIMES[NOW[0]]["bare collective"].append(time.perf_counter() - start)

    entry_points = getattr(extend, "tools", extend).ENTRY_POINTS  # 8d5d047: extend's own
    registry = dict(entry_points)
    guarded = extend.entry_point(timed_call.__wrapped__.__wrapped__)  # no lane
    entry_points.update(registry)  # the registry keeps the model's own entry point

    def c_timed_step(keep, clocks, attention):
        """One step with only the outer timer; later layers read the one call's own clock."""
        calls = []

        def outer(module, *a, **k):
            start = time.perf_counter()
            try:
                return attention(module, *a, **k)
            finally:
                calls.append((module.layer_idx, time.perf_counter() - start))

        bound = [struct(layer.fast.bound) for layer in cache.layers if layer.fast is not None]
        funcs["mpitree"] = outer
        for call in bound:
            call.timed, call.kernel_ns = 1, -1
        comm.Barrier()
        try:
            with torch.no_grad():
                model.set_attn_implementation("mpitree")
                model(input_ids=tok, cache=cache, use_cache=True)
        finally:
            for call in bound:
                call.timed = 0
            funcs["mpitree"] = timed_call
        for idx, took in calls[1:] if keep else ():
            fast = cache.layers[idx].fast
            call = None if fast is None else struct(fast.bound)
            if fast is not None and fast.bound.merger is None:  # every rank alike
                if comm.rank == 0:
                    print(
                        "decode_overhead.py: --c-timers times each later layer's one compiled "
                        "call, which this MPI does not run (its all-reduce is not persistent: "
                        "Open MPI runs two calls); run without --c-timers",
                        file=sys.stderr,
                    )
                raise SystemExit(2)
            if call is None or call.kernel_ns < 0:
                raise RuntimeError("a later layer did not run its one compiled call")
            clocks.append((took, call.kernel_ns * 1e-9, call.collective_ns * 1e-9))

    def one_call(on):
        for layer in cache.layers:
            if layer.fast is not None:
                layer.fast.fused = on and layer.fast.bound.merger is not None

    runs = [("mpitree", cache)] + ([("sdpa", dynamic)] if dynamic is not None else [])
    variants = ["one call"] + (["unfused"] if args.unfused else [])
    variants += ["C timers", "C timers, guarded"] if args.c_timers else []
    # C timers: (call, kernel, collective) seconds of each later layer, lane on and off
    clocks = {"C timers": [], "C timers, guarded": []}
    # mpitree's own timers: the merge, a step's one agreement (checks included), the
    # collective and its failure flag, the C kernel, a layer's checked step ("local")
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            for times in TIMES.values():
                times.clear()
        for variant in variants:
            NOW[0] = variant
            one_call(variant != "unfused")
            if variant in clocks:
                attention = timed_call.__wrapped__ if variant == "C timers" else guarded
                c_timed_step(i >= args.warmup, clocks[variant], attention)
                continue
            with phase_times(TIMES[variant]):
                comm.Barrier()
                bare_agreement()
                for impl, c in runs:
                    step(impl, c)
    for variant in variants[:2] if args.unfused else variants[:1]:
        report(comm, args, variant, TIMES[variant])
    for variant, taken in clocks.items() if args.c_timers else ():
        report_clocks(comm, variant, taken)


def report_clocks(comm, variant, clocks):
    """Print the C-timed step's later layers: call, kernel, collective, the rest (rank 0)."""
    med = [statistics.median(x) * 1e6 for x in zip(*clocks, strict=True)]
    rest = statistics.median(c - k - x for c, k, x in clocks) * 1e6
    every = comm.gather([*med, rest])
    if comm.rank == 0:
        call, kernel, coll, rest = (max(m[i] for m in every) for i in range(4))
        print(
            f"{variant}, one call, {comm.size} rank(s): later layers' median us: call {call:.1f}, "
            f"kernel {kernel:.1f}, collective {coll:.1f}; overhead (call - both) {rest:.1f}"
        )


def report(comm, args, variant, times):
    """Print one variant's per-layer breakdown on rank 0."""
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    med["per step"] = statistics.median(per_step(times, args.steps)) * 1e6
    first, later = by_layer(times, args.steps)
    med["first layer"], med["later layers"] = first * 1e6, later * 1e6
    every = comm.gather(med)
    if comm.rank:
        return
    med = {k: max(m[k] for m in every) for k in med}
    call, merge, kernel, coll = (med[k] for k in ("mpitree call", "merge", "kernel", "collective"))
    local = med.get("local", kernel)  # no checked step: every layer ran its one call
    print(
        f"{variant}: {comm.size} rank(s), context {args.context}, {args.layers} layers, "
        f"Llama 8 q / 2 kv heads, D 32, float32; "
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
        print(f"  (the checked path ran {len(times['local'])} of {len(times['merge'])} layers)")
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
