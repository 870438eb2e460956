"""Bytes this rank hands to MPI in decode steps, counted by the strategies themselves."""


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
