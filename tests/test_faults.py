"""Faults and resource limits: a rank dying mid-decode, native op slots running out."""

import os
import signal
import subprocess
import sys
import time

import pytest
from launch import mpiexec

LOOP = """
import os, sys, time, numpy as np, mpitree
from mpi4py import MPI
comm = MPI.COMM_WORLD
open(os.path.join(sys.argv[1], f"rank{comm.rank}.pid"), "w").write(str(os.getpid()))
q = np.ones((1, 4, 1, 16), np.float32)
kv = np.ones((1, 2, 64, 16), np.float32)
with mpitree.DecodePlan(1, 4, 2, 16) as plan:
    while True:  # decode until killed
        plan.decode(q, kv, kv)
"""


@pytest.mark.timeout(90)
def test_killed_rank_ends_the_job_quickly(tmp_path):
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    proc = subprocess.Popen(
        [*mpiexec(3), sys.executable, "-c", LOOP, str(tmp_path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        pid_file = tmp_path / "rank1.pid"
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pid_file.exists(), "ranks did not start"
        time.sleep(1.0)  # let them decode
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        killed = time.monotonic()
        rc = proc.wait(timeout=30)
        elapsed = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc != 0
    assert elapsed < 30, f"job took {elapsed:.1f} s to end after a rank died"


EXHAUST = """
import numpy as np, mpitree
from mpi4py import MPI
errors = 0
for d in range(1, 71):
    q = np.ones((1, 1, 1, d), np.float32)
    try:
        mpitree.tree_decode(q, q, q, strategy="allreduce")
    except RuntimeError as e:
        assert "native op slots" in str(e), e
        errors += 1
q = np.ones((1, 1, 1, 8), np.float32)
out = mpitree.tree_decode(q, q, q, strategy="allreduce")  # an existing op still works
assert np.allclose(out, 1)
counts = MPI.COMM_WORLD.gather(errors)
if counts:
    print("errors", *counts)
"""


@pytest.mark.timeout(120)
def test_native_op_slots_exhausted_raise_on_every_rank():
    from launch import run

    res = run(2, [sys.executable, "-c", EXHAUST])
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip() == "errors 6 6", res.stdout  # D = 65..70 fail on both ranks
