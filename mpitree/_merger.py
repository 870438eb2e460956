"""The one merger object: a record buffer of one buffer kind, and its strategy's merge.

A :class:`Merger` is built once for a problem (rows, head dim, accumulation
dtype, strategy, the arrays' framework and device) and merges step after step
without allocating: plans own one, and one-shot calls, adapters and the
transformers cache share the mergers cached on their communicator
(:func:`merger_for`). Its buffer lives in the kind (``mpitree._buffers``) that
its strategy's declared ``buffers`` and the call's arrays pick; a call agrees on
that kind's name (:func:`buffer_kind`, in its local phase) before any merger is built.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

import numpy as np
from mpi4py import MPI

from ._buffers import kind_for, unserved
from ._guard import raise_failure
from ._invariant_merger import InvariantMerger
from ._namespace import namespace
from ._options import INVARIANT
from ._registry import AUTO
from ._runtime import before_comm_free, check_mpi_usable
from ._state import empty_records
from ._step_code import settle_code
from ._strategies import DETERMINISTIC, REGISTRY, free_requests
from ._traffic import hook

_CACHE_SIZE = 16
_keyval = None
_keyval_lock = threading.Lock()


#: every live merger's persistent requests: the id of its strategy's list -> the list
_REQUESTS = {}


def _free_requests(key):
    """Free one merger's persistent requests (its finalizer; local, never collective)."""
    free_requests(_REQUESTS.pop(key, []))


