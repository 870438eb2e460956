"""The strategy registry: declared attributes, and every list of strategies read from them."""

import ast
import itertools
import os
import pkgutil
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

import mpitree
from mpitree import _op, _options, _strategies, model
from mpitree._registry import register, strategy_names
from mpitree._strategies import REGISTRY, Strategy, auto_strategy, op_needed, resolve
from mpitree._strategies.allgather import Allgather
from mpitree._strategies.allreduce import Allreduce
from mpitree._strategies.node import NodeStrategy
from mpitree.cli import main
from mpitree.cli.merge import merged

ROOT = Path(__file__).resolve().parent.parent
TODAY = (
    "allreduce", "allreduce3", "allgather", "hierarchical", "node", "ring", "device-node", "nccl"
)  # fmt: skip
# name: (needs_kv, uses_op, persistent, reproducible, modelled, auto_priority)
ATTRIBUTES = {
    "allreduce": (False, True, True, False, True, 1),
    "allreduce3": (False, False, False, False, False, 3),
    "allgather": (False, False, False, True, True, 2),
    "hierarchical": (False, True, False, False, True, 0),
    "node": (False, True, False, False, False, None),
    "ring": (True, False, False, True, True, None),
    "device-node": (False, True, False, False, False, None),
    "nccl": (False, False, False, True, False, None),
}
# name: the buffer kinds it merges in (the host strategies: host or pinned memory)
BUFFERS = {"device-node": ("device",), "nccl": ("device",)}


def old_op_needed(strategy, deterministic, acc, head_dim, native):
    """``op_needed`` as 8d5d047 wrote it, the names spelled out (and ``node`` and
    ``device-node``, which came later and run the op among their node leaders)."""
    uses = ("auto", "allreduce", "hierarchical", "node", "device-node")
    if deterministic or strategy not in uses:
        return None
    if strategy == "auto" and not native:
        return None
    return (acc, head_dim + 2)


def old_auto_strategy(size, native, nodes, ranks_per_node, ring_library):
    """``auto_strategy`` as 8d5d047 wrote it."""
    if not native:
        return "allgather" if size <= 8 else "allreduce3"
    if nodes > 1 and ranks_per_node > 1 and ring_library:
        return "hierarchical"
    return "allreduce"


def unmodelled_gaps():
    """Registered strategies the cost model neither predicts nor is told to leave out."""
    gaps = [n for n, cls in REGISTRY.items() if cls.modelled != (n in model.STRATEGIES)]
    return gaps + [n for n in model.STRATEGIES if n not in REGISTRY]


@pytest.fixture
def throwaway():
    """Register two strategies for one test (one using the native op); remove them after."""

    class Throwaway(Allgather):
        name = "throwaway"
        order = 99
        summary = "allgather under another name, for a test"
        short = "throwaway"
        label = "throwaway + local merge"
        modelled = False
        auto_priority = None

    class ThrowawayOp(Allreduce):
        name = "throwaway_op"
        order = 98
        summary = "allreduce under another name, for a test"
        short = "throw. op"
        label = ""  # the name, not the inherited allreduce's row
        modelled = False
        auto_priority = None

    try:
        yield register(Throwaway), register(ThrowawayOp)
    finally:
        REGISTRY.pop("throwaway", None)
        REGISTRY.pop("throwaway_op", None)
    assert tuple(REGISTRY) == TODAY


def test_every_module_registers_one_strategy():
    """Each module of the package is found and holds one registered strategy, and no more."""
    modules = {m.name for m in pkgutil.iter_modules(_strategies.__path__)}
    owners = [cls.__module__.rsplit(".", 1)[-1] for cls in REGISTRY.values()]
    assert sorted(owners) == sorted(modules) and len(set(owners)) == len(owners)
    assert tuple(REGISTRY) == TODAY  # the declared order: every table's order
    assert [cls.order for cls in REGISTRY.values()] == sorted(c.order for c in REGISTRY.values())


@pytest.mark.parametrize("name", TODAY)
def test_todays_attributes(name):
    cls = REGISTRY[name]
    got = (cls.needs_kv, cls.uses_op, cls.persistent, cls.reproducible, cls.modelled)
    assert (*got, cls.auto_priority) == ATTRIBUTES[name]
    assert cls.buffers == BUFFERS.get(name, ("host", "pinned"))


