"""Benchmarks reach mpitree only through its public API and ``mpitree.extend``.

Every ``benchmarks/*.py`` is parsed (not run): an import of a private mpitree
module (``mpitree._x``, ``from mpitree import _x``, ``mpitree.adapters.y._z``)
or an attribute path through one (``mpitree._x.name``) fails the test. What a
benchmark needs of the internals has a documented name in ``mpitree.extend``.
"""

import ast
import pathlib

import pytest

BENCHMARKS = sorted((pathlib.Path(__file__).parent.parent / "benchmarks").glob("*.py"))


def private(module):
    """Return whether a dotted module name is mpitree's and passes through a private part."""
    parts = module.split(".")
    return parts[0] == "mpitree" and any(p.startswith("_") for p in parts[1:])


def dotted(node):
    """Return the dotted name of a chain of attributes on a name, or None."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(names)])


def violations(source):
    """Return (line, what) of every reach into a private mpitree module in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if private(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if private(node.module):
                found.append((node.lineno, node.module))
            elif node.module.split(".")[0] == "mpitree":
                found += [
                    (node.lineno, f"{node.module}.{a.name}")
                    for a in node.names
                    if private(f"{node.module}.{a.name}")
                ]
        elif isinstance(node, ast.Attribute):
            name = dotted(node)
            if name is not None and private(name):
                found.append((node.lineno, name))
    return sorted(set(found))


def test_the_rule_catches_each_form():
    bad = (
        "import mpitree._kernel\n"
        "from mpitree import _merger\n"
        "from mpitree._runtime import default_comm\n"
        "from mpitree.adapters.transformers._attention import LayerStep\n"
        "import mpitree\nx = mpitree._decode_plan.FAST_PATH\n"
    )
    assert sorted({line for line, _ in violations(bad)}) == [1, 2, 3, 4, 6]
    good = (
        "import mpitree\nimport mpitree.adapters.transformers as mtt\n"
        "from mpitree import DecodePlan, extend, spec\nfrom mpitree.extend import phase_times\n"
        "from decode_overhead import TIMES\nx = mpitree.extend.traffic\n"
    )
    assert violations(good) == []


def test_there_are_benchmarks():
    assert len(BENCHMARKS) >= 5


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_uses_public_names_only(path):
    found = violations(path.read_text())
    assert not found, f"{path.name} reaches private mpitree modules: {found}"
