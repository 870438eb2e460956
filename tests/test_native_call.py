"""``mpitree._native_call``: the CPython entry of a later decode layer's compiled step.

``_library.bind_call`` binds a compiled ``int fn(args *, void *out)`` to its ctypes
struct, through that entry where it was built, else through ctypes. Either way the
bound callable keeps the struct alive and reports what the function returns; the
entry refuses arguments it cannot use with a Python exception, never a crash.
"""

import ctypes
import gc

import pytest

from mpitree import _library
from mpitree._kernel import _lib

lib = _lib()
pytestmark = pytest.mark.skipif(lib is None, reason="the compiled library is not built")


@pytest.fixture(params=["cpython", "ctypes"])
def way(request, monkeypatch):
    """Bind through the CPython entry, then through ctypes."""
    if _library._native_call is None:
        pytest.fail("mpitree._native_call was not built: the suite must run its path")
    if request.param == "ctypes":
        monkeypatch.setattr(_library, "_native_call", None)
    return request.param


def test_the_bound_step_keeps_its_struct_alive_and_returns_the_functions_code(way):
    """A struct with no merge bound: the step returns 3 (nothing ran), after the struct's
    last other reference is gone."""
    step = _library.bind_call(lib.mpitree_step_run, _library.StepArgs())
    gc.collect()
    assert step(0) == 3
    held = step.args[-1]
    assert isinstance(getattr(held, "_obj", held), _library.StepArgs)


@pytest.mark.parametrize(
    "args, error",
    [
        ((1, 2), TypeError),  # two arguments
        ((None, _library.StepArgs(), 0), TypeError),  # fn not an int
        ((0, _library.StepArgs(), 0), ValueError),  # fn NULL
        ((1, 7, 0), TypeError),  # the layer exports no buffer
        ((1, bytes(ctypes.sizeof(_library.StepArgs)), 0), BufferError),  # read-only
        ((1, bytearray(1), 0), ValueError),  # not the struct's size
        ((1, _library.StepArgs(), "out"), TypeError),  # out not an int
    ],
    ids=["arity", "fn type", "fn null", "not a buffer", "read-only", "size", "out type"],
)
def test_the_cpython_entry_refuses_what_it_cannot_call(args, error):
    """Each refusal is a Python exception, raised before any call (the addresses themselves
    it cannot check: like ctypes, it calls what they name)."""
    if _library._native_call is None:
        pytest.fail("mpitree._native_call was not built: the suite must run its path")
    with pytest.raises(error):
        _library._native_call(*args)