@pytest.mark.parametrize("name", tuple(REGISTRY))
def test_every_strategy_declares_what_the_lists_need(name):
    """What every registered strategy (today's, and one added later) must declare."""
    cls = REGISTRY[name]
    assert issubclass(cls, Strategy) and cls.name == name
    assert cls.summary and "\n" not in cls.summary
    assert len(cls.short or name) <= 10  # bench's columns are 11 wide
    assert len((cls.label or name).format(nodes="real", op="native")) <= 34  # merge's first column
    flags = (cls.needs_kv, cls.uses_op, cls.persistent, cls.reproducible, cls.modelled)
    assert all(type(flag) is bool for flag in flags)
    assert cls.buffers and set(cls.buffers) <= {"host", "pinned", "device"}
    assert cls.auto_priority is None or type(cls.auto_priority) is int


def test_register_refuses_bad_declarations():
    class Base(Allgather):
        order, summary, auto_priority = 50, "a test's", None

    for name in ("", "auto", "ring", None):
        with pytest.raises(ValueError, match="name"):
            register(type("Bad", (Base,), {"name": name}))
    with pytest.raises(ValueError, match="order"):
        register(type("Bad", (Base,), {"name": "bad", "order": 1.5}))
    for summary in ("", "two\nlines"):
        with pytest.raises(ValueError, match="summary"):
            register(type("Bad", (Base,), {"name": "bad", "summary": summary}))
    refused = {  # what a list reads, declared so that the list would break
        "a name of at most": {"name": "a_name_of_thirteen"},
        "needs_kv must be": {"needs_kv": "no"},
        "buffers": {"buffers": ("host", "disk")},
        "short .or the name. must be": {"short": "eleven-wide"},
        "label must be a str": {"label": "gather {node} then merge"},
        "label must be at most": {"label": "x" * 35},
        "auto_priority must be": {"auto_priority": True},
        "cannot be picked by 'auto'": {"needs_kv": True, "auto_priority": -1},
        "'auto' may pick merges in host memory": {"buffers": ("device",), "auto_priority": 5},
    }
    for says, fields in refused.items():
        with pytest.raises(ValueError, match=says):
            register(type("Bad", (Base,), {"name": "bad", **fields}))
    assert tuple(REGISTRY) == TODAY


def test_names_lists_are_generated():
    want = ("auto", *TODAY)
    assert strategy_names() == _options.STRATEGIES == mpitree.STRATEGIES == want
    assert "STRATEGIES" in mpitree.__all__
    for name in want:
        assert _options.check_strategy(name) == name
    for bad in ("bogus", "", None, 3):
        with pytest.raises(ValueError, match=r"strategy must be one of \('auto', 'allreduce'"):
            _options.check_strategy(bad)
    with pytest.raises(AttributeError):
        _options.NOT_THERE  # noqa: B018
    # ring moves K/V; device-node and nccl merge device buffers, which numpy arrays have not
    host = [n for n in TODAY if n not in ("ring", "device-node", "nccl")]
    assert [name for name, _ in merged(2)] == host
    assert [label for _, label in merged(0)] == [
        "allreduce, native op",
        "allreduce3 (paper's Alg. 3)",
        "allgather + local merge",
        "hierarchical (nodes of real)",
        "node shared window (nodes of real)",
    ]


@pytest.mark.parametrize("native", [False, True])
def test_op_needed_is_todays_rule(monkeypatch, native):
    """Every (strategy, deterministic, native) gives what the hand-written rule gave."""
    monkeypatch.setattr(_op, "native_op_available", lambda: native)
    for strategy, deterministic in itertools.product(
        ("auto", *TODAY, "bogus"), (False, True, "invariant")
    ):
        for acc, dim in (("float32", 8), ("float64", 128)):
            want = old_op_needed(strategy, deterministic, acc, dim, native)
            assert op_needed(strategy, deterministic, acc, dim) == want, (strategy, deterministic)


def test_auto_rule_is_todays_and_op_needed_follows_it():
    """The rule from the strategies' attributes picks as the hand-written rule did, and
    "auto" runs a strategy that uses the native op exactly where the op is available."""
    for size, native, nodes, rpn, ring in itertools.product(
        range(1, 20), (False, True), (1, 2, 3, 5), (1, 2, 4), (False, True)
    ):
        got = auto_strategy(size, native, nodes, rpn, ring)
        assert got == old_auto_strategy(size, native, nodes, rpn, ring)
        assert REGISTRY[got].uses_op == native


@pytest.mark.parametrize("deterministic", [False, True])
def test_resolve_on_one_rank(deterministic):
    for native in (False, True):
        for strategy in ("auto", *TODAY):
            got = resolve(strategy, MPI.COMM_SELF, native, 0, deterministic)
            if deterministic:
                want = strategy if strategy in ("allgather", "ring", "nccl") else "allgather"
            elif strategy == "auto":
                want = "allreduce" if native else "allgather"
            else:
                want = strategy
            assert got == want, (strategy, native)


