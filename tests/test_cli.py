"""The command line: versions, verdicts, hints, help text, table widths and early errors."""

import argparse
import json
import os
import re
import subprocess
import sys

import pytest
from launch import run

import mpitree
from mpitree.cli import build_parser

PY = sys.executable
SMALL_DEMO = ["demo", "--tokens", "2048", "--steps", "2", "--warmup", "1"]
# main() on every rank, then each rank reports the exit code it is about to return
EXIT_PER_RANK = (
    "import sys; from mpi4py import MPI; from mpitree.cli import main; rc = main(sys.argv[1:]); "
    "print(f'rank {MPI.COMM_WORLD.rank} exits {rc}', flush=True); sys.exit(rc)"
)
NEGATIVE = re.compile(r"(^|\s)-\d")  # a cell holding a negative number


def serial(args, env=None, timeout=60):
    """Run ``python args`` as one process, without mpiexec."""
    return subprocess.run(
        [PY, *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_version():
    res = serial(["-m", "mpitree", "--version"])
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == f"mpitree {mpitree.__version__}"
    assert lines[1].startswith("MPI library: ")
    assert lines[2].startswith("mpi4py ")


def test_demo_on_one_rank_hints_and_passes():
    res = serial(["-m", "mpitree", *SMALL_DEMO])
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "running on 1 rank: launch with " in out
    assert re.search(r"mpiexec -n 4 \S*python\S* -m mpitree demo", out)
    assert "vs ring" not in out and "over local" not in out
    assert out.splitlines()[-1].startswith("PASS")
    assert "demo [" not in out and "demo [" in res.stderr  # progress on stderr only


def test_demo_on_two_ranks_passes():
    res = run(2, [PY, "-m", "mpitree", *SMALL_DEMO], timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "running on 1 rank" not in out
    assert "vs ring" in out and "over local ms" in out
    assert out.splitlines()[-1].startswith("PASS")
    table = out[out.index("strategy") : out.index("slowest rank")]
    assert not NEGATIVE.search(table), table
    assert res.stderr.count("demo [##############################]") == 1  # rank 0 only


def test_demo_failure_is_agreed_by_every_rank():
    res = run(2, [PY, "-c", EXIT_PER_RANK, *SMALL_DEMO, "--tolerance", "1e-30"], timeout=120)
    assert res.returncode != 0
    assert "FAIL: allreduce" in res.stdout
    assert "rank 0 exits 1" in res.stdout and "rank 1 exits 1" in res.stdout


def test_plot_without_matplotlib_fails_before_any_work(tmp_path):
    (tmp_path / "matplotlib.py").write_text("raise ImportError('matplotlib blocked')\n")
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    figure = tmp_path / "fig.png"
    res = run(
        2,
        [PY, "-m", "mpitree", "bench", "--quick", "--tokens", "300", "--plot", str(figure)],
        env={"PYTHONPATH": path},
        timeout=60,
    )
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.count("pip install -e '.[bench]'") == 1  # rank 0 says why, once
    assert "pip install matplotlib" in res.stderr
    assert "bench [" not in res.stderr and res.stdout == "" and not figure.exists()


def subparsers(parser):
    """Yield (name, parser) for the top-level parser and each subcommand's."""
    yield "python -m mpitree", parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def test_every_option_has_help_and_shows_its_default():
    for name, parser in subparsers(build_parser()):
        text = " ".join(parser.format_help().split())
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help and action.help.strip(), (name, action.option_strings)
            if action.default not in (None, False, argparse.SUPPRESS):
                assert f"(default: {action.default})" in text, (name, action.option_strings)


def test_bench_tables_fit_in_100_columns():
    res = run(
        2,
        [PY, "-m", "mpitree", "bench", "--quick", "--tokens", "300", "--workloads", "llama3-8b"],
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert "overhead over local attention, ms: median step time minus local's" in lines
    assert all(len(line) <= 100 for line in lines), max(lines, key=len)
    assert not any("=" in line for line in lines if line[:8].strip().isdigit())  # no key=value
    assert not NEGATIVE.search(res.stdout)


def test_bench_refuses_no_or_unknown_workloads_before_any_work():
    for given, says in (("", "none given"), (",", "none given"), ("x", "['x']")):
        res = serial(["-m", "mpitree", "bench", "--quick", "--workloads", given])
        assert res.returncode != 0 and says in res.stderr, (given, res.stderr[-500:])
        assert "llama3-70b" in res.stderr and "Traceback" not in res.stderr


BAD_ARGUMENTS = {  # arguments every rank refuses before any work; rank 0 says why, once
    ("demo", "--steps", "0"): "--steps: must be at least 1, got 0",
    ("demo", "--q-heads", "3", "--kv-heads", "2"): "must be a multiple of --kv-heads",
    ("demo", "--head-dim", "0"): "--head-dim: must be at least 1",
    ("merge", "--rows", "-1"): "--rows: must be at least 1",
    ("merge", "--iters", "0"): "--iters: must be at least 1",
    ("model", "--ranks", "0"): "--ranks: must be at least 1",
    ("model", "--calibrate", "/nonexistent.json"): "no such file",
    ("bench", "--tokens", "0"): "--tokens: must be at least 1",
    ("bench", "--workloads", "nosuch"): "unknown ['nosuch']",
}


@pytest.mark.parametrize("args", list(BAD_ARGUMENTS), ids=" ".join)
def test_bad_arguments_fail_once_on_every_rank_before_any_work(args):
    """Each rank exits 2 (no hang, no traceback); the error and usage print once."""
    res = run(2, [PY, "-c", EXIT_PER_RANK, *args], timeout=60)
    output = res.stdout + res.stderr
    assert res.returncode == 2, output
    assert res.stderr.count(BAD_ARGUMENTS[args]) == 1, output
    assert res.stderr.count(f"python -m mpitree {args[0]}: error:") == 1, output
    assert "Traceback" not in output and "exits" not in res.stdout, output


def test_model_warns_when_extrapolating_a_calibration(tmp_path):
    p, cells = 4, []
    for n in (4096, 8192, 16384):
        per_rank = 2 * 8 * 128 * 4 * n / p
        local = 1e-4 + per_rank / 10e9
        cells.append(
            {
                "tokens": n,
                "ranks": p,
                "paper": {"eq31_ring_bytes": per_rank * p},
                "bytes_sent_per_rank": {"ring": (p - 1) * per_rank},
                "times": {
                    "local (C kernel)": {"median_ms": local * 1e3},
                    "ring": {"median_ms": (p * local + (p - 1) * per_rank / 2e9) * 1e3},
                    "allreduce": {"median_ms": (local + 1e-4) * 1e3},
                },
            }
        )
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"results": cells}))
    model = ["-m", "mpitree", "model", "--calibrate", str(bench)]

    inside = serial([*model, "--ranks", "4,8", "--tokens", "4096,32768"])
    assert inside.returncode == 0 and inside.stderr == "", inside.stderr

    far = serial([*model, "--ranks", "4,64", "--tokens", "8192,1048576"])
    assert far.returncode == 0, far.stderr
    assert "measured ranks = 4;" in far.stderr and "ranks = 64 extrapolate" in far.stderr
    assert "measured tokens = 4096 to 16384;" in far.stderr
    assert "tokens = 1048576 extrapolate" in far.stderr


# what an abort, a crash or an uncaught error prints (the merge's numpy op once aborted so)
CRASHES = ("Abort", "Fatal Python error", "Traceback", "user-defined reduction", "Segmentation")
# the merge table's methods, in order (from the strategy registry, but for the two references)
MERGE_ROWS = [
    "MPI.SUM allreduce (same bytes)",
    "allreduce, native op",
    "allreduce, native op, persistent",
    "allreduce, numpy Python op",
    "allreduce3 (paper's Alg. 3)",
    "allgather + local merge",
    "hierarchical (nodes of 2)",
    "node shared window (nodes of 2)",
]
# every subcommand but generate (a real model) and cluster (network namespaces), kept tiny
SUBCOMMANDS = {
    "demo": ["--tokens", "512", "--q-heads", "4", "--kv-heads", "2", "--steps", "1"],
    "bench": ["--quick", "--tokens", "256", "--workloads", "llama3-8b", "--steps", "1"],
    "model": ["--ranks", "2,4", "--tokens", "4096"],
    "merge": ["--rows", "4", "--head-dim", "16", "--iters", "3", "--warmup", "1"],
}


def assert_clean(res, what):
    """The launch exited 0 and printed no abort, crash or traceback."""
    out = res.stdout + res.stderr
    assert res.returncode == 0, f"{what}: exit {res.returncode}\n{out[-3000:]}"
    crashed = [text for text in CRASHES if text in out]
    assert not crashed, f"{what}: {crashed}\n{out[-3000:]}"


@pytest.mark.parametrize("n", [2, 3, 4])
def test_merge_runs_clean_on_several_ranks(n):
    """``python -m mpitree merge`` (its default shapes, few merges) runs on real ranks.

    It once aborted: the numpy op's row ran against a datatype of another width.
    A timeout (a hang) fails the test too.
    """
    res = run(n, [PY, "-m", "mpitree", "merge", "--iters", "5", "--warmup", "2"], timeout=60)
    assert_clean(res, f"merge on {n} ranks")
    rows = [line[:34].rstrip() for line in res.stdout.splitlines()[2:-1]]
    assert rows == MERGE_ROWS, res.stdout


def test_merge_names_the_op_it_runs():
    """Without the native op (``MPITREE_NATIVE_OP=0``), merge's op rows say numpy, not native."""
    args = [PY, "-m", "mpitree", "merge", "--iters", "3", "--warmup", "1", "--rows", "4"]
    res = run(2, args, env={"MPITREE_NATIVE_OP": "0"}, timeout=60)
    assert_clean(res, "merge without the native op")
    assert "native op: on 0 of 2 ranks;" in res.stdout.splitlines()[0], res.stdout
    rows = [line[:34].rstrip() for line in res.stdout.splitlines()[2:-1]]
    want = [row.replace("native op", "numpy op") for row in MERGE_ROWS]
    assert rows == want, res.stdout


@pytest.mark.parametrize("without", [0, 1])
def test_merge_names_the_op_every_rank_runs(without):
    """One rank without the native op: each rank runs its own op, so the op rows say mixed,
    whichever rank lacks it (rank 0's own op once named them), and the header says how many
    ranks have it."""
    merge = [PY, "-m", "mpitree", "merge", "--iters", "3", "--warmup", "1", "--rows", "4"]
    ranks = [merge, merge]
    ranks[without] = ["env", "MPITREE_NATIVE_OP=0", *merge]
    res = run(1, [*ranks[0], ":", "-n", "1", *ranks[1]], timeout=60)
    assert_clean(res, f"merge with rank {without} without the native op")
    assert "native op: on 1 of 2 ranks;" in res.stdout.splitlines()[0], res.stdout
    rows = [line[:34].rstrip() for line in res.stdout.splitlines()[2:-1]]
    want = [row.replace("native op", "mixed op") for row in MERGE_ROWS]
    assert rows == want, res.stdout


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_subcommand_runs_clean(n):
    """demo, bench, model and merge, each launched as a user would, at 1 to 4 ranks."""
    for command, args in SUBCOMMANDS.items():
        res = run(n, [PY, "-m", "mpitree", command, *args], timeout=60)
        assert_clean(res, f"{command} on {n} ranks")
        assert res.stdout.strip(), f"{command} on {n} ranks printed nothing"
