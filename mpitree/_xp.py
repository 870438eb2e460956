"""Array-namespace dispatch: numpy, or CuPy for CuPy arrays, without importing CuPy first."""

import sys

import numpy as np


def namespace(*arrays):
    """Return the array module of ``arrays``: cupy if any is a CuPy array, else numpy."""
    for x in arrays:
        if type(x).__module__.split(".")[0] == "cupy":
            return sys.modules["cupy"]  # loaded: it made the array
    return np
