"""Launch a command under the mpiexec that belongs to the MPI mpi4py is using."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from mpi4py import MPI


def mpiexec(n):
    """Return the argv prefix that starts ``n`` ranks (oversubscribing is allowed)."""
    here = Path(sys.executable).parent / "mpiexec"
    exe = str(here) if here.exists() else shutil.which("mpiexec")
    if exe is None:
        raise RuntimeError("no mpiexec found next to the interpreter or on PATH")
    if "open mpi" in MPI.Get_library_version().lower():
        return [exe, "--oversubscribe", "-n", str(n)]
    return [exe, "-n", str(n)]


# Open MPI's launcher, under load, now and then fails to start its own PMIx server, before
# any rank exists: a launch that fails so is made again (twice at most). Any other outcome,
# a failure included, is the run's.
LAUNCHER_FAILURES = ("PMIx server's listener thread failed to start",)


ROOT = Path(__file__).resolve().parent.parent


def run(n, args, env=None, timeout=120, cwd=ROOT, input=None):
    """Run ``args`` on ``n`` ranks in ``cwd`` (default: the root); return the CompletedProcess.

    ``input``: the text mpiexec forwards to rank 0's stdin.
    """
    full_env = {**os.environ, **(env or {})}
    full_env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    full_env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    for _ in range(3):
        proc = subprocess.run(
            [*mpiexec(n), *args],
            env=full_env,
            capture_output=True,
            text=True,
            input=input,
            timeout=timeout,
            check=False,
            cwd=cwd,  # the root: the examples' and benchmarks' relative paths hold from any cwd
        )
        output = proc.stdout + proc.stderr
        if proc.returncode == 0 or not any(f in output for f in LAUNCHER_FAILURES):
            break
        print(f"mpiexec failed to start ({output.strip()[:200]!r}): starting it again")
    return proc
