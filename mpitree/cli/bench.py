"""``python -m mpitree bench``: the paper's comparisons (latency, bytes, peak memory) in one run."""

import json
import platform
import time
import tracemalloc

import numpy as np
from mpi4py import MPI

from .. import __version__
from .._decode_plan import DecodePlan
from .._kernel import kernel_isa, native_kernel_available, read_seconds
from .._local import local_state, state_records
from .._namespace import namespace
from .._op import native_op_available
from .._registry import host_strategies
from .._runtime import default_comm, limit_blas_threads, ranks_on_node
from .._strategies import REGISTRY
from .._traffic import traffic
from ._args import count, counts, names
from ._display import NOISE, NOISE_NOTE, overhead, progress

WORKLOADS = {
    # Llama-3.1-8B attention layer: 32 query heads, 8 KV heads, D = 128
    "llama3-8b": dict(q_heads=32, kv_heads=8, head_dim=128),
    # the paper's benchmark block (section 6.6.1): 16 heads of dimension 128
    "paper-block": dict(q_heads=16, kv_heads=16, head_dim=128),
    # Llama-3-70B attention layer: 64 query heads, 8 KV heads (a GQA group of 8), D = 128
    "llama3-70b": dict(q_heads=64, kv_heads=8, head_dim=128),
}
DEFAULT_WORKLOADS = ("llama3-8b", "paper-block")
DEFAULT_TOKENS = "32768,65536,131072,262144"
QUICK_TOKENS = "2048,4096"


def add_arguments(parser):
    """Register the benchmark's options."""
    parser.add_argument(
        "--workloads",
        type=names(tuple(WORKLOADS)),
        default=DEFAULT_WORKLOADS,
        help=f"comma-separated, from {', '.join(WORKLOADS)}",
    )
    parser.add_argument(
        "--tokens",
        type=counts(1),
        default=None,
        help=f"comma-separated sequence lengths N (default: {DEFAULT_TOKENS}; "
        f"{QUICK_TOKENS} with --quick)",
    )
    parser.add_argument("--batch", type=count(1), default=1, help="batch size B")
    parser.add_argument("--steps", type=count(1), default=10, help="timed steps per method")
    parser.add_argument(
        "--warmup", type=count(0), default=2, help="untimed warm-up steps per method"
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"small run: N = {QUICK_TOKENS}, 3 steps, 1 warm-up"
    )
    parser.add_argument(
        "--node-size",
        type=count(0),
        default=0,
        help="virtual node size for the hierarchical strategy (0: real nodes)",
    )
    parser.add_argument(
        "--json", metavar="PATH", help="write every number and the environment to PATH"
    )
    parser.add_argument(
        "--plot", metavar="PATH", help="draw the paper-style figure to PATH (needs matplotlib)"
    )


