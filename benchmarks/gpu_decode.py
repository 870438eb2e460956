"""A decode step's local attention on a CUDA GPU against the read floor, side by side in one run.

Llama-3.1-8B layer shapes (32 query heads, 8 KV heads, D = 128, bfloat16 by default),
one query token, ``--tokens`` keys on this rank. Measured in one interleaved loop
with CUDA events (median of ``--steps`` after ``--warmup``):

- ``copy``: a device-to-device copy of K and V (read + write bytes): the card's
  bandwidth as this run finds it; the read floor is K+V bytes over it;
- ``records``: ``mpitree.adapters.torch.local_state`` (the records mpitree merges);
- ``sdpa``: torch's fused ``scaled_dot_product_attention`` (GQA), output only, no lse;
- ``flash_lse``: torch's flash-attention op with its log-sum-exp, the GQA group folded
  into the query rows (what records from a fused kernel would cost: out and lse);
- ``tree_decode``: the whole ``mpitree.tree_decode`` call (local state, staging the
  records to the host, the merge, the output back on the device);
- ``plan``: ``DecodePlan.decode``, the same step through a plan;
- ``triton_records``, ``triton_tree``, ``triton_plan``: ``records``, ``tree_decode``
  and ``plan`` with ``MPITREE_KERNEL=triton`` set around each: the fused Triton
  kernel (``adapters/_triton_decode.py``) writes the records (rows left out where
  triton is not installed);
- ``triton_plan_out``: ``triton_plan`` into one output tensor (``out=``: a step
  allocates nothing);
- ``triton_graph``: with one rank, that step captured once in a ``torch.cuda.CUDAGraph``
  and replayed (the row is left out, saying why, where the capture fails).

Each row's error is against ``mpitree.reference_attention`` in float64 on the same
(rounded) inputs: the local rows over this rank's keys, the merged ones over the whole
sequence (``--kv-len``: mpitree's calls see each shard's first T - 1 keys, and so does
their reference). Under ``mpiexec -n P`` every rank holds
``--tokens`` keys (the ranks may share one GPU: then they run concurrently and each
rank's times include the others' load); rank 0 prints the slowest rank's medians.

    python benchmarks/gpu_decode.py --tokens 131072
    mpiexec -n 2 python benchmarks/gpu_decode.py --tokens 65536
"""

from __future__ import annotations

import argparse
import importlib.util
import os

import numpy as np
import torch
from mpi4py import MPI
from mpitree.adapters import torch as mt

import mpitree

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MERGED = ("tree_decode", "plan", "triton_tree", "triton_plan", "triton_plan_out", "triton_graph")


