"""The one-shot calls' lanes: a recurring call's agreement and merge in one compiled call.

A guarded :func:`~._oneshot.allreduce_state` or :func:`~._oneshot.tree_decode`
whose call recurs (the same shapes, strides, dtype and options, on the same
communicator) leaves a :class:`_Lane`: the agreement vector that
:func:`~._guard.agree` sent for it, its merger's persistent all-reduce, and for
``tree_decode`` the bound kernel. A later such call runs in the entry point's lane
(:func:`~._guard.entry_point`): one compiled call (``_native_step.c``'s step, with
its agreement bound) makes the same agreement collective with the same vector and,
only if every rank sent it, this rank's records (the state's, or the kernel's over
the shard) and the merge.
Ranks on the lane and ranks on the guarded path make the same collectives in the
same order. Where the agreement's result differs (a rank failed its checks, ranks
disagree, or the native op is not everywhere), :func:`~._guard.settle` finishes it
as :func:`~._guard.agree` would have. Anything the lane cannot look up without
raising sends the call to the guarded path before any collective. As a plan's bound
kernel does, a lane keeps the kernel chosen when it was kept (``MPITREE_LOCAL_KERNEL``
is read then).
"""

from __future__ import annotations

import ctypes
import dataclasses
import weakref

import numpy as np
from mpi4py import MPI

from ._agreed import _recent, agreed_merger
from ._guard import _encoding, _entry, settle
from ._kernel import Prepared
from ._library import StepArgs, StepCode, StepLocal, StepOutput, address, bind_call, native_lib
from ._recurring import _options_key
from ._runtime import mpi_calls
from ._state import State, finish, trusted_state
from ._step import KernelSlot, _layout
from ._step_code import settle_code
from ._traffic import hook, traffic

_lanes: dict = {}  # (id of the comm argument, layout, options key) -> _Lane
_seen: dict = {}  # the keys of calls seen once: a lane is kept when one comes again
_LANES_SIZE = 16
_HANDLE_BYTES = {MPI._sizeof(MPI.Comm), MPI._sizeof(MPI.Datatype), MPI._sizeof(MPI.Op)}
_MERGED = int(StepCode.MERGE_ERROR)  # codes up to it: every rank agreed and merged


class _Lane:
    """What a recurring one-shot call needs to run in one compiled call."""

    __slots__ = (
        "args",
        "cache",
        "cache_key",
        "call",
        "comm",
        "comm_arg",
        "enc",
        "entry",
        "kernel",
        "merger",
        "rows",
        "run",
        "sent",
    )

    def __init__(self, comm_arg, comm, entry, call, enc, merger, collective, cached):
        self.comm_arg, self.comm, self.entry = comm_arg, comm, entry
        self.call, self.enc = dataclasses.replace(call, payload=None), enc  # holds no arrays
        self.kernel, self.rows = None, None
        # held weakly, as agree_merger's kept mergers are: a freed communicator's or an
        # evicted merger's buffers are not kept here
        self.merger, self.cache = weakref.ref(merger), weakref.ref(cached[0])
        self.cache_key = cached[1]
        finalized, start, wait, request, flag = collective
        args = self.args = StepArgs()  # allreduce_state's: its records copied in, out again
        args.local, args.output = StepLocal.COPY, StepOutput.RECORDS
        args.finalized, args.start, args.wait = finalized, start, wait
        args.request, args.flag = request, flag
        args.rec, args.nbytes = address(merger.records), merger.records.nbytes
        args.sent[:] = np.frombuffer(enc.sent, np.int64).tolist()
        self.sent = merger.buf.nbytes if start is not None else 0  # bytes counted per merge
        if start is not None:
            args.allreduce = mpi_calls()[3]
            args.handle_bytes = size = MPI._sizeof(MPI.Comm)
            # as the C type's value: a 4-byte handle as a signed int, so C converts it exactly
            signed = ctypes.c_int32 if size == 4 else ctypes.c_int64
            args.comm = signed(MPI._handleof(comm)).value
            args.int64_type = signed(MPI._handleof(MPI.INT64_T)).value
            args.min_op = signed(MPI._handleof(MPI.MIN)).value
        self.run = bind_call(native_lib().mpitree_step_run, args)  # run(out) -> a StepCode

    def bind_kernel(self, prepared, rows):
        """Bind ``tree_decode``'s kernel (a :class:`Prepared`) for query rows ``(B, Hq, Sq)``."""
        self.kernel, self.rows = prepared, rows
        args = self.args
        args.local, args.output = StepLocal.KERNEL, StepOutput.HEADS
        args.args, args.scratch = prepared.args, address(prepared.scratch)

    def open(self):
        """Return ``(merger, its cache)`` if the lane may run now; else None (never raises).

        It may not inside another entry point, or while an observer is on the
        phase hook (a ``phase_times`` block is open: the guarded path's phases
        are the ones timed).
        """
        merger, cache = self.merger(), self.cache()
        if (
            merger is None
            or cache is None
            or not merger.alive
            or _entry.get() is not None
            or hook.observer is not None
        ):
            return None
        return merger, cache

    def close(self, code, cache):
        """Mark the merger used and count its bytes where every rank agreed (codes 0 to 2).

        As the guarded path does after its agreement: every rank marks it, so that
        their caches evict alike.
        """
        if code <= _MERGED:
            cache.move_to_end(self.cache_key)
            if self.sent:
                traffic.add(self.sent)


