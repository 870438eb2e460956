"""Phase timers for benchmarks: ``extend.phase_times``, an observer on the phase hook."""

from __future__ import annotations

import threading
import time
from collections import defaultdict

from ._traffic import PHASES, hook

_lock = threading.Lock()  # guards the two below and the hook's slot
_open = []  # the times dict of each open block, in the order they opened
_dicts = ()  # the distinct dicts of the open blocks: where a phase's seconds go


class _Observer:
    """What :data:`~._traffic.hook` holds while a block is open: the clock and the nesting."""

    __slots__ = ("_started",)

    def __init__(self):
        self._started = threading.local()  # per thread: phase -> its open call's start

    def enter(self, phase):
        """Open ``phase`` on this thread unless it is open there; whether it opened it."""
        started = self._started.__dict__
        if phase in started:
            return False
        started[phase] = time.perf_counter()
        return True

    def timed(self, phase, fn, *args):
        """Return ``fn(*args)``, then close the ``phase`` :meth:`enter` opened (raising too)."""
        try:
            return fn(*args)
        finally:
            took = time.perf_counter() - self._started.__dict__.pop(phase)
            self.took(phase, took)

    def took(self, phase, seconds):
        """Append ``seconds`` to ``phase`` in every open block (never raises)."""
        for times in _dicts:  # dicts, checked on entry
            got = times.get(phase)
            if type(got) is list:
                got.append(seconds)
            else:
                times[phase] = [seconds]


_OBSERVER = _Observer()


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
    - ``"local"``: a transformers layer's checked local step.

    Inside a block, a recurring one-shot call does not run its bound step (one
    compiled call): it takes its guarded path, whose phases are these.

    Not timed: the sharded-prefill collectives (``allgather_rows``,
    ``reduce_scatter_records``), a ``flagged_allreduce`` outside a merger, and
    numpy's local attention (no compiled kernel).

    The code times itself: each of those calls asks the phase hook whether a
    block is open (one read compared to None: all it costs outside every
    block) and only then reports its phase. The first open block puts the
    timers on and the last one to end takes them off, in whatever order blocks
    end (a generator's block closed inside a later one, another thread's);
    nothing of mpitree is replaced or wrapped. Inside, each timed call costs
    about a microsecond more. Blocks nest and may overlap: a timed call appends
    to every open block's dict once. Calls from every thread are timed; each
    thread's phases are counted on their own.

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
            dicts = _distinct([*_open, self.times])
            _open.append(self.times)
            _dicts = dicts
            hook.observer = _OBSERVER
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
                hook.observer = None
        return False


def _distinct(dicts):
    """Return ``dicts`` without repeats (by identity), as a tuple."""
    seen = {}
    for times in dicts:
        seen.setdefault(id(times), times)
    return tuple(seen.values())
