"""A merge of ready records as an entry point's step: ``allreduce_state``'s and JAX's."""

from __future__ import annotations

import dataclasses

import numpy as np

from . import _guard
from ._agreed import agree_merger
from ._checks import lane_output
from ._library import address
from ._steps import STEPS, Layout, merged_records, remember


class RecordsMerge:
    """The merge of an entry point whose records are ready: its guarded call and its lane.

    :func:`~mpitree.allreduce_state` merges a state's records; the JAX adapter's
    host step merges the records its kernel wrote. Both are one
    :class:`~._steps.Step` (prepare, agree, bind, run): :meth:`merge` is the
    guarded call, and a call that recurs (the same ``key``, ``comm`` object,
    records shape and dtype) leaves its step in the memo, bound once as the
    compiled step (``Bound``: the agreement, the records copied in, the merge
    and the records copied out), which :meth:`lane` runs.

    Parameters
    ----------
    entry : str
        The qualified name (``"module.qualname"``) of the :func:`~._guard.entry_point`
        whose call this is; its step binds only where that entry point is the
        outermost one running.
    """

    __slots__ = ("entry",)

    def __init__(self, entry):
        self.entry = entry

    def lane(self, comm, key, records, out=None):
        """Run a recurring call's bound step in one compiled call; None where it cannot run.

        Never raises before its collective (anything it cannot look up without
        raising returns None: the guarded :meth:`merge` decides).

        Parameters
        ----------
        comm : mpi4py.MPI.Intracomm or None
            The entry point's ``comm`` argument, the very object.
        key : hashable
            What the call's checks and agreement depend on besides the records'
            shape and dtype (the caller's options); the key :meth:`merge` was given.
        records : numpy.ndarray
            ``(..., D + 2)`` float32 records, C order.
        out : numpy.ndarray, optional
            A writeable C-order float32 array of ``records``' shape to write the
            merged records into (it may be ``records``); default a new one.

        Returns
        -------
        numpy.ndarray or None
            The merged records (``out``), or None: nothing has communicated.
        """
        if not STEPS:
            return None
        try:
            step = STEPS.get((self.entry, id(comm), key, records.shape, records.dtype))
            merger = None if step is None else step.open(comm)
            if (
                merger is None
                or type(records) is not np.ndarray
                or records.dtype != np.float32  # the compiled copy takes the merger's own dtype
                or not records.flags.c_contiguous
            ):
                return None
            out = lane_output(out, records.shape)
            if out is None:
                return None
            step.compiled.struct.source, target = address(records), address(out)
        except Exception:  # nothing has communicated: the guarded path decides
            return None
        settled = step.finish(merger, target, lambda call: step.merged(call, records, out))
        return out if settled is None else settled

    def merge(self, comm_arg, comm, key, records, prepare, out=None):
        """Agree on ``prepare()``'s call, merge ``records``: the guarded call, in the entry point.

        Parameters
        ----------
        comm_arg : mpi4py.MPI.Intracomm or None
            The entry point's ``comm`` argument (its step runs for that very object).
        comm : mpi4py.MPI.Intracomm
            The checked communicator (:func:`~._guard.check_comm`).
        key : hashable or None
            See :meth:`lane`; None: the call is neither memoized nor bound (its
            checks run in full every call). A key must determine ``prepare()``'s
            call for records of one shape and dtype: a later call of the same
            layout reuses the agreed call instead of calling ``prepare``.
        records : numpy.ndarray
            ``(..., D + 2)`` records, of any float dtype (the merge converts them);
            anything else (None where the local work failed) fails inside the
            merge's guard, on every rank. Only float32 records recur compiled.
        prepare : callable
            ``prepare() -> Call`` whose ``merge`` is ``(rows, D, acc, options)``:
            the local checks, raising this rank's verdict (it rides in the
            agreement). Its payload, if any, is not kept: nothing reads it.
        out : numpy.ndarray, optional
            As in :meth:`lane` (any dtype and order numpy can assign into).

        Returns
        -------
        numpy.ndarray
            The merged records, ``out`` or a new array of ``records``' shape.
        """
        layout = None
        if key is not None and type(records) is np.ndarray:  # else: fill fails, in the guard
            layout = Layout(self.entry, id(comm_arg), key, records.shape, records.dtype)

        def prepared():
            if self.entry not in _guard.ENTRY_POINTS:
                raise RuntimeError(f"mpitree: RecordsMerge for {self.entry!r}: no such entry point")
            found = None if layout is None else STEPS.get(layout)
            return prepare() if found is None else found.prepare()

        call, merger = agree_merger(comm, prepared)
        result = merged_records(merger, call.merge[0], records, out)
        if layout is not None:
            step = remember(layout, dataclasses.replace(call, payload=None))
            if step is not None and _guard.current_entry() == self.entry:
                step.bind(call, comm_arg, comm, merger, self.entry)
        return result
