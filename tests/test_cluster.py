"""The emulated cluster (mpitree.cluster): every strategy exact across real TCP links between
network namespaces, the hierarchical layout found by MPI, shaped links, and teardown always."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpitree.cluster import Cluster, ClusterError, find_mpiexec, parse_rate

pytestmark = pytest.mark.cluster  # skipped, with the reason, where namespaces cannot be made

HERE = Path(__file__).resolve().parent
PY = sys.executable
PROG = str(HERE / "cluster_prog.py")
ENV = {k: v for k, v in os.environ.items() if k != "MPITREE_NODE_SIZE"}
KIND = find_mpiexec()[1]  # "hydra" (MPICH) or "openmpi": the mpiexec the harness launches
hydra_only = pytest.mark.skipif(
    KIND != "hydra", reason="cluster-marked: MPICH's fault controls; this run's MPI is Open MPI"
)
SLEEPER = (
    "import os, sys, time; from mpi4py import MPI; "
    "sys.stdout.write(f'ready {MPI.COMM_WORLD.rank} {os.getpid()}\\n'); sys.stdout.flush(); "
    "time.sleep(300)"
)


def leftovers(tag):
    """Return what of run ``tag`` still exists: namespaces, links, processes."""
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    found = [line for line in (spaces + links).splitlines() if tag in line]
    procs = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return found + [line for line in procs.splitlines() if f"mpitree-{tag}" in line]


def alive(pid):
    """Whether process ``pid`` exists (and is not a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize(
    "nodes,rpn,link", [(2, 1, "1gbit"), (2, 2, None), (3, 1, None), (3, 2, "100mbit")]
)
def test_every_strategy_exact_across_nodes(nodes, rpn, link):
    with Cluster(nodes, link=link) as cluster:
        tag = cluster.tag
        argv = [PY, PROG, "--nodes", str(nodes), "--ranks-per-node", str(rpn)]
        res = cluster.run(argv, rpn, env=ENV, capture=True, timeout=150)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"{nodes} nodes x {rpn} ranks: all exact" in res.stdout
    assert leftovers(tag) == []


def test_transformers_path_across_nodes_equals_one_process():
    prog = str(HERE / "cluster_transformers_prog.py")
    with Cluster(2, link="1gbit") as cluster:
        tag = cluster.tag
        res = cluster.run([PY, prog], 2, env=ENV, capture=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "4 ranks: equal to one process" in res.stdout
    assert leftovers(tag) == []


def test_traffic_crosses_the_shaped_link():
    # 2 MB per rank at 100 Mbit/s: at least 0.17 s on the wire, and at least 2 MB through
    # each node's veth; UCX's shared memory between namespaces of one kernel would skip both
    code = (
        "import time, numpy as np; from mpi4py import MPI; c = MPI.COMM_WORLD; "
        "a = np.ones(2**18); b = np.empty_like(a); c.Allreduce(a, b); c.Barrier(); "
        "t = time.perf_counter(); c.Allreduce(a, b); t = c.allreduce(time.perf_counter() - t, "
        "op=MPI.MAX); print('seconds', t, flush=True) if c.rank == 0 else None"
    )
    with Cluster(2, link="100mbit") as cluster:
        before = [cluster.link_bytes(i) for i in (0, 1)]
        res = cluster.run([PY, "-c", code], 2, env=ENV, capture=True, timeout=120)
        after = [cluster.link_bytes(i) for i in (0, 1)]
    assert res.returncode == 0, res.stdout + res.stderr
    seconds = float(res.stdout.split()[-1])
    assert seconds >= 0.8 * 2**18 * 8 * 8 / 100e6, seconds
    for (tx0, rx0), (tx1, rx1) in zip(before, after, strict=True):
        assert tx1 - tx0 >= 2 * 2**21 and rx1 - rx0 >= 2 * 2**21, (before, after)


def test_teardown_after_a_failing_command():
    with Cluster(2, link="1gbit") as cluster:
        tag = cluster.tag
        res = cluster.run(["sh", "-c", "exit 3"], 1, capture=True, timeout=60)
        assert leftovers(tag) != []  # the cluster exists while in use
    assert res.returncode == 3
    assert leftovers(tag) == []


def test_teardown_after_an_exception_and_a_timeout():
    with pytest.raises(RuntimeError, match="boom"), Cluster(2) as cluster:
        tag = cluster.tag
        raise RuntimeError("boom")
    assert leftovers(tag) == []
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired), Cluster(2) as cluster:
        tag = cluster.tag
        cluster.run([PY, "-c", SLEEPER], 2, env=ENV, capture=True, timeout=8)
    assert time.monotonic() - start < 30
    assert leftovers(tag) == []


@pytest.mark.parametrize(
    "sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 128 + 15), (signal.SIGHUP, 128 + 1)]
)
def test_teardown_after_a_signal_to_the_harness(sig, code):
    cmd = [PY, "-m", "mpitree", "cluster", "--nodes", "2", "--ranks-per-node", "2"]
    proc = subprocess.Popen(
        [*cmd, "--", PY, "-c", SLEEPER], env=ENV, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        banner = proc.stderr.readline()
        tag = banner.split("mpitree-")[1].split("-")[0]
        ranks = [proc.stdout.readline().split() for _ in range(4)]
        assert sorted(int(r[1]) for r in ranks) == [0, 1, 2, 3], (banner, ranks)
        pids = [int(r[2]) for r in ranks]
        assert all(alive(p) for p in pids)
        proc.send_signal(sig)  # to the harness alone, not its process group
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # the harness tears its cluster down
            proc.wait(timeout=60)
    assert proc.returncode == code, err
    assert leftovers(tag) == []
    assert not any(alive(p) for p in pids)


def test_remove_stale_cleans_up_after_a_killed_harness():
    cmd = [PY, "-m", "mpitree", "cluster", "--nodes", "2", "--", PY, "-c", SLEEPER]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        tag = proc.stderr.readline().split("mpitree-")[1].split("-")[0]
        pids = [int(proc.stdout.readline().split()[2]) for _ in range(2)]
        with Cluster(1) as live:  # another run, alive: left alone
            proc.kill()  # SIGKILL: no teardown; the job runs on in its own session
            proc.wait(timeout=30)
            assert leftovers(tag) != [] and all(alive(p) for p in pids)
            res = subprocess.run(
                [PY, "-m", "mpitree", "cluster", "--remove-stale"],
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert res.returncode == 0, res.stderr
            assert tag in res.stderr and live.tag not in res.stderr
            assert leftovers(live.tag) != []
    finally:
        if proc.poll() is None:
            proc.kill()
    assert leftovers(tag) == [] and leftovers(live.tag) == []
    assert not any(alive(p) for p in pids)


def test_killing_a_node_ends_the_job_with_an_error():
    # every rank of node 1 dies in the middle of a decode loop: mpiexec must exit non-zero
    code = (
        "import numpy as np, mpitree; from mpi4py import MPI; rng = np.random.default_rng(0); "
        "q = rng.standard_normal((1, 8, 1, 64)).astype(np.float32); "
        "k = rng.standard_normal((1, 2, 4096, 64)).astype(np.float32); "
        "plan = mpitree.DecodePlan(1, 8, 2, 64, strategy='hierarchical'); "
        "[plan.decode(q, k, k) for _ in range(5)]; "
        "MPI.COMM_WORLD.rank or print('decoding', flush=True); "
        "[plan.decode(q, k, k) for _ in range(10**7)]"
    )
    with Cluster(2, link="1gbit") as cluster:
        tag = cluster.tag
        job = cluster.start(
            [PY, "-c", code], 2, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert job.stdout.readline().strip() == "decoding"
        start = time.monotonic()
        victims = cluster.kill_node(1)
        _out, err = job.communicate(timeout=60)
        elapsed = time.monotonic() - start
    assert len(victims) >= 3, victims  # the node's MPI daemon or proxy, and both ranks
    if KIND == "openmpi":  # prterun reports the lost daemon but once exited 0 (CI, load 15)
        assert job.returncode != 0 or "lost communication with a remote daemon" in err, err
    else:
        assert job.returncode != 0, err
    assert elapsed < 30, elapsed
    assert leftovers(tag) == []


DECODER = (
    "import os, sys, numpy as np, mpitree; from mpi4py import MPI; "
    "rng = np.random.default_rng(0); "
    "q = rng.standard_normal((1, 8, 1, 64)).astype(np.float32); "
    "k = rng.standard_normal((1, 2, 4096, 64)).astype(np.float32); "
    "plan = mpitree.DecodePlan(1, 8, 2, 64, strategy='hierarchical'); "
    "[plan.decode(q, k, k) for _ in range(5)]; "
    "sys.stdout.write(f'decoding {MPI.COMM_WORLD.rank} {os.getpid()}\\n'); sys.stdout.flush(); "
    "[plan.decode(q, k, k) for _ in range(10**7)]"
)


@hydra_only
def test_a_cut_link_is_bounded_by_mpich_timeouts():
    # node 1's link goes down mid-decode. Nothing in the network notices (no packet comes
    # back to say so): alone, every rank and mpiexec wait forever (measured: > 60 s). Two
    # MPICH controls bound it. MPIR_CVAR_PROGRESS_TIMEOUT=T: a wait that makes no progress
    # prints the pending requests at T and fails at 2T, so every rank raises
    # mpi4py.MPI.Exception and exits about 2T after the cut (both nodes' ranks). A node
    # leader whose timed-out wait is the receive half of a send-receive in the leaders'
    # all-reduce gets a fatal error instead (MPIC_Sendrecv: MPIR_ERR_POPFATAL) and aborts;
    # its abort tells the other leader first, which is cut off, so that wait fails at 2T
    # too (MPIDIG_am_comm_abort): 4T in all (5 of 75 runs here with T = 8, once in CI).
    # The non-leaders receive in the node's broadcast (MPIC_Recv): they always raise.
    # Hydra's MPIEXEC_TIMEOUT=W ends mpiexec, which would otherwise wait on the cut-off
    # node's proxy, at a wall-clock limit counted from the start (measured: 1x to 2.5x W),
    # killing the live node's ranks: 2T + the time to the cut must stay well below W
    t, w = 5, 20
    env = {**ENV, "MPIR_CVAR_PROGRESS_TIMEOUT": str(t), "MPIEXEC_TIMEOUT": str(w)}
    with Cluster(2, link="1gbit") as cluster:
        tag = cluster.tag
        start = time.monotonic()
        job = cluster.start(
            [PY, "-c", DECODER], 2, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        ranks = [job.stdout.readline().split() for _ in range(4)]
        if sorted(int(r[1]) for r in ranks if r) != [0, 1, 2, 3]:
            raise AssertionError(f"{ranks}: {job.communicate(timeout=60)}")
        pids = {int(r[1]): int(r[2]) for r in ranks}
        cluster.cut_link(1)
        cut = time.monotonic()
        gone = {}  # rank -> seconds from the cut to its end
        while len(gone) < 4 and time.monotonic() - cut < 4 * t + 10:
            now = time.monotonic() - cut
            gone |= {r: now for r, p in pids.items() if r not in gone and not alive(p)}
            time.sleep(0.1)
        out, err = job.communicate(timeout=60)
        elapsed = time.monotonic() - start
        ends = {r: round(s, 1) for r, s in sorted(gone.items())}
        print(f"cut at {cut - start:.1f} s; ranks gone after it {ends}; mpiexec {elapsed:.1f} s")
    report = (cut - start, gone, elapsed, job.returncode, out[-1500:], err[-3000:])
    assert not any(alive(p) for p in pids.values()), report  # all ended before any teardown
    assert sorted(gone) == [0, 1, 2, 3] and max(gone.values()) < 4 * t + 10, report
    assert gone[1] < 2 * t + 10 and gone[3] < 2 * t + 10, report  # non-leaders raise
    assert "mpi4py.MPI.Exception" in err, report  # the live node's non-leader, at least
    assert job.returncode != 0 and ("TIMED OUT" in out + err or "Abort(" in err), report
    assert elapsed < 2.5 * w + 15, report
    assert leftovers(tag) == []


@hydra_only
@pytest.mark.parametrize("how", ["no namespace", "link down"])
def test_a_node_that_never_starts_ends_the_job_with_an_error(how):
    # node 1 is gone before the launch (its ssh cannot reach it) or cannot reach mpiexec
    # (its proxy cannot connect back): mpiexec exits non-zero at once
    with Cluster(2, link="1gbit") as cluster:
        tag = cluster.tag
        if how == "no namespace":
            subprocess.run(["ip", "netns", "del", cluster.names[1]], check=True)
        else:
            cluster.cut_link(1)
        start = time.monotonic()
        res = cluster.run([PY, "-c", SLEEPER], 2, env=ENV, capture=True, timeout=60)
        elapsed = time.monotonic() - start
    assert res.returncode != 0, res.stdout + res.stderr
    assert "Launch proxy failed" in res.stderr or "unable to connect" in res.stderr, res.stderr
    assert elapsed < 30, elapsed
    assert "ready" not in res.stdout  # no rank started anywhere
    assert leftovers(tag) == []


def not_root():
    """A command prefix running as a user that is not root but can still read this checkout.

    A user namespace keeps root's access to the checkout's files (a checkout under a
    private directory, such as mktemp's, is unreadable to ``nobody``); where user
    namespaces are not allowed, ``nobody`` itself.
    """
    userns = ["unshare", "--user"]
    probe = subprocess.run(
        [*userns, PY, "-c", "import os, mpitree; print(os.geteuid())"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if probe.returncode == 0 and probe.stdout.strip() != "0":
        return userns
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def test_not_root_is_a_clear_error():
    res = subprocess.run(
        [*not_root(), PY, "-m", "mpitree", "cluster", "--", "true"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert "needs root" in res.stderr


def test_latency_without_netem_is_a_clear_error():
    # netem present: the job runs; netem missing (this machine type): a clear error
    res = subprocess.run(
        [PY, "-m", "mpitree", "cluster", "--latency", "1ms", "--", "true"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if res.returncode:
        assert res.returncode == 2 and "netem" in res.stderr, res.stderr
    else:
        assert "links" in res.stderr


def test_bad_requests_are_refused():
    assert parse_rate("1gbit") == 10**9 and parse_rate("100mbit") == 10**8
    assert parse_rate("2.5gbit") == 2_500_000_000 and parse_rate("unshaped") is None
    for bad in ("fast", "1gb", "-1mbit", "1bit", True):
        with pytest.raises(ClusterError, match="link rate"):
            parse_rate(bad)
    for kw in ({"nodes": 0}, {"nodes": 2.0}, {"latency": "soon"}):
        with pytest.raises(ClusterError):
            Cluster(**{"nodes": 2, **kw})
    with Cluster(1) as cluster, pytest.raises(ClusterError, match="ranks_per_node"):
        cluster.run(["true"], 0)
    with pytest.raises(ClusterError, match="not up"):
        cluster.run(["true"])
    with pytest.raises(ClusterError, match="made once"), cluster:
        pass


def test_cli_runs_the_command_and_returns_its_exit_code():
    res = subprocess.run(
        [PY, "-m", "mpitree", "cluster", "--nodes", "2", "--ranks-per-node", "2", "--link",
         "1gbit", "--", PY, "-c",
         "import os, socket; os.write(1, (socket.gethostname() + chr(10)).encode())"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    # mpiexec forwards each rank's stdout as it comes: lines of two nodes can interleave
    hosts = sorted(re.findall(r"mpitree-[0-9a-f]+-n[0-9]+", res.stdout))
    tag = hosts[0].split("-")[1]
    assert hosts == [f"mpitree-{tag}-n{i}" for i in (0, 0, 1, 1)]
    assert leftovers(tag) == []
    res = subprocess.run(
        [PY, "-m", "mpitree", "cluster", "--", "sh", "-c", "exit 5"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 5, res.stderr
    assert leftovers(res.stderr.split("mpitree-")[1].split("-")[0]) == []
