"""``mpitree/_library.py``'s mirrors of ``_native.h``, checked against the header itself.

A tiny C program compiled against ``_native.h`` with the library's own compiler flags
prints each mirrored struct's size and every field's offset and size, and each enum's
values; they must be the ctypes mirror's, so a field added, moved or retyped on one
side only fails here, not as a misread struct at run time.
"""

import ctypes
import math
import os
import re
import shlex
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from mpitree import _library, _state

ROOT = Path(__file__).resolve().parents[1]
HEADER = ROOT / "mpitree" / "_native.h"
STRUCTS = {"mpitree_attn_args": _library.AttnArgs, "mpitree_step": _library.StepArgs}
ENUMS = {  # C enum -> (its members' prefix, the Python mirror)
    "mpitree_code": ("MPITREE_", _library.StepCode),
    "mpitree_local": ("MPITREE_LOCAL_", _library.StepLocal),
    "mpitree_output": ("MPITREE_OUTPUT_", _library.StepOutput),
}


def fields(struct, prefix="", base=0):
    """Yield ``(C member designator, offset, size)`` of every field of ctypes ``struct``,
    nested structs' fields included."""
    for name, kind in struct._fields_:
        offset = base + getattr(struct, name).offset
        yield prefix + name, offset, ctypes.sizeof(kind)
        if issubclass(kind, ctypes.Structure):
            yield from fields(kind, f"{prefix}{name}.", offset)


def compile_flags():
    """The compiler and flags the library builds with: Python's CC and CFLAGS (or $CC, as
    setuptools takes it), then pyproject.toml's extra-compile-args."""
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    flags = shlex.split(sysconfig.get_config_var("CFLAGS") or "")
    flags += shlex.split(sysconfig.get_config_var("CCSHARED") or "")
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^extra-compile-args = \[(.*?)\]", text, re.M | re.S)
    assert block, "pyproject.toml names no extra-compile-args"
    return cc, flags + re.findall(r'"([^"]+)"', block.group(1))


def header_enum(name):
    """The member names of ``enum name`` as the header spells them."""
    body = re.search(rf"enum {name} \{{(.*?)\}};", HEADER.read_text(), re.S)
    assert body, f"_native.h defines no enum {name}"
    return re.findall(r"^\s*(MPITREE_\w+) = ", body.group(1), re.M)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """What the C program printed: ``{(kind, name...): values}``."""
    cc, flags = compile_flags()
    if shutil.which(cc[0]) is None:  # CI has gcc, and fails on any skip
        pytest.skip(f"no C compiler ({cc[0]}) to check _native.h's layouts with")
    lines = ["#include <math.h>", "#include <stddef.h>", "#include <stdio.h>"]
    lines.append('#include "_native.h"')
    lines.append("int main(void)\n{")
    for c_name, struct in STRUCTS.items():
        lines.append(f'    printf("size {c_name} %zu\\n", sizeof({c_name}));')
        for field, _, _ in fields(struct):
            lines.append(
                f'    printf("field {c_name} {field} %zu %zu\\n", offsetof({c_name}, {field}),'
                f" sizeof((({c_name} *)0)->{field}));"
            )
    for c_name in ENUMS:
        for member in header_enum(c_name):
            lines.append(f'    printf("enum {c_name} {member} %d\\n", (int){member});')
    lines.append('    printf("define MPITREE_STATUS_WORDS %d\\n", MPITREE_STATUS_WORDS);')
    for macro in ("MPITREE_REC_M", "MPITREE_REC_D", "MPITREE_REC_N", "MPITREE_REC_WIDTH(7)"):
        lines.append(f'    printf("define {macro} %d\\n", (int)({macro}));')
    lines.append('    printf("define MPITREE_FLAG_CLEAR %d\\n", MPITREE_FLAG_CLEAR == -INFINITY);')
    lines.append("    return 0;\n}\n")
    work = tmp_path_factory.mktemp("layouts")
    (work / "layouts.c").write_text("\n".join(lines))
    argv = [*cc, *flags, "-I", str(HEADER.parent), "layouts.c", "-o", "layouts"]
    built = subprocess.run(argv, cwd=work, capture_output=True, text=True)
    assert built.returncode == 0, f"{shlex.join(argv)}:\n{built.stderr}"
    ran = subprocess.run([str(work / "layouts")], capture_output=True, text=True, check=True)
    return parse(ran.stdout)


def parse(stdout):
    """``{(kind, name, ...): (int, ...)}`` of the program's lines."""
    out = {}
    for line in stdout.splitlines():
        words = line.split()
        kind = words[0]
        width = 2 if kind == "field" else 1
        out[tuple(words[: len(words) - width])] = tuple(int(w) for w in words[-width:])
    return out


@pytest.mark.parametrize("c_name", sorted(STRUCTS))
def test_struct_mirror_matches_the_header(compiled, c_name):
    """Every field's offset and size, and the struct's size, as the compiler lays it out."""
    struct = STRUCTS[c_name]
    assert compiled[("size", c_name)] == (ctypes.sizeof(struct),)
    for field, offset, size in fields(struct):
        assert compiled[("field", c_name, field)] == (offset, size), field


@pytest.mark.parametrize("c_name", sorted(ENUMS))
def test_enum_mirror_matches_the_header(compiled, c_name):
    """The same members, with the same values, on both sides."""
    prefix, mirror = ENUMS[c_name]
    members = header_enum(c_name)
    assert [m[len(prefix) :] for m in members] == [code.name for code in mirror]
    for code in mirror:
        assert compiled[("enum", c_name, prefix + code.name)] == (code.value,)


def test_status_room_matches_the_header(compiled):
    """The int64 words of room for one MPI_Status."""
    assert compiled[("define", "MPITREE_STATUS_WORDS")] == (_library.STATUS_WORDS,)


def test_record_layout_matches_the_python_definition(compiled):
    """The C record layout macros are _state.py's: m, d, n offsets, width, the clear flag."""
    assert compiled[("define", "MPITREE_REC_M")] == (_state.M,)
    assert compiled[("define", "MPITREE_REC_D")] == (_state.D,)
    assert compiled[("define", "MPITREE_REC_N")] == (_state.N.start,)
    assert compiled[("define", "MPITREE_REC_WIDTH(7)")] == (_state.width(7),)
    assert compiled[("define", "MPITREE_FLAG_CLEAR")] == (1,) and _state.FLAG_CLEAR == -math.inf


def test_the_loaded_library_was_built_from_these_sources():
    """The loaded library's structs are its ctypes mirrors' sizes (so is ``_native_call``'s
    step, where built); a library whose sizes differ (built from other sources, a stale
    editable install) is refused with a message saying to rebuild, never run."""
    lib = _library.native_lib()
    if lib is None:
        pytest.skip(f"no compiled library: {_library.load_error()}")
    assert lib.mpitree_struct_size(0) == ctypes.sizeof(_library.StepArgs)
    assert lib.mpitree_struct_size(1) == ctypes.sizeof(_library.AttnArgs)
    if _library._native_call is not None:
        assert _library._CALL_STEP_SIZE == ctypes.sizeof(_library.StepArgs)


def test_a_library_built_from_other_sources_is_refused(monkeypatch):
    if _library.library_path() is None:
        pytest.skip("no compiled library to load")

    class Longer(_library.StepArgs):  # the mirror of a struct one field longer
        _fields_ = (("later", ctypes.c_int64),)

    monkeypatch.setattr(_library, "StepArgs", Longer)
    lib, error = _library._load()
    assert lib is None and "was built from other sources" in error and "rebuild" in error, error
