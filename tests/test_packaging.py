"""Packaging: lazy optional imports, the public API, the demo and the fallback op."""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from launch import run

import mpitree

ROOT = Path(__file__).resolve().parent.parent
BLOCK_FRAMEWORKS = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "cupy", "flash_attn", "jax", "triton"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
import mpitree, mpitree.adapters
print(sorted(m for m in ("torch", "cupy", "flash_attn", "jax", "triton") if m in sys.modules))
"""


def test_import_pulls_in_no_framework():
    out = subprocess.run(
        [sys.executable, "-c", BLOCK_FRAMEWORKS],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert out.stdout.strip() == "[]"


def test_public_api():
    for name in mpitree.__all__:
        assert hasattr(mpitree, name), name
    assert set(mpitree.STRATEGIES) == {
        "auto",
        "allreduce",
        "allreduce3",
        "allgather",
        "ring",
        "hierarchical",
        "node",
        "device-node",
        "nccl",
    }


def test_demo_runs_and_is_exact():
    res = run(
        3,
        [
            sys.executable,
            "-m",
            "mpitree",
            "demo",
            "--tokens",
            "3000",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--tolerance",
            "2e-5",
        ],
    )
    assert res.returncode == 0, res.stdout + res.stderr
    for name in ("local only", "allreduce", "allreduce3", "allgather", "hierarchical", "ring"):
        assert name in res.stdout


FALLBACK = """
import warnings, numpy as np, mpitree
from mpi4py import MPI
comm = MPI.COMM_WORLD
rng = np.random.default_rng(0)
q = rng.standard_normal((1, 4, 1, 8))
k = rng.standard_normal((1, 2, 6 * comm.size, 8))
v = rng.standard_normal((1, 2, 6 * comm.size, 8))
sl = slice(6 * comm.rank, 6 * comm.rank + 6)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    out = mpitree.tree_decode(q, k[:, :, sl], v[:, :, sl], strategy="allreduce")
ref = mpitree.tree_decode(q, k[:, :, sl], v[:, :, sl], strategy="allgather")
assert not mpitree.native_op_available()
assert any("numpy Python op" in str(x.message) for x in w), [str(x.message) for x in w]
assert np.abs(out - ref).max() < 1e-12
with mpitree.DecodePlan(1, 4, 2, 8) as plan:
    assert plan.strategy == "allgather", plan.strategy
print("fallback ok")
"""


@pytest.mark.timeout(120)
def test_python_fallback_op_warns_and_is_exact():
    res = run(3, [sys.executable, "-c", FALLBACK], env={"MPITREE_NATIVE_OP": "0"})
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("fallback ok") == 3


def test_quickstart_example():
    res = run(3, [sys.executable, "examples/quickstart.py"])
    assert res.returncode == 0, res.stdout + res.stderr
    err = float(res.stdout.split("max |out - ref| = ")[1].split(",")[0])
    assert err < 2e-5 and "plan == one-shot: True" in res.stdout


def test_an_adapter_of_ones_own_from_extend_alone():
    """examples/extend_adapter.py: exact over uneven and empty shards, bad input on one rank
    raising on every rank, and nothing imported from mpitree but its public modules."""
    path = ROOT / "examples" / "extend_adapter.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module.startswith("mpitree"):
            assert node.module in ("mpitree", "mpitree.extend"), node.module
            assert not any(alias.name.startswith("_") for alias in node.names), node.module
        if isinstance(node, ast.Import):
            assert all(a.name in ("math", "numpy", "mpitree") for a in node.names), node.names
    res = run(3, [sys.executable, str(path)])
    assert res.returncode == 0, res.stdout + res.stderr
    err = float(res.stdout.split("max |out - ref| = ")[1].split(" ")[0])
    assert err < 1e-6 and "bad input: RankError" in res.stdout, res.stdout


THREADS = """
import json, os, mpitree
from mpi4py import MPI
from threadpoolctl import threadpool_info
with mpitree.DecodePlan(1, 2, 1, 8):
    pass
blas = [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]
info = MPI.COMM_WORLD.gather({"blas": blas, "cores": len(os.sched_getaffinity(0))})
for x in info or []:
    print(json.dumps(x))
