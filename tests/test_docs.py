"""Every code block of README.md and docs/*.md runs as pasted, or says why not.

A block's kind is an HTML comment on the line before its fence (invisible on the
rendered page), ``<!-- test: KIND -->``; a block without one fails the suite:

``run mpiexec -n N``
    A complete Python program: written to a temporary directory and run there on N
    real ranks (``mpiexec -n N python example.py``).
``run python``
    A complete Python program that starts its own processes: run by this interpreter.
``run``
    Shell commands, run by bash in a temporary directory that holds the checkout's
    ``examples/`` and ``benchmarks/`` (``.venv/bin/`` is this interpreter's folder).
``output``
    What the run block before it printed: every line shown must come out, in order,
    numbers aside (timings differ from run to run). After a ``ci`` block, the command
    CI runs itself, ``.ci/run`` compares it with that run's output
    (``python tests/test_docs.py NAME LOG``, NAME ``main`` or ``test``).
``ci``
    One of the two commands of README.md, which ``.ci/run`` runs itself, verbatim.
``setup``
    ``pip install`` lines: parsed, and every extra they name installs nothing that the
    test command's extras do not (so this suite ran with what they install).
``fragment``
    Deliberately a part of a program (a signature, one call inside a loop): it must
    parse (Python by ``ast``, shell by ``bash -n``), and nothing more.

After a ``;``: ``cuda``, ``cluster`` or ``realmodel`` (the block's test carries that
marker: it skips where the hardware is missing) and ``timeout=S`` (seconds). Tools such
as Sphinx's doctest, pytest-examples or pytest-codeblocks run a block in one process;
none launches it on N ranks, so the blocks are found and run here.
"""

import ast
import configparser
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from launch import run
from mpi4py import MPI
from test_packaging import ci_commands

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
KINDS = ("run", "output", "ci", "setup", "fragment")
_RAN: dict = {}  # (mark, lang, text) of a run block -> its output
FLAGS = ("cuda", "cluster", "realmodel")


@dataclass
class Block:
    """One fenced code block of a page and its ``<!-- test: ... -->`` comment."""

    page: Path
    line: int  # the fence's line, 1-based
    lang: str
    text: str
    mark: str | None  # the comment's words, or None

    @property
    def name(self):
        """``page:line``: the block's test id."""
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def kind(self):
        """The first word of the mark: run, output, ci, setup or fragment."""
        return (self.mark or "").split(";")[0].split()[0] if self.mark else None

    @property
    def ranks(self):
        """N of ``run mpiexec -n N``, or None."""
        found = re.match(r"run mpiexec -n (\d+)\b", self.mark or "")
        return int(found.group(1)) if found else None

    @property
    def flags(self):
        """The words after the mark's ``;``: {flag or "timeout": value}."""
        rest = (self.mark or "").partition(";")[2]
        flags = {}
        for word in rest.split():
            key, _, value = word.partition("=")
            flags[key] = value
        return flags