def timed(fn, steps, warmup):
    """Return the CUDA-event times of ``fn`` in ms, one per step, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return times


def flash_lse(q, k, v):
    """Return (out, lse) of torch's flash-attention op with the GQA group folded into rows."""
    b, hq, sq, dim = q.shape
    hkv = k.shape[1]
    folded = q.reshape(b, hkv, hq // hkv * sq, dim)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(folded, k, v, scale=dim**-0.5)[:2]
    return out.reshape(b, hq, sq, dim), lse.reshape(b, hq, sq)


def triton_methods(q, k, v, kw, comm, plan):
    """Return the Triton kernel's methods {name: fn} (none where triton is not installed)."""
    if importlib.util.find_spec("triton") is None:
        print("no Triton rows: triton is not installed")
        return {}

    def selected(fn):
        def run():
            os.environ["MPITREE_KERNEL"] = "triton"
            try:
                return fn()
            finally:
                del os.environ["MPITREE_KERNEL"]

        return run

    records = selected(lambda: mt.local_state(q, k, v, kv_len=kw.get("kv_len")))
    out = torch.empty_like(q)
    step = selected(lambda: plan.decode(q, k, v, out=out, **kw))
    methods = {
        "triton_records": records,
        "triton_tree": selected(lambda: mpitree.tree_decode(q, k, v, comm=comm, **kw)),
        "triton_plan": selected(lambda: plan.decode(q, k, v, **kw)),
        "triton_plan_out": step,
    }
    if comm.size == 1:
        try:
            graph = captured(step)
        except Exception as exc:  # an untried path on a new machine: say why, keep the rest
            print(f"no triton_graph row: the capture failed: {type(exc).__name__}: {exc}")
        else:
            methods["triton_graph"] = lambda: (graph.replay(), out)[1]
    return methods


def captured(step):
    """Return a ``torch.cuda.CUDAGraph`` of ``step()``, warmed up on a side stream first."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def main():
    """Time every method in one interleaved loop; rank 0 prints the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=131072, help="keys per rank")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    parser.add_argument("--heads", default="32,8", help="query heads, KV heads")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument(
        "--kv-len", action="store_true", help="pass kv_len = T - 1 per row to mpitree's calls"
    )
    parser.add_argument(
        "--profile", action="store_true", help="also print torch.profiler's table of tree_decode"
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU: torch.cuda.is_available() is False")
    comm = MPI.COMM_WORLD
    dtype = DTYPES[args.dtype]
    hq, hkv = (int(x) for x in args.heads.split(","))
    b, dim, n = args.batch, 128, args.tokens
    torch.manual_seed(comm.rank)
    gen = np.random.default_rng(0)
    q = torch.from_numpy(gen.standard_normal((b, hq, 1, dim))).to("cuda", dtype)
    k = torch.randn(b, hkv, n, dim, device="cuda", dtype=dtype)
    v = torch.randn(b, hkv, n, dim, device="cuda", dtype=dtype)
    scratch = [torch.empty_like(k), torch.empty_like(v)]
    nbytes = k.numel() * k.element_size() * 2
    plan = mpitree.DecodePlan(b, hq, hkv, dim, dtype=dtype, comm=comm)
    seen = n - 1 if args.kv_len else n  # keys mpitree's calls attend to, per row
    kw = {"kv_len": torch.full((b,), seen, dtype=torch.int32, device="cuda")} if args.kv_len else {}

    def copy():
        scratch[0].copy_(k)
        scratch[1].copy_(v)

    methods = {
        "copy": copy,
        "records": lambda: mt.local_state(q, k, v, **kw),
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        "flash_lse": lambda: flash_lse(q, k, v),  # half precision only
        "tree_decode": lambda: mpitree.tree_decode(q, k, v, comm=comm, **kw),
        "plan": lambda: plan.decode(q, k, v, **kw),
    }
    if dtype == torch.float32:
        del methods["flash_lse"]
    methods.update(triton_methods(q, k, v, kw, comm, plan))
    times = {name: [] for name in methods}
    for _ in range(3):  # rounds: every method once in turn, so drifts touch all alike
        for name, fn in methods.items():
            comm.Barrier()
            times[name] += timed(fn, args.steps, args.warmup)
    med = {name: comm.allreduce(float(np.median(t)), op=MPI.MAX) for name, t in times.items()}

    # exactness: every rank's shard gathered to rank 0 for the float64 reference
    shards = comm.gather((k.double().cpu().numpy(), v.double().cpu().numpy()), root=0)
    outs = {
        "records": mpitree.State(mt.local_state(q, k, v, **kw).double().cpu().numpy()).output(),
        "sdpa": torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        "tree_decode": mpitree.tree_decode(q, k, v, comm=comm, **kw),
        "plan": plan.decode(q, k, v, **kw),
    }
    if "flash_lse" in methods:
        outs["flash_lse"] = flash_lse(q, k, v)[0]
    if "triton_records" in methods:
        rec = methods["triton_records"]().double().cpu().numpy()
        outs["triton_records"] = mpitree.State(rec).output()
        outs["triton_tree"] = methods["triton_tree"]()
        outs["triton_plan"] = methods["triton_plan"]()
        outs["triton_plan_out"] = methods["triton_plan_out"]().clone()
        if "triton_graph" in methods:
            outs["triton_graph"] = methods["triton_graph"]().clone()
    if args.profile:  # last: the profiler leaves CUDA's activity tracing on, slowing launches
        with torch.profiler.profile() as prof:
            for _ in range(20):
                methods["tree_decode"]()
            torch.cuda.synchronize()
        if comm.rank == 0:
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))

    plan.free()
    if comm.rank:
        return
    q64 = q.double().cpu().numpy()
    refs = {  # (whole sequence, rank 0's shard) over every key, and over the keys mpitree sees
        "all": [mpitree.reference_attention(q64, *kv)[0] for kv in _whole_and_own(shards, n)],
        "seen": [mpitree.reference_attention(q64, *kv)[0] for kv in _whole_and_own(shards, seen)],
    }
    err = {}
    for name, out in outs.items():
        got = out if isinstance(out, np.ndarray) else out.double().cpu().numpy()
        whole, own = refs["all" if name in ("sdpa", "flash_lse") else "seen"]
        merged = name in MERGED
        err[name] = float(np.abs(got - (whole if merged else own)).max())
    bw = 2 * nbytes / med["copy"] / 1e6  # GB/s, read + write
    floor = nbytes / bw / 1e6  # ms
    print(
        f"{torch.cuda.get_device_name()}; {comm.size} rank(s); batch {b}, {hq}/{hkv} heads, "
        f"D {dim}, {n} {args.dtype} keys per rank" + (f", kv_len {seen}" if args.kv_len else "")
    )
    print(f"K+V per rank {nbytes / 1e6:.1f} MB; copy {bw:.0f} GB/s; read floor {floor:.4f} ms")
    print(f"{'method':<16} {'median ms':>10} {'x floor':>8} {'max |err|':>10}")
    for key, t in med.items():
        e = f"{err[key]:.2e}" if key in err else "-"
        print(f"{key:<16} {t:>10.4f} {t / floor:>8.2f} {e:>10}")


def _whole_and_own(shards, keys):
    """Return ((K, V) of every rank's first ``keys`` keys concatenated, rank 0's (K, V))."""
    cut = [(k[:, :, :keys], v[:, :, :keys]) for k, v in shards]
    return tuple(np.concatenate(x, axis=2) for x in zip(*cut, strict=True)), cut[0]


if __name__ == "__main__":
    main()
