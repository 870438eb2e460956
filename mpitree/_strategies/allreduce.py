"""``allreduce``: one MPI_Allreduce of the records with the native (m, d, n) user op."""

from __future__ import annotations

from mpi4py import MPI

from .._library import STATUS_WORDS, address
from .._op import record_op
from .._runtime import mpi_calls
from .._traffic import traffic
from . import Strategy, register, set_flag

_EMPTY = float("-inf")

# Open MPI 5.0 retains ~17 KB per freed persistent all-reduce request (measured: 4000
# Allreduce_init/Free cycles in plain mpi4py grew RSS by 67 MB; MPICH: 0 MB), and a
# persistent request measured no faster than a blocking call here: use blocking ones.
_PERSISTENT_OK = "open mpi" not in MPI.Get_library_version().lower()


@register
class Allreduce(Strategy):
    """One all-reduce (a persistent ``MPI_Allreduce_init`` request where MPI has it)."""

    name = "allreduce"
    order = 0
    summary = "one MPI_Allreduce of the records with the native (m, d, n) user op"
    label = "allreduce, {op} op"
    uses_op = True
    persistent = True
    auto_priority = 1

    @classmethod
    def auto_fits(cls, size, native, nodes, ranks_per_node, ring_library):
        """With the native op, anywhere (``hierarchical`` goes first where it fits)."""
        return native

    def __init__(self, merger, node_size=0, persistent=True):
        super().__init__(merger, node_size, persistent)
        self._request = None
        buf = self.host
        self._flag = buf[-1]  # the flag record: m set each merge, d and n stay 0
        set_flag(buf, False)
        self._nbytes = buf.nbytes
        self._many = self.comm.Get_size() > 1
        if not self._many:
            return
        rec, self._op = record_op(buf.dtype, buf.shape[1])
        self._spec = [buf, buf.shape[0], rec]
        if persistent and _PERSISTENT_OK:
            try:
                self._request = self.comm.Allreduce_init(MPI.IN_PLACE, self._spec, self._op)
                self.requests.append(self._request)
            except (RuntimeError, MPI.Exception):  # MPI < 4 has no persistent collectives
                self._request = None

    def bound_collective(self):
        """Return ``(MPI_Finalized, MPI_Start, MPI_Wait, request, flag)`` addresses, or None.

        For a compiled step, which asks ``MPI_Finalized`` first, then starts and
        waits on the persistent request itself: all three take pointers only. A
        blocking all-reduce is not handed over (its handles' ABI differs between
        MPIs). With one rank: no collective (start, wait and request None).
        """
        flag = address(self._flag)
        if self._many and self._request is None:
            return None
        calls = mpi_calls(STATUS_WORDS * 8 if self._many else None)
        if calls is None:
            return None
        start, wait, finalized, _ = calls
        if not self._many:
            return finalized, None, None, None, flag
        return finalized, start, wait, MPI._addressof(self._request), flag

    def reduce_bound(self, bound, out):
        """Run a step bound to :meth:`bound_collective`; return its code (None: freed)."""
        if self._many:
            if not self.requests:  # freed with the merger: the handle is no longer valid
                return None
            traffic.add(self._nbytes)
        return bound.run(out)

    def reduce(self, local, failed):
        """One all-reduce of records and flag (a merged flag record keeps d = n = 0)."""
        flag = self._flag
        flag[0] = 1.0 if failed else _EMPTY
        if self._many:
            traffic.add(self._nbytes)
            request = self._request
            if request is not None and self.requests:
                request.Start()
                request.Wait()
            else:
                self.comm.Allreduce(MPI.IN_PLACE, self._spec, self._op)
        return flag.item(0) != _EMPTY