def _keep(key, comm_arg, comm, call, merger, entry):
    """Keep a lane under ``key`` after a guarded call, where one can run; return it or None.

    One can where the compiled library is there, every rank has the native op, and
    the merger merges float32 records in one persistent all-reduce (or there is one
    rank). The caller keeps one only for an outermost call: its agreement vector
    names the entry point, and a lane runs only outside every other.
    """
    enc = _encoding(entry, call)
    last = _recent.get(id(call.merge))
    if (
        native_lib() is None
        or not call.native
        or enc.native != call.native
        or merger.buf.dtype != np.float32
        or len(_HANDLE_BYTES) != 1
        or last is None
        or last[3]() is not merger
    ):
        return None
    collective = merger._impl.bound_collective()
    if collective is None or (collective[1] is not None and mpi_calls()[3] is None):
        return None
    if len(_lanes) >= _LANES_SIZE:
        _lanes.clear()
    lane = _lanes[key] = _Lane(comm_arg, comm, entry, call, enc, merger, collective, last[4:6])
    return lane


def _wanted(key, comm_arg, merger):
    """Whether a call under ``key`` should keep a lane: it recurs, and has none yet.

    The first call of a key only marks it seen: a loop whose every call has a new
    layout (a cache reallocated as it grows) builds no lane in vain.
    """
    lane = _lanes.get(key)
    if lane is not None and lane.merger() is merger and lane.comm_arg is comm_arg:
        return False
    if key in _seen:
        return True
    if len(_seen) >= _LANES_SIZE:
        _seen.clear()
    _seen[key] = None
    return False


def keep_state_lane(comm_arg, comm, call, merger, records, entry):
    """After a guarded ``allreduce_state`` with a key: keep its lane where one can run."""
    key = (id(comm_arg), records.shape, records.dtype, call.key[2])
    if _wanted(key, comm_arg, merger):
        _keep(key, comm_arg, comm, call, merger, entry)


def keep_decode_lane(comm_arg, comm, call, merger, arrays, scale, options_key, entry):
    """After a guarded ``tree_decode`` with an options key: keep its lane where one can run.

    ``arrays`` are its checked ``(q, k, v)``, ``scale`` the resolved scale.
    """
    q, k, v = arrays
    layout = _layout(q, k, v, None)
    key = (id(comm_arg), layout, options_key)
    if layout is None or not _wanted(key, comm_arg, merger):
        return
    rows = tuple(int(s) for s in q.shape[:3])
    prepared = None if KernelSlot.prompt(*rows, int(k.shape[2])) else Prepared.of(q, k, v, scale)
    if prepared is None:
        return
    lane = _keep(key, comm_arg, comm, call, merger, entry)
    if lane is not None:
        lane.bind_kernel(prepared, rows)


