"""Run the whole suite: serial tests, then each rank count under real mpiexec ranks.

    python tests/run.py [--nprocs 2,3,4] [--leg-timeout SECONDS] [pytest args...]

Each leg runs ``pytest -m parallel[N]`` on N ranks (mpi-pytest's non-forking
mode) with a wall-clock limit, every rank writing its own JUnit XML, so a test
failing on any rank counts as failed. The runner lists every skipped test with its
reason. Only ``cuda``-marked tests (where no CUDA device is usable) and
``cluster``-marked ones (where network namespaces cannot be made) may skip: any
other skip counts as a failure, so the suite cannot silently test less than it says.
Exits non-zero if any test failed or skipped unexpectedly, any leg crashed or timed
out, or a leg ran no test.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from launch import mpiexec

ROOT = Path(__file__).resolve().parent.parent


INSTALL = {
    "torch": "pip install torch --index-url https://download.pytorch.org/whl/cpu",
    "mpi_pytest": "pip install -e '.[test]'",
}


def outcomes(xml_path):
    """Map test id -> (outcome, message) from one JUnit XML file."""
    result = {}
    for case in ET.parse(xml_path).iter("testcase"):
        tid = f"{case.get('classname')}::{case.get('name')}"
        cuda = any(p.get("value") in ("cuda", "cluster") for p in case.iter("property"))
        outcome, msg = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                text = (child.text or "").strip().splitlines()
                msg = child.get("message") or ""
                if msg == "collection failure" and text:  # the cause is the text's last line
                    msg = f"{msg}: {text[-1]}"
                outcome, msg = "failed", msg[:400]
            elif child.tag == "skipped" and outcome == "passed":
                outcome = "skipped" if cuda else "unexpected skip"
                msg = child.get("message") or ""
        result[tid] = (outcome, msg)
    return result


def hint(message):
    """Return an install hint for a failure caused by a missing module, or ''."""
    found = re.search(r"No module named '([\w.]+)'", message)
    if not found:
        return ""
    top = found.group(1).split(".")[0]
    how = INSTALL.get(top, "pip install -e '.[mpich,test]' (from the checkout)")
    return f"  -> {top} is missing: {how}"


def run_leg(n, extra, outdir, timeout):
    """Run one leg; return (merged outcomes, problem or None)."""
    python = [sys.executable, "-m", "pytest", "--color=no", "-m", f"parallel[{n}]", *extra]
    xmls = [outdir / f"n{n}-rank{r}.xml" for r in range(n)]
    if n == 1:
        cmd = [*python, f"--junitxml={xmls[0]}"]
    else:
        cmd = mpiexec(1)
        for r in range(n):
            cmd += [*([":", "-n", "1"] if r else []), *python, f"--junitxml={xmls[r]}"]
    env = {
        **os.environ,
        "MPITREE_QUIET": "1",
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    }
    print(f"\n=== {n} rank{'s' if n > 1 else ''}: {' '.join(cmd[:4])} ...", flush=True)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout, check=False)
        problem = None if proc.returncode in (0, 1) else f"exit code {proc.returncode}"
    except subprocess.TimeoutExpired:
        problem = f"timed out after {timeout} s"
    merged = {}
    for r, path in enumerate(xmls):
        if not path.exists():
            problem = problem or f"rank {r} wrote no report"
            continue
        for tid, (outcome, msg) in outcomes(path).items():
            if outcome == "failed" or tid not in merged:
                merged[tid] = (outcome, f"[rank {r}] {msg}" if outcome == "failed" else msg)
    if not merged:
        problem = problem or "no test ran"
    return merged, problem


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", default="1,2,3,4", help="comma-separated rank counts")
    parser.add_argument(
        "--leg-timeout",
        type=int,
        default=None,
        help="seconds per leg (default: 3600 for one rank, which runs the real model's and the "
        "docs' programs, 900 for the others)",
    )
    args, extra = parser.parse_known_args()
    totals = dict.fromkeys(("passed", "failed", "skipped", "unexpected skip"), 0)
    problems, skips, hints = [], [], set()
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in args.nprocs.split(",")):
            limit = args.leg_timeout or (3600 if n == 1 else 900)
            merged, problem = run_leg(n, extra, Path(tmp), limit)
            for tid, (outcome, msg) in sorted(merged.items()):
                totals[outcome] += 1
                if outcome == "failed":
                    print(f"FAILED ({n} ranks) {tid}: {msg}")
                    hints.add(hint(msg))
                elif outcome != "passed":
                    skips.append(
                        f"{'SKIPPED' if outcome == 'skipped' else 'UNEXPECTED SKIP'} "
                        f"({n} ranks) {tid}: {msg}"
                    )
            if problem:
                problems.append(f"{n} ranks: {problem}")
    if skips:
        print(f"\n{len(skips)} skipped (only cuda- and cluster-marked tests may skip):")
    for line in skips:
        print(f"  {line}")
    for line in sorted(hints - {""}):
        print(line)
    for p in problems:
        print(f"ERROR {p}")
    print(
        f"\nmpitree tests: {totals['passed']} passed, {totals['failed']} failed, "
        f"{totals['skipped']} skipped (cuda- or cluster-marked), "
        f"{totals['unexpected skip']} skipped unexpectedly"
    )
    return 1 if totals["failed"] or totals["unexpected skip"] or problems else 0


if __name__ == "__main__":
    sys.exit(main())