def matplotlib_importable():
    """Return whether matplotlib imports, as ``--plot`` needs."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def environment(comm):
    """Describe the run: MPI, ranks, placement, BLAS threads, CPU, versions."""
    from threadpoolctl import threadpool_info

    nodes = len(set(comm.allgather(MPI.Get_processor_name())))
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return {
        "mpi_library": MPI.Get_library_version().splitlines()[0].strip(),
        "mpi_version": "{}.{}".format(*MPI.Get_version()),
        "ranks": comm.Get_size(),
        "nodes": nodes,
        "ranks_per_node": ranks_on_node(),
        "blas_threads": sorted(
            {p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"}
        ),
        "cpu": cpu,
        "gpu": "none (numpy/C path)",
        "python": platform.python_version(),
        "numpy": np.__version__,
        "mpitree": __version__,
        "native_op": native_op_available(),
        "native_kernel": native_kernel_available(),
        "kernel_build": kernel_isa() if native_kernel_available() else "numpy (no C kernel)",
    }


def paper_formulas(p, batch, tokens, q_heads, kv_heads, head_dim, kv_itemsize):
    """Eqs. 29-35 of the paper in bytes, per rank per step (state in float32)."""
    t = tokens / p
    d_kv, d_q = kv_heads * head_dim, q_heads * head_dim
    kv_chunk = 2 * batch * t * d_kv * kv_itemsize  # eq. 32: numel(k, v) of one chunk
    state = (batch * d_q + 2 * batch * q_heads) * 4  # eq. 34: numel(n, d, m)
    return {
        "eq31_ring_bytes": kv_chunk * p,
        "eq35_tree_bytes": 2 * (p - 1) / p * state,
        "eq34_state_bytes": state,
        # eqs. 29/30 minus the resident shard (2btd): what each strategy adds
        "eq29_ring_extra_bytes": kv_chunk + 2 * batch * d_q * kv_itemsize,
        "eq30_tree_extra_bytes": 2 * batch * d_q * kv_itemsize + 2 * batch * q_heads * 4,
    }


def _stats(seconds):
    """Median, 10th and 90th percentile in milliseconds."""
    return {
        "median_ms": float(np.median(seconds) * 1e3),
        "p10_ms": float(np.percentile(seconds, 10) * 1e3),
        "p90_ms": float(np.percentile(seconds, 90) * 1e3),
    }


def measure(comm, args, workload, tokens):
    """Measure one (workload, N) cell on every rank; return its numbers (all ranks)."""
    p, rank = comm.Get_size(), comm.Get_rank()
    shape = WORKLOADS[workload]
    hq, hkv, dim = shape["q_heads"], shape["kv_heads"], shape["head_dim"]
    sizes = np.diff(np.linspace(0, tokens, p + 1).round().astype(np.int64))
    rng = np.random.default_rng([7, rank])
    q = np.random.default_rng(7).standard_normal((args.batch, hq, 1, dim), dtype=np.float32)
    k = rng.standard_normal((args.batch, hkv, int(sizes[rank]), dim), dtype=np.float32)
    v = rng.standard_normal((args.batch, hkv, int(sizes[rank]), dim), dtype=np.float32)
    strategies = host_strategies()  # every registered one numpy arrays run, in order
    plans = {
        s: DecodePlan(args.batch, hq, hkv, dim, comm=comm, strategy=s, node_size=args.node_size)
        for s in strategies
    }

    outputs, sent, extra = {}, {}, {}
    for s, plan in plans.items():
        outputs[s] = plan.decode(q, k, v)  # first call: not timed
        traffic.reset()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        plan.decode(q, k, v)
        extra[s] = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
        sent[s] = traffic.bytes
    diff = {s: float(np.abs(o - outputs["allreduce"]).max()) for s, o in outputs.items()}

    numpy = namespace(q)
    methods = {
        "read K+V": lambda: (read_seconds(k), read_seconds(v)),
        "local (C kernel)": lambda: local_state(q, k, v),
        "local (numpy)": lambda: state_records(numpy, q, k, v, dim**-0.5, None, None, "float32"),
        **{s: (lambda plan=plan: plan.decode(q, k, v)) for s, plan in plans.items()},
    }
    names = list(methods)
    times = np.zeros((len(names), args.steps))
    for step in range(args.warmup + args.steps):
        for i, name in enumerate(names):
            comm.Barrier()
            t0 = time.perf_counter()
            methods[name]()
            if step >= args.warmup:
                times[i, step - args.warmup] = time.perf_counter() - t0
    for plan in plans.values():
        plan.free()
    slow = np.empty_like(times)
    comm.Allreduce(times, slow, op=MPI.MAX)
    # bandwidth: each rank's own median (K+V bytes / time), then the median over ranks
    kv_bytes = k.nbytes + v.nbytes
    own = kv_bytes / np.median(times[:3], axis=1)
    bw = np.array(comm.allgather(own))  # (p, 3): read, kernel, numpy
    ratio = np.median(bw[:, 1] / bw[:, 0])
    counted = np.array(comm.allgather([sent[s] for s in strategies])).max(axis=0)
    mem = np.array(comm.allgather([extra[s] for s in strategies])).max(axis=0)
    cell = {
        "workload": workload,
        **shape,
        "tokens": tokens,
        "batch": args.batch,
        "ranks": p,
        "shard_tokens": sizes.tolist(),
        "dtype": "float32",
        "times": {n: _stats(slow[i]) for i, n in enumerate(names)},
        "bytes_sent_per_rank": dict(zip(strategies, counted.tolist(), strict=False)),
        "extra_peak_bytes_per_rank": dict(zip(strategies, mem.tolist(), strict=False)),
        "max_abs_diff_vs_allreduce": diff,
        "bandwidth_gbs": {
            "read": float(np.median(bw[:, 0]) / 1e9),
            "kernel": float(np.median(bw[:, 1]) / 1e9),
            "numpy": float(np.median(bw[:, 2]) / 1e9),
            "kernel_over_read": float(ratio),
        },
        "paper": paper_formulas(p, args.batch, tokens, hq, hkv, dim, 4),
    }
    med = {n: cell["times"][n]["median_ms"] for n in names}
    cell["ring_over_tree"] = med["ring"] / med["allreduce"]
    return cell


def _mb(x):
    """Bytes as a short human string."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f} {unit}"
    return f"{x:.0f} B"


