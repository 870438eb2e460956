"""End to end on the CPU: time to first token and decode tokens/s, mpitree vs one process.

Runs ``examples/llama_decode.py --llama8b`` (Llama-3.1-8B attention shapes, 2 layers,
random weights, float32) for each context and rank count; each run times
single-process ``transformers`` (``sdpa``, every core) and then mpitree on p ranks
(sharded prefill, ``allreduce`` decode) in the same job, and checks tokens and
teacher-forced logits against the single-process run. Prints one table of ratios,
writes the runs as JSON lines and, with ``--plot``, a PNG of tokens/s against context.

    .venv/bin/python benchmarks/e2e.py --ranks 2,4 --json e2e.jsonl --plot e2e.png
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from launch import mpiexec  # noqa: E402


def run(context, ranks, new_tokens, out):
    """Run one llama_decode job; return its JSON record."""
    before = out.read_text().count("\n") if out.exists() else 0
    cmd = [
        *mpiexec(ranks),
        sys.executable,
        str(ROOT / "examples" / "llama_decode.py"),
        "--llama8b",
        "--context",
        str(context),
        "--new-tokens",
        str(new_tokens),
        "--strategies",
        "allreduce",
        "--json",
        str(out),
    ]
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    print(f"== context {context}, {ranks} ranks", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, env=env, text=True, capture_output=True, check=False)
    sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-2000:])
    lines = out.read_text().splitlines() if out.exists() else []
    if proc.returncode or len(lines) <= before:
        raise SystemExit(f"llama_decode failed (exit {proc.returncode}) at {context}, p={ranks}")
    return json.loads(lines[-1])


def main():
    """Run every (context, ranks) job, then print the table and draw the plot."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--contexts", default="2048,16384,32768", help="comma-separated")
    parser.add_argument("--ranks", default="2", help="comma-separated rank counts")
    parser.add_argument("--new-tokens", type=int, default=16, help="greedy tokens per run")
    parser.add_argument("--json", default="e2e.jsonl", help="JSON-lines output (appended)")
    parser.add_argument("--plot", help="write tokens/s against context to this PNG")
    args = parser.parse_args()
    if args.plot:
        try:
            import matplotlib
        except ImportError:
            parser.error("--plot needs matplotlib: pip install -e '.[bench]' from the checkout")
        matplotlib.use("Agg")
    out = Path(args.json)
    records = [
        run(int(c), int(p), args.new_tokens, out)
        for p in args.ranks.split(",")
        for c in args.contexts.split(",")
    ]
    cores = os.cpu_count()
    print(
        f"\n{'context':>8} {'p':>3} {'TTFT 1p s':>10} {'TTFT mpt s':>11} {'TTFT ratio':>11} "
        f"{'tok/s 1p':>9} {'tok/s mpt':>10} {'decode x':>9} {'|dlogit|':>9} {'tokens':>7}"
    )
    for r in records:
        ref, mine = r["reference"], r["allreduce"]
        note = " (oversubscribed)" if r["ranks"] > cores else ""
        print(
            f"{r['context']:>8} {r['ranks']:>3} {ref['ttft_s']:>10.2f} {r['mpitree_ttft_s']:>11.2f}"
            f" {r['mpitree_ttft_s'] / ref['ttft_s']:>10.2f}x {ref['tok_s']:>9.2f}"
            f" {mine['tok_s']:>10.2f} {mine['tok_s'] / ref['tok_s']:>8.2f}x"
            f" {mine['forced_dlogit']:>9.1e} {'equal' if mine['tokens_equal'] else 'DIFFER':>7}"
            f"{note}"
        )
    print(
        f"1p = one process, sdpa, {cores} threads; mpt = mpitree on p ranks (sharded prefill, "
        "allreduce decode); |dlogit| = max over teacher-forced logits"
    )
    if args.plot:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for p in sorted({r["ranks"] for r in records}):
            rs = [r for r in records if r["ranks"] == p]
            ax.plot(
                [r["context"] for r in rs],
                [r["allreduce"]["tok_s"] for r in rs],
                "o-",
                label=f"mpitree, p={p}",
            )
        rs = [r for r in records if r["ranks"] == records[0]["ranks"]]
        ax.plot(
            [r["context"] for r in rs],
            [r["reference"]["tok_s"] for r in rs],
            "s--",
            label="one process (sdpa)",
        )
        ax.set(xscale="log", xlabel="context (tokens)", ylabel="decode tokens/s")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot)


if __name__ == "__main__":
    main()
