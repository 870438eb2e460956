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


def run(n, args, env=None, timeout=120):
    """Run ``args`` on ``n`` ranks; return the CompletedProcess (text output)."""
    full_env = {**os.environ, **(env or {})}
    full_env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    full_env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return subprocess.run(
        [*mpiexec(n), *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
