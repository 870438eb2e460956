"""The one merger object: record buffer, strategy (op, persistent request) and host staging.

A :class:`Merger` is built once for a problem (rows, head dim, accumulation
dtype, strategy) and merges step after step without allocating: plans own one,
and one-shot calls, adapters and the transformers cache share the mergers
cached on their communicator (:func:`merger_for`).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

import numpy as np
from mpi4py import MPI

from ._guard import raise_failure
from ._invariant_merger import InvariantMerger
from ._namespace import namespace
from ._options import INVARIANT
from ._runtime import check_mpi_usable
from ._state import empty_records
from ._step_code import settle_code
from ._strategies import REGISTRY, free_requests
from ._traffic import hook

_CACHE_SIZE = 16
_keyval = None
_keyval_lock = threading.Lock()


class Merger:
    """Merges ``(rows, D + 2)`` records across ``comm`` with one strategy, reusably.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        Checked and agreed on by the caller.
    rows, head_dim : int
        Records to merge and ``D``.
    acc : str
        Accumulation dtype name, "float32" or "float64".
    strategy : str
        A resolved strategy name (not ``"auto"``).
    node_size : int
        Virtual node size for ``"hierarchical"`` (0: real nodes).
    persistent : bool
        Use a persistent request where the strategy and MPI support one.
    like : array, optional
        A device array whose records are staged through this merger's host
        buffer (allocated page-locked for CUDA).
    """

    def __init__(
        self, comm, rows, head_dim, acc, strategy, *, node_size=0, persistent=True, like=None
    ):
        self.comm, self.strategy = comm, strategy
        shape = (rows + 1, head_dim + 2)
        if like is None:
            self.buf = np.empty(shape, dtype=np.dtype(acc))
        else:
            self.buf = namespace(like).pinned_empty(shape, acc, like)
        self.records = self.buf[:rows]
        self._impl = REGISTRY[strategy](self, node_size, persistent)
        # the finalizer holds the request list only, never the merger: dropping it frees them
        self._finalizer = weakref.finalize(self, free_requests, self._impl.requests)

    def merge(self, local):
        """Fill this rank's records and merge them across ranks; return the merged records.

        Parameters
        ----------
        local : callable or object
            ``local(records)`` (or ``local.fill(records)``) writes this rank's
            ``(rows, D + 2)`` host records. It runs inside the guard: whatever it
            raises becomes this rank's verdict, carried by the merge collective.

        Returns
        -------
        numpy.ndarray
            ``(rows, D + 2)`` merged records: this merger's buffer, valid until
            its next merge.

        Raises
        ------
        Exception
            On every rank when any rank's local work failed.

        Notes
        -----
        Under an observer on the phase hook (:data:`~._traffic.hook`), the
        call is its ``"merge"`` phase and the strategy's collective (with the
        failure flag) its ``"collective"``.
        """
        observer = hook.observer
        if observer is not None and observer.enter("merge"):
            return observer.timed("merge", self.merge, local)
        error = None
        try:
            getattr(local, "fill", local)(self.records)
        except Exception as exc:  # the verdict rides in the merge collective
            error = exc
            empty_records(self.records)
        failed = error is not None
        if observer is not None and observer.enter("collective"):
            failed = observer.timed("collective", self._impl.reduce, local, failed)
        else:
            failed = self._impl.reduce(local, failed)
        if failed:
            error = error if error is not None else self._impl.error
            self._impl.error = None
            raise_failure(self.comm, error)
        return self.records

    def bind_layer(self, bound):
        """Bind a layer's one-call step to this merge.

        Parameters
        ----------
        bound : mpitree._kernel.BoundLayer
            Bound to this merger's records.

        Returns
        -------
        bool
            Whether it could: where the records are float32 and the strategy
            merges in one persistent all-reduce (or there is one rank).
            :meth:`merge_layer` then runs the layer's whole step in one
            compiled call; otherwise it runs the kernel inside :meth:`merge`,
            then finishes.
        """
        collective = self._impl.bound_collective() if self.buf.dtype == np.float32 else None
        if collective is None:
            return False
        bound.bind_merge(self, collective)
        return True

    def merge_layer(self, bound, out):
        """Run a bound layer's kernel, this merge and its output in one compiled call.

        Parameters
        ----------
        bound : mpitree._kernel.BoundLayer
            Bound to this merger's records; its step cannot fail locally, so this
            rank's flag is clear. Bound by :meth:`bind_layer`, it runs in one
            call; otherwise its kernel runs inside :meth:`merge`, then it finishes.
        out : int
            Address of the float32 ``(B, Sq, Hq, D)`` output, written on success.

        Raises
        ------
        Exception
            On every rank when any rank's local work failed (its flag rode the
            merge); ``mpi4py.MPI.Exception`` where an MPI call returned an error;
            ``RuntimeError`` once MPI is finalized (the one call asks first).

        Notes
        -----
        Under an observer on the phase hook (:data:`~._traffic.hook`), the
        call is its ``"merge"`` phase, and the one compiled call times its
        kernel and its collective (with the flag) on its own clock: they are
        its ``"kernel"`` and ``"collective"``.
        """
        observer = hook.observer
        if observer is not None and observer.enter("merge"):
            return observer.timed("merge", self._clocked_layer, observer, bound, out)
        code = self._impl.reduce_bound(bound, out) if bound.merger is self else None
        if code is None:  # unbound, or freed: the general path (as a merge after free runs)
            check_mpi_usable()  # the one call asks MPI_Finalized; so must its replacement
            self.merge(bound)
            bound.finish(out)
        elif code:  # a layer binds no agreement: every code but OK raises
            settle_code(code, self.comm, bound.call)

    def _clocked_layer(self, observer, bound, out):
        """:meth:`merge_layer` with the compiled step's own clock on (``call.timed``).

        Its kernel's and collective's nanoseconds go to ``observer`` where the
        one compiled call ran (the general path leaves them at -1: its kernel
        reports itself).
        """
        call = bound.call
        call.timed, call.kernel_ns, call.collective_ns = 1, -1, -1
        try:
            self.merge_layer(bound, out)
        finally:
            call.timed = 0
            if call.kernel_ns >= 0:
                observer.took("kernel", call.kernel_ns * 1e-9)
                observer.took("collective", call.collective_ns * 1e-9)

    def free(self):
        """Release the merger's MPI resources now (otherwise when it is collected)."""
        self._finalizer()

    @property
    def alive(self):
        """Whether the merger can still merge (not freed, nor evicted from its cache)."""
        return self._finalizer.alive

    def __repr__(self):
        rows, width = self.records.shape
        return f"Merger({self.strategy!r}, rows={rows}, D={width - 2}, {self.buf.dtype})"


