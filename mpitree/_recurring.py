"""The recurring-call memo: what a checked one-shot call leaves for later calls like it."""

from __future__ import annotations

import functools
import os
import threading
from collections import OrderedDict

from ._guard import Call
from ._kernel import Prepared
from ._local import BLOCK_SCORES
from ._options import NODE_SIZE_ENV


def _options_key(strategy, scale, deterministic, node_size):
    """Return a key that determines a one-shot call's resolved options exactly, or None.

    None (options resolved afresh) for anything but a ``str`` strategy other than
    the ring, ``scale`` None or a nonzero ``float`` (``-0.0 == 0.0``),
    ``deterministic`` True or False and ``node_size`` None or an ``int``; with
    ``node_size=None`` the key holds ``MPITREE_NODE_SIZE``, which it then reads.
    """
    if type(strategy) is not str or strategy == "ring":
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


class _Recurring:
    """What a checked one-shot call leaves for later calls with its layout and options.

    A later call with the same key (:func:`_layout` of its arrays and
    :func:`_options_key` of its options) passes the same checks but those on the
    shard length ``T``, which :meth:`call` repeats; it then reuses the signature,
    the options and the bound C kernel, as a plan's step does.
    """

    __slots__ = ("_out", "blocks", "call", "prepared")

    def __init__(self, call, prepared):
        problem = call.payload[0]
        self.call, self.prepared = call, prepared
        self.blocks = BLOCK_SCORES // max(1, problem.batch * problem.q_heads)
        self._out = (None, 0)

    def _run(self, q, k, v, records):
        """Run the bound kernel on this call's arrays (holding none of them afterwards)."""
        if records is not self._out[0]:  # a merger hands the same buffer every call
            self._out = (records, records.ctypes.data)
        self.prepared.run_raw(q.ctypes.data, k.ctypes.data, v.ctypes.data, k.shape[2], self._out[1])

    def call_for(self, q, k, v):
        """Return this call's :class:`Call` if ``T``'s checks pass, else None (full checks)."""
        t = k.shape[2]
        if v.shape[2] != t:
            return None
        call = self.call
        q_len = call.payload[0].q_len
        if q_len > 1 and q_len > max(1, self.blocks // max(1, t)):
            return None  # a prompt: attend() splits it into blocks of rows
        problem, opts = call.payload
        fill = functools.partial(self._run, q, k, v)
        payload = (problem, opts, fill, None)
        return Call(call.signature, payload, op=call.op, key=call.key, merge=call.merge)


_recurring = threading.local()  # per thread: a bound kernel is not reentrant


_RECURRING_SIZE = 16


def _recurring_calls():
    """Return this thread's cache of :class:`_Recurring` calls (least recently used first)."""
    cache = getattr(_recurring, "calls", None)
    if cache is None:
        cache = _recurring.calls = OrderedDict()
    return cache


def _remember(key, call, step):
    """Keep a checked call's reusable parts under ``key`` once its key recurs.

    The first call with a key only marks it seen: a loop whose every call has a
    new layout (a cache that is reallocated as it grows) binds no kernel in vain.
    """
    if getattr(_recurring, "seen", None) != key:
        _recurring.seen = key
        return
    prepared = Prepared.of(step.q, step.k, step.v, step.scale)
    if prepared is None:
        return
    cache = _recurring_calls()
    kept = Call(call.signature, call.payload[:2], op=call.op, key=key, merge=call.merge)
    cache[key] = _Recurring(kept, prepared)
    if len(cache) > _RECURRING_SIZE:
        cache.popitem(last=False)


_state_calls: dict = {}  # (records shape, dtype, options key) -> allreduce_state's Call
