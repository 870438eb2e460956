"""What decode steps cost, counted for benchmarks: bytes handed to MPI, time per phase."""

from __future__ import annotations

import functools
import importlib
import sys
import threading
import time
from collections import defaultdict


class Traffic:
    """A running count of payload bytes passed to MPI calls by this rank.

    Counts what each strategy hands to MPI (the all-reduce buffer, the all-gather
    send buffer, every ring message), not what the MPI library's own algorithm
    then moves on the wire, which MPI does not report.

    Attributes
    ----------
    bytes : int
        Payload bytes handed to MPI since the last :meth:`reset`.
    calls : int
        MPI calls counted since the last :meth:`reset`.
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

    def __repr__(self):
        return f"Traffic(bytes={self.bytes}, calls={self.calls})"


traffic = Traffic()

# (module, owner of the callable or "" for a module function, attribute, phase); a module
# function is timed under each name a caller reaches it by (modules bind ``agree`` at import)
_POINTS = (
    ("mpitree._agreed", "", "agree", "agreement"),
    ("mpitree._decode_plan", "", "agree", "agreement"),  # a validating plan's step
    ("mpitree.extend", "", "agree", "agreement"),  # the adapters' agreements
    ("mpitree._merger", "Merger", "merge", "merge"),
    ("mpitree._merger", "Merger", "merge_layer", "layer"),  # merge; its kernel, collective
    ("mpitree._invariant_merger", "InvariantMerger", "merge", "merge"),
    ("mpitree._local", "", "attend_native", "kernel"),
    ("mpitree._kernel", "Prepared", "run", "kernel"),
    ("mpitree._kernel", "Prepared", "run_raw", "kernel"),
    ("mpitree._kernel", "BoundLayer", "fill", "kernel"),
    ("mpitree.adapters.transformers._attention", "LayerStep", "fill", "local"),
)
PHASES = ("agreement", "merge", "collective", "kernel", "local")

_lock = threading.Lock()  # guards the three below
_open = []  # the times dict of each open block, in the order they opened
_dicts = ()  # the distinct dicts of the open blocks: what a timed call appends to
_saved = []  # (owner, attribute, original) of every wrapper on, while a block is open
_depth = threading.local()  # per thread: the phases being timed now


def _append(phase, took):
    """Append ``took`` seconds to ``phase`` in every open block (never raises)."""
    for times in _dicts:  # dicts, checked on entry
        got = times.get(phase)
        if type(got) is list:
            got.append(took)
        else:
            times[phase] = [took]


def _timed(fn, phase):
    """Wrap ``fn``: an outermost call of ``phase`` appends its seconds to every open block."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        depth = _depth.__dict__
        if depth.get(phase):
            return fn(*args, **kwargs)
        depth[phase] = True
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            took = time.perf_counter() - start
            depth[phase] = False
            _append(phase, took)

    return wrapper


def _timed_layer(fn):
    """Wrap ``Merger.merge_layer``: a merge whose kernel and collective run in one C call.

    The compiled step times its kernel and its collective (with the flag) itself
    while ``call.timed`` is set; they count as those phases, the call as a merge.
    """
    merge = _timed(fn, "merge")

    @functools.wraps(fn)
    def wrapper(self, bound, out):
        call = bound.call
        call.timed, call.kernel_ns, call.collective_ns = 1, -1, -1
        try:
            return merge(self, bound, out)
        finally:
            call.timed = 0
            if call.kernel_ns >= 0:  # the compiled step ran (not the general path)
                _append("kernel", call.kernel_ns * 1e-9)
                _append("collective", call.collective_ns * 1e-9)

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


def _restore():
    """Put every wrapped callable back (under ``_lock``)."""
    while _saved:
        owner, attr, fn = _saved.pop()
        setattr(owner, attr, fn)


def phase_times(times=None):
    """Time the phases of mpitree calls made inside a ``with`` block (local, for benchmarks).

    While a block is open, each outermost call of a phase appends its duration
    in seconds to ``times[phase]``; a phase called inside itself counts once.
    The phases:

    - ``"agreement"``: a call's one agreement (its local checks and collective),
      a validating plan step's included, and an adapter's ``extend.agree``;
    - ``"merge"``: a merger's merge (local work, collective and bookkeeping),
      the ``deterministic="invariant"`` merger's included;
    - ``"collective"``: the merge strategy's collective with its failure flag
      (the invariant merger's collective counts in its ``"merge"`` only);
    - ``"kernel"``: the compiled local-attention kernel, its ctypes call included
      (a transformers layer's one compiled step, ``Merger.merge_layer``, times
      its kernel and its collective in C: there they are the C code's alone);
    - ``"local"``: a transformers layer's checked local step (when that adapter
      is imported before the first open block starts).

    Inside a block, a recurring one-shot call does not take its lane (one
    compiled call): it takes its guarded path, whose phases are these.

    Not timed: the sharded-prefill collectives (``allgather_rows``,
    ``reduce_scatter_records``), a ``flagged_allreduce`` outside a merger,
    numpy's local attention (no compiled kernel), and any of these reached
    through a name bound before the block started (``from mpitree.extend import
    agree`` in user code: use ``extend.agree``).

    The timers are put on when the first open block starts and taken off when
    the last one ends, in whatever order blocks end (a generator's block closed
    inside a later one, another thread's): outside every block, mpitree runs
    exactly the code it runs without this hook, so it costs nothing when unused.
    Inside, each timed call costs about a microsecond more. Blocks nest and may
    overlap: a timed call appends to every open block's dict once. Calls from
    every thread are timed; each thread's phases are counted on their own.

    Parameters
    ----------
    times : dict of str to list of float, optional
        Where to append; a new ``collections.defaultdict(list)`` if omitted.
        Checked here, before any timer is on (``TypeError``): a dict whose
        values for the phase names, where present, are lists. Other keys are
        left alone.

    Returns
    -------
    context manager
        Entering it puts the timers on (if no block is open) and gives
        ``times``; leaving it takes them off (if no other block is open).

    Raises
    ------
    TypeError
        If ``times`` is not a dict of lists.

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

    __slots__ = ("times",)

    def __init__(self, times=None):
        if times is None:
            times = defaultdict(list)
        elif not isinstance(times, dict):
            raise TypeError(f"mpitree: phase_times takes a dict, not {type(times).__name__}")
        bad = [p for p in PHASES if p in times and type(times[p]) is not list]
        if bad:
            raise TypeError(f"mpitree: phase_times needs lists at times{bad}")
        self.times = times

    def __enter__(self):
        global _dicts
        with _lock:
            if not _open:
                try:
                    for owner, attr, phase in _targets():
                        fn = vars(owner)[attr]
                        _saved.append((owner, attr, fn))
                        wrapped = _timed_layer(fn) if phase == "layer" else _timed(fn, phase)
                        setattr(owner, attr, wrapped)
                except BaseException:
                    _restore()
                    raise
            _open.append(self.times)
            _dicts = _distinct(_open)
        return self.times

    def __exit__(self, *exc):
        global _dicts
        with _lock:
            for i, times in enumerate(_open):
                if times is self.times:
                    del _open[i]
                    break
            else:
                raise RuntimeError("mpitree: a phase_times block left more often than entered")
            _dicts = _distinct(_open)
            if not _open:
                _restore()
        return False


def _distinct(dicts):
    """Return ``dicts`` without repeats (by identity), as a tuple."""
    seen = {}
    for times in dicts:
        seen.setdefault(id(times), times)
    return tuple(seen.values())
