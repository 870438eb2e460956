"""The step object (prepare, agree, bind, run), and the one memo of them by layout.

A :class:`Step` is an agreed attention step. A :class:`~._decode_plan.DecodePlan`
makes one when it agrees and runs it step after step. A guarded
:func:`~._oneshot.tree_decode` or :func:`~._oneshot.allreduce_state` prepares
(its local checks), agrees (:func:`~._agreed.agree_merger`), then merges; when
such a call recurs (the same :class:`Layout`: shapes, strides, dtypes, options
and communicator), its second call leaves a :class:`Step` in the memo, and later
calls run it:

- **prepare**: :meth:`Step.prepare` is the guarded path's ``prepare()`` for a
  later call: only the checks that can change within a layout (the shard length)
  run, and the agreed call, its merger and the bound kernel are reused;
- **bind**: :meth:`Step.bind`, after an outermost guarded call, binds the step's
  compiled form (``_native_step.c``'s ``mpitree_step``): the agreement vector
  that :func:`~._guard.agree` sent for it (:attr:`Call.sent`), its merger's
  persistent all-reduce (:meth:`Merger.bind_layer
  <mpitree._merger.Merger.bind_layer>`) and, for ``tree_decode``, the kernel;
- **run**: the entry point's lane (:func:`~._guard.entry_point`) runs a bound
  step in one compiled call (:meth:`Step.open`, then :meth:`Step.finish`): the
  same agreement collective with the same vector and, only if every rank sent
  it, this rank's records (the kernel over the shard, or the state's) and the
  merge.

Ranks that run a bound step and ranks on the guarded path make the same
collectives in the same order. Where the agreement's result differs (a rank
failed its checks, ranks disagree, or the native op is not everywhere),
:func:`~._guard.settle` finishes it as :func:`~._guard.agree` would have.
Anything the lane cannot look up without raising sends the call to the guarded
path before any collective. As a plan's bound kernel does, a step keeps the
kernel chosen when it was made (``MPITREE_LOCAL_KERNEL`` is read then).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import weakref
from typing import NamedTuple

import numpy as np
from mpi4py import MPI

from ._agreed import agreed_merger, kept
from ._guard import _VECTOR, Call, _encoding, _entry, settle
from ._library import StepArgs, StepCode, StepLocal, StepOutput, address, bind_call, native_lib
from ._options import NODE_SIZE_ENV
from ._registry import needs_kv
from ._runtime import mpi_calls
from ._state import finish, trusted_state
from ._step import KernelSlot, local_attention, validated
from ._step_code import settle_code
from ._traffic import hook, traffic

_HANDLE_BYTES = {MPI._sizeof(MPI.Comm), MPI._sizeof(MPI.Datatype), MPI._sizeof(MPI.Op)}
_MERGED = int(StepCode.MERGE_ERROR)  # codes up to it: every rank agreed and merged
_SIZE = 16


class Layout(NamedTuple):
    """What a one-shot call's checks and agreement depend on but the shard length.

    Two calls with equal layouts pass the same checks (those on ``T`` aside) and
    agree on the same signature: the memo's key (see :class:`Step`).

    Attributes
    ----------
    entry : str
        The entry point's name.
    comm : int
        ``id`` of the ``comm`` argument (None's too); a step holds the argument,
        and runs only for that very object.
    options : tuple
        :func:`options_key` of the call's options.
    arrays : tuple
        ``tree_decode``: :func:`~._step._layout` of ``q, k, v``;
        ``allreduce_state``: the records' shape.
    dtype : numpy.dtype or None
        ``allreduce_state``: the records' dtype (``tree_decode``'s is in ``arrays``).
    """

    entry: str
    comm: int
    options: tuple
    arrays: tuple
    dtype: object = None


def options_key(strategy, scale, deterministic, node_size):
    """Return a key that determines a one-shot call's resolved options exactly, or None.

    None (options resolved afresh, no step kept) for anything but a ``str``
    strategy that merges records alone (not the ring), ``scale`` None or a
    nonzero ``float`` (``-0.0 == 0.0``), ``deterministic`` True or False and
    ``node_size`` None or an ``int``; with ``node_size=None`` the key holds
    ``MPITREE_NODE_SIZE``, which it then reads.
    """
    if type(strategy) is not str or needs_kv(strategy):
        return None
    if not (deterministic is False or deterministic is True):
        return None
    if scale is not None and (type(scale) is not float or scale == 0.0):
        return None
    if node_size is None:
        node_size = ("env", os.environ.get(NODE_SIZE_ENV))
    elif type(node_size) is not int:
        return None
    return (strategy, scale, deterministic, node_size)


class Step:
    """An agreed attention step: prepare, agree, bind, run; made once, run step after step.

    Behind :class:`~._decode_plan.DecodePlan` (made when the plan agrees) and a
    recurring one-shot call (made by its second call, kept in the memo under its
    :class:`Layout`). What it binds:

    - ``kernel``, a :class:`KernelSlot`: bound to the layout of the last local step
      that passed the full checks, later steps of that layout check only what can
      change within it (the shard length);
    - its compiled form (:meth:`bind`, one-shot calls only): the agreement, the
      kernel or a state's copy, and the merge, in one compiled call.

    As a plan's local step (``merger.merge(step)``), :meth:`fill` checks ``args``
    (the step's ``(q, k, v, kv_len, q_pos, k_pos, mask)``) against the agreed
    problem inside the merge's guard.

    Parameters
    ----------
    call : Call
        The agreed call (its signature, op, key and merge tuple); kept without payload.
    problem : Problem or None
        The agreed shapes and dtype (None: ``allreduce_state``'s step).
    options : Options or None
        The agreed options.
    """

    __slots__ = (
        "args",
        "call",
        "checked",
        "comm",
        "comm_arg",
        "entry",
        "fast",
        "kept",
        "kernel",
        "merger",
        "nbytes",
        "options",
        "problem",
        "rows",
        "run",
        "struct",
    )

    def __init__(self, call, problem=None, options=None):
        self.call = dataclasses.replace(call, payload=None)
        self.problem, self.options = problem, options
        self.kernel = KernelSlot()
        self.rows = None if problem is None else problem.row_shape
        self.args = self.checked = None  # a plan step's arguments, and their checked Attention
        self.fast = True  # whether a plan step may skip the checks of an unchanged layout
        self.comm_arg = self.comm = self.entry = self.kept = None
        self.merger = None  # a weak reference to the merger the compiled form was tried with
        self.struct, self.run, self.nbytes = None, None, 0

    @classmethod
    def of(cls, call):
        """Return the step of a one-shot call just agreed and merged, or None.

        ``tree_decode``'s (``call.payload`` ``(problem, options, Attention, None)``)
        where its kernel binds (:meth:`KernelSlot.bind`: host float32, not a
        prompt); ``allreduce_state``'s (no payload) always.
        """
        if call.payload is None:
            return cls(call)
        problem, options, att, _ = call.payload
        step = cls(call, problem, options)
        return step if step.kernel.bind(att) else None

    # ------------------------------------------------------------------ prepare
    def check(self, args):
        """Check a step's ``(q, k, v, kv_len, q_pos, k_pos, mask)``; return its Attention.

        Raises where they do not match the agreed problem.
        """
        problem, att = local_attention(*args, self.options.scale)
        if problem != self.problem:
            raise ValueError(f"inputs {problem} do not match the plan's {self.problem}")
        return att

    def validated(self, args):
        """Validate mode: a plan step's :class:`Call`, with finiteness and q's checksum."""
        att = self.check(args)
        return Call(validated(att, dict(self.call.signature)), att)

    def prepare(self, q=None, k=None, v=None):
        """Return a later one-shot call's :class:`Call` (guarded path), or None (full checks).

        ``tree_decode``'s (with its arrays): its local step runs the bound kernel,
        where the shard length's checks pass (:meth:`KernelSlot.takes`);
        ``allreduce_state``'s: the agreed call again.
        """
        call = self.call
        if self.problem is None:
            return Call(call.signature, None, op=call.op, key=call.key, merge=call.merge)
        if not self.kernel.takes(k, v):
            return None  # K and V lengths differ, or a prompt: the full checks decide
        fill = functools.partial(self.kernel.run_unheld, q, k, v)
        payload = (self.problem, self.options, fill, None)
        return Call(call.signature, payload, op=call.op, key=call.key, merge=call.merge)

    # --------------------------------------------------------------------- bind
    def bind(self, agreed, comm_arg, comm, merger, entry):
        """After an outermost one-shot call: bind the compiled form, once per merger.

        ``agreed`` is that call's :class:`Call` (agreed under ``entry``: the vector
        it sent is the one the compiled form sends). It binds where the compiled
        library is there, every rank has the native op, and the merger merges
        float32 records in one persistent all-reduce (or there is one rank);
        otherwise later calls take the guarded path.
        """
        if self.merger is not None and self.merger() is merger and self.comm_arg is comm_arg:
            return  # bound, or tried, with this merger already
        self.comm_arg, self.comm, self.entry = comm_arg, comm, entry
        self.merger, self.run = weakref.ref(merger), None
        call = agreed
        sent = call.sent
        last = self.kept = kept(call)
        if (
            native_lib() is None
            or not call.native
            or sent is None
            or call.counts
            or _VECTOR.unpack(sent)[1] != call.native
            or len(_HANDLE_BYTES) != 1
            or last is None
            or last.merger() is not merger
        ):
            return
        struct = self.struct = StepArgs()
        if self.problem is None:  # allreduce_state's: its records copied in, out again
            struct.local, struct.output = StepLocal.COPY, StepOutput.RECORDS
        else:
            struct.local, struct.output = StepLocal.KERNEL, StepOutput.HEADS
            self.kernel.point(struct)
        struct.rec, struct.nbytes = address(merger.records), merger.records.nbytes
        struct.sent[:] = _VECTOR.unpack(sent)
        if not merger.bind_layer(self) or (struct.start and mpi_calls()[3] is None):
            return
        self.run = bind_call(native_lib().mpitree_step_run, struct)  # run(out) -> a StepCode

    def bind_merge(self, merger, collective):
        """Take the merge's compiled collective (:meth:`Merger.bind_layer` hands it).

        ``collective`` is ``(finalized, start, wait, request, flag)``: the
        addresses of ``MPI_Finalized``, ``MPI_Start`` and ``MPI_Wait``, of the
        merger's persistent all-reduce and of its flag record's ``m`` (start, wait
        and request None with one rank: no collective).
        """
        struct = self.struct
        finalized, start, wait, request, flag = collective
        struct.finalized, struct.start, struct.wait = finalized, start, wait
        struct.request, struct.flag = request, flag
        self.nbytes = merger.buf.nbytes if start is not None else 0  # bytes counted per merge
        if start is not None:
            struct.allreduce = mpi_calls()[3] or 0
            struct.handle_bytes = size = MPI._sizeof(MPI.Comm)
            # as the C type's value: a 4-byte handle as a signed int, so C converts it exactly
            signed = ctypes.c_int32 if size == 4 else ctypes.c_int64
            struct.comm = signed(MPI._handleof(self.comm)).value
            struct.int64_type = signed(MPI._handleof(MPI.INT64_T)).value
            struct.min_op = signed(MPI._handleof(MPI.MIN)).value

    # ---------------------------------------------------------------------- run
    def fill(self, records):
        """Run a plan step's local work: check ``args`` against the plan, write the records.

        Fast path: a step with the layout of the last step that passed the full
        checks, and no positions or mask, checks only what can change within a
        layout (:meth:`KernelSlot.step`) and runs the bound kernel.
        """
        args = self.args
        kernel = self.kernel
        if (
            self.fast
            and args[4] is None
            and args[5] is None
            and args[6] is None
            and kernel.step(args[0], args[1], args[2], args[3], records)
        ):
            return
        kernel.unbind()
        att = self.checked = self.check(args)
        att.fill(records)
        if (
            args[4] is None
            and args[5] is None
            and args[6] is None
            and records.dtype == np.float32
            and records.flags.c_contiguous
        ):
            kernel.bind(att, args[3])  # no positions or mask: the next steps' kernel

    @property
    def q_len(self):
        """``Sq`` (the ring sizes its incoming visibility blocks by it)."""
        return self.problem.q_len

    def block(self):
        """See :meth:`Attention.block`."""
        if self.checked is None:  # the fast path ran: the ring needs the checked step
            self.checked = self.check(self.args)
        return self.checked.block()

    def attend_block(self, *args):
        """See :meth:`Attention.attend_block`."""
        if self.checked is None:
            self.checked = self.check(self.args)
        self.checked.attend_block(*args)

    def open(self, comm_arg):
        """Return the bound merger if the compiled form may run now; else None (never raises).

        It may not for another ``comm`` object, inside another entry point, or
        while an observer is on the phase hook (a ``phase_times`` block is open:
        the guarded path's phases are the ones timed).
        """
        if self.run is None or self.comm_arg is not comm_arg:
            return None
        merger = self.merger()
        if merger is None or not merger.alive or _entry.get() is not None:
            return None
        return None if hook.observer is not None else merger

    def finish(self, merger, out, merged):
        """Run the compiled form into address ``out``; return None if it merged, else settle.

        After a nonzero code every rank raises, or (the native op not everywhere)
        ``merged(call)`` is the call's result. Where every rank agreed (codes 0 to
        2), the merger is marked used and its bytes counted, as the guarded path
        does after its agreement: every rank marks it, so that caches evict alike.
        """
        code = self.run(out)
        if code <= _MERGED:
            kept = self.kept
            kept.cache.move_to_end(kept.key)  # kept.touch(), inline: every call runs it
            if self.nbytes:
                traffic.add(self.nbytes)
        if not code:
            return None
        got = settle_code(code, merger.comm, self.struct)
        call = dataclasses.replace(self.call)
        call = settle(self.comm, self.entry, call, _encoding(self.entry, call), None, got)
        return merged(call)

    def decoded(self, call, q, k, v):
        """``tree_decode``'s result after an agreement that settled, as the guarded path's."""
        merger = agreed_merger(self.comm, call)
        records = merger.merge(functools.partial(self.kernel.run_unheld, q, k, v))
        return finish(records.reshape(*self.rows, -1), q)

    def state(self, call, records):
        """``allreduce_state``'s result after an agreement that settled."""
        return merged_state(agreed_merger(self.comm, call), call.merge[0], records)


def merged_state(merger, rows, records):
    """Return a new :class:`State` of ``records`` ``(..., D + 2)`` merged by ``merger``."""

    def fill(out):
        out[...] = records.reshape(rows, records.shape[-1])

    return trusted_state(merger.merge(fill).reshape(records.shape).copy())


# ---------------------------------------------------------------------- the memo
STEPS: dict = {}  # Layout -> Step: the one memo of recurring one-shot calls
_seen: dict = {}  # the layouts of calls seen once: a step is made when one comes again


def remember(layout, call):
    """Return ``layout``'s :class:`Step`, made from its agreed ``call`` on its second call.

    None on its first call, which only marks it seen: a loop whose every call has
    a new layout (a cache reallocated as it grows) makes no step in vain; None
    too where :meth:`Step.of` makes none.
    """
    step = STEPS.get(layout)
    if step is not None:
        return step
    if layout not in _seen:
        if len(_seen) >= _SIZE:
            _seen.clear()
        _seen[layout] = None
        return None
    step = Step.of(call)
    if step is not None:
        if len(STEPS) >= _SIZE:
            STEPS.clear()
        STEPS[layout] = step
    return step
