"""Every benchmark runs: each ``benchmarks/*.py`` once, at a tiny size, on real ranks.

The figures are not checked (timings are never tests); what is checked is that the
script ends with exit status 0 and prints its table's last line, so a change to
mpitree or to a helper two benchmarks share cannot leave one that no longer runs.
A benchmark that needs what this machine lacks runs under the marker that skips it
(``cuda``, ``cluster``). A new benchmark must join ``RUNS``, or a test fails.
"""

import argparse
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
from launch import run
from mpi4py import MPI

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
HELPERS = {"tiny_llama.py", "timers.py"}  # imported by benchmarks, not run alone

#: benchmark -> (ranks, its arguments, a regular expression its output must match)
RUNS = {
    "decode_overhead.py": (
        2,
        "--context 64 --steps 5 --warmup 2 --layers 2 --unfused --c-timers",
        r"C timers, guarded, one call, 2 rank\(s\): .*overhead \(call - both\) [\d.]+",
    ),
    "layer_cost.py": (
        2,
        "--steps 5 --warmup 2 --layers 2",
        r"p = 2, context 16; .*later layer's overhead -?[\d.]+",
    ),
    "merge_cost.py": (
        2,
        "--shapes tiny --iters 5 --warmup 2 --rounds 1",
        r"paper 3 / plan merge +[\d.]+x",
    ),
    "plan_overhead.py": (2, "--tokens 256 --steps 5 --rounds 1", r"\n +256 +0 +[\d.]+ +[\d.]+"),
    "invariant_cost.py": (
        2,
        "--tokens 512 --blocks 256 --steps 3 --rounds 1",
        r"\n +256 +off-grid +[\d.]+",
    ),
    "dense_rows.py": (
        1,
        "--hidden 256 --kv 64 --intermediate 128 --vocab 128 --rows 2 --big 16 --rounds 3",
        r"\n +2 +[\d.]+ +[\d.]+x",
    ),
    "kernel_bw.py": (
        1,
        "--tokens 1024 --steps 2 --rounds 1",
        r"MHA 16/16 +all +ratio \d+%\.\.\d+%",
    ),
    "module_walk.py": (2, "", r"a later layer +modules +\d+ +returns to a module left +\d+"),
    "jax_decode.py": (2, "--keys 256 --iters 3 --warmup 1", r"jax jit, local only +[\d.]+"),
    "tree_verify.py": (
        2,
        "--context 512 --hidden 256 --intermediate 128 --nodes 2,5 --steps 2 --warmup 1",
        r"chain 5: fully rejected [\d.]+x a plain step; perfect depth 4: [\d.]+x plain "
        r"tokens/s; attention \(kernel \+ collective\) [\d.]+x",
    ),
    "real_speculative.py": (
        2,
        "--new-tokens 8 --repeats 1 --tasks copying",
        r"copying .* identical",
    ),
    "e2e.py": (  # launches its own ranks
        1,
        "--contexts 256 --ranks 2 --new-tokens 4 --json {tmp}/e2e.jsonl",
        r"\n +256 +2 .* equal",
    ),
    "cluster_links.py": (  # makes its own nodes and launches its own ranks
        1,
        "--rates 1gbit --tokens 4096 --steps 3 --ring-steps 2 --rounds 1 --probe-mb 4",
        r"ring / tree: step [\d.]+x",
    ),
    "gpu_decode.py": (2, "--tokens 4096 --steps 3 --warmup 1", r"\ntree_decode +[\d.]+ +[\d.]+"),
}
MARKS = {
    "cluster_links.py": pytest.mark.cluster,
    "gpu_decode.py": pytest.mark.cuda,
    "real_speculative.py": pytest.mark.realmodel,
}


def test_every_benchmark_is_run():
    scripts = {p.name for p in BENCHMARKS.glob("*.py")} - HELPERS
    assert scripts == set(RUNS), f"add to RUNS: {sorted(scripts - set(RUNS))}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [pytest.param(n, marks=MARKS.get(n, ())) for n in sorted(RUNS)])
def test_benchmark_runs(name, tmp_path):
    ranks, args, expect = RUNS[name]
    if name == "gpu_decode.py":  # a CUDA device seen by CuPy alone is not torch's
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("cuda-marked: torch sees no CUDA device")
    if name == "decode_overhead.py" and "open mpi" in MPI.Get_library_version().lower():
        # Open MPI's all-reduce is not persistent: no one compiled call for --c-timers
        argv = [sys.executable, str(BENCHMARKS / name), *args.split()]
        res = run(ranks, argv, timeout=280)
        assert res.returncode == 2 and "run without --c-timers" in res.stderr, res.stderr[-3000:]
        args, expect = args.replace(" --c-timers", ""), r"mpitree attention call +[\d.]+"
    argv = [sys.executable, str(BENCHMARKS / name), *args.format(tmp=tmp_path).split()]
    if ranks == 1:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=280, cwd=ROOT)
    else:
        res = run(ranks, argv, timeout=280)
    output = res.stdout + res.stderr
    assert res.returncode == 0, output[-3000:]
    assert re.search(expect, res.stdout), res.stdout[-3000:]


def test_tree_verify_whole_times_steps_whole():
    """``--whole``: no split columns, the attention call's ratio instead."""
    args = "--context 512 --hidden 256 --intermediate 128 --nodes 5 --steps 2 --warmup 1 --whole"
    res = run(2, [sys.executable, str(BENCHMARKS / "tree_verify.py"), *args.split()], timeout=280)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert re.search(r"chain 5: fully rejected [\d.]+x .* attention call [\d.]+x", res.stdout), (
        res.stdout
    )
    assert "kernel + collective" not in res.stdout, res.stdout


def test_tree_verify_refuses_a_tree_without_the_split_unless_whole(monkeypatch):
    """A tree older than ``extend.phase_times``: an error without ``--whole``, none with it."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import tree_verify
    finally:
        sys.path.remove(str(BENCHMARKS))
    monkeypatch.setattr(tree_verify, "extend", types.SimpleNamespace())  # no phase_times
    parser = argparse.ArgumentParser(prog="tree_verify.py")
    tree_verify.check_split(parser, whole=True)
    with pytest.raises(SystemExit) as exit_:
        tree_verify.check_split(parser, whole=False)
    assert exit_.value.code == 2


def test_gpu_benchmark_without_a_gpu_says_so():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        return  # the cuda-marked run above covers it
    res = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_decode.py")], capture_output=True, text=True
    )
    assert res.returncode == 2 and "needs a CUDA GPU" in res.stderr, res.stderr


def test_invariant_benchmark_refuses_tokens_off_the_block_grid():
    res = run(2, [sys.executable, str(BENCHMARKS / "invariant_cost.py"), "--tokens", "256"])
    assert res.returncode != 0, res.stdout
    assert "must be a multiple of every block size" in res.stderr, res.stderr
