"""Local kernel bandwidth against the read floor, measured side by side in one run.

The same method as ``python -m mpitree bench``: the read floor streams K and V once
with the compiled loop (``read_seconds``), the kernel is ``local_state`` (C kernel);
both are timed interleaved, and bandwidth is K+V bytes over the median time. Every
build of the kernel this CPU runs is measured (``--isa`` picks some); ``--before``
times another build of the library on the same build level in the same run.

    .venv/bin/python benchmarks/kernel_bw.py --tokens 65536 --steps 15 --rounds 3
    .venv/bin/python benchmarks/kernel_bw.py --shapes all --before OLD.so
"""

from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np

from mpitree import extend, local_state

tools = getattr(extend, "tools", extend)  # trees before extend.tools (8d5d047): extend's own
Prepared, kernel_isa, kernel_levels, kernel_read_order, read_seconds, select_kernel = (
    tools.Prepared,
    tools.kernel_isa,
    tools.kernel_levels,
    tools.kernel_read_order,
    tools.read_seconds,
    tools.select_kernel,
)

SHAPES = {  # (Hq, Hkv, D, Sq): rows a KV head = Hq / Hkv * Sq
    "llama3-8b GQA 32/8": (32, 8, 128, 1),
    "paper-block MHA 16/16": (16, 16, 128, 1),
    "llama3-70b GQA 64/8": (64, 8, 128, 1),
    "8 queries of 32/8": (32, 8, 128, 8),
}
DEFAULT_SHAPES = ("llama3-8b GQA 32/8", "paper-block MHA 16/16")


def other_build(path, level):
    """Return a function running the kernel of another ``mpitree._native`` build (e.g. before)."""
    lib = ctypes.CDLL(path)
    lib.mpitree_kernel_select(level)
    lib.mpitree_attend_f32.argtypes = [ctypes.c_void_p] * 6
    lib.mpitree_attend_scratch.restype = ctypes.c_int64
    lib.mpitree_attend_scratch.argtypes = [ctypes.c_int64] * 2

    def run(q, k, v):
        b, hq, sq, dim = q.shape
        prepared = Prepared.of(q, k, v, dim**-0.5, lib=lib)
        out = np.empty((b, hq, sq, dim + 2), np.float32)
        for x in (q, k, v, out):
            assert x.flags.c_contiguous
        prepared.run(q, k, v, None, out)

    return run


def measure(hq, hkv, dim, sq, tokens, steps, before=None, dtype=np.float32):
    """Return (read GB/s, kernel GB/s, before GB/s or nan), medians of interleaved repeats."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, hq, sq, dim), dtype=np.float32).astype(dtype)
    k = rng.standard_normal((1, hkv, tokens, dim), dtype=np.float32).astype(dtype)
    v = rng.standard_normal((1, hkv, tokens, dim), dtype=np.float32).astype(dtype)
    kv32 = (k.astype(np.float32), v.astype(np.float32)) if dtype != np.float32 else (k, v)
    nbytes = k.nbytes + v.nbytes
    methods = {
        "read": lambda: (read_seconds(kv32[0]), read_seconds(kv32[1])),
        "kernel": lambda: local_state(q, k, v),
    }
    if before is not None:
        methods["before"] = lambda: before(q, k, v)
    times = {n: [] for n in methods}
    for step in range(steps + 2):
        for name, fn in methods.items():
            t0 = time.perf_counter()
            fn()
            if step >= 2:
                times[name].append(time.perf_counter() - t0)
    read_bytes = kv32[0].nbytes + kv32[1].nbytes
    gbs = {n: nbytes / np.median(x) / 1e9 for n, x in times.items()}
    return read_bytes / np.median(times["read"]) / 1e9, gbs["kernel"], gbs.get("before", np.nan)


def settle_read_order(level):
    """Let the kernel make its timed read-order choice (8 MHA calls of 64 MiB); return it."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 16, 1, 128), dtype=np.float32)
    k, v = rng.standard_normal((2, 1, 16, 4096, 128), dtype=np.float32)
    for _ in range(16):  # 8 calls decide; more only if another thread took some tries
        if kernel_read_order(level=level) != "undecided":
            break
        local_state(q, k, v)
    return kernel_read_order(level=level)


def isa_levels(text):
    """Parse ``--isa``: comma-separated kernel builds among 4, 3 and 1."""
    try:
        levels = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated 4, 3 or 1") from None
    if not levels or any(x not in (4, 3, 1) for x in levels):
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated 4, 3 or 1")
    return levels


def shape_names(text):
    """Parse ``--shapes``: comma-separated names of SHAPES (each once), or "all"."""
    if text.strip() == "all":
        return tuple(SHAPES)
    names = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    unknown = [x for x in names if x not in SHAPES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"{text!r}: comma-separated, among {', '.join(SHAPES)}; or all"
        )
    return names


def main():
    """Print kernel vs read bandwidth per shape, with the spread over rounds."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", metavar="SO", help="another mpitree._native .so, timed too")
    parser.add_argument(
        "--isa",
        type=isa_levels,
        default=None,
        help="comma-separated kernel builds: 4 (x86-64-v4), 3 (x86-64-v3), 1 (baseline); "
        "default: every build this CPU runs",
    )
    parser.add_argument(
        "--shapes",
        type=shape_names,
        default=DEFAULT_SHAPES,
        help=f"comma-separated, among: {', '.join(SHAPES)}; 'all' for every one",
    )
    args = parser.parse_args()
    levels = args.isa or kernel_levels()
    if not levels:
        parser.error("the compiled kernel is not built (or MPITREE_LOCAL_KERNEL=numpy)")
    for level in levels:
        if level not in kernel_levels():
            parser.error(f"--isa {level}: this CPU runs only {kernel_levels()}")
        select_kernel(level)
        before = other_build(args.before, level) if args.before else None
        way = settle_read_order(level)
        print(f"kernel ISA: {kernel_isa()}; one row per KV head reads by {way} (timed choice)")
        print(
            f"{'shape':<24}{'round':>6}{'read GB/s':>11}{'kernel GB/s':>13}{'ratio':>8}"
            f"{'before GB/s':>13}{'ratio':>8}"
        )
        for label in args.shapes:
            ratios = []
            for r in range(args.rounds):
                read, kern, old = measure(*SHAPES[label], args.tokens, args.steps, before)
                ratios.append(kern / read)
                print(
                    f"{label:<24}{r:>6}{read:>11.1f}{kern:>13.1f}{kern / read:>8.0%}"
                    f"{old:>13.1f}{old / read:>8.0%}"
                )
            print(f"{label:<24}{'all':>6}  ratio {min(ratios):.0%}..{max(ratios):.0%}")
    select_kernel(0)


if __name__ == "__main__":
    main()