def blocks(page):
    """Every fenced block of ``page`` but MyST directives (``{toctree}`` and the like)."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = re.match(r"^(`{3,})(\S*)", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith(fence.group(1)))
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mark = re.fullmatch(r"<!-- test: (.*?) -->", before.strip())
        if not fence.group(2).startswith("{"):
            text = "\n".join(lines[i + 1 : end]) + "\n"
            found.append(Block(page, i + 1, fence.group(2), text, mark and mark.group(1)))
        i = end + 1
    return found


ALL = [b for page in PAGES for b in blocks(page)]
# each output block with the run block before it on its page
OUTPUTS = {
    b.name: prev
    for page in PAGES
    for prev, b in zip(blocks(page), blocks(page)[1:], strict=False)
    if b.kind == "output"
}


def _marks(block):
    """The pytest markers of a block's flags (its ``timeout``: pytest's limit too)."""
    marks = [getattr(pytest.mark, flag) for flag in block.flags if flag in FLAGS]
    if block.flags.get("timeout"):
        marks.append(pytest.mark.timeout(int(block.flags["timeout"]) + 60))
    return marks


def _params(kinds):
    """pytest params of the blocks of ``kinds``, with their markers (an output: its run's)."""
    params = []
    for b in ALL:
        if b.kind in kinds:
            source = OUTPUTS.get(b.name, b)
            params.append(pytest.param(b, id=b.name, marks=_marks(b) + _marks(source)))
    return params


def test_every_block_says_how_it_is_tested():
    """Each block has a ``<!-- test: KIND -->`` comment of a known kind, with known flags."""
    for b in ALL:
        assert b.kind in KINDS, f"{b.name}: no '<!-- test: ... -->' of {KINDS} before the block"
        assert set(b.flags) <= {*FLAGS, "timeout"}, (b.name, b.flags)
        if b.kind == "run" and b.lang == "python":
            assert b.ranks or b.mark.split(";")[0].split() == ["run", "python"], (
                f"{b.name}: a Python program says 'run mpiexec -n N' or 'run python'"
            )
        if b.kind == "output":
            assert OUTPUTS[b.name].kind in ("run", "ci"), f"{b.name}: follows no run or ci block"


def _normal(line):
    """A line with its numbers as ``#`` and its spaces collapsed."""
    line = re.sub(r"[-+]?\d+(?:[.,]\d+)*(?:e[-+]?\d+)?", "#", line)
    return " ".join(line.split())


def _run_env(tmp_path):
    """A temporary directory set up as the checkout's root is for a reader; its env.

    Under Open MPI, as root, the two variables its ``mpiexec`` asks for (install.md).
    """
    for name in ("examples", "benchmarks"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def _for_this_mpi(text):
    """The commands as the page says to run them under this MPI (install.md, Open MPI).

    Open MPI's ``mpiexec`` refuses more ranks than cores without ``--oversubscribe``.
    """
    if "open mpi" not in MPI.Get_library_version().lower():
        return text
    return re.sub(r"\bmpiexec(?= )", "mpiexec --oversubscribe", text)


def _execute(block, tmp_path):
    """Run a ``run`` block (once per text: pages may show the same); return its output."""
    key = (block.mark, block.lang, block.text)
    if key not in _RAN:
        _RAN[key] = _run_block(block, tmp_path)
    return _RAN[key]


def _run_block(block, tmp_path):
    """Run a ``run`` block; return its stdout and stderr."""
    timeout = int(block.flags.get("timeout") or 240)
    if block.lang == "python" and block.ranks:
        (tmp_path / "example.py").write_text(block.text)
        proc = run(block.ranks, [sys.executable, "example.py"], timeout=timeout, cwd=tmp_path)
    elif block.lang == "python":
        (tmp_path / "example.py").write_text(block.text)
        proc = subprocess.run(
            [sys.executable, "example.py"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    else:
        env = _run_env(tmp_path)
        proc = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", _for_this_mpi(block.text)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{block.name} exited {proc.returncode}:\n{output[-3000:]}"
    for bad in ("Traceback", "MPI_Abort", "Fatal Python error"):
        assert bad not in output, f"{block.name} printed {bad}:\n{output[-3000:]}"
    return output


@pytest.mark.parametrize("block", _params(("run",)))
def test_run_blocks_run_as_pasted(block, tmp_path):
    """The program or commands run without an error (and print, as the next test checks)."""
    _execute(block, tmp_path)


def shown_lines_missing(shown, output):
    """Return the first line of ``shown`` not printed in ``output`` in order, or None."""
    got = [_normal(line) for line in output.splitlines()]
    at = 0
    for line in shown.splitlines():
        want = _normal(line)
        if not want:
            continue
        try:
            at = got.index(want, at) + 1
        except ValueError:
            return line
    return None


def _ci_name(block):
    """The name (main or test) of the CI command a ``ci`` block shows."""
    return next(n for n, c in ci_commands().items() if c == block.text.strip())


@pytest.mark.parametrize("block", _params(("output",)))
def test_output_blocks_are_what_the_run_printed(block, tmp_path):
    """Every shown line comes out of the run before it, in order (numbers aside)."""
    source = OUTPUTS[block.name]
    if source.kind == "ci":  # CI's own run of the command: .ci/run compares it
        name = _ci_name(source)
        assert f"tests/test_docs.py {name} " in (ROOT / ".ci" / "run").read_text(), block.name
        return
    output = _execute(source, tmp_path)
    missing = shown_lines_missing(block.text, output)
    assert missing is None, f"{block.name}: {missing!r} not printed by {source.name}:\n{output}"


@pytest.mark.parametrize("block", _params(("ci",)))
def test_ci_blocks_are_the_commands_ci_runs(block):
    """A ``ci`` block is one of the README's two commands, which .ci/run runs verbatim."""
    assert block.text.strip() in ci_commands().values(), block.name


def _extras():
    """setup.cfg's extras: {name: set of requirement names}."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = {}
    for name, value in cfg["options.extras_require"].items():
        extras[name] = {re.split(r"[<>=!~ ]", r.strip())[0] for r in value.split("\n") if r.strip()}
    return extras


@pytest.mark.parametrize("block", _params(("setup",)))
def test_setup_blocks_install_what_the_suite_ran_with(block):
    """``pip install -e ".[...]"`` lines name extras within the test command's."""
    check = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True)
    assert check.returncode == 0, (block.name, check.stderr)
    extras = _extras()
    tested = set().union(*(extras[e] for e in ("mpich", "test")))
    named = re.findall(r'pip install[^&\n]*-e "\.\[([\w,-]+)\]"', block.text)
    assert named, f"{block.name}: a setup block installs the package"
    for group in named:
        for extra in group.split(","):
            assert extras[extra] <= tested, (block.name, extra, extras[extra] - tested)


@pytest.mark.parametrize("block", _params(("fragment",)))
def test_fragments_parse(block):
    """A fragment is valid Python or shell."""
    if block.lang == "python":
        ast.parse(block.text, filename=block.name)
    else:
        check = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True)
        assert check.returncode == 0, (block.name, check.stderr)


def main(name, log):
    """Check every output block after the ``ci`` block of command ``name`` against ``log``."""
    shown = [
        b
        for b in ALL
        if b.kind == "output" and OUTPUTS[b.name].kind == "ci" and _ci_name(OUTPUTS[b.name]) == name
    ]
    output = Path(log).read_text()
    for block in shown:
        missing = shown_lines_missing(block.text, output)
        if missing is not None:
            sys.exit(f"{block.name}: {missing!r} is not in the output of CI's {name} command")
    print(f"docs: {len(shown)} output block(s) of CI's {name} command match its run")


if __name__ == "__main__":
    main(*sys.argv[1:])
