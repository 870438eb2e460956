"""The guarded-call recipe, written once: agree, resolve the strategy, get its merger."""

from __future__ import annotations

import dataclasses
import weakref
from collections import OrderedDict

from . import _merger
from ._guard import agree
from ._invariant_merger import InvariantMerger
from ._merger import Merger, _staging, buffer_kind, cache_key, merger_for
from ._options import INVARIANT
from ._strategies import resolve

_recent: OrderedDict = OrderedDict()  # id(merge) -> _Kept: the last few shared mergers
_RECENT_SIZE = 8
# the last (signature, merge) pair :func:`with_merge_fields` found complete (nothing to add)
_complete = [None, None]


class _Kept:
    """A shared merger kept for an agreed ``merge`` tuple, and its place in its comm's cache.

    A call that repeats an agreed ``merge`` tuple (a kept template's, step after
    step, or in turn with others) skips resolve and merger_for, but marks the
    merger used in the cache as merger_for does (:meth:`touch`). The merger is
    held weakly: the cache alone keeps it, so a freed communicator's or an
    evicted merger's buffers are not kept here.
    """

    __slots__ = ("cache", "comm", "key", "merge", "merger", "native")

    def __init__(self, comm, merge, native, merger, cache, key):
        self.comm, self.merge, self.native = comm, merge, native
        self.merger, self.cache, self.key = weakref.ref(merger), cache, key

    def touch(self):
        """Mark the merger used in its communicator's cache (as :func:`merger_for` does)."""
        self.cache.move_to_end(self.key)


def kept(call):
    """Return the :class:`_Kept` of an agreed ``call``'s merger, or None if none is kept."""
    return _recent.get(id(call.merge))


def agree_merger(comm, prepare, *, like=None, owned=False, dtype=None):
    """Run a call's one agreement, then resolve its strategy and get its merger.

    Every entry point that merges takes this path: ``prepare()`` runs the local
    checks and returns a :class:`Call` whose ``merge`` names the merger
    it needs (its ``op`` follows from it, inside the guard); :func:`agree`
    runs the one agreement collective; then every rank resolves the agreed
    strategy (``"auto"`` with the agreed native-op fact and the options' node
    size; ``deterministic="invariant"`` gives the canonical-tree merger) and
    gets the same merger. Nothing between the agreement and the merger can
    raise on some ranks only.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        A communicator checked by :func:`check_comm`.
    prepare : callable
        Returns a :class:`Call`; any exception it raises becomes this
        rank's verdict in the agreement.
    like : array, optional
        An array of the call's framework and device (a one-shot call's q, a plan's
        ``like=``): with the strategy's declared ``buffers`` it picks the merger's
        buffer kind, where the records of such arrays live. None for numpy.
    owned : bool, optional
        Build a merger that only the caller holds (a plan frees it with itself)
        instead of the one cached on ``comm`` (:func:`merger_for`).
    dtype : dtype or str, optional
        For a call given a dtype and no arrays (a plan without ``like=``): named,
        as given, in the error where the strategy's buffer kinds cannot serve its
        host records.

    Returns
    -------
    call : Call
        The agreed call (``native`` set).
    merger : Merger or InvariantMerger or None
        Its merger over ``call.merge = (rows, head_dim, acc, options)``; None
        when ``call.merge`` is None. ``merger.strategy`` is the strategy that runs.

    Raises
    ------
    Exception
        On every rank, as :func:`agree` raises.
    """
    call = agree(comm, _staged(prepare, like, dtype))
    return call, agreed_merger(comm, call, like=like, owned=owned)


def _staged(prepare, like, dtype=None):
    """Wrap ``prepare``: its call's signature also names how ``like``'s records are staged.

    A merger is cached per staging (host, or the framework's device) and holds a
    buffer of the kind its strategy and the arrays pick (:func:`buffer_kind`,
    which raises here, in the local phase, where no registered kind serves them), so
    ranks whose arrays live in different places, or that pick different kinds, would
    look up different mergers: one rank building one (a collective) while another
    starts its cached one would hang. Agreed, they raise. The device's index is not
    agreed: each rank may use its own.
    """

    def staged():
        call = with_merge_fields(prepare())
        buffer = buffer_kind(call.merge, like, dtype)
        kind = _staging(like)
        if kind is None and buffer in (None, "host"):
            return call
        fields = {"buffer": buffer}
        if kind is not None:
            kind = (kind[0], str(kind[1]).split(":")[0]) if kind[0] == "torch" else kind[:1]
            fields["staging"] = kind
        key = None if call.key is None else (call.key, kind, buffer)
        return dataclasses.replace(call, signature={**call.signature, **fields}, key=key)

    return staged


def with_merge_fields(call):
    """Return ``call`` with what its merger depends on agreed too, where its signature lacks it.

    The merger is built from ``call.merge``: ranks whose ``(rows, head_dim, acc)``
    or options (strategy, determinism, node size...) differ would build different
    mergers and wait in different collectives. An entry point's signature usually
    names them (a :class:`Problem`'s, with its ``head_dim``, and the options'); an
    adapter's that does not still has them agreed (a call's key determines its
    ``merge`` as it does its signature): each option it lacks, and the merge's
    sizes where it names no ``head_dim``. An adapter's kept template that has them
    already (the transformers layer's, made complete with this once) costs one
    identity test a call.
    """
    if call.merge is None or (call.signature is _complete[0] and call.merge is _complete[1]):
        return call
    rows, head_dim, acc, opts = call.merge
    signature = call.signature
    agreed = opts.signature()
    if "head_dim" not in signature:
        agreed["merge"] = (rows, head_dim, acc)
    missing = {name: value for name, value in agreed.items() if name not in signature}
    if not missing:
        # held (so neither id is reused): a kept template's next call skips the look
        _complete[:] = signature, call.merge
        return call
    return dataclasses.replace(call, signature={**signature, **missing})


def agreed_merger(comm, call, *, like=None, owned=False):
    """Return the merger of an agreed ``call`` (:func:`agree_merger` after its agreement)."""
    if call.merge is None:
        return None
    last = _recent.get(id(call.merge))
    merger = None if last is None else last.merger()
    if (
        merger is not None
        and last.merge is call.merge
        and last.comm is comm
        and last.native == call.native
        and like is None
        and not owned
        and merger.alive
    ):
        # a rank may reuse it where another (whose last call was on another communicator)
        # looks it up: both mark it used, so every rank's cache evicts the same merger
        last.touch()
        return merger
    rows, head_dim, acc, opts = call.merge
    if opts.deterministic == INVARIANT:
        if owned:
            return InvariantMerger(comm, rows, head_dim, acc)
        return merger_for(comm, rows, head_dim, acc, INVARIANT)
    chosen = resolve(opts.strategy, comm, call.native, opts.node_size, opts.deterministic)
    if owned:
        return Merger(comm, rows, head_dim, acc, chosen, node_size=opts.node_size, like=like)
    merger = merger_for(comm, rows, head_dim, acc, chosen, opts.node_size, like)
    if like is None:
        _remember(comm, call, merger, cache_key(rows, head_dim, acc, chosen, opts.node_size))
    return merger


def _remember(comm, call, merger, key):
    """Keep ``merger`` as the one for ``call.merge`` on ``comm`` (until it is freed)."""
    found = id(call.merge)
    cache = comm.Get_attr(_merger._keyval)
    _recent[found] = _Kept(comm, call.merge, call.native, merger, cache, key)
    _recent.move_to_end(found)
    if len(_recent) > _RECENT_SIZE:
        _recent.popitem(last=False)
