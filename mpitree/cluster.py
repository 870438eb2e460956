"""An emulated cluster on one Linux machine: network namespaces as nodes, shaped links.

Each node is a network namespace (with its own host name) joined to the others by
a veth pair on a private bridge; ``mpiexec`` runs in one more namespace, the head,
and starts its ranks on the nodes through a stand-in for ``ssh`` that enters the
node's namespace. Ranks on one node share memory; ranks on different nodes talk
TCP over their links, each direction of each link shaped by a token bucket
(``tc qdisc ... tbf``) to the requested rate (UCX and libfabric are kept to TCP
between nodes: on one kernel they would otherwise reach another namespace's
ranks through shared memory, see :func:`network_env`). Every address lives on a
subnet that exists only inside these namespaces, so no traffic leaves them.

Needs root, ``ip`` (iproute2) with ``ip netns``, ``tc`` when a link rate is set,
and ``mpiexec`` from MPICH (hydra) or Open MPI. Everything the harness made
(namespaces, links, bridge, processes) is removed on normal exit, on an
exception, on SIGINT/SIGTERM/SIGHUP and at interpreter exit; what a harness
killed outright (SIGKILL) left behind, :func:`remove_stale` removes.

Examples
--------
>>> from mpitree.cluster import Cluster
>>> with Cluster(nodes=2, link="1gbit") as cluster:  # doctest: +SKIP
...     result = cluster.run(["python", "prog.py"], ranks_per_node=2)
"""

from __future__ import annotations

import atexit
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SUBNET = "10.213.0"  # /24, inside this run's namespaces only; node i is .(i+1), the head .254
HEAD_ADDRESS = f"{SUBNET}.254"
MAX_NODES = 200
TBF_LATENCY = "100ms"  # how long a packet may wait in the token bucket before it is dropped
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?bit)?\s*$", re.IGNORECASE)
_DELAY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(us|ms|s)\s*$", re.IGNORECASE)
SSH_NAME = "mpitree-ssh"  # the $0 of the launcher's shell inside a node
_GRACE = 5.0  # seconds between SIGTERM and SIGKILL when stopping processes
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # end the run, tear down

LAUNCHER = """#!/bin/sh
# ssh stand-in made by mpitree.cluster: skip ssh's options, enter the node's namespace
# (and a UTS namespace named after it), run the rest of the command line there. The shell
# stands for ssh, which runs on the head node: its $0 (SSH_NAME) marks it for kill_node.
while [ $# -gt 0 ]; do
    case "$1" in
        -o|-p|-l|-i|-F|-E|-J) shift 2 ;;
        -*) shift ;;
        *) break ;;
    esac
done
node=$1
shift
cmd="$*"
exec ip netns exec "$node" {unshare}sh -c '{hostname}eval "$2"' {ssh_name} "$node" "$cmd"
"""


class ClusterError(RuntimeError):
    """The emulated cluster cannot be made here, or a request for it is invalid."""


def parse_rate(rate) -> int | None:
    """Return a link rate in bits per second, or None for an unshaped link.

    Parameters
    ----------
    rate : str, int or None
        ``"100mbit"``, ``"1gbit"``, ``"2.5gbit"``, ``"500kbit"``, a number of bits
        per second, or ``None``/``"unshaped"`` for no shaping (decimal units, as tc).

    Returns
    -------
    int or None
        Bits per second.
    """
    if rate is None or (isinstance(rate, str) and rate.strip().lower() == "unshaped"):
        return None
    if isinstance(rate, bool):
        raise ClusterError(f"link rate must be like '1gbit' or 'unshaped', got {rate!r}")
    found = _RATE.match(str(rate))
    if not found:
        raise ClusterError(f"link rate must be like '1gbit', '100mbit' or 'unshaped', got {rate!r}")
    bits = int(float(found.group(1)) * _UNITS[(found.group(2) or "bit").lower()])
    if bits < 8000:
        raise ClusterError(f"link rate must be at least 8kbit, got {rate!r}")
    return bits


def _check_delay(latency):
    """Return ``latency`` as tc writes it (``"5ms"``), or None; raise on a malformed one."""
    if latency is None:
        return None
    found = _DELAY.match(str(latency))
    if not found:
        raise ClusterError(f"latency must be like '5ms', '200us' or '0.1s', got {latency!r}")
    return f"{found.group(1)}{found.group(2).lower()}"


