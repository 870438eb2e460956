"""``python -m mpitree demo``: every strategy on a synthetic long context, checked and timed."""

import os
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from .._decode_plan import DecodePlan
from .._local import local_state
from .._op import native_op_available
from .._reference import reference_attention
from .._registry import host_strategies
from .._runtime import default_comm
from ._args import count
from ._display import NOISE, NOISE_NOTE, overhead, progress

# Max |out - float64 reference| allowed by default: the test suite's bounds (tests/helpers.py).
# K and V are standard normal, so every output, a weighted mean of V rows, has unit-scale
# inputs and the rounding error stays near eps * O(1) however long the context (measured:
# float16 ~5e-5, float32 ~2e-7, float64 ~5e-16 from 3K to 262K tokens), while the output
# itself shrinks like 1/sqrt(N): an error relative to the output's size would grow with N.
DEFAULT_TOLERANCE = {"float16": 2e-3, "float32": 2e-5, "float64": 1e-12}


def shard_sizes(tokens, p):
    """Uneven shard sizes: rank r holds a share proportional to p + r (sums to tokens)."""
    weights = np.arange(p, 2 * p, dtype=np.float64)
    edges = np.round(np.concatenate([[0], np.cumsum(weights)]) / weights.sum() * tokens)
    return np.diff(edges.astype(np.int64))


def make_shard(args, rank, size):
    """Return the K/V shard of ``rank``, reproducible from (seed, rank)."""
    rng = np.random.default_rng([args.seed, 1, rank])
    shape = (args.batch, args.kv_heads, int(size), args.head_dim)
    k = rng.standard_normal(shape, dtype=np.float32).astype(args.dtype)
    v = rng.standard_normal(shape, dtype=np.float32).astype(args.dtype)
    return k, v


def problem(args):
    """Return what is wrong with the arguments taken together, or None."""
    if args.q_heads % args.kv_heads:
        return f"--q-heads ({args.q_heads}) must be a multiple of --kv-heads ({args.kv_heads})"
    return None


def add_arguments(parser):
    """Register the demo's command-line options."""
    parser.add_argument("--tokens", type=count(1), default=65536, help="total context length N")
    parser.add_argument("--batch", type=count(1), default=1, help="batch size B")
    parser.add_argument("--q-heads", type=count(1), default=32, help="query heads Hq")
    parser.add_argument("--kv-heads", type=count(1), default=8, help="key/value heads Hkv")
    parser.add_argument("--head-dim", type=count(1), default=128, help="head dimension D")
    parser.add_argument("--q-len", type=count(1), default=1, help="query tokens per step")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=list(DEFAULT_TOLERANCE),
        help="dtype of Q, K and V",
    )
    parser.add_argument("--steps", type=count(1), default=20, help="timed steps per strategy")
    parser.add_argument("--warmup", type=count(0), default=3, help="untimed warm-up steps")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic Q, K and V")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="PASS if every strategy's max |err| vs the float64 reference is at most this, "
        "else FAIL and exit 1 (default: per dtype, "
        + ", ".join(f"{d} {t:.0e}" for d, t in DEFAULT_TOLERANCE.items())
        + "; K and V are standard normal)",
    )


def _slowest(comm, seconds):
    """Per-step time of the slowest rank."""
    out = np.empty_like(seconds)
    comm.Allreduce(seconds, out, op=MPI.MAX)
    return out


def _shown(path):
    """Return ``path`` relative to the working directory when it lies inside it."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def launch_hint():
    """Return the command that runs the demo on 4 ranks with this interpreter."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    launcher = _shown(str(mpiexec)) if mpiexec.exists() else "mpiexec"
    return f"{launcher} -n 4 {_shown(sys.executable)} -m mpitree demo"


