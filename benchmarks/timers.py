"""The call timer that the per-layer decode benchmarks wrap around an attention call.

Imported by ``decode_overhead.py`` and ``tree_verify.py``; it imports no mpitree, so a
benchmark can time any tree with it.
"""

from __future__ import annotations

import time


def timed(name, fn, times):
    """Wrap ``fn`` so each call's duration in seconds is appended to ``times()[name]``.

    ``times`` is called after each call, so a benchmark can switch the dict it fills
    (one per variant timed).
    """

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times()[name].append(time.perf_counter() - start)

    wrapper.__wrapped__ = fn
    return wrapper