def test_every_strategy_is_modelled_or_marked_unmodelled(throwaway):
    """A strategy the cost model does not predict says so (``modelled = False``)."""
    assert unmodelled_gaps() == []
    throwaway[0].modelled = True  # a new strategy forgotten by the model: caught
    assert unmodelled_gaps() == ["throwaway"]


def test_registered_strategy_shows_up_in_every_list(throwaway, capsys):
    want = ("auto", *TODAY, "throwaway_op", "throwaway")  # in their declared order
    assert strategy_names() == _options.STRATEGIES == mpitree.STRATEGIES == want
    assert _options.check_strategy("throwaway") == "throwaway"
    assert op_needed("throwaway_op", False, "float32", 8) == ("float32", 10)
    assert op_needed("throwaway", False, "float32", 8) is None
    assert [n for n, _ in merged(0)][-2:] == ["throwaway_op", "throwaway"]
    q = np.random.default_rng(0).standard_normal((1, 2, 1, 8)).astype(np.float32)
    kv = np.random.default_rng(1).standard_normal((1, 2, 5, 8)).astype(np.float32)
    want_out = mpitree.tree_decode(q, kv, kv, comm=MPI.COMM_SELF)
    for name in ("throwaway", "throwaway_op"):
        got = mpitree.tree_decode(q, kv, kv, comm=MPI.COMM_SELF, strategy=name)
        np.testing.assert_allclose(got, want_out, rtol=1e-6, atol=1e-7)
    # the command line's tables, run in this process on one rank
    capsys.readouterr()
    assert main(["demo", "--tokens", "256", "--q-heads", "4", "--kv-heads", "2", "--steps", "1",
                 "--warmup", "0", "--head-dim", "16"]) == 0  # fmt: skip
    demo = capsys.readouterr().out
    assert "\nthrowaway " in demo and "\nthrowaway_op " in demo
    main(["merge", "--rows", "2", "--head-dim", "8", "--iters", "2", "--warmup", "1"])
    table = capsys.readouterr().out
    assert "throwaway + local merge" in table and "throwaway_op, persistent" in table
    main(["bench", "--quick", "--tokens", "256", "--workloads", "llama3-8b", "--steps", "1"])
    bench = capsys.readouterr().out
    assert "throwaway" in bench and "throw. op" in bench


def test_a_new_strategy_is_one_file(tmp_path):
    """A module dropped into a copy of the package is found, listed and run by the CLI."""
    package = tmp_path / "mpitree"
    shutil.copytree(ROOT / "mpitree", package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "_strategies" / "echo.py").write_text(
        '"""``echo``: the all-gather under another name (a test\'s strategy)."""\n\n'
        "from . import register\n"
        "from .allgather import Allgather\n\n\n"
        "@register\n"
        "class Echo(Allgather):\n"
        '    """All-gather again."""\n\n'
        '    name = "echo"\n'
        "    order = 50\n"  # after every strategy of today
        '    summary = "the all-gather again"\n'
        "    modelled = False\n"
        "    auto_priority = None\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    check = (
        "import mpitree; from mpitree import _options, _strategies; "
        f"assert mpitree.__file__.startswith({str(tmp_path)!r}), mpitree.__file__; "
        "print(mpitree.STRATEGIES, _options.STRATEGIES == mpitree.STRATEGIES, "
        "_strategies.op_needed('echo', False, 'float32', 8))"
    )
    res = subprocess.run(
        [sys.executable, "-c", check],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    names = ("auto", *TODAY, "echo")
    assert res.stdout.split("\n")[0] == f"{names} True None"
    demo = ["-m", "mpitree", "demo", "--tokens", "256", "--steps", "1", "--warmup", "0"]
    res = subprocess.run(
        [sys.executable, *demo], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "\necho " in res.stdout


def test_node_strategies_derive_their_node_layout_once():
    """``node`` and ``device-node`` split the communicator, check that a virtual node shares
    memory and make the leaders' all-reduce in one place: their common base."""
    calls = {}
    for name in ("node", "device-node"):
        cls = REGISTRY[name]
        assert issubclass(cls, NodeStrategy), name
        tree = ast.parse(Path(sys.modules[cls.__module__].__file__).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                calls[node.func.id] = calls.get(node.func.id, 0) + 1
    assert [calls.get(f, 0) for f in ("layout", "_shared_node", "record_op")] == [1, 1, 1]
