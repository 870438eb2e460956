"""A jitted JAX decode step against the eager core's step, same shapes, side by side.

One Llama-3.1-8B attention layer (B=1, Hq=32, Hkv=8, D=128, one query row,
float32), ``--keys`` keys in all, split evenly over the ranks. Timed
interleaved in one run, slowest rank per iteration, median (and p10) after
warm-up:

- ``core tree_decode``: ``mpitree.tree_decode`` on numpy (the C kernel, the
  agreement, the native-op merge, the output);
- ``core plan``: ``DecodePlan.decode`` (agreement paid once);
- ``jax jit``: ``jax.jit`` of ``mpitree.adapters.jax.tree_decode`` (XLA's local
  attention, then the ordered host callback: agreement and merge);
- ``jax jit, local only``: the same jitted local attention with no merge (what
  XLA's kernel costs alone);
- ``mpi4jax max+sum`` (when mpi4jax imports): the paper's merge inside the
  jitted program through mpi4jax's ``allreduce`` (MAX of m, then SUM of the
  rescaled ``[d, n]``).

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/jax_decode.py --keys 32768
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI
from mpitree.adapters import jax as mj

import mpitree

B, HQ, HKV, D = 1, 32, 8, 128


def local_only(q, k, v):
    """Return softmax attention of one query row over this shard alone (no merge)."""
    g = HQ // HKV
    s = jnp.einsum("bhgd,bhtd->bhgt", q.reshape(B, HKV, g, D) / np.sqrt(D), k)
    m = s.max(-1, keepdims=True)
    p = jnp.exp(s - m)
    out = jnp.einsum("bhgt,bhtd->bhgd", p, v) / p.sum(-1, keepdims=True)
    return out.reshape(B, HQ, 1, D)


def mpi4jax_step():
    """Return a jitted step merging with mpi4jax's MAX then SUM all-reduces, or None."""
    try:
        import mpi4jax
    except ImportError:
        return None
    comm = MPI.COMM_WORLD.Clone()

    def step(q, k, v):
        g = HQ // HKV
        s = jnp.einsum("bhgd,bhtd->bhgt", q.reshape(B, HKV, g, D) / np.sqrt(D), k)
        m = s.max(-1, keepdims=True)
        big_m = mpi4jax.allreduce(m, op=MPI.MAX, comm=comm)
        p = jnp.exp(s - big_m)
        n = jnp.einsum("bhgt,bhtd->bhgd", p, v)
        dn = jnp.concatenate([p.sum(-1, keepdims=True), n], -1)
        dn = mpi4jax.allreduce(dn, op=MPI.SUM, comm=comm)
        return (dn[..., 1:] / dn[..., :1]).reshape(B, HQ, 1, D)

    return jax.jit(step)


def main():
    """Time the steps side by side; rank 0 prints the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=32768, help="keys over all ranks")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    t = args.keys // size
    rng = np.random.default_rng(rank)
    q = np.random.default_rng(0).standard_normal((B, HQ, 1, D)).astype(np.float32)
    k = rng.standard_normal((B, HKV, t, D)).astype(np.float32)
    v = rng.standard_normal((B, HKV, t, D)).astype(np.float32)
    jq, jk, jv = (jnp.asarray(x) for x in (q, k, v))
    plan = mpitree.DecodePlan(B, HQ, HKV, D)
    jitted = jax.jit(mj.tree_decode)
    local = jax.jit(local_only)
    steps = {
        "core tree_decode": lambda: mpitree.tree_decode(q, k, v),
        "core plan": lambda: plan.decode(q, k, v),
        "jax jit": lambda: jitted(jq, jk, jv).block_until_ready(),
        "jax jit, local only": lambda: local(jq, jk, jv).block_until_ready(),
    }
    other = mpi4jax_step()
    if other is not None:
        steps["mpi4jax max+sum"] = lambda: other(jq, jk, jv).block_until_ready()
    ref = np.asarray(plan.decode(q, k, v))
    for name in ("jax jit", "mpi4jax max+sum"):
        if name in steps:
            got = np.asarray(steps[name]() if name == "jax jit" else other(jq, jk, jv))
            assert np.abs(got - ref).max() < 1e-4, (name, np.abs(got - ref).max())
    times = {name: [] for name in steps}
    for i in range(args.warmup + args.iters):
        for name, fn in steps.items():
            comm.Barrier()
            start = time.perf_counter()
            fn()
            took = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
            if i >= args.warmup:
                times[name].append(took)
    plan.free()
    if rank == 0:
        base = np.median(times["core tree_decode"])
        print(f"p={size}, {args.keys} keys ({t} a rank), B={B} Hq={HQ} Hkv={HKV} D={D}, float32")
        print(f"{'step':<22}{'median ms':>11}{'p10 ms':>9}{'vs core':>9}")
        for name, ts in times.items():
            med = np.median(ts)
            p10 = np.percentile(ts, 10)
            print(f"{name:<22}{med * 1e3:>11.3f}{p10 * 1e3:>9.3f}{med / base:>8.2f}x")


if __name__ == "__main__":
    main()
