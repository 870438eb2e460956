"""What decode steps cost, as the code reports it: bytes handed to MPI, and the phase hook.

The bottom of the package: it imports nothing of mpitree. Strategies and
:func:`~._guard.flagged_allreduce` count their bytes in :data:`traffic`; the
timed sites (the agreement, the mergers, the kernel calls, a transformers
layer's checked local step) read :attr:`PhaseHook.observer` of :data:`hook`
and, only where one is there, report their phases to it. The tools that
observe (``extend.phase_times``) live on the package's top floor
(``mpitree._timers``) and set the hook; nothing here knows them.
"""

from __future__ import annotations


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

#: The phases a timed site reports (see ``extend.phase_times`` for what each covers).
PHASES = ("agreement", "merge", "collective", "kernel", "local")


class PhaseHook:
    """The one slot the timed sites read: ``observer``, None unless a tool observes.

    Each timed site reads ``hook.observer`` once and compares it to None; that
    is all it costs when nothing observes. Where an observer is there, the site
    reports to it through three methods (the observer keeps the clock, the
    nesting and where the seconds go):

    - ``observer.enter(phase) -> bool``: open ``phase`` on this thread; False
      when it is open there already (a phase called inside itself counts once),
      and then the site runs as it would unobserved;
    - ``observer.timed(phase, fn, *args)``: return ``fn(*args)``, then (also
      when it raises) close the ``phase`` that :meth:`enter` opened: its
      seconds are reported. A site passes itself as ``fn``: the call inside
      finds the phase open and runs the site's own code;
    - ``observer.took(phase, seconds)``: report seconds measured elsewhere
      (the compiled layer step's own clock).

    None of them raises. Only the tools set ``observer``; no timed code does.

    Attributes
    ----------
    observer : object or None
        The observer while one is on, else None.
    """

    __slots__ = ("observer",)

    def __init__(self):
        self.observer = None

    def __repr__(self):
        return f"PhaseHook(observer={self.observer!r})"


hook = PhaseHook()