def _staging(like):
    """Return the kind of host buffer ``like``'s records need: None for host arrays."""
    if like is None:
        return None
    ns = namespace(like)
    return None if ns.name == "numpy" else ns.device(like)


class _Cache(OrderedDict):
    """A communicator's mergers (key -> merger), built over its private duplicate ``inner``.

    A persistent request holds its communicator, and MPICH runs a communicator's
    delete callbacks only once nothing holds it: requests on the user's
    communicator kept it, and its mergers, past its ``Free`` for good.
    """

    def __init__(self, inner):
        super().__init__()
        self.inner = inner


def _delete(comm, keyval, cache):
    """Attribute delete callback: free the cached mergers, then their communicator."""
    for merger in cache.values():
        merger.free()
    cache.clear()
    if not MPI.Is_finalized():
        cache.inner.Free()


def cache_key(rows, head_dim, acc, strategy, node_size=0, like=None):
    """Return the key of a merger in its communicator's cache (see :func:`merger_for`)."""
    return (rows, head_dim, acc, strategy, node_size, _staging(like))


def merger_for(comm, rows, head_dim, acc, strategy, node_size=0, like=None):
    """Return the merger cached on ``comm`` for this problem, building it on first use.

    ``strategy="invariant"`` gives an :class:`~._invariant_merger.InvariantMerger`.

    Collective on first use (a persistent request, a node split; the first on
    ``comm`` duplicates it: the mergers work over the duplicate, so that freeing
    ``comm`` frees them); call it only after the agreement, with agreed
    arguments, on every rank. At most 16 mergers are kept per communicator
    (least recently used dropped).
    """
    global _keyval
    if _keyval is None:
        with _keyval_lock:
            if _keyval is None:
                _keyval = MPI.Comm.Create_keyval(delete_fn=_delete)
    cache = comm.Get_attr(_keyval)
    if cache is None:
        cache = _Cache(comm.Dup())
        comm.Set_attr(_keyval, cache)
    key = cache_key(rows, head_dim, acc, strategy, node_size, like)
    merger = cache.get(key)
    if merger is None and strategy == INVARIANT:
        merger = cache[key] = InvariantMerger(cache.inner, rows, head_dim, acc)
    elif merger is None:
        merger = cache[key] = Merger(
            cache.inner, rows, head_dim, acc, strategy, node_size=node_size, like=like
        )
        if len(cache) > _CACHE_SIZE:
            cache.popitem(last=False)[1].free()
    cache.move_to_end(key)
    return merger