def state_lane(state, comm=None, strategy="auto", *, deterministic=False, node_size=None):
    """``allreduce_state`` in one compiled call where its lane is kept; else None."""
    if not _lanes:
        return None
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
            or type(records) is not np.ndarray
            or not records.flags.c_contiguous
        ):
            return None
        opened = lane.open()
        if opened is None:
            return None
        out = np.empty(records.shape, np.float32)
        lane.args.source, target = address(records), address(out)
    except Exception:  # nothing has communicated: the guarded path decides
        return None
    settled = _run(lane, opened, target, lambda call: _merged_state(lane, call, records))
    return trusted_state(out) if settled is None else settled


def decode_lane(
    q,
    k,
    v,
    comm=None,
    *,
    scale=None,
    kv_len=None,
    q_pos=None,
    k_pos=None,
    mask=None,
    strategy="auto",
    return_lse=False,
    deterministic=False,
    validate=False,
    node_size=None,
    block_size=None,
    kv_start=None,
    kv_blocks=None,
):
    """``tree_decode`` in one compiled call where its lane is kept; else None."""
    if (
        not _lanes
        or kv_len is not None
        or q_pos is not None
        or k_pos is not None
        or mask is not None
        or return_lse is not False
        or validate is not False
        or block_size is not None
        or kv_start is not None
        or kv_blocks is not None
    ):
        return None
    try:
        options = _options_key(strategy, scale, deterministic, node_size)
        lane = _lanes.get((id(comm), _layout(q, k, v, None), options))
        if lane is None or lane.comm_arg is not comm or lane.kernel is None:
            return None
        t = k.shape[2]
        b, hq, sq = lane.rows
        if v.shape[2] != t or (sq != 1 and KernelSlot.prompt(b, hq, sq, t)):
            return None
        opened = lane.open()
        if opened is None:
            return None
        out = np.empty(q.shape, np.float32)
        pointers = (address(q), address(k), address(v))
        target = address(out)
        args = lane.args
        args.q, args.k, args.v = pointers
        args.t = t
    except Exception:  # nothing has communicated: the guarded path decides
        return None
    settled = _run(lane, opened, target, lambda call: _decoded(lane, call, q, pointers, t))
    return out if settled is None else settled


def _run(lane, opened, out, merged):
    """Run the lane's compiled step into address ``out``; None if it merged, else settle it.

    ``opened`` is :meth:`_Lane.open`'s; after a nonzero code every rank raises, or
    (the native op not everywhere) ``merged(call)`` is the call's result.
    """
    merger, cache = opened
    code = lane.run(out)
    lane.close(code, cache)
    return _settled(lane, merger, code, merged) if code else None


def _settled(lane, merger, code, merged):
    """Finish the lane's call after a nonzero code: raise on every rank, or ``merged(call)``."""
    got = settle_code(code, merger.comm, lane.args)
    call = settle(lane.comm, lane.entry, dataclasses.replace(lane.call), lane.enc, None, got)
    return merged(call)


def _merged_state(lane, call, records):
    """Merge ``records`` as the guarded path does after an agreement that settled."""
    return merged_state(agreed_merger(lane.comm, call), call.merge[0], records)


def _decoded(lane, call, q, pointers, t):
    """Decode as the guarded path does after an agreement that settled."""
    merger = agreed_merger(lane.comm, call)
    records = merger.merge(lambda out: lane.kernel.run_raw(*pointers, t, address(out)))
    return finish(records.reshape(*lane.rows, -1), q)


def merged_state(merger, rows, records):
    """Return a new :class:`State` of ``records`` ``(..., D + 2)`` merged by ``merger``."""

    def fill(out):
        out[...] = records.reshape(rows, records.shape[-1])

    return trusted_state(merger.merge(fill).reshape(records.shape).copy())
