"""The one guarded path from a public entry point into MPI.

Every public function that communicates is decorated with :func:`entry_point`
and reaches MPI in two kinds of step, both here or behind :class:`~._merger.Merger`:

1. :func:`agree`, the one agreement collective. It runs all of the call's local
   checks and preparation (``prepare()``: validation, option resolution, the
   native op) inside a ``try``, then one ``MPI_Allreduce(MIN)`` of a fixed-size
   int64 vector carries this rank's verdict, the call's signature and the facts
   the ranks must share (the native op). Nothing that can fail on some ranks
   only runs between it and the data collective.
2. A data collective that carries a failure flag (a flag record in the merge
   buffer, :func:`flagged_allreduce` for plain arrays): the local work of the
   step (attention over the shard) runs inside a ``try`` before it, and a
   failure on any rank reaches every rank in the same collective.

When any rank failed, every rank calls :func:`raise_failure`: one more small
collective, on the failure path only, hands every rank the lowest failing
rank's reason. The failing rank raises its own exception; the others raise
:class:`RankError`. Nothing hangs, and MPI never aborts inside a reduction.
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import struct
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from ._op import native_op_available, record_op
from ._runtime import check_mpi_usable, default_comm
from ._strategies import op_needed
from ._traffic import hook, traffic

ENTRY_POINTS: dict = {}  # "module.qualname" -> the public function or method
_entry = contextvars.ContextVar("mpitree_entry", default=None)


class RankError(ValueError):
    """Raised on the ranks whose own input was fine when another rank's input was not.

    Attributes
    ----------
    rank : int
        The lowest rank whose local checks or local work failed.
    reason : str
        That rank's exception, as ``"TypeName: message"``.
    """

    def __init__(self, rank, reason):
        self.rank, self.reason = rank, reason
        super().__init__(f"mpitree: invalid input on rank {rank}: {reason}")


def entry_point(fn=None, *, lane=None):
    """Mark ``fn`` as a public entry point that communicates; register it for the catalogue.

    The outermost entry point of a call first checks that MPI can be used at all
    (:func:`check_mpi_usable`): after ``MPI.Finalize()`` any MPI call aborts the
    process from inside the MPI library.

    A ``lane`` (``@entry_point(lane=...)``) is tried first, with the same
    arguments, before all that: its result is the call's unless it is None, when
    the guarded ``fn`` runs (as it does when the arguments do not fit the lane's
    signature, which is ``fn``'s: ``fn`` raises the ``TypeError``). A lane raises
    nothing before its collective and reaches MPI only through a compiled call
    that asks ``MPI_Finalized`` itself. It is for a call whose checks an earlier
    agreement made: a decode layer's one compiled call after its step's first
    layer agreed, or a plan's step after the plan agreed (:meth:`Merger.merge_layer`:
    no agreement), or a recurring one-shot call's bound step (``_steps.Step``: the
    same agreement as ``fn``'s, in C).
    """
    if fn is None:
        return functools.partial(entry_point, lane=lane)
    name = f"{fn.__module__}.{fn.__qualname__}"

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        outer = _entry.get()
        if outer is None:
            check_mpi_usable()
        token = _entry.set(outer or name)
        try:
            return fn(*args, **kwargs)
        finally:
            _entry.reset(token)

    if lane is not None:
        guarded = wrapper

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                out = lane(*args, **kwargs)
            except TypeError as exc:
                if exc.__traceback__.tb_next is not None:
                    raise  # raised inside the lane, not by binding its arguments
                out = None  # arguments that fit no call: the guarded function says why
            return guarded(*args, **kwargs) if out is None else out

    ENTRY_POINTS[name] = wrapper
    return wrapper


def current_entry():
    """Return the outermost entry point running in this context; raise if there is none."""
    name = _entry.get()
    if name is None:
        raise RuntimeError("mpitree internal error: a collective outside an @entry_point")
    return name


def check_comm(comm):
    """Return ``comm`` (default: mpitree's private one) if it is a usable intracommunicator.

    This is the one check that cannot be agreed on, since agreeing needs the
    communicator: every rank must pass a valid one (a wrong one raises
    ``TypeError`` locally, on the ranks that passed it).
    """
    comm = default_comm() if comm is None else comm
    if isinstance(comm, MPI.Intracomm) and comm == MPI.COMM_NULL:
        raise TypeError("comm is MPI.COMM_NULL (freed, or never made): no live intracommunicator")
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"comm must be an mpi4py intracommunicator, got {comm!r}")
    return comm


def _describe(error):
    """One line naming an exception (its type alone if its ``str`` fails: never raise here)."""
    try:
        return f"{type(error).__name__}: {error}"
    except Exception:  # a str() that raises must not keep this rank from the all-gather
        return f"{type(error).__name__} (its message could not be formatted)"


def raise_failure(comm, error):
    """Raise on every rank after a collective reported a failure (failure path only).

    Collective: every rank learns from the preceding collective that some rank
    failed, so every rank calls this. The failing ranks re-raise their own
    exception; the others raise :class:`RankError` naming the lowest failing rank.
    """
    mine = None if error is None else _describe(error)
    reasons = comm.allgather(mine) if comm.Get_size() > 1 else [mine]
    if error is not None:
        raise error
    failed = [r for r, reason in enumerate(reasons) if reason is not None]
    if not failed:
        raise RuntimeError("mpitree internal error: a failure was flagged but no rank failed")
    raise RankError(failed[0], reasons[failed[0]])


_CODES: dict = {}


def _code(value):
    """Return a process-independent 56-bit code of a signature value (type included)."""
    key = (type(value), value.hex() if isinstance(value, float) else value)  # -0.0 != 0.0
    try:
        return _CODES[key]
    except (KeyError, TypeError):
        data = repr((type(value).__name__, value)).encode()
        code = int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little")
        if len(_CODES) < 4096:
            try:
                _CODES[key] = code
            except TypeError:  # unhashable values are coded afresh each time
                pass
        return code


@dataclass
class Call:
    """What ``prepare()`` hands to :func:`agree`.

    Attributes
    ----------
    signature : dict
        Field name -> value (int, float, str, bool, None or tuples of them) that
        every rank must agree on.
    payload : object
        Anything the entry point needs afterwards (validated arrays, options).
    op : tuple or None
        ``(accumulation dtype name, record width)`` of the native MPI op the call
        will need; it is created inside the guarded local phase. Default: the op
        ``merge`` needs, if any.
    native : bool
        After :func:`agree`: whether every rank has the compiled op (a shared fact).
    key : hashable or None
        A key that determines ``signature`` and ``op`` exactly (types and signs of
        zero included): :func:`agree` then encodes them once per key and entry point.
    counts : dict or None
        Field name -> int in ``[0, 2**62)`` that every rank must agree on too but
        that changes from call to call (a cache's length): kept out of ``key``, so
        a recurring call keeps its encoding and only these are coded afresh.
    merge : tuple or None
        ``(rows, head_dim, acc, options)``: the merger the call needs after the
        agreement (an :class:`Options` names its strategy,
        determinism and node size), which :func:`agree_merger`
        resolves and returns; None for a call that merges nothing.
    sent : bytes or None
        After :func:`agree`: the agreement vector this rank sent, which every rank
        sent too (a recurring call's bound step sends it again, from C).
    """

    signature: dict
    payload: object = None
    op: tuple | None = None
    native: bool = field(default=True)
    key: object = None
    merge: tuple | None = None
    counts: dict | None = None
    sent: bytes | None = None

    def __post_init__(self):
        if self.op is None and self.merge is not None:
            _, head_dim, acc, opts = self.merge
            self.op = op_needed(opts.strategy, opts.deterministic, acc, head_dim)


_OK = 1 << 62  # an agreement's verdict slot on a rank whose local phase passed
# the agreement's four int64 (verdict, native op, code, -code), packed in a plain buffer and
# sent as MPI_INT64_T: no array library on the path of a call that agrees
_VECTOR = struct.Struct("=4q")
_encoded: dict = {}  # (entry point, Call.key) -> _Encoding
ENTRY_FIELD = "entry point"  # the agreed field that names the call itself


def _fields(entry, signature, counts=None):
    """Return the fields ranks agree on, name -> value: the call's, its signature, its counts.

    The one list of the agreement's fields: :class:`_Encoding` codes them in this
    order and a disagreement names them from it (:func:`_raise_disagreement`).
    """
    return {ENTRY_FIELD: entry, **signature, **(counts or {})}


class _Encoding:
    """A call's signature (:func:`_fields` less the counts) as one agreement code."""

    __slots__ = ("native", "sent", "whole")

    def __init__(self, fields, op):
        if op is not None:
            record_op(*op)
        self.native = int(native_op_available())
        self.whole = _code(tuple(_code(v) for v in fields.values()))
        self.sent = self._pack(self.whole)  # without counts

    def vector(self, counts):
        """Return the agreement's packed vector, with ``counts`` mixed into the code."""
        if not counts:
            return self.sent
        whole = self.whole
        for value in counts.values():
            whole = _mix(whole, _count(value))
        return self._pack(whole)

    def _pack(self, whole):
        """Return the vector of a rank whose local phase passed, for the code ``whole``."""
        return _VECTOR.pack(_OK, self.native, whole, -whole)


_MASK64 = (1 << 64) - 1


def _mix(code, value):
    """Return a 56-bit code of a 56-bit ``code`` followed by ``value`` (an int in [0, 2**62)).

    splitmix64's finalizer of ``code * phi + value`` (mod 2**64): an injective
    start and a bijection, so each bit of either input flips about half of the
    code's; pure integer arithmetic, the same in every process.
    """
    x = (code * 0x9E3779B97F4A7C15 + value) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 8


def _count(value):
    """Return a :attr:`Call.counts` value as its own code (it must be an int in [0, 2**62))."""
    if type(value) is not int or not 0 <= value < _OK:
        raise RuntimeError(f"mpitree internal error: a count must be an int >= 0, got {value!r}")
    return value


def _encoding(entry, call):
    """Return the call's :class:`_Encoding`, cached under ``call.key`` when it has one."""
    if call.key is None:
        return _Encoding(_fields(entry, call.signature), call.op)
    key = (entry, call.key)
    found = _encoded.get(key)
    if found is None:
        found = _Encoding(_fields(entry, call.signature), call.op)
        if len(_encoded) < 4096:
            _encoded[key] = found
    return found


def agree(comm, prepare):
    """Run ``prepare()`` locally, then agree on its verdict and signature in one collective.

    The collective is an ``MPI_Allreduce(MIN)`` of four int64: the verdict
    (the lowest failing rank), whether the native op is there, and a 56-bit code
    of the whole signature (its counts included) and its negation. When the codes
    differ between ranks, one more collective (failure path only) names the
    fields that differ. The whole call is the ``"agreement"`` phase of an observer on
    the phase hook (:data:`~._traffic.hook`).

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        A communicator checked by :func:`check_comm`.
    prepare : callable
        Returns a :class:`Call`. Any exception it raises becomes this rank's
        verdict.

    Returns
    -------
    Call
        With ``native`` set to the agreed fact.

    Raises
    ------
    Exception
        On every rank: the failing rank's own exception there, :class:`RankError`
        elsewhere; ``ValueError`` naming the fields when ranks disagree.
    """
    observer = hook.observer
    if observer is not None and observer.enter("agreement"):
        return observer.timed("agreement", agree, comm, prepare)
    entry = current_entry()
    error = call = enc = None
    try:
        call = prepare()
        enc = _encoding(entry, call)
        sent = enc.vector(call.counts)
    except Exception as exc:  # every local failure becomes this rank's verdict
        error = exc
        sent = _VECTOR.pack(comm.Get_rank(), 0, 0, 0)
    if comm.Get_size() == 1:
        if error is not None:
            raise_failure(comm, error)
        call.native, call.sent = bool(enc.native), sent  # one rank: its own verdict, codes, op
        return call
    buf = bytearray(sent)
    comm.Allreduce(MPI.IN_PLACE, [buf, MPI.INT64_T], op=MPI.MIN)
    if error is None and buf == sent:
        call.native, call.sent = bool(enc.native), sent  # every rank sent the same
        return call
    return settle(comm, entry, call, error, buf)


def settle(comm, entry, call, error, got):
    """Finish an agreement whose result ``got`` is not this rank's vector; return the call.

    Collective where a rank failed or ranks disagree (every rank learns so from
    ``got``): raises on every rank as :func:`agree` does, naming the fields from
    ``entry`` and ``call`` (:func:`_fields`). Otherwise only the native-op fact
    differs: ``call.native`` is set to the agreed one.
    """
    verdict, native, low, negated = _VECTOR.unpack(got)
    if verdict != _OK:
        raise_failure(comm, error)
    if low != -negated:
        _raise_disagreement(comm, _fields(entry, call.signature, call.counts))
    call.native = bool(native)  # the agreed fact (a rank without the op sent 0)
    return call


def _raise_disagreement(comm, fields):
    """Raise on every rank: ranks agreed on different fields (failure path: one allgather).

    Each rank sends each field's name, code and ``repr``; a field differs where
    ranks hold different codes for it, or where some ranks have it and others
    do not. Ranks in different calls (``ENTRY_FIELD`` differs) are named for that
    alone: their other fields do not compare.
    """
    mine = {name: (_code(value), repr(value)) for name, value in fields.items()}
    every = comm.allgather(mine)
    names = dict.fromkeys(name for rank in every for name in rank)  # in order, each once
    differ = [n for n in names if len({rank[n][0] if n in rank else None for rank in every}) > 1]
    if ENTRY_FIELD in differ:
        differ = [ENTRY_FIELD]
    if not differ:
        raise RuntimeError("mpitree internal error: signature codes differ but no field does")
    detail = "; ".join(f"{name}: {_holders(every, name)}" for name in differ)
    raise ValueError(f"mpitree: ranks disagree on {', '.join(differ)} ({detail})")


def _holders(every, name):
    """Return which ranks hold which value of ``name``: ``"rank 0 has 8, ranks 1-2 have 16"``."""
    groups: dict = {}  # code -> (shown, [ranks]), in order of the lowest rank
    for r, rank in enumerate(every):
        code, shown = rank.get(name, (None, f"no {name}"))
        groups.setdefault(code, (shown, []))[1].append(r)
    parts = []
    for shown, ranks in groups.values():
        many = len(ranks) > 1
        parts.append(f"rank{'s' * many} {_spans(ranks)} {'have' if many else 'has'} {shown}")
    return ", ".join(parts)


def _spans(ranks):
    """Return ascending ``ranks`` as ``"0-2, 5"``."""
    spans = []
    for r in ranks:
        if spans and spans[-1][1] == r - 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in spans)


def flagged_allreduce(comm, values, op, error):
    """Allreduce a float array with a built-in ``op`` (MAX or SUM), carrying a failure flag.

    ``values`` is this rank's contribution (ignored when ``error`` is set).
    Returns the reduced array; raises on every rank if any rank failed.
    """
    values = np.asarray(values)
    buf = np.zeros(values.size + 1, dtype=np.float64 if values.dtype == np.float64 else np.float32)
    if error is None:
        buf[:-1] = values.reshape(-1)
    else:
        buf[:-1] = -np.inf if op == MPI.MAX else 0
    buf[-1] = 1 if error is not None else 0
    if comm.Get_size() > 1:
        traffic.add(buf.nbytes)
        comm.Allreduce(MPI.IN_PLACE, buf, op=op)
    if buf[-1] > 0:
        raise_failure(comm, error)
    return buf[:-1].reshape(values.shape)