def _table(title, columns, rows):
    """Print a titled table: N, then one right-aligned value per cell (fits 100 columns)."""
    print(f"\n{title}")
    print(f"{'N':>8}" + "".join(f"{c:>11}" for c in columns))
    for n, values in rows:
        print(f"{n:>8}" + "".join(f"{x:>11}" for x in values))


def report(env, cells, steps):
    """Print the tables on rank 0."""
    print(
        f"\nmpitree bench: {env['ranks']} ranks on {env['nodes']} node(s); "
        f"BLAS threads {env['blas_threads']}"
    )
    print(f"MPI: {' '.join(env['mpi_library'].split(',')[0].split())}")  # Open MPI's runs long
    print(f"CPU: {env['cpu']}; local kernel: {env['kernel_build']}")
    strategies = host_strategies()
    short = {"local (C kernel)": "local", **{n: c.short for n, c in REGISTRY.items() if c.short}}
    timed = ("local (C kernel)", *strategies)
    noisy = False
    for wl in dict.fromkeys(c["workload"] for c in cells):
        rows = [c for c in cells if c["workload"] == wl]
        c0 = rows[0]
        print(
            f"\n== {wl}: Hq={c0['q_heads']} Hkv={c0['kv_heads']} D={c0['head_dim']} "
            f"B={c0['batch']} float32"
        )
        _table(
            f"step time, ms: slowest rank per step, median of {steps} steps; "
            "local = C kernel on the shard alone",
            [*(short.get(n, n) for n in timed), "ring/tree"],
            [
                (
                    c["tokens"],
                    [
                        *(f"{c['times'][n]['median_ms']:.2f}" for n in timed),
                        f"{c['ring_over_tree']:.2f}x",
                    ],
                )
                for c in rows
            ],
        )
        _table(
            "spread of the step time, ms: p90 - p10",
            [short.get(n, n) for n in timed],
            [
                (
                    c["tokens"],
                    [f"{c['times'][n]['p90_ms'] - c['times'][n]['p10_ms']:.2f}" for n in timed],
                )
                for c in rows
            ],
        )
        over = [
            (
                c["tokens"],
                [
                    overhead(
                        c["times"][s]["median_ms"] - c["times"]["local (C kernel)"]["median_ms"]
                    )
                    for s in strategies
                ],
            )
            for c in rows
        ]
        noisy = noisy or any(NOISE in values for _, values in over)
        _table(
            "overhead over local attention, ms: median step time minus local's",
            [short.get(s, s) for s in strategies],
            over,
        )
        _table(
            "bytes sent per rank per step, counted, vs the paper's eq.31 (ring), "
            "eq.34 (state) and eq.35 (tree)",
            [
                "ring",
                "eq.31",
                "ring/eq.31",
                "allreduce",
                "eq.34",
                "eq.35",
                "allreduce3",
                "allgather",
            ],
            [
                (
                    c["tokens"],
                    [
                        _mb(c["bytes_sent_per_rank"]["ring"]),
                        _mb(c["paper"]["eq31_ring_bytes"]),
                        f"{c['bytes_sent_per_rank']['ring'] / c['paper']['eq31_ring_bytes']:.2f}x",
                        _mb(c["bytes_sent_per_rank"]["allreduce"]),
                        _mb(c["paper"]["eq34_state_bytes"]),
                        _mb(c["paper"]["eq35_tree_bytes"]),
                        _mb(c["bytes_sent_per_rank"]["allreduce3"]),
                        _mb(c["bytes_sent_per_rank"]["allgather"]),
                    ],
                )
                for c in rows
            ],
        )
        _table(
            "peak memory beyond the resident K/V shard, per rank, measured, "
            "vs the paper's eq.29 and eq.30",
            ["ring", "eq.29", "allreduce", "eq.30", "allreduce3", "allgather"],
            [
                (
                    c["tokens"],
                    [
                        _mb(c["extra_peak_bytes_per_rank"]["ring"]),
                        _mb(c["paper"]["eq29_ring_extra_bytes"]),
                        _mb(c["extra_peak_bytes_per_rank"]["allreduce"]),
                        _mb(c["paper"]["eq30_tree_extra_bytes"]),
                        _mb(c["extra_peak_bytes_per_rank"]["allreduce3"]),
                        _mb(c["extra_peak_bytes_per_rank"]["allgather"]),
                    ],
                )
                for c in rows
            ],
        )
        _table(
            "local attention on one shard: ms as above; GB/s = K+V bytes / median time, "
            "median over ranks",
            [
                "read ms",
                "kernel ms",
                "numpy ms",
                "read GB/s",
                "kern GB/s",
                "kern/read",
                "numpy GB/s",
            ],
            [
                (
                    c["tokens"],
                    [
                        *(
                            f"{c['times'][n]['median_ms']:.2f}"
                            for n in ("read K+V", "local (C kernel)", "local (numpy)")
                        ),
                        f"{c['bandwidth_gbs']['read']:.1f}",
                        f"{c['bandwidth_gbs']['kernel']:.1f}",
                        f"{100 * c['bandwidth_gbs']['kernel_over_read']:.0f}%",
                        f"{c['bandwidth_gbs']['numpy']:.1f}",
                    ],
                )
                for c in rows
            ],
        )
        worst = max(max(c["max_abs_diff_vs_allreduce"].values()) for c in rows)
        print(f"\nmax |out - allreduce out| over strategies and N: {worst:.2e}")
    if noisy:
        print(f"\n{NOISE_NOTE}")


