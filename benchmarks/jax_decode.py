"""A jitted JAX decode step against the eager core's step, same shapes, side by side.

One Llama-3.1-8B attention layer (B=1, Hq=32, Hkv=8, D=128, one query row,
``--dtype``), ``--keys`` keys in all, split evenly over the ranks. Timed
interleaved in one run, slowest rank per iteration, median (and p10) after
warm-up (the order rotates from one iteration to the next):

- ``core tree_decode``: ``mpitree.tree_decode`` on numpy (the C kernel for
  float32, the agreement, the native-op merge, the output);
- ``core plan``: ``DecodePlan.decode`` (agreement paid once);
- ``jax jit``: ``jax.jit`` of ``mpitree.adapters.jax.tree_decode`` (float32: the
  C kernel's XLA FFI custom call on K/V in place; then the ordered merge call:
  agreement and merge);
- ``jax jit, XLA local``: the same with ``MPITREE_JAX_LOCAL=xla`` when traced
  (XLA's local attention, the adapter's path before the custom call);
- ``jax jit, local only``: XLA's local attention alone, no merge;
- ``previous adapter`` (with ``--baseline FILE``, e.g. ``git show
  HEAD~1:adapters/jax.py > /tmp/jax_before.py``): an earlier ``adapters/jax.py``
  loaded beside the current one, jitted the same way;
- ``mpi4jax max+sum`` (when mpi4jax imports): the paper's merge inside the
  jitted program through mpi4jax's ``allreduce`` (MAX of m, then SUM of the
  rescaled ``[d, n]``).

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/jax_decode.py --keys 32768

XLA's buffers get transparent huge pages only with
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` in the ranks' environment (numpy's
always do): without it the jitted kernel reads K/V on 4 KiB pages (docs/jax.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
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


def baseline_adapter(path):
    """Load an earlier ``adapters/jax.py`` from ``path`` as ``mpitree.adapters._jax_baseline``."""
    name = "mpitree.adapters._jax_baseline"
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def traced_with_xla_local(fn, *args):
    """Return ``jax.jit(fn)`` traced (and compiled) with the adapter's XLA local attention.

    A function of its own: JAX shares one trace cache between every ``jax.jit``
    of the same function, which would hand the default step this trace.
    """
    os.environ[mj.LOCAL_ENV] = "xla"
    try:
        return jax.jit(lambda *a: fn(*a)).lower(*args).compile()
    finally:
        del os.environ[mj.LOCAL_ENV]


def main():
    """Time the steps side by side; rank 0 prints the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=32768, help="keys over all ranks")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--baseline", help="an earlier adapters/jax.py to time beside")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    t = args.keys // size
    rng = np.random.default_rng(rank)
    jq = jnp.asarray(np.random.default_rng(0).standard_normal((B, HQ, 1, D)), args.dtype)
    jk = jnp.asarray(rng.standard_normal((B, HKV, t, D)), args.dtype)
    jv = jnp.asarray(rng.standard_normal((B, HKV, t, D)), args.dtype)
    q, k, v = (np.asarray(x) for x in (jq, jk, jv))  # ml_dtypes' bfloat16 for bfloat16
    plan = mpitree.DecodePlan(B, HQ, HKV, D, dtype=args.dtype)
    jitted = jax.jit(mj.tree_decode)
    xla_local = traced_with_xla_local(mj.tree_decode, jq, jk, jv)
    local = jax.jit(local_only)
    steps = {
        "core tree_decode": lambda: mpitree.tree_decode(q, k, v),
        "core plan": lambda: plan.decode(q, k, v),
        "jax jit": lambda: jitted(jq, jk, jv).block_until_ready(),
        "jax jit, XLA local": lambda: xla_local(jq, jk, jv).block_until_ready(),
        "jax jit, local only": lambda: local(jq, jk, jv).block_until_ready(),
    }
    checked = {"jax jit": jitted, "jax jit, XLA local": xla_local}
    if args.baseline:
        before = jax.jit(baseline_adapter(args.baseline).tree_decode)
        steps["previous adapter"] = lambda: before(jq, jk, jv).block_until_ready()
        checked["previous adapter"] = before
    other = mpi4jax_step()
    if other is not None:
        steps["mpi4jax max+sum"] = lambda: other(jq, jk, jv).block_until_ready()
        checked["mpi4jax max+sum"] = other
    ref = np.asarray(plan.decode(q, k, v), np.float32)
    tol = 1e-4 if args.dtype == "float32" else 2e-2
    for name, fn in checked.items():
        got = np.asarray(fn(jq, jk, jv), np.float32)
        assert np.abs(got - ref).max() < tol, (name, np.abs(got - ref).max())
    times = {name: [] for name in steps}
    names = list(steps)
    for i in range(args.warmup + args.iters):
        # the order rotates: a step that follows XLA's multi-threaded ops (its pool's
        # threads still spinning) is slowed, and every step takes that place in turn
        for name in names[i % len(names) :] + names[: i % len(names)]:
            fn = steps[name]
            comm.Barrier()
            start = time.perf_counter()
            fn()
            took = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
            if i >= args.warmup:
                times[name].append(took)
    plan.free()
    if rank == 0:
        base = np.median(times["core tree_decode"])
        shape = f"B={B} Hq={HQ} Hkv={HKV} D={D}, {args.dtype}"
        print(f"p={size}, {args.keys} keys ({t} a rank), {shape}")
        print(f"{'step':<22}{'median ms':>11}{'p10 ms':>9}{'vs core':>9}")
        for name, ts in times.items():
            med = np.median(ts)
            p10 = np.percentile(ts, 10)
            print(f"{name:<22}{med * 1e3:>11.3f}{p10 * 1e3:>9.3f}{med / base:>8.2f}x")


if __name__ == "__main__":
    main()
