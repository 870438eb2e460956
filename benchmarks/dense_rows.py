"""What a decoder layer's dense part costs for M rows (tree nodes), against its floors.

A verification step runs every tree node through every rank's replicated dense
layers (projections, MLP, logits); attention is mpitree's, the rest is torch's.
This times torch's ``F.linear`` over the weights of one layer of
``tree_verify.py``'s Llama (Llama-3.1-8B attention projections: q and o 4096 x
4096, k and v 1024 x 4096; the MLP's gate, up and down at ``--intermediate``; the
logits at ``--vocab``), float32, one thread, for M rows, interleaved over rounds,
median, and prints beside it:

* ``read``: streaming the same weights once with mpitree's compiled loop
  (``mpitree.extend.tools.read_seconds``): the floor of any M;
* ``rows apart``: each row its own ``F.linear`` (M one-row products);
* ``arithmetic``: 2 M flops a weight at the rate ``F.linear`` reaches on
  ``--big`` rows (its GEMM's own peak on this core): the floor where it exceeds
  the read.

So ``linear / max(read, arithmetic)`` says how far torch's dense layers are from this
core's floors for M rows, and ``linear(M) / linear(1)`` what a node costs them.

    .venv/bin/python benchmarks/dense_rows.py --rows 1,2,4,8,16
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from mpitree import extend

tools = getattr(extend, "tools", extend)  # trees before extend.tools (8d5d047): extend's own
read_seconds = tools.read_seconds


def weights(hidden, kv, intermediate, vocab, seed=0):
    """Return one layer's weights ``(out, in)``, float32, and the logits' ``(vocab, hidden)``."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [
        (hidden, hidden),  # q
        (kv, hidden),  # k
        (kv, hidden),  # v
        (hidden, hidden),  # o
        (intermediate, hidden),  # gate
        (intermediate, hidden),  # up
        (hidden, intermediate),  # down
        (vocab, hidden),  # logits (once a step, not once a layer)
    ]
    return [torch.randn(s, generator=gen) * 0.02 for s in shapes]


def linear_all(ws, xs):
    """Run every weight on its input rows (``xs[i]`` has ``ws[i]``'s input width)."""
    for w, x in zip(ws, xs, strict=True):
        torch.nn.functional.linear(x, w)


def rows_apart(ws, xs):
    """Run every weight on each row alone."""
    for w, x in zip(ws, xs, strict=True):
        for r in range(x.shape[0]):
            torch.nn.functional.linear(x[r : r + 1], w)


def main():
    """Print one row per M: ms for the layer's weights and the floors, ratios to M = 1."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--rows", default="1,2,4,8,16", help="comma-separated M")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--kv", type=int, default=1024, help="k and v projections' width")
    parser.add_argument("--intermediate", type=int, default=1024, help="MLP size")
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--big", type=int, default=256, help="rows of the arithmetic peak")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    rows = sorted({1, *(int(m) for m in args.rows.split(","))})  # M = 1: the ratios' base
    if rows[0] < 1:
        parser.error("--rows must be positive integers")
    torch.set_num_threads(1)
    ws = weights(args.hidden, args.kv, args.intermediate, args.vocab)
    flat = np.concatenate([w.numpy().ravel() for w in ws])
    n_weights = flat.size
    gen = torch.Generator().manual_seed(1)
    inputs = {m: [torch.randn(m, w.shape[1], generator=gen) for w in ws] for m in {*rows, args.big}}
    cases = {("read", 0): lambda: read_seconds(flat)}
    cases[("peak", args.big)] = lambda: linear_all(ws, inputs[args.big])
    for m in rows:
        cases[("linear", m)] = lambda m=m: linear_all(ws, inputs[m])
        cases[("apart", m)] = lambda m=m: rows_apart(ws, inputs[m])
    times = {key: [] for key in cases}
    for fn in cases.values():  # warm-up: first calls, packing, caches
        fn()
    for i in range(args.rounds):
        for key, fn in cases.items() if i % 2 else reversed(cases.items()):
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    med = {key: statistics.median(v) for key, v in times.items()}
    read = med[("read", 0)]
    peak = 2 * args.big * n_weights / med[("peak", args.big)]  # flop/s
    print(
        f"weights {n_weights * 4 / 1e6:.1f} MB (hidden {args.hidden}, k/v {args.kv}, MLP "
        f"{args.intermediate}, vocab {args.vocab}), float32, torch {torch.__version__}, "
        f"1 thread; read {read * 1e3:.2f} ms ({n_weights * 4 / read / 1e9:.1f} GB/s); "
        f"F.linear peak {peak / 1e9:.1f} GFLOP/s at {args.big} rows; "
        f"median of {args.rounds} interleaved rounds, ms"
    )
    print(
        f"{'M':>4} {'linear':>9} {'x M=1':>7} {'rows apart':>11} {'x M=1':>7} "
        f"{'arithmetic':>11} {'floor':>8} {'linear/floor':>13}"
    )
    one = med[("linear", 1)]
    for m in rows:
        lin, apart = med[("linear", m)], med[("apart", m)]
        arith = 2 * m * n_weights / peak
        floor = max(read, arith)
        print(
            f"{m:>4} {lin * 1e3:>9.2f} {lin / one:>6.2f}x "
            f"{apart * 1e3:>11.2f} {apart / one:>6.2f}x "
            f"{arith * 1e3:>11.2f} {floor * 1e3:>8.2f} {lin / floor:>12.2f}x"
        )


if __name__ == "__main__":
    main()
