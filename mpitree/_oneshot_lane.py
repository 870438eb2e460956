"""``allreduce_state``'s lane: a recurring call's agreement and merge in one compiled call.

A guarded :func:`~._oneshot.allreduce_state` whose call recurs (a ``State`` of the
same shape and dtype, the same options, on the same communicator) leaves a
:class:`_Lane`: the agreement vector that :func:`~._guard.agree` sent for it, and
its merger's persistent all-reduce. A later such call runs in the entry point's
lane (:func:`~._guard.entry_point`): one compiled call
(``_native_oneshot.c``) makes the same agreement collective with the same vector,
and only if every rank sent it, the merge. Ranks on the lane and ranks on the
guarded path make the same collectives in the same order. Where the agreement's
result differs (a rank failed its checks, ranks disagree, or the native op is
not everywhere), :func:`~._guard.settle` finishes it as :func:`~._guard.agree`
would have. Anything the lane cannot look up without raising sends the call to
the guarded path before any collective.
"""

from __future__ import annotations

import ctypes
import dataclasses
import weakref

import numpy as np
from mpi4py import MPI

from ._agreed import _recent, agreed_merger
from ._guard import _encoding, _entry, raise_failure, settle
from ._library import OneShotArgs, address, native_lib
from ._recurring import _options_key
from ._runtime import FINALIZED, mpi_calls
from ._state import State, trusted_state
from ._traffic import traffic

_lanes: dict = {}  # (id of the comm argument, records shape, dtype, options key) -> _Lane
_LANES_SIZE = 16
_HANDLE_BYTES = {MPI._sizeof(MPI.Comm), MPI._sizeof(MPI.Datatype), MPI._sizeof(MPI.Op)}


class _Lane:
    """What a recurring ``allreduce_state`` needs to run in one compiled call."""

    __slots__ = (
        "args",
        "cache",
        "cache_key",
        "call",
        "comm",
        "comm_arg",
        "enc",
        "entry",
        "merger",
        "sent",
    )

    def __init__(self, comm_arg, comm, entry, call, enc, merger, collective, cached):
        self.comm_arg, self.comm, self.entry = comm_arg, comm, entry
        self.call, self.enc = call, enc
        # held weakly, as agree_merger's kept mergers are: a freed communicator's or an
        # evicted merger's buffers are not kept here
        self.merger, self.cache, self.cache_key = (
            weakref.ref(merger),
            weakref.ref(cached[0]),
            cached[1],
        )
        finalized, start, wait, request, flag = collective
        args = self.args = OneShotArgs()
        args.finalized, args.start, args.wait, args.request, args.flag = (
            finalized,
            start,
            wait,
            request,
            flag,
        )
        args.records, args.nbytes = address(merger.records), merger.records.nbytes
        args.sent[:] = np.frombuffer(enc.sent, np.int64).tolist()
        self.sent = merger.buf.nbytes if start is not None else 0  # bytes counted per merge
        if start is not None:
            args.allreduce = mpi_calls()[3]
            args.handle_bytes = MPI._sizeof(MPI.Comm)
            args.comm = ctypes.c_int64(MPI._handleof(comm)).value
            args.int64_type = ctypes.c_int64(MPI._handleof(MPI.INT64_T)).value
            args.min_op = ctypes.c_int64(MPI._handleof(MPI.MIN)).value


def keep_lane(comm_arg, comm, call, merger, records, entry):
    """After a guarded ``allreduce_state``: keep its lane, where its recurrence can take one.

    It can where the compiled library is there, the call has a key, it is the
    outermost entry point (its agreement vector names it), every rank has the
    native op, and the merger merges float32 records in one persistent all-reduce
    (or there is one rank).
    """
    key = (id(comm_arg), records.shape, records.dtype, call.key[2])
    lane = _lanes.get(key)
    if lane is not None and lane.merger() is merger and lane.comm_arg is comm_arg:
        return
    enc = _encoding(entry, call)
    last = _recent.get(id(call.merge))
    if (
        native_lib() is None
        or _entry.get() != entry
        or not call.native
        or enc.native != call.native
        or merger.buf.dtype != np.float32
        or len(_HANDLE_BYTES) != 1
        or last is None
        or last[3]() is not merger
    ):
        return
    collective = merger._impl.bound_collective()
    if collective is None or (collective[1] is not None and mpi_calls()[3] is None):
        return
    if len(_lanes) >= _LANES_SIZE:
        _lanes.clear()
    _lanes[key] = _Lane(comm_arg, comm, entry, call, enc, merger, collective, last[4:6])


def state_lane(state, comm=None, strategy="auto", *, deterministic=False, node_size=None):
    """``allreduce_state`` in one compiled call where its lane is kept; else None."""
    try:
        records = state.records if type(state) is State else None
        lane = _lanes.get(
            (
                id(comm),
                records.shape,
                records.dtype,
                _options_key(strategy, None, deterministic, node_size),
            )
        )
        if (
            lane is None
            or lane.comm_arg is not comm
            or _entry.get() is not None
            or type(records) is not np.ndarray
            or not records.flags.c_contiguous
        ):
            return None
        merger, cache = lane.merger(), lane.cache()
        if merger is None or cache is None or not merger.alive:
            return None
        cache.move_to_end(lane.cache_key)  # marked used, as the guarded path marks it
        out = np.empty(records.shape, np.float32)
        source, target = address(records), address(out)
    except Exception:  # nothing has communicated: the guarded path decides
        return None
    if lane.sent:
        traffic.add(lane.sent)
    code = _merge(lane.args, source, target)
    if code:
        return _settled(lane, merger, code, records)
    return trusted_state(out)


def _merge(args, source, target):
    """Run the compiled call (a module-level name, so that a test can count its calls)."""
    return native_lib().mpitree_oneshot_merge_f32(args, source, target)


def _settled(lane, merger, code, records):
    """Finish the lane's call after a nonzero code: raise on every rank, or merge as agreed."""
    if code == 1:
        raise_failure(merger.comm, None)
    if code == 2:
        raise MPI.Exception(lane.args.mpi_error)
    if code == 4:
        raise RuntimeError(FINALIZED)
    if code != 5:
        raise RuntimeError(f"mpitree internal error: allreduce_state's lane returned {code}")
    got = bytes(lane.args.got)
    call = settle(lane.comm, lane.entry, dataclasses.replace(lane.call), lane.enc, None, got)
    return merged_state(agreed_merger(lane.comm, call), call.merge[0], records)


def merged_state(merger, rows, records):
    """Return a new :class:`State` of ``records`` ``(..., D + 2)`` merged by ``merger``."""

    def fill(out):
        out[...] = records.reshape(rows, -1)

    return trusted_state(merger.merge(fill).reshape(records.shape).copy())