def find_mpiexec(mpiexec=None) -> tuple[str, str]:
    """Return ``(path, kind)`` of the mpiexec to use; kind is ``"hydra"`` or ``"openmpi"``.

    Parameters
    ----------
    mpiexec : str, optional
        A path or command name; default: ``mpiexec`` next to the running interpreter
        (a virtual environment's MPI wheel), else the first on ``PATH``.

    Returns
    -------
    (str, str)
        The absolute path and the kind; :class:`ClusterError` for any other mpiexec.
    """
    if mpiexec is None:
        here = Path(sys.executable).parent / "mpiexec"
        mpiexec = str(here) if here.exists() else "mpiexec"
    path = shutil.which(mpiexec)
    if path is None:
        raise ClusterError(f"no mpiexec found (looked for {mpiexec!r})")
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ClusterError(f"{path} --version failed: {exc}") from None
    text = out.stdout + out.stderr
    if "HYDRA" in text:
        return path, "hydra"
    if "Open MPI" in text or "OpenRTE" in text or "PRRTE" in text:
        return path, "openmpi"
    first = text.strip().splitlines()[0] if text.strip() else "no output"
    raise ClusterError(
        f"{path} is neither MPICH's hydra nor Open MPI's mpiexec ({first}): the cluster "
        "harness knows how to start only those two across namespaces"
    )


def network_env(mpiexec, kind) -> dict:
    """Return the environment that makes ranks on different nodes talk over the links.

    The namespaces share one kernel, so UCX (and libfabric's shared-memory
    providers) would reach a rank on another node through shared memory and
    bypass the shaped link: restrict them to TCP. Ranks on one node still share
    memory through the MPI library's own intra-node path. Under MPICH built with
    both netmods, prefer libfabric (``ofi``), measured faster over TCP here.
    The caller's environment overrides every entry.

    Parameters
    ----------
    mpiexec : str
        Path of the mpiexec (its ``mpichversion`` sibling names MPICH's netmods).
    kind : {"hydra", "openmpi"}
        Which mpiexec it is (see :func:`find_mpiexec`).

    Returns
    -------
    dict of str to str
    """
    env = {"UCX_TLS": "tcp,self", "FI_PROVIDER": "tcp"}
    if kind == "openmpi":
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        return env
    version = Path(mpiexec).parent / "mpichversion"
    if version.exists():
        out = subprocess.run([str(version)], capture_output=True, text=True, check=False).stdout
        device = next((line for line in out.splitlines() if "Device" in line), "")
        if "ofi" in device:
            env["MPIR_CVAR_CH4_NETMOD"] = "ofi"
    return env


def _ip(*args, check=True):
    """Run ``ip ARGS``; raise ClusterError with its message when it fails and ``check``."""
    res = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and res.returncode:
        raise ClusterError(f"ip {' '.join(args)} failed: {res.stderr.strip()}")
    return res


def check_host():
    """Raise ClusterError unless this machine can host an emulated cluster.

    Checks that the process is root (network namespaces need ``CAP_SYS_ADMIN``
    and ``CAP_NET_ADMIN``), that ``ip`` exists and that ``ip netns`` works.
    """
    if os.geteuid() != 0:
        raise ClusterError(
            "the emulated cluster needs root (it creates network namespaces, veth links and "
            "a bridge): run it as root, e.g. with sudo"
        )
    if shutil.which("ip") is None:
        raise ClusterError("the emulated cluster needs 'ip' from iproute2, which is not on PATH")
    res = _ip("netns", "list", check=False)
    if res.returncode:
        raise ClusterError(f"'ip netns' is unavailable here: {res.stderr.strip()}")


def our_namespaces(prefix="mpitree-") -> list[str]:
    """Return the names of network namespaces starting with ``prefix`` (all runs' nodes)."""
    res = _ip("netns", "list", check=False)
    names = [line.split()[0] for line in res.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix)]


