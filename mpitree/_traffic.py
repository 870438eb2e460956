"""What decode steps cost, counted for benchmarks: bytes handed to MPI, time per phase."""

from __future__ import annotations

import functools
import importlib
import sys
import time
from collections import defaultdict


class Traffic:
    """A running count of payload bytes passed to MPI calls by this rank.

    Counts what each strategy hands to MPI (the all-reduce buffer, the all-gather
    send buffer, every ring message), not what the MPI library's own algorithm
    then moves on the wire, which MPI does not report.
    """

    __slots__ = ("bytes", "calls")

    def __init__(self):
        self.bytes = 0
        self.calls = 0

    def add(self, nbytes):
        """Record one MPI call carrying ``nbytes``."""
        self.bytes += int(nbytes)
        self.calls += 1

    def reset(self):
        """Zero the counts."""
        self.bytes = self.calls = 0


traffic = Traffic()

# (module, owner of the callable or "" for a module function, attribute, phase)
_POINTS = (
    ("mpitree._agreed", "", "agree", "agreement"),
    ("mpitree._merger", "Merger", "merge", "merge"),
    ("mpitree._local", "", "attend_native", "kernel"),
    ("mpitree._kernel", "Prepared", "run", "kernel"),
    ("mpitree._kernel", "Prepared", "run_raw", "kernel"),
    ("mpitree._kernel", "BoundLayer", "fill", "kernel"),
    ("mpitree.adapters.transformers._attention", "LayerStep", "fill", "local"),
)


def _timed(fn, phase, times, depth):
    """Wrap ``fn``: an outermost call of ``phase`` appends its seconds to ``times[phase]``."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if depth[phase]:
            return fn(*args, **kwargs)
        depth[phase] = 1
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times.setdefault(phase, []).append(time.perf_counter() - start)
            depth[phase] = 0

    return wrapper


def _targets():
    """Yield (owner, attribute, phase) of every timed callable whose module is loaded."""
    for module, owner, attr, phase in _POINTS:
        if module.startswith("mpitree.adapters") and module not in sys.modules:
            continue  # an adapter not in use: nothing of it runs
        mod = importlib.import_module(module)
        yield (getattr(mod, owner) if owner else mod), attr, phase
    registry = importlib.import_module("mpitree._strategies").REGISTRY
    for cls in registry.values():  # every strategy's collective, with its failure flag
        if "reduce" in vars(cls):
            yield cls, "reduce", "collective"


def phase_times(times=None):
    """Time the phases of mpitree calls made inside a ``with`` block (local, for benchmarks).

    While the block runs, each outermost call of a phase appends its duration in
    seconds to ``times[phase]``; a phase called inside itself counts once. The
    phases:

    - ``"agreement"``: a call's one agreement (its local checks and collective);
    - ``"merge"``: a merger's merge (local work, collective and bookkeeping);
    - ``"collective"``: the merge strategy's collective with its failure flag;
    - ``"kernel"``: the compiled local-attention kernel, its ctypes call included;
    - ``"local"``: a transformers layer's checked local step (when that adapter
      is imported before the block starts).

    The timers are put on when the block starts and taken off when it ends:
    outside a block, mpitree runs exactly the code it runs without this hook, so
    it costs nothing when unused. Inside, each timed call costs about a
    microsecond more. Not thread-safe: use it around single-threaded loops.

    Parameters
    ----------
    times : dict of str to list of float, optional
        Where to append; a new ``collections.defaultdict(list)`` if omitted. Other
        keys in it are left alone.

    Returns
    -------
    context manager
        Entering it puts the timers on and gives ``times``; leaving it takes them off.

    Examples
    --------
    >>> with extend.phase_times() as times:           # doctest: +SKIP
    ...     plan.decode(q, k, v)
    >>> sorted(times)                                  # doctest: +SKIP
    ['collective', 'kernel', 'merge']
    """
    return _PhaseTimes(times)


class _PhaseTimes:
    """The context manager of :func:`phase_times`."""

    def __init__(self, times=None):
        self.times = defaultdict(list) if times is None else times
        self._saved = []

    def __enter__(self):
        depth = defaultdict(int)
        for owner, attr, phase in _targets():
            fn = getattr(owner, attr)
            self._saved.append((owner, attr, fn))
            setattr(owner, attr, _timed(fn, phase, self.times, depth))
        return self.times

    def __exit__(self, *exc):
        while self._saved:
            owner, attr, fn = self._saved.pop()
            setattr(owner, attr, fn)
        return False
