"""setup.py: a C extension is compiled once per set of inputs, then reused."""

import importlib.util
from pathlib import Path

import pytest
from setuptools import Distribution, Extension

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def setup_module():
    """The checkout's setup.py as a module (its ``setup()`` runs only as a script)."""
    spec = importlib.util.spec_from_file_location("mpitree_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(module, tmp_path, source):
    """Run the setup's build_ext on one tiny extension; return the built file."""
    dist = Distribution({"name": "tiny", "ext_modules": [Extension("tiny", [str(source)])]})
    cmd = module.CachedBuildExt(dist)
    cmd.build_lib, cmd.build_temp = str(tmp_path / "lib"), str(tmp_path / "tmp")
    cmd.ensure_finalized()
    cmd.run()
    (built,) = (tmp_path / "lib").glob("tiny*")
    return built


def test_unchanged_sources_are_not_compiled_again(setup_module, tmp_path, monkeypatch, capsys):
    """The second build of the same inputs copies the first; a changed source compiles."""
    monkeypatch.setenv("MPITREE_BUILD_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "tiny.c"
    source.write_text("int tiny(void) { return 1; }\n")
    first = _build(setup_module, tmp_path, source).read_bytes()
    assert "mpitree: compiling tiny from tiny.c" in capsys.readouterr().out
    assert len(list((tmp_path / "cache").iterdir())) == 1

    next((tmp_path / "lib").glob("tiny*")).unlink()
    again = _build(setup_module, tmp_path, source).read_bytes()
    assert "sources unchanged, reusing" in capsys.readouterr().out
    assert again == first

    source.write_text("int tiny(void) { return 2; }\n")
    _build(setup_module, tmp_path, source)
    assert "mpitree: compiling tiny" in capsys.readouterr().out
    assert len(list((tmp_path / "cache").iterdir())) == 2


def test_the_flags_are_part_of_the_key(setup_module, tmp_path, monkeypatch, capsys):
    """Other CFLAGS (another build of the same sources) compile anew."""
    monkeypatch.setenv("MPITREE_BUILD_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "tiny.c"
    source.write_text("int tiny(void) { return 1; }\n")
    _build(setup_module, tmp_path, source)
    monkeypatch.setenv("CFLAGS", "-DMPITREE_TEST_FLAG=1")
    _build(setup_module, tmp_path, source)
    assert capsys.readouterr().out.count("mpitree: compiling tiny") == 2