@before_comm_free
def _free_every_merger_requests():
    """At exit, free every live merger's requests before the private communicator goes."""
    for key in list(_REQUESTS):
        _free_requests(key)


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
        An array of the call (framework and device): with the strategy's declared
        ``buffers`` it picks the buffer kind (:func:`~._buffers.kind_for`). None:
        host records.

    Attributes
    ----------
    kind : mpitree._buffers.BufferKind
        The buffer's kind, allocated once: strategies read the buffer through it.
    buf : array
        ``(rows + 1, D + 2)``: the records, then the failure flag record, in the
        kind's memory (a numpy array for host memory).
    records : array
        ``buf[:rows]``: what ``local`` writes and, in host memory, what
        :meth:`merge` returns.

    Raises
    ------
    ValueError
        When no registered kind of the strategy's ``buffers`` serves ``like``
        (:func:`buffer_kind` raised it before the agreement already).
    """

    def __init__(
        self, comm, rows, head_dim, acc, strategy, *, node_size=0, persistent=True, like=None
    ):
        self.comm, self.strategy = comm, strategy
        cls = REGISTRY[strategy]
        kind = kind_for(cls.buffers, like)
        if kind is None:
            raise ValueError(unserved(strategy, cls.buffers, like))
        self.kind = kind((rows + 1, head_dim + 2), acc, like)
        self.buf = self.kind.buf
        self.records = self.buf[:rows]
        self._rows = rows if not kind.host_memory else None  # staged out after each merge
        self._impl = cls(self, node_size, persistent)
        # the finalizer holds the request list's key only, never the merger: dropping it
        # frees them (and so does the exit, before the private communicator goes)
        requests = self._impl.requests
        _REQUESTS[id(requests)] = requests
        self._finalizer = weakref.finalize(self, _free_requests, id(requests))

    def merge(self, local):
        """Fill this rank's records and merge them across ranks; return the merged records.

        Parameters
        ----------
        local : callable or object
            ``local(records)`` (or ``local.fill(records)``) writes this rank's
            ``(rows, D + 2)`` records, in place, into :attr:`records`: host memory
            (numpy), or the buffer kind's own arrays. It runs inside the guard:
            whatever it raises becomes this rank's verdict, carried by the merge
            collective.

        Returns
        -------
        numpy.ndarray
            ``(rows, D + 2)`` merged host records: this merger's buffer (or, for a
            kind not in host memory, its host mirror), valid until its next merge.

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
        rows = self._rows
        return self.records if rows is None else self.kind.output(rows)

    def bind_layer(self, bound):
        """Bind a compiled step (a plan's, a recurring call's, a layer's) to this merge.

        Parameters
        ----------
        bound : mpitree._steps.Bound
            Bound to this merger's records; this calls its ``bind_merge``.

        Returns
        -------
        bool
            Whether it could: where the records are float32 host memory and the
            strategy merges in one persistent all-reduce (or there is one rank).
            :meth:`merge_layer` then runs the whole step in one compiled call;
            otherwise it runs the step's local part inside :meth:`merge`, then
            finishes.
        """
        host = self.kind.host_memory and self.buf.dtype == np.float32
        collective = self._impl.bound_collective() if host else None
        if collective is None:
            return False
        bound.bind_merge(self, collective)
        return True

    def merge_layer(self, bound, out):
        """Run a bound step's local part, this merge and its output in one compiled call.

        For a step with no agreement (a plan's, a layer's): every code but ``OK``
        raises.

        Parameters
        ----------
        bound : mpitree._steps.Bound
            Bound to this merger's records; its step cannot fail locally, so this
            rank's flag is clear (a rank whose checks failed runs :meth:`merge`
            with its verdict instead: the same collective). Bound by
            :meth:`bind_layer`, it runs in one call; otherwise its local part
            runs inside :meth:`merge`, then it finishes.
        out : int
            Address of the float32 output in the step's bound layout, written on
            success.

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
        ref = bound.merger
        code = self._impl.reduce_bound(bound, out) if ref is not None and ref() is self else None
        if code is None:  # unbound, or freed: the general path (as a merge after free runs)
            check_mpi_usable()  # the one call asks MPI_Finalized; so must its replacement
            self.merge(bound)
            bound.finish(out)
        elif code:  # no agreement is bound: every code but OK raises
            settle_code(code, self.comm, bound.struct)

    def _clocked_layer(self, observer, bound, out):
        """:meth:`merge_layer` with the compiled step's own clock on (``call.timed``).

        Its kernel's and collective's nanoseconds go to ``observer`` where the
        one compiled call ran (the general path leaves them at -1: its kernel
        reports itself).
        """
        call = bound.struct
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
        kind, dtype = self.kind.name, self.kind.host.dtype
        return f"Merger({self.strategy!r}, rows={rows}, D={width - 2}, {dtype}, {kind})"


def buffer_kind(merge, like, dtype=None):
    """Return the name of the buffer kind a call's merger will hold; raise if there is none.

    Runs in a call's local phase, before its agreement (``_agreed``): a strategy
    that cannot serve the call's arrays is then this rank's verdict, raised on every
    rank, and the name goes into the agreed signature, so that no two ranks build
    mergers of different kinds.

    Parameters
    ----------
    merge : tuple or None
        A call's ``(rows, head_dim, acc, options)`` (``Call.merge``).
    like : array or None
        The call's array (framework and device); None for host records.
    dtype : dtype or str, optional
        The dtype a call without arrays was given (a plan's without ``like=``), for the error.

    Returns
    -------
    str or None
        The kind's name; ``"host"`` where the strategy is picked after the
        agreement (``"auto"``: every strategy it may pick merges in host memory)
        or invariant mode's; None for a call that merges nothing.

    Raises
    ------
    ValueError
        When no registered kind of the strategy's ``buffers`` serves ``like``.
    """
    if merge is None:
        return None
    opts = merge[3]
    strategy = opts.strategy
    if opts.deterministic == INVARIANT or strategy == AUTO:
        return "host"
    if opts.deterministic and not REGISTRY[strategy].reproducible:
        strategy = DETERMINISTIC
    buffers = REGISTRY[strategy].buffers
    kind = kind_for(buffers, like)
    if kind is None:
        raise ValueError(unserved(strategy, buffers, like, dtype))
    return kind.name


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
