"""Benchmarks reach mpitree only through its public API and ``mpitree.extend``.

Every ``benchmarks/*.py`` is parsed (not run). A reach into a private mpitree
module or name fails the test, in every form: an import (``mpitree._x``,
``from mpitree import _x``, ``mpitree.adapters.y._z``), an attribute path
through one, under any alias (``import mpitree as mt; mt._x``), a string naming
one (``importlib.import_module("mpitree._x")``, ``__import__``,
``sys.modules[...]``), ``getattr(obj, "_x")``, and a private attribute of an
object (``cache._commit``; another library's modules and a benchmark's own
``self`` are its business). Docstrings and command-line help may name private
modules. What a benchmark needs of the internals has a documented name in
``mpitree.extend`` (the internals they time: ``extend.tools``); the few exceptions are listed
in ``ALLOWED`` with the reason.
"""

import ast
import pathlib
import re

import pytest

BENCHMARKS = sorted((pathlib.Path(__file__).parent.parent / "benchmarks").glob("*.py"))

#: (benchmark, what the rule reports) -> why it stays
ALLOWED = {
    ("tree_verify.py", "cache._commit"): (
        "fills a ShardedCache with random K/V of a given length without running a "
        "prefill (no public call seeds a cache with given K/V)"
    ),
    ("merge_cost.py", "plan._merger"): (
        "a --baseline tree older than extend.plan_merger (from fe6c268, issue 25's "
        "start) has no public name for a plan's merger (nor for its bound kernel, which "
        "the benchmark imports from the baseline's _kernel by a computed name)"
    ),
    ("layer_cost.py", "mpitree._kernel.Prepared"): (
        "a tree older than extend.Prepared (from fe6c268, issue 25's start) has no "
        "public name for its bound kernel; the benchmark times any tree"
    ),
    ("jax_decode.py", "mpitree.adapters._jax_baseline"): (
        "the module name under which an older adapters/jax.py file is loaded beside "
        "the current adapter for an A/B: a name of the benchmark's own, not a reach "
        "into mpitree"
    ),
}

PRIVATE_NAME = re.compile(r"\bmpitree(?:\.\w+)*?\._[A-Za-z0-9]\w*")
HELP_KEYWORDS = {"help", "description", "epilog", "usage"}


def private_part(name):
    """Return whether one name is private (a leading underscore, not a dunder)."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private(module):
    """Return whether a dotted module name is mpitree's and passes through a private part."""
    parts = module.split(".")
    return parts[0] == "mpitree" and any(private_part(p) for p in parts[1:])


def bound_names(tree):
    """Return local name -> the dotted module or object an import binds it to."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = (
                    a.name if a.asname else a.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def documentation(tree):
    """Return the ids of string constants that document: docstrings and CLI help text."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
        elif isinstance(node, ast.keyword) and node.arg in HELP_KEYWORDS:
            ids |= {id(n) for n in ast.walk(node.value) if isinstance(n, ast.Constant)}
    return ids


def attribute_reach(node, names):
    """Return the private reach of an attribute chain (``mt._x``, ``cache._commit``), or None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    parts.reverse()
    root = node.id if isinstance(node, ast.Name) else None
    full = names.get(root)
    if full is not None and full.split(".")[0] == "mpitree":
        path = [*full.split("."), *parts]
    elif full is not None or root in ("self", "cls"):
        return None  # another library's module, or the benchmark's own object
    else:
        path = [root or "(...)", *parts]
    for i, part in enumerate(path[1:], 1):
        if private_part(part):
            return ".".join(path[: i + 1])
    return None


def violations(source):
    """Return (line, what) of every reach into private mpitree names in ``source``."""
    tree = ast.parse(source)
    names, docs = bound_names(tree), documentation(tree)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {(node.lineno, a.name) for a in node.names if private(a.name)}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                if private(f"{node.module}.{a.name}"):
                    found.add((node.lineno, f"{node.module}.{a.name}"))
        elif isinstance(node, ast.Attribute):
            what = attribute_reach(node, names)
            if what is not None:
                found.add((node.lineno, what))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in docs:
                found |= {(node.lineno, m) for m in PRIVATE_NAME.findall(node.value)}
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and private_part(node.args[1].value)
        ):
            found.add((node.lineno, f"{node.func.id}(..., {node.args[1].value!r})"))
    return sorted(found)


BAD = {
    "import": "import mpitree._kernel\n",
    "from-import": "from mpitree import _merger\n",
    "from private": "from mpitree._runtime import default_comm\n",
    "adapter private": "from mpitree.adapters.transformers._attention import LayerStep\n",
    "attribute": "import mpitree\nx = mpitree._decode_plan.FAST_PATH\n",
    "alias pkg": "import mpitree as mt\nx = mt._kernel.Prepared\n",
    "alias adapter": "import mpitree.adapters.transformers as mtt\nx = mtt._attention.LayerStep\n",
    "from-import then attr": "from mpitree.adapters import transformers\ntransformers._attention\n",
    "public name then private": "from mpitree import DecodePlan\nDecodePlan._step\n",
    "extend._traffic": "from mpitree import extend\nx = extend._traffic\n",
    "import_module": 'import importlib\nm = importlib.import_module("mpitree._kernel")\n',
    "__import__": 'm = __import__("mpitree._kernel", fromlist=["x"])\n',
    "sys.modules": 'import sys\nm = sys.modules["mpitree._kernel"]\n',
    "getattr": 'import mpitree\nm = getattr(mpitree, "_kernel")\n',
    "object attribute": "import mpitree\nplan = mpitree.DecodePlan(1, 1, 1, 8)\nplan._merger\n",
    "call result attribute": "import mpitree\nmpitree.DecodePlan(1, 1, 1, 8)._merger\n",
}


@pytest.mark.parametrize("source", BAD.values(), ids=BAD.keys())
def test_the_rule_catches_each_form(source):
    assert violations(source)


def test_the_rule_passes_public_use_and_documentation():
    good = (
        '"""Times ``mpitree._kernel`` through ``mpitree.extend``."""\n'
        "import argparse\nimport transformers\n"
        "import mpitree\nimport mpitree.adapters.transformers as mtt\n"
        "from mpitree import DecodePlan, extend, spec\nfrom mpitree.extend import phase_times\n"
        "from decode_overhead import TIMES\nx = mpitree.extend.traffic\nmtt.ShardedCache\n"
        "transformers.AttentionInterface._global_mapping\nmpitree.__version__\n"
        "class Timer:\n    def __init__(self):\n        self._t = 0\n"
        "def f():\n    '''Reads mpitree._native's loop.'''\n"
        "argparse.ArgumentParser().add_argument('--so', help='another mpitree._native .so')\n"
    )
    assert violations(good) == []


def test_there_are_benchmarks():
    assert len(BENCHMARKS) >= 5


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_uses_public_names_only(path):
    found = [
        (line, what)
        for line, what in violations(path.read_text())
        if (path.name, what) not in ALLOWED
    ]
    assert not found, f"{path.name} reaches private mpitree names: {found}"


def test_every_allowed_reach_is_still_there():
    for name, what in ALLOWED:
        path = BENCHMARKS[0].parent / name
        assert what in {w for _, w in violations(path.read_text())}, (name, what)