def run(args):
    """Run the demo on every rank; rank 0 prints the table and the verdict.

    Returns
    -------
    bool
        Whether some strategy missed the tolerance; the same on every rank.
    """
    comm = default_comm()
    p, rank = comm.Get_size(), comm.Get_rank()
    tolerance = DEFAULT_TOLERANCE[args.dtype] if args.tolerance is None else args.tolerance
    total = 2 + args.warmup + args.steps

    def tick(done, label):
        if rank == 0:
            progress("demo", done, total, label)

    sizes = shard_sizes(args.tokens, p)
    q = (
        np.random.default_rng([args.seed, 0])
        .standard_normal((args.batch, args.q_heads, args.q_len, args.head_dim), dtype=np.float32)
        .astype(args.dtype)
    )
    k, v = make_shard(args, rank, sizes[rank])
    if rank == 0:
        print(
            f"mpitree demo: {p} rank{'s' if p > 1 else ''}, N={args.tokens} tokens "
            f"(shards {sizes.tolist()}), B={args.batch} Hq={args.q_heads} Hkv={args.kv_heads} "
            f"D={args.head_dim} Sq={args.q_len} {args.dtype}; native op: {native_op_available()}; "
            f"{' '.join(MPI.Get_library_version().splitlines()[0].split())}",
            flush=True,
        )
        if p == 1:
            print(
                f"running on 1 rank: launch with {launch_hint()} to shard the cache\n"
                "(the ring comparison and overhead columns need 2 or more ranks, so they are "
                "left out)",
                flush=True,
            )

    strategies = host_strategies()  # every registered one numpy arrays run, in order
    plans = {
        s: DecodePlan(
            args.batch,
            args.q_heads,
            args.kv_heads,
            args.head_dim,
            q_len=args.q_len,
            dtype=args.dtype,
            comm=comm,
            strategy=s,
        )
        for s in strategies
    }
    tick(0, "first decode, every strategy")
    outputs = {s: plan.decode(q, k, v) for s, plan in plans.items()}

    failed = False
    if rank == 0:
        tick(1, "float64 reference")
        shards = [make_shard(args, r, sizes[r]) for r in range(p)]
        ref, _ = reference_attention(
            q,
            np.concatenate([s[0] for s in shards], axis=2),
            np.concatenate([s[1] for s in shards], axis=2),
        )
        ref_err = {s: float(np.abs(o.astype(np.float64) - ref).max()) for s, o in outputs.items()}
        del shards
        passed = {s: e <= tolerance for s, e in ref_err.items()}  # NaN fails
        failed = not all(passed.values())

    names = ("local only", *strategies)
    times = np.zeros((len(names), args.steps))
    for step in range(args.warmup + args.steps):
        timed = step >= args.warmup
        tick(
            2 + step,
            f"timed step {step - args.warmup + 1}/{args.steps}"
            if timed
            else f"warm-up step {step + 1}/{args.warmup}",
        )
        for i, name in enumerate(names):
            comm.Barrier()
            t0 = time.perf_counter()
            if i == 0:
                local_state(q, k, v)
            else:
                plans[name].decode(q, k, v)
            if timed:
                times[i, step - args.warmup] = time.perf_counter() - t0
    tick(total, "done")
    slow = _slowest(comm, times)
    for plan in plans.values():
        plan.free()

    if rank == 0:
        med = np.median(slow, axis=1) * 1e3
        lo, hi = (np.percentile(slow, q_, axis=1) * 1e3 for q_ in (10, 90))
        ring = med[names.index("ring")]
        extra = f" {'over local ms':>14} {'vs ring':>8}" if p > 1 else ""
        print(
            f"\n{'strategy':<12} {'max |err| vs f64':>17} {'check':>6} {'median ms':>10} "
            f"{'p10-p90 ms':>14}{extra}"
        )
        overs = ["-", *(overhead(m - med[0]) for m in med[1:])]
        for i, name in enumerate(names):
            err = "-" if i == 0 else f"{ref_err[name]:.2e}"
            check = "-" if i == 0 else ("ok" if passed[name] else "FAIL")
            spread = f"{lo[i]:.2f}-{hi[i]:.2f}"
            row = f"{name:<12} {err:>17} {check:>6} {med[i]:>10.2f} {spread:>14}"
            if p > 1:
                row += f" {overs[i]:>14} {ring / med[i]:>7.2f}x"
            print(row)
        print(
            f"\nslowest rank's time per step, median of {args.steps} interleaved steps "
            f"after {args.warmup} warm-up steps"
        )
        if p > 1 and NOISE in overs:
            print(NOISE_NOTE)
        worst = max(ref_err.values())
        if failed:
            bad = ", ".join(s for s in strategies if not passed[s])
            print(f"FAIL: {bad} beyond the tolerance {tolerance:g} (max |err| {worst:.2e})")
        else:
            print(
                f"PASS: every strategy within {tolerance:g} of the float64 reference "
                f"(max |err| {worst:.2e})"
            )
        sys.stdout.flush()
    return bool(comm.allreduce(failed, op=MPI.LOR))
