"""``python -m mpitree demo``: every strategy on a synthetic long context, checked and timed."""

import time

import numpy as np
from mpi4py import MPI

from .._local import local_state
from .._op import native_op_available
from .._plan import DecodePlan
from .._reference import reference_attention
from .._runtime import default_comm

STRATEGY_ORDER = ("allreduce", "allreduce3", "allgather", "hierarchical", "ring")


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


def add_arguments(parser):
    """Register the demo's command-line options."""
    parser.add_argument("--tokens", type=int, default=65536, help="total context length N")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--q-len", type=int, default=1, help="query tokens per step")
    parser.add_argument("--dtype", default="float32", choices=["float16", "float32", "float64"])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per strategy")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)


def _slowest(comm, seconds):
    """Per-step time of the slowest rank."""
    out = np.empty_like(seconds)
    comm.Allreduce(seconds, out, op=MPI.MAX)
    return out


def run(args):
    """Run the demo on every rank; rank 0 prints the table. Returns the max error."""
    comm = default_comm()
    p, rank = comm.Get_size(), comm.Get_rank()
    sizes = shard_sizes(args.tokens, p)
    q = (
        np.random.default_rng([args.seed, 0])
        .standard_normal((args.batch, args.q_heads, args.q_len, args.head_dim), dtype=np.float32)
        .astype(args.dtype)
    )
    k, v = make_shard(args, rank, sizes[rank])
    if rank == 0:
        print(
            f"mpitree demo: {p} ranks, N={args.tokens} tokens (shards {sizes.tolist()}), "
            f"B={args.batch} Hq={args.q_heads} Hkv={args.kv_heads} D={args.head_dim} "
            f"Sq={args.q_len} {args.dtype}; native op: {native_op_available()}; "
            f"{MPI.Get_library_version().splitlines()[0].strip()}",
            flush=True,
        )

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
        for s in STRATEGY_ORDER
    }
    outputs = {s: plan.decode(q, k, v) for s, plan in plans.items()}

    ref_err = None
    if rank == 0:
        shards = [make_shard(args, r, sizes[r]) for r in range(p)]
        ref, _ = reference_attention(
            q,
            np.concatenate([s[0] for s in shards], axis=2),
            np.concatenate([s[1] for s in shards], axis=2),
        )
        ref_err = {s: float(np.abs(o.astype(np.float64) - ref).max()) for s, o in outputs.items()}
        del shards

    names = ("local only", *STRATEGY_ORDER)
    times = np.zeros((len(names), args.steps))
    for step in range(args.warmup + args.steps):
        for i, name in enumerate(names):
            comm.Barrier()
            t0 = time.perf_counter()
            if i == 0:
                local_state(q, k, v)
            else:
                plans[name].decode(q, k, v)
            if step >= args.warmup:
                times[i, step - args.warmup] = time.perf_counter() - t0
    slow = _slowest(comm, times)
    for plan in plans.values():
        plan.free()

    if rank == 0:
        med = np.median(slow, axis=1) * 1e3
        lo, hi = (np.percentile(slow, q_, axis=1) * 1e3 for q_ in (10, 90))
        print(
            f"\n{'strategy':<12} {'max |err| vs f64':>17} {'median ms':>10} "
            f"{'p10-p90 ms':>14} {'over local':>11} {'vs ring':>8}"
        )
        ring = med[names.index("ring")]
        for i, name in enumerate(names):
            err = "-" if i == 0 else f"{ref_err[name]:.2e}"
            over = "-" if i == 0 else f"{med[i] - med[0]:+.2f} ms"
            print(
                f"{name:<12} {err:>17} {med[i]:>10.2f} {lo[i]:>6.2f}-{hi[i]:<7.2f} "
                f"{over:>11} {ring / med[i]:>7.2f}x"
            )
        print(
            f"\nslowest rank's time per step, median of {args.steps} interleaved steps "
            f"after {args.warmup} warm-up steps"
        )
        return max(ref_err.values())
    return None