"""


@pytest.mark.parametrize("env, expect", [({}, "split"), ({"MPITREE_BLAS_THREADS": "1"}, 1)])
def test_blas_threads_divided_among_ranks(env, expect):
    res = run(2, [sys.executable, "-c", THREADS], env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 2
    for line in lines:
        info = json.loads(line)
        want = max(1, info["cores"] // 2) if expect == "split" else expect
        assert info["blas"] and set(info["blas"]) == {want}, line


def test_torch_example():
    res = run(3, [sys.executable, "examples/torch_decode.py"])
    assert res.returncode == 0, res.stdout + res.stderr
    assert float(res.stdout.split("= ")[-1]) < 2e-3  # bf16 output rounding


def test_llama_example_checks_teacher_forced_logits():
    args = [sys.executable, "examples/llama_decode.py", "--context", "200", "--new-tokens", "3"]
    res = run(3, [*args, "--strategies", "allreduce"], timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "PASS: teacher-forced logits of 33 positions" in res.stdout
    res = run(2, [*args, "--strategies", "allreduce", "--tolerance", "1e-12"], timeout=240)
    assert res.returncode != 0 and "FAIL" in res.stdout, res.stdout + res.stderr


def test_soak_example_short_run_and_bad_arguments():
    res = run(2, [sys.executable, "examples/soak.py", "--steps", "60", "--rebuild", "25"])
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip().endswith("PASS") and "MPI objects: no leak" in res.stdout
    res = run(1, [sys.executable, "examples/soak.py", "--steps", "5", "--warmup", "5"])
    assert res.returncode == 2 and "--warmup (5) < --steps (5)" in res.stderr


def test_spec_verify_example():
    res = run(3, [sys.executable, str(ROOT / "examples/spec_verify.py")])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "packed into 35 nodes" in res.stdout, res.stdout
    assert float(res.stdout.split("reference| = ")[1]) < 1e-12, res.stdout


def example_names_run(tree):
    """Return the example files a test module names in a list, a call or a path it builds.

    Strings elsewhere (docstrings, comments, messages) do not count.
    """
    named = set()
    for expr in (n for n in ast.walk(tree) if isinstance(n, (ast.List, ast.Call, ast.BinOp))):
        strings = [
            n.value
            for n in ast.iter_child_nodes(expr)
            if isinstance(n, ast.Constant) and isinstance(n.value, str)
        ]
        for text in strings:  # "examples/x.py"
            named.update(re.findall(r"\bexamples/([\w-]+\.py)\b", text))
    for node in ast.walk(tree):  # ROOT / "examples" / "x.py": (ROOT / "examples") / "x.py"
        if (
            isinstance(node, ast.BinOp)
            and isinstance(node.left, ast.BinOp)
            and isinstance(node.left.right, ast.Constant)
            and node.left.right.value == "examples"
            and isinstance(node.right, ast.Constant)
            and isinstance(node.right.value, str)
        ):
            named.add(node.right.value)
    return named


def test_every_example_is_run_by_a_test():
    """Each examples/*.py is named in a test's code: a list, a call, a path (not a docstring)."""
    named = set()
    for path in (ROOT / "tests").glob("test_*.py"):
        named |= example_names_run(ast.parse(path.read_text()))
    missing = sorted({p.name for p in (ROOT / "examples").glob("*.py")} - named)
    assert not missing, f"no test runs {missing}"
    docstring = ast.parse('def test_x():\n    """examples/energy.py: later."""\n')
    assert not example_names_run(docstring)
    assert example_names_run(ast.parse('run(2, [ROOT / "examples" / "energy.py"])')) == {
        "energy.py"
    }


def test_energy_example():
    res = run(3, [sys.executable, "examples/energy.py"])
    assert res.returncode == 0, res.stdout + res.stderr
    gaps = [float(x.split(",")[0]) for x in res.stdout.split("= ")[1:3]]
    assert max(gaps) < 1e-10, res.stdout


def ci_commands():
    """The two commands from .ci/run's one marked place: {name: command}."""
    text = (ROOT / ".ci" / "run").read_text()
    block = text.split("# <commands>\n", 1)[1].split("# </commands>", 1)[0]
    found = dict(re.findall(r"^(\w+)_command='(.*)'$", block, flags=re.M))
    assert set(found) == {"main", "test"}, found
    return found


def test_readme_shows_the_commands_ci_runs():
    """The README's two set-up commands are, verbatim, the ones CI runs, in bash blocks."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```bash\n(.*?)^```", readme, flags=re.M | re.S)
    lines = {line for b in blocks for line in b.splitlines()}
    for name, command in ci_commands().items():
        assert command in lines, f"README lacks CI's {name} command: {command}"


def test_readme_and_guide_links_resolve():
    """Every relative link in the README and the guide names a file of the checkout."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), (page.name, target)


def test_layout_page_names_every_module():
    """docs/layout.md's module table lists every module of the package, and no other."""
    table = set(re.findall(r"^\| `([^`]+)` \|", (ROOT / "docs" / "layout.md").read_text(), re.M))
    modules = {
        str(p.relative_to(ROOT))
        for folder in ("mpitree", "adapters")
        for p in (ROOT / folder).rglob("*")
        if p.suffix in (".py", ".c", ".h") and "__pycache__" not in p.parts
    }
    assert table == modules, (sorted(modules - table), sorted(table - modules))


WHEEL_IMPORT = """
import importlib, sys
import mpitree
assert mpitree.__file__.startswith(sys.argv[1]), mpitree.__file__
for name in sys.argv[2:]:
    importlib.import_module(name)
"""


def test_wheel_holds_every_module_and_imports(tmp_path):
    """A built (not editable) wheel holds every module, imports, and runs the CLI.

    Editable installs hide a package the wheel leaves out (before: setup.cfg listed
    the packages by hand, the wheel lacked ``mpitree._strategies`` and ``mpitree.cli``,
    and ``import mpitree`` failed from it). The build skips the optional C extension
    (``CC=false``: seconds, not a compile); ``.ci/wheel`` installs a compiled one.
    """
    import os
    import shutil
    import zipfile

    src, out, site = tmp_path / "src", tmp_path / "dist", tmp_path / "site"
    skip = (".git", ".venv*", "build", "*.egg-info", ".ci-out", "__pycache__", "*.so")
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*skip))
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    env = {**os.environ, "CC": "false", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    subprocess.run([*pip, "-w", str(out), str(src)], env=env, check=True, timeout=240)
    (wheel,) = out.glob("mpitree-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {
        str(Path(prefix, p.relative_to(ROOT / folder)))
        for folder, prefix in (("mpitree", "mpitree"), ("adapters", "mpitree/adapters"))
        for p in (ROOT / folder).rglob("*")
        if p.suffix in (".py", ".c", ".h") and "__pycache__" not in p.parts
    } | {"mpitree/py.typed"}
    assert not want - names, f"the wheel lacks {sorted(want - names)}"
    zipfile.ZipFile(wheel).extractall(site)
    env = {**os.environ, "PYTHONPATH": str(site)}  # before the venv's editable finder
    # every module but the adapters (their frameworks), the CLI's __main__ (run below)
    modules = sorted(
        name.removesuffix(".__init__")
        for name in (p[:-3].replace("/", ".") for p in want if p.endswith(".py"))
        if not name.startswith(("mpitree.adapters.", "mpitree.__main__"))
    )
    for args in (["-c", WHEEL_IMPORT, str(site), *modules], ["-m", "mpitree", "--version"]):
        res = subprocess.run(
            [sys.executable, *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 0, res.stdout + res.stderr


SDIST = """
import sys
from setuptools import build_meta
print(build_meta.build_sdist(sys.argv[1]))
"""


def test_sdist_holds_every_c_source_the_build_names(tmp_path):
    """The sdist holds the extension's C sources and header, and the build names every one.

    The extension is optional: a source the sdist lacked would make ``pip install`` from
    it succeed without the compiled op and kernel, and a ``.c`` the build did not name
    would leave its functions out of the library.
    """
    import shutil
    import tarfile

    src, out = tmp_path / "src", tmp_path / "dist"
    skip = (".git", ".venv*", "build", "*.egg-info", ".ci-out", "__pycache__", "*.so")
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*skip))
    res = subprocess.run(
        [sys.executable, "-c", SDIST, str(out)],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    sdist = out / res.stdout.split()[-1]
    names = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
    c_files = {str(p.relative_to(ROOT)) for p in (ROOT / "mpitree").glob("*.c")}
    headers = {str(p.relative_to(ROOT)) for p in (ROOT / "mpitree").glob("*.h")}
    built = set(re.findall(r'"(mpitree/[\w.]+\.c)"', (ROOT / "pyproject.toml").read_text()))
    assert built == c_files, (sorted(c_files - built), sorted(built - c_files))
    want = c_files | headers | {"pyproject.toml", "setup.cfg", "setup.py"}
    assert headers and not want - names, f"the sdist lacks {sorted(want - names)}"


def test_generate_command_uses_the_transformers_adapters_public_names_only():
    """``mpitree generate`` (``mpitree/cli/``) reaches the transformers adapter through its
    ``__all__`` alone: no private module, no name outside it (``mtt.<name>`` included)."""
    adapter = "mpitree.adapters.transformers"
    init = ast.parse((ROOT / "adapters" / "transformers" / "__init__.py").read_text())
    public = next(
        set(ast.literal_eval(node.value))
        for node in init.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "__all__"
    )
    wrong = []
    for path in sorted((ROOT / "mpitree" / "cli").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(adapter):
                names = {alias.name for alias in node.names}
                if node.module != adapter or not names <= public:
                    wrong.append((path.name, node.module, sorted(names)))
            elif isinstance(node, ast.Import):
                inside = [a.name for a in node.names if a.name.startswith(adapter + ".")]
                wrong += [(path.name, name) for name in inside]
            elif isinstance(node, ast.Attribute) and node.attr not in public:
                owner = node.value
                if getattr(owner, "id", None) == "mtt" or getattr(owner, "attr", None) == "mtt":
                    wrong.append((path.name, f"mtt.{node.attr}"))
    assert not wrong, wrong