class Cluster:
    """Nodes as network namespaces on one machine, with shaped links; a context manager.

    Parameters
    ----------
    nodes : int
        Number of nodes, 1 to 200.
    link : str, int or None
        Rate of each direction of each node's link (see :func:`parse_rate`);
        ``None`` or ``"unshaped"``: veth speed, limited only by the CPU.
    latency : str, optional
        One-way delay added on each node's link (``"1ms"``); needs the kernel's
        ``netem`` qdisc and raises :class:`ClusterError` where it is missing.
    mpiexec : str, optional
        The mpiexec to launch with (see :func:`find_mpiexec`).

    Attributes
    ----------
    tag : str
        This run's random suffix, part of every name it makes.
    names : list of str
        The nodes' namespace (and host) names, unique to this run.
    head : str
        The namespace ``mpiexec`` runs in.

    Notes
    -----
    Entering the context (once per object) creates everything and installs
    SIGINT, SIGTERM and SIGHUP handlers (in the main thread) that raise, so that
    leaving the context tears everything down; an ``atexit`` hook covers an
    interpreter that exits otherwise. :meth:`close` is idempotent.
    """

    def __init__(self, nodes=2, link=None, latency=None, mpiexec=None):
        if isinstance(nodes, bool) or not isinstance(nodes, int) or not 1 <= nodes <= MAX_NODES:
            raise ClusterError(f"nodes must be an integer in [1, {MAX_NODES}], got {nodes!r}")
        self.rate = parse_rate(link)
        self.latency = _check_delay(latency)
        self.mpiexec, self.kind = find_mpiexec(mpiexec)
        self.tag = secrets.token_hex(3)
        self.names = [f"mpitree-{self.tag}-n{i}" for i in range(nodes)]
        self.head = f"mpitree-{self.tag}-head"
        self.bridge = f"mtbr-{self.tag}"
        self._made = False
        self._closed = False
        self._tmp = None
        self._launcher = None
        self._handlers = {}

    # -- making and removing -----------------------------------------------------

    def __enter__(self):
        if self._made:
            raise ClusterError("a Cluster is made once: create a new one to start again")
        check_host()
        if self.rate is not None or self.latency is not None:
            if shutil.which("tc") is None:
                raise ClusterError("shaping links needs 'tc' from iproute2, which is not on PATH")
        self._install_handlers()
        atexit.register(self.close)
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _make(self):
        """Create the bridge, the head and the nodes, with addresses and shaping."""
        self._made = True
        self._tmp = tempfile.mkdtemp(prefix=f"mpitree-cluster-{self.tag}-")
        with open(os.path.join(self._tmp, "owner"), "w") as f:
            f.write(_identity(os.getpid()))
        uts = shutil.which("unshare") is not None  # then each node has its own host name
        self._launcher = os.path.join(self._tmp, "node-shell")
        with open(self._launcher, "w") as f:
            f.write(
                LAUNCHER.replace("{unshare}", "unshare --uts " if uts else "")
                .replace("{hostname}", 'hostname "$1"; ' if uts else "")
                .replace("{ssh_name}", SSH_NAME)
            )
        os.chmod(self._launcher, 0o755)
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        self._attach(self.head, "h", HEAD_ADDRESS)
        for i, name in enumerate(self.names):
            self._attach(name, str(i), f"{SUBNET}.{i + 1}")
        for i, name in enumerate(self.names):
            self._shape(name, f"mtn{i}-{self.tag}", f"mtv{i}-{self.tag}")

    def _attach(self, ns, index, address):
        """Create namespace ``ns`` with loopback up and a veth to the bridge at ``address``."""
        _ip("netns", "add", ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        outer, inner = f"mtv{index}-{self.tag}", f"mtn{index}-{self.tag}"
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner, "netns", ns)
        _ip("link", "set", outer, "master", self.bridge)
        _ip("link", "set", outer, "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", inner)
        _ip("-n", ns, "link", "set", inner, "up")

    def _shape(self, ns, inner, outer):
        """Shape both directions of one node's link: its own veth and the bridge's end."""
        for dev, where in ((inner, ["ip", "netns", "exec", ns]), (outer, [])):
            parent = ["root"]
            if self.latency is not None:
                netem = ["netem", "delay", self.latency]
                self._tc(where, "qdisc", "add", "dev", dev, "root", "handle", "1:", *netem)
                parent = ["parent", "1:1", "handle", "10:"]
            if self.rate is not None:
                burst = max(self.rate // 8 // 100, 256 * 1024)  # 10 ms of traffic, >= 256 KiB
                tbf = ["tbf", "rate", f"{self.rate}bit", "burst", str(burst)]
                self._tc(where, "qdisc", "add", "dev", dev, *parent, *tbf, "latency", TBF_LATENCY)

    def _tc(self, where, *args):
        """Run ``tc ARGS`` (inside a namespace when ``where`` says so); raise on failure."""
        res = subprocess.run([*where, "tc", *args], capture_output=True, text=True, check=False)
        if res.returncode:
            message = res.stderr.strip()
            if "netem" in args and ("unknown" in message.lower() or "No such" in message):
                raise ClusterError(
                    "latency needs the kernel's netem qdisc (module sch_netem), which this "
                    f"kernel lacks ({message}); run without latency to shape only the rate"
                )
            raise ClusterError(f"tc {' '.join(args)} failed: {message}")

    def close(self):
        """Stop every process in the cluster's namespaces and remove everything made.

        SIGINT, SIGTERM and SIGHUP are ignored while it runs, so that a second
        Ctrl-C cannot cut the teardown short.
        """
        if self._closed:
            return
        self._closed = True
        main = threading.current_thread() is threading.main_thread()
        if main:
            for signum in STOP_SIGNALS:
                self._handlers.setdefault(signum, signal.signal(signum, signal.SIG_IGN))
        try:
            atexit.unregister(self.close)
            if self._made:
                _remove(self.tag, [self.head, *self.names], self._tmp)
        finally:
            self._restore_handlers()

    def _install_handlers(self):
        """Make SIGTERM and SIGHUP raise SystemExit, SIGINT KeyboardInterrupt (main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return

        def stop(signum, frame):
            raise SystemExit(128 + signum)

        for signum in STOP_SIGNALS:
            handler = signal.default_int_handler if signum == signal.SIGINT else stop
            self._handlers[signum] = signal.signal(signum, handler)

    def _restore_handlers(self):
        """Put back the signal handlers found on entry."""
        while self._handlers:
            signum, handler = self._handlers.popitem()
            signal.signal(signum, handler)

    def link_bytes(self, node) -> tuple[int, int]:
        """Return the bytes node ``node`` (an index) has sent and received over its link.

        Counted by the kernel on the node's veth, so they include TCP/IP headers and
        mpiexec's own control traffic.

        Returns
        -------
        (int, int)
            ``(sent, received)`` since the cluster was made.
        """
        dev = f"mtn{node}-{self.tag}"
        out = _ip("-n", self.names[node], "-s", "-j", "link", "show", "dev", dev).stdout
        stats = json.loads(out)[0]["stats64"]
        return stats["tx"]["bytes"], stats["rx"]["bytes"]

    def cut_link(self, node):
        """Take node ``node``'s (an index) link down, as if its cable were pulled.

        Sets the node's end of its veth down; the bridge's end loses carrier, so
        nothing crosses in either direction. Its processes run on, cut off (see
        the user guide's "Faults" for what MPICH and hydra then do).
        """
        _ip("-n", self.names[node], "link", "set", f"mtn{node}-{self.tag}", "down")

    def kill_node(self, node, sig=signal.SIGKILL) -> list[int]:
        """Send ``sig`` to every process of node ``node`` (an index), as if the node died.

        The shells that stand for ``ssh`` are spared: a real ``ssh`` runs on the
        head node and outlives the remote node, reporting its end to mpiexec.

        Returns
        -------
        list of int
            The process ids signalled.
        """
        hit = []
        for pid in _pids([self.names[node]]):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if SSH_NAME.encode() not in argv[:4]:
                    os.kill(pid, sig)
                    hit.append(pid)
            except (FileNotFoundError, ProcessLookupError):
                pass
        return hit

    # -- launching ---------------------------------------------------------------

    def command(self, command, ranks_per_node=1) -> list[str]:
        """Return the argv that starts ``command`` on every node (run it in :attr:`head`).

        Parameters
        ----------
        command : sequence of str
            The program and its arguments, as given to mpiexec.
        ranks_per_node : int
            Ranks started on each node; rank ``r`` runs on node ``r // ranks_per_node``.

        Returns
        -------
        list of str
        """
        if not command:
            raise ClusterError("no command to run on the cluster")
        rpn = ranks_per_node
        if isinstance(rpn, bool) or not isinstance(rpn, int) or rpn < 1:
            raise ClusterError(f"ranks_per_node must be a positive integer, got {rpn!r}")
        total = str(rpn * len(self.names))
        if self.kind == "hydra":
            return [
                self.mpiexec, "-launcher", "ssh", "-launcher-exec", self._launcher,
                "-localhost", HEAD_ADDRESS, "-hosts", ",".join(self.names),
                "-n", total, "-ppn", str(rpn), *command,
            ]  # fmt: skip
        return [
            self.mpiexec, "--mca", "plm_rsh_agent", self._launcher,
            "--host", ",".join(f"{n}:{rpn}" for n in self.names),
            "--map-by", f"ppr:{rpn}:node", "-n", total, *command,
        ]  # fmt: skip

    def start(self, command, ranks_per_node=1, *, env=None, **popen):
        """Start ``command`` under mpiexec across the nodes; return its :class:`subprocess.Popen`.

        mpiexec runs in the head namespace, in a session of its own. Leaving the
        context stops whatever of the job is still running.

        Parameters
        ----------
        command : sequence of str
            The program each rank runs, e.g. ``["python", "prog.py"]``.
        ranks_per_node : int
            Ranks on each node (consecutive ranks share a node).
        env : dict, optional
            Environment for mpiexec (and so the ranks); default: this process's.
            Entries of :func:`network_env` are added where ``env`` lacks them.
        **popen
            Passed to :class:`subprocess.Popen` (``stdout``, ``text``, ...).

        Returns
        -------
        subprocess.Popen
        """
        if not self._made or self._closed:
            raise ClusterError("the cluster is not up: use it inside 'with Cluster(...)'")
        argv = ["ip", "netns", "exec", self.head, *self.command(command, ranks_per_node)]
        full_env = {**network_env(self.mpiexec, self.kind), **(os.environ if env is None else env)}
        return subprocess.Popen(argv, env=full_env, start_new_session=True, **popen)

    def run(self, command, ranks_per_node=1, *, env=None, timeout=None, capture=False):
        """Run ``command`` under mpiexec across the nodes; return when it exits.

        Parameters
        ----------
        command : sequence of str
            The program each rank runs, e.g. ``["python", "prog.py"]``.
        ranks_per_node : int
            Ranks on each node (consecutive ranks share a node).
        env : dict, optional
            Environment for mpiexec (and so the ranks); default: this process's.
        timeout : float, optional
            Seconds after which every process of the job is stopped and
            :class:`subprocess.TimeoutExpired` raised.
        capture : bool
            Capture stdout and stderr as text instead of passing them through.

        Returns
        -------
        subprocess.CompletedProcess
            With ``returncode`` the exit code of mpiexec.
        """
        pipe = subprocess.PIPE if capture else None
        proc = self.start(command, ranks_per_node, env=env, stdout=pipe, stderr=pipe, text=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:  # timeout, Ctrl-C, SIGTERM: stop the job, then re-raise
            _stop_group(proc)
            _kill_namespaces([self.head, *self.names])
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _identity(pid) -> str:
    """Return ``"PID STARTTIME"`` of a live process, or "" (its start time tells reuse apart)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return ""
    return f"{pid} {stat.rsplit(')', 1)[1].split()[19]}"


def _remove(tag, spaces, tmp):
    """Stop the processes in ``spaces``, delete them, run ``tag``'s links and bridge, ``tmp``."""
    _kill_namespaces(spaces)
    for ns in spaces:
        _ip("netns", "del", ns, check=False)
    links = _ip("-o", "link", "show", check=False).stdout.splitlines()
    for name in {line.split(":")[1].strip().split("@")[0] for line in links if ":" in line}:
        if name.endswith(f"-{tag}") and name.startswith(("mtv", "mtbr")):
            _ip("link", "del", name, check=False)
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_stale() -> list[str]:
    """Remove what clusters whose harness process died (SIGKILL, power) left behind.

    A run counts as stale when its owner record (in the temporary directory) is
    missing or names a process that no longer exists; live runs are left alone.

    Returns
    -------
    list of str
        The tags (the random part of the names) of the runs removed.
    """
    check_host()
    links = _ip("-o", "link", "show", "type", "bridge", check=False).stdout
    tags = {n.split("-")[1] for n in our_namespaces()}
    tags |= {w.split("-", 1)[1].rstrip(":") for w in links.split() if w.startswith("mtbr-")}
    removed = []
    for tag in sorted(tags):
        tmps = list(Path(tempfile.gettempdir()).glob(f"mpitree-cluster-{tag}-*"))
        owners = [p / "owner" for p in tmps if (p / "owner").exists()]
        owner = owners[0].read_text().strip() if owners else ""
        if owner and _identity(owner.split()[0]) == owner:
            continue
        spaces = our_namespaces(f"mpitree-{tag}-")
        _remove(tag, spaces, None)
        for tmp in tmps:
            shutil.rmtree(tmp, ignore_errors=True)
        removed.append(tag)
    return removed


def _stop_group(proc):
    """SIGINT the job's process group, then SIGKILL it if it outlives the grace period."""
    for sig, wait in ((signal.SIGINT, _GRACE), (signal.SIGKILL, _GRACE)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _kill_namespaces(spaces):
    """SIGTERM, then SIGKILL, every process still inside the given namespaces."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = _pids(spaces)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + _GRACE
        while time.monotonic() < deadline and _pids(spaces):
            time.sleep(0.05)


def _pids(spaces):
    """Return the ids of the processes inside the given namespaces."""
    pids = set()
    for ns in spaces:
        res = _ip("netns", "pids", ns, check=False)
        pids.update(int(p) for p in res.stdout.split() if p.isdigit())
    pids.discard(os.getpid())
    return sorted(pids)
