"""Local kernel bandwidth against the read floor, measured side by side in one run.

The same method as ``python -m mpitree bench``: the read floor streams K and V once
with the compiled loop (``read_seconds``), the kernel is ``local_state`` (C kernel);
both are timed interleaved, and bandwidth is K+V bytes over the median time.

    .venv/bin/python benchmarks/kernel_bw.py --tokens 65536 --steps 15 --rounds 3
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from mpitree._kernel import kernel_isa, read_seconds
from mpitree._local import local_state

SHAPES = {
    "llama3-8b GQA 32/8": (32, 8, 128),
    "paper-block MHA 16/16": (16, 16, 128),
}


def measure(hq, hkv, dim, tokens, steps, dtype=np.float32):
    """Return (read GB/s, kernel GB/s) medians over ``steps`` interleaved repeats."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, hq, 1, dim), dtype=np.float32).astype(dtype)
    k = rng.standard_normal((1, hkv, tokens, dim), dtype=np.float32).astype(dtype)
    v = rng.standard_normal((1, hkv, tokens, dim), dtype=np.float32).astype(dtype)
    kv32 = (k.astype(np.float32), v.astype(np.float32)) if dtype != np.float32 else (k, v)
    nbytes = k.nbytes + v.nbytes
    methods = {
        "read": lambda: (read_seconds(kv32[0]), read_seconds(kv32[1])),
        "kernel": lambda: local_state(q, k, v),
    }
    times = {n: [] for n in methods}
    for step in range(steps + 2):
        for name, fn in methods.items():
            t0 = time.perf_counter()
            fn()
            if step >= 2:
                times[name].append(time.perf_counter() - t0)
    read_bytes = kv32[0].nbytes + kv32[1].nbytes
    return read_bytes / np.median(times["read"]) / 1e9, nbytes / np.median(times["kernel"]) / 1e9


def main():
    """Print kernel vs read bandwidth per shape, with the spread over rounds."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"kernel ISA: {kernel_isa()}")
    print(f"{'shape':<24}{'round':>6}{'read GB/s':>11}{'kernel GB/s':>13}{'ratio':>8}")
    for label, (hq, hkv, dim) in SHAPES.items():
        ratios = []
        for r in range(args.rounds):
            read, kern = measure(hq, hkv, dim, args.tokens, args.steps)
            ratios.append(kern / read)
            print(f"{label:<24}{r:>6}{read:>11.1f}{kern:>13.1f}{kern / read:>8.0%}")
        print(f"{label:<24}{'all':>6}  ratio {min(ratios):.0%}..{max(ratios):.0%}")


if __name__ == "__main__":
    main()
