"""The step object (prepare, agree, bind, run), its one bound compiled form, and the memo.

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
- **bind**: a step's fast form is the one compiled step
  (``_native_step.c``'s ``mpitree_step``) bound once, a :class:`Bound`:
  :meth:`Step.bind`, after an outermost guarded call, binds it with the
  agreement vector that :func:`~._guard.agree` sent for it (:attr:`Call.sent`),
  its merger's persistent all-reduce (:meth:`Merger.bind_layer
  <mpitree._merger.Merger.bind_layer>`) and, for ``tree_decode``, the kernel;
  :meth:`Step.compile` binds a plan's with no agreement (the plan agreed at
  construction); the transformers layer binds its own (:meth:`Bound.layer`);
- **run**: the entry point's lane (:func:`~._guard.entry_point`) runs a bound
  step in one compiled call (:meth:`Step.open`, then :meth:`Step.finish`): the
  same agreement collective with the same vector and, only if every rank sent
  it, this rank's records (the kernel over the shard, or the state's) and the
  merge. A plan's and a layer's run through :meth:`Merger.merge_layer
  <mpitree._merger.Merger.merge_layer>`.

Ranks that run a bound step and ranks on the guarded path make the same
collectives in the same order. Where the agreement's result differs (a rank
failed its checks, ranks disagree, or the native op is not everywhere),
:func:`~._guard.settle` finishes it as :func:`~._guard.agree` would have; with no
agreement, a rank whose checks fail runs the guarded merge with its verdict in
the flag record, and every rank raises. Anything the lane cannot look up without
raising sends the call to the guarded path before any collective. As a plan's
bound kernel does, a step keeps the kernel chosen when it was made
(``MPITREE_LOCAL_KERNEL`` is read then).
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
from ._guard import _VECTOR, Call, _entry, settle
from ._kernel import native_kernel_available
from ._library import (
    AttnArgs,
    StepArgs,
    StepCode,
    StepLocal,
    StepOutput,
    address,
    bind_call,
    native_lib,
)
from ._options import INVARIANT, NODE_SIZE_ENV
from ._registry import needs_kv
from ._runtime import mpi_calls
from ._state import finish
from ._step import KernelSlot, local_attention, validated
from ._step_code import settle_code
from ._traffic import hook, traffic

_HANDLE_BYTES = {MPI._sizeof(MPI.Comm), MPI._sizeof(MPI.Datatype), MPI._sizeof(MPI.Op)}
_MERGED = int(StepCode.MERGE_ERROR)  # codes up to it: every rank agreed and merged
_SIZE = 16
_I64x3 = ctypes.c_int64 * 3


class Layout(NamedTuple):
    """What a one-shot call's checks and agreement depend on but the shard length.

    Two calls with equal layouts pass the same checks (those on ``T`` and
    ``kv_len``'s range aside) and agree on the same signature: the memo's key (see
    :class:`Step`).

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
        ``tree_decode``: :func:`~._step._layout` of ``q, k, v``, ``kv_len`` and the mask;
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


class Bound:
    """The one compiled step (``mpitree_step_run``) bound once: what every fast path runs.

    A recurring one-shot call (:meth:`Step.bind`), a :class:`~._decode_plan.DecodePlan`
    (:meth:`Step.compile`) and a transformers decode layer (:meth:`layer`) each bind
    one: its ``StepArgs`` struct holds this rank's records (the kernel over a
    shard, or a state's records copied in), the output's layout and, as an option,
    the agreement (the vector :func:`~._guard.agree` sent for the call, made again
    in C first; none for a plan or a layer, which agreed before). A step then sets
    only this call's fields (``q``, ``k``, ``v``, ``t``, ``vis``, or ``source``;
    a plan's ``kv_len`` goes into the lengths buffer its kernel slot points ``lens``
    at, :meth:`KernelSlot.load <mpitree._step.KernelSlot.load>`) and runs
    :attr:`run`. The merge is bound by :meth:`Merger.bind_layer
    <mpitree._merger.Merger.bind_layer>` (it calls :meth:`bind_merge`) where it is
    one persistent all-reduce, or there is one rank; otherwise the caller runs
    :meth:`fill` inside :meth:`Merger.merge <mpitree._merger.Merger.merge>`, then
    :meth:`finish`. The caller checks that what it was bound for still holds.

    Parameters
    ----------
    local : StepLocal
        ``KERNEL`` (the caller points ``struct.args``, ``scratch``, and a layer's
        ``k`` and ``v``, at the kernel's) or ``COPY``.
    output : StepOutput
        ``LAYER``, ``HEADS`` or ``RECORDS``.
    records : numpy.ndarray
        The merger's float32 ``(rows, D + 2)`` records, C order (``Merger.records``).
    keep : tuple, optional
        What the struct's addresses point into, held while the binding lives (never
        a merger kept in a memo: :meth:`Step.bind` holds its merger weakly).
    agreement : tuple, optional
        ``(comm, sent)``: the communicator the call agreed over and the vector it
        sent (four int64). None: no agreement.

    Attributes
    ----------
    struct : StepArgs
        The bound ``mpitree_step`` struct.
    run : callable
        ``run(out) -> int``: ``mpitree_step_run`` with the struct bound (no Python
        frame: :func:`~._library.bind_call`). It writes the output to address
        ``out`` unless some rank failed, and returns a :class:`StepCode`.
    merger : weakref.ref or None
        The merger bound by :meth:`bind_merge` (a weak reference), else None.
    nbytes : int
        Bytes the bound merge hands to MPI (0: one rank, no collective).
    """

    __slots__ = ("_attend", "_finish", "_ref", "agreement", "merger", "nbytes", "run", "struct")

    def __init__(self, local, output, records, keep=(), agreement=None):
        lib = native_lib()
        struct = self.struct = StepArgs()
        struct.local, struct.output = local, output
        struct.rec, struct.nbytes = address(records), records.nbytes
        self.agreement = agreement
        if agreement is not None:
            struct.sent[:] = agreement[1]
        self._ref = ctypes.byref(struct)
        self._attend, self._finish = lib.mpitree_step_local, lib.mpitree_step_output
        self.run = bind_call(lib.mpitree_step_run, struct, keep)
        self.merger, self.nbytes = None, 0

    @classmethod
    def layer(cls, shape, kv_heads, k, v, records, scale, keep=()):
        """Bind a decode layer's step (no agreement, output ``LAYER``); None without the kernel.

        Parameters
        ----------
        shape : tuple of int
            The query's ``(B, Hq, Sq, D)``; the query is C-contiguous float32.
        kv_heads : int
            ``Hkv``, dividing ``Hq``.
        k, v : tuple
            ``(address, (batch, head, key) strides in elements)`` of float32 K and V
            ``(B, Hkv, T, D)`` with unit stride along ``D``.
        records : numpy.ndarray
            The merge's float32 ``(B * Hq * Sq, D + 2)`` records, C order.
        scale : float
            The score scale.
        keep : tuple
            The objects owning those addresses (the merger's too), held while the
            binding lives.
        """
        if not native_kernel_available():
            return None
        lib = native_lib()
        b, hq, sq, dim = shape
        scratch = np.empty(lib.mpitree_attend_scratch(hq // kv_heads * sq, dim), np.float32)
        bound = cls(StepLocal.KERNEL, StepOutput.LAYER, records, (*keep, scratch))
        struct = bound.struct
        struct.args = AttnArgs(b, hq, kv_heads, sq, dim, _I64x3(*k[1]), _I64x3(*v[1]), 0, 0)
        struct.args.scale = scale
        struct.k, struct.v, struct.scratch = k[0], v[0], address(scratch)
        return bound

    def bind_merge(self, merger, collective):
        """Bind the merge that :attr:`run` runs (use :meth:`Merger.bind_layer`).

        Parameters
        ----------
        merger : mpitree._merger.Merger
            The merger whose records this step was bound to (held weakly in
            :attr:`merger`: the caller keeps it alive).
        collective : tuple
            ``(finalized, start, wait, request, flag)``: the addresses of
            ``MPI_Finalized``, ``MPI_Start`` and ``MPI_Wait``, of the handle of the
            merger's persistent all-reduce (over the records and the flag record
            after them), and of the float32 flag record's ``m``; start, wait and
            request None with one rank (no collective). With an agreement and a
            collective, the agreement's ``MPI_Allreduce`` and handles are bound too.
        """
        struct = self.struct
        finalized, start, wait, request, flag = collective
        struct.finalized, struct.start, struct.wait = finalized, start, wait
        struct.request, struct.flag = request, flag
        self.merger = weakref.ref(merger)
        self.nbytes = merger.buf.nbytes if start is not None else 0  # bytes counted per merge
        if start is not None and self.agreement is not None:
            struct.allreduce = mpi_calls()[3] or 0
            struct.handle_bytes = size = MPI._sizeof(MPI.Comm)
            # as the C type's value: a 4-byte handle as a signed int, so C converts it exactly
            signed = ctypes.c_int32 if size == 4 else ctypes.c_int64
            struct.comm = signed(MPI._handleof(self.agreement[0])).value
            struct.int64_type = signed(MPI._handleof(MPI.INT64_T)).value
            struct.min_op = signed(MPI._handleof(MPI.MIN)).value

    def fill(self, records):
        """Run the bound local part into the bound records (``records``: the merger's same buffer).

        For the merge's general path (:meth:`Merger.merge <mpitree._merger.Merger.merge>`).
        The call is the ``"kernel"`` phase of an observer on :data:`~._traffic.hook`.
        """
        observer = hook.observer
        if observer is not None and observer.enter("kernel"):
            return observer.timed("kernel", self._attend, self._ref)
        self._attend(self._ref)

    def finish(self, out):
        """Write the merged records' output to address ``out``, in the bound layout."""
        self._finish(self._ref, out)


class Step:
    """An agreed attention step: prepare, agree, bind, run; made once, run step after step.

    Behind :class:`~._decode_plan.DecodePlan` (made when the plan agrees) and a
    recurring one-shot call (made by its second call, kept in the memo under its
    :class:`Layout`). What it binds:

    - ``kernel``, a :class:`KernelSlot`: bound to the layout of the last local step
      that passed the full checks, later steps of that layout check only what can
      change within it (the shard length);
    - its compiled form, a :class:`Bound`: a one-shot call's (:meth:`bind`, kept
      in ``compiled``: the agreement, the kernel or a state's copy, and the merge)
      or a plan's (:meth:`compile`, kept by the plan: the kernel and the merge),
      in one compiled call.

    As a plan's local step on its guarded path (``merger.merge(step)``),
    :meth:`fill` checks ``args`` (the step's ``(q, k, v, kv_len, q_pos, k_pos,
    mask)``) against the agreed problem inside the merge's guard.

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
        "compiled",
        "entry",
        "fast",
        "kept",
        "kernel",
        "merger",
        "options",
        "problem",
        "rows",
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
        self.compiled = None  # a one-shot call's Bound (:meth:`bind`)

    @classmethod
    def of(cls, call, kv_len=None, mask=None):
        """Return the step of a one-shot call just agreed and merged, or None.

        ``tree_decode``'s (``call.payload`` ``(problem, options, Attention, None)``,
        and the call's ``kv_len`` and mask) where its kernel binds
        (:meth:`KernelSlot.bind`: host float32, not a prompt); ``allreduce_state``'s
        (no payload) always.
        """
        if call.payload is None:
            return cls(call)
        problem, options, att, _ = call.payload
        step = cls(call, problem, options)
        return step if step.kernel.bind(att, kv_len, mask) else None

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

    def prepare(self, q=None, k=None, v=None, kv_len=None, mask=None):
        """Return a later one-shot call's :class:`Call` (guarded path), or None (full checks).

        ``tree_decode``'s (with its arrays): its local step runs the bound kernel,
        where the checks that can change within its layout pass
        (:meth:`KernelSlot.ready`: the shard length, ``kv_len``'s range; the
        caller found this step by that layout);
        ``allreduce_state``'s: the agreed call again.
        """
        call = self.call
        if self.problem is None:
            return Call(call.signature, None, op=call.op, key=call.key, merge=call.merge)
        if not self.kernel.ready(q, k, v, kv_len, mask, fitted=True):  # found by its layout
            return None  # lengths out of range, or a prompt: the full checks decide
        fill = functools.partial(self.kernel.run_unheld, q, k, v, mask=mask)
        payload = (self.problem, self.options, fill, None)
        return Call(call.signature, payload, op=call.op, key=call.key, merge=call.merge)

    # --------------------------------------------------------------------- bind
    def bind(self, agreed, comm_arg, comm, merger, entry):
        """After an outermost one-shot call: bind its :class:`Bound` form, once per merger.

        ``agreed`` is that call's :class:`Call` (agreed under ``entry``: the vector
        it sent is the one the compiled form sends). It binds where the compiled
        library is there, every rank has the native op, and the merger merges
        float32 records in one persistent all-reduce (or there is one rank);
        otherwise later calls take the guarded path.
        """
        if self.merger is not None and self.merger() is merger and self.comm_arg is comm_arg:
            return  # bound, or tried, with this merger already
        self.comm_arg, self.comm, self.entry = comm_arg, comm, entry
        self.merger, self.compiled = weakref.ref(merger), None
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
        agreement = (comm, _VECTOR.unpack(sent))
        if self.problem is None:  # allreduce_state's: its records copied in, out again
            bound = Bound(StepLocal.COPY, StepOutput.RECORDS, merger.records, (), agreement)
        else:
            bound = Bound(StepLocal.KERNEL, StepOutput.HEADS, merger.records, (), agreement)
            self.kernel.point(bound.struct)
        if merger.bind_layer(bound) and (bound.struct.allreduce or not bound.struct.start):
            self.compiled = bound  # run(out) -> a StepCode

    def compile(self, merger):
        """Return a plan's step bound once as a :class:`Bound`, or None where it cannot be.

        No agreement (the plan agreed at construction): the kernel its slot binds
        (re-pointed whenever it binds another layout, its ``kv_len`` included:
        :meth:`KernelSlot.point`), the merge and the ``(B, Hq, Sq, D)`` output, in
        one compiled call. None
        without the compiled library, in validate or invariant mode, or where
        ``merger`` does not merge float32 host records in one persistent
        all-reduce (or with one rank): :meth:`Merger.bind_layer
        <mpitree._merger.Merger.bind_layer>`.
        """
        opts = self.options
        if native_lib() is None or opts.validate or opts.deterministic == INVARIANT:
            return None
        records = merger.records
        if type(records) is not np.ndarray or records.dtype != np.float32:
            return None
        bound = Bound(StepLocal.KERNEL, StepOutput.HEADS, records, (self.kernel, merger))
        if not merger.bind_layer(bound):
            return None
        self.kernel.point(bound.struct)
        return bound

    # ---------------------------------------------------------------------- run
    def fill(self, records):
        """Run a plan step's local work: check ``args`` against the plan, write the records.

        Fast path: a step with the layout of the last step that passed the full
        checks, and no positions, checks only what can change within a layout
        (:meth:`KernelSlot.step`) and runs the bound kernel.
        """
        args = self.args
        kernel = self.kernel
        if (
            self.fast
            and args[4] is None
            and args[5] is None
            and kernel.step(args[0], args[1], args[2], args[3], records, args[6])
        ):
            return
        kernel.unbind()
        att = self.checked = self.check(args)
        att.fill(records)
        if (
            args[4] is None
            and args[5] is None
            and records.dtype == np.float32
            and records.flags.c_contiguous
        ):
            kernel.bind(att, args[3], args[6])  # no positions: the next steps' kernel

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
        if self.compiled is None or self.comm_arg is not comm_arg:
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
        compiled = self.compiled
        code = compiled.run(out)
        if code <= _MERGED:
            kept = self.kept
            kept.cache.move_to_end(kept.key)  # kept.touch(), inline: every call runs it
            if compiled.nbytes:
                traffic.add(compiled.nbytes)
        if not code:
            return None
        got = settle_code(code, merger.comm, compiled.struct)
        call = dataclasses.replace(self.call)
        call = settle(self.comm, self.entry, call, None, got)
        return merged(call)

    def decoded(self, call, q, k, v, mask=None):
        """``tree_decode``'s result after an agreement that settled, as the guarded path's.

        Its lengths are those the lane's :meth:`KernelSlot.load` copied in.
        """
        merger = agreed_merger(self.comm, call)
        records = merger.merge(functools.partial(self.kernel.run_unheld, q, k, v, mask=mask))
        return finish(records.reshape(*self.rows, -1), q)

    def merged(self, call, records, out):
        """Return a records merge's result after an agreement that settled."""
        return merged_records(agreed_merger(self.comm, call), call.merge[0], records, out)


def merged_records(merger, rows, records, out):
    """Merge ready ``records`` ``(..., D + 2)`` by ``merger``; return them in ``out``.

    ``out`` is an array of ``records``' shape to write into, or None for a new one.
    """

    def fill(buf):
        buf[...] = records.reshape(rows, records.shape[-1])

    merged = merger.merge(fill).reshape(records.shape)
    if out is None:
        return merged.copy()
    out[...] = merged
    return out


# ---------------------------------------------------------------------- the memo
STEPS: dict = {}  # Layout -> Step: the one memo of recurring one-shot calls
_seen: dict = {}  # the layouts of calls seen once: a step is made when one comes again


def remember(layout, call, *arrays):
    """Return ``layout``'s :class:`Step`, made from its agreed ``call`` on its second call.

    None on its first call, which only marks it seen: a loop whose every call has
    a new layout (a cache reallocated as it grows) makes no step in vain; None
    too where :meth:`Step.of` makes none (``arrays``: the call's ``kv_len`` and
    mask, for it).
    """
    step = STEPS.get(layout)
    if step is not None:
        return step
    if layout not in _seen:
        if len(_seen) >= _SIZE:
            _seen.clear()
        _seen[layout] = None
        return None
    step = Step.of(call, *arrays)
    if step is not None:
        if len(STEPS) >= _SIZE:
            STEPS.clear()
        STEPS[layout] = step
    return step