def plot(cells, path):
    """Draw time relative to ring at the smallest N, per strategy, vs N (one panel per workload)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(c["workload"] for c in cells))
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.2), squeeze=False)
    for ax, wl in zip(axes[0], workloads, strict=False):
        rows = sorted((c for c in cells if c["workload"] == wl), key=lambda c: c["tokens"])
        base = rows[0]["times"]["ring"]["median_ms"]
        n = [c["tokens"] for c in rows]
        for name in (*host_strategies(), "local (C kernel)"):
            ax.plot(
                n,
                [c["times"][name]["median_ms"] / base for c in rows],
                marker="o",
                label="tree (allreduce)" if name == "allreduce" else name,
                linestyle="--" if name.startswith("local") else "-",
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length N (tokens)")
        ax.set_ylabel(f"time relative to ring at N={n[0]}")
        c0 = rows[0]
        ax.set_title(
            f"{wl}: {c0['ranks']} ranks, Hq={c0['q_heads']} Hkv={c0['kv_heads']} D={c0['head_dim']}"
        )
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(args):
    """Run every (workload, N) cell; rank 0 reports."""
    comm = default_comm()
    rank = comm.Get_rank()
    workloads = list(args.workloads)
    if args.quick:
        args.steps, args.warmup = min(args.steps, 3), min(args.warmup, 1)
    tokens = list(args.tokens or counts(1)(QUICK_TOKENS if args.quick else DEFAULT_TOKENS))
    limit_blas_threads()  # what every plan applies; report the threads the run really uses
    env = environment(comm)
    cells, total = [], len(workloads) * len(tokens)
    for wl in workloads:
        for n in tokens:
            if rank == 0:
                progress("bench", len(cells), total, f"{wl} N={n}")
            cells.append(measure(comm, args, wl, n))
    if rank == 0:
        progress("bench", total, total, "done")
        report(env, cells, args.steps)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"environment": env, "results": cells}, f, indent=1)
            print(f"wrote {args.json}")
        if args.plot:
            plot(cells, args.plot)
            print(f"wrote {args.plot}")
    return cells
