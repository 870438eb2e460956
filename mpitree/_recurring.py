"""The recurring-call memo: what a checked one-shot call leaves for later calls like it."""

from __future__ import annotations

import functools
import os
import threading
from collections import OrderedDict

from ._guard import Call
from ._options import NODE_SIZE_ENV
from ._registry import needs_kv
from ._step import KernelSlot


def _options_key(strategy, scale, deterministic, node_size):
    """Return a key that determines a one-shot call's resolved options exactly, or None.

    None (options resolved afresh) for anything but a ``str`` strategy that merges
    records alone (not the ring), ``scale`` None or a nonzero ``float`` (``-0.0 == 0.0``),
    ``deterministic`` True or False and ``node_size`` None or an ``int``; with
    ``node_size=None`` the key holds ``MPITREE_NODE_SIZE``, which it then reads.
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


class _Recurring:
    """What a checked one-shot call leaves for later calls with its layout and options.

    A later call with the same key (:func:`_layout` of its arrays and
    :func:`_options_key` of its options) passes the same checks but those on the
    shard length ``T``, which :meth:`call_for` repeats (:meth:`KernelSlot.takes`);
    it then reuses the signature, the options and the bound kernel, as a plan's
    step does.
    """

    __slots__ = ("call", "kernel")

    def __init__(self, call, kernel):
        self.call, self.kernel = call, kernel

    def call_for(self, q, k, v):
        """Return this call's :class:`Call` if ``T``'s checks pass, else None (full checks)."""
        if not self.kernel.takes(k, v):
            return None  # K and V lengths differ, or a prompt: the full checks decide
        call = self.call
        problem, opts = call.payload
        fill = functools.partial(self.kernel.run_unheld, q, k, v)
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
    kernel = KernelSlot()
    if not kernel.bind(step):
        return
    cache = _recurring_calls()
    kept = Call(call.signature, call.payload[:2], op=call.op, key=key, merge=call.merge)
    cache[key] = _Recurring(kept, kernel)
    if len(cache) > _RECURRING_SIZE:
        cache.popitem(last=False)


_state_calls: dict = {}  # (records shape, dtype, options key) -> allreduce_state's Call
