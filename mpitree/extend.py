"""The extension API: the guarded path for adapters, and what benchmarks measure with.

Fourteen names, stable within a minor version; everything else of the core is
private and free to change.

An adapter that brings its own local attention (a fused kernel, another cache
layout) joins mpitree's guarantees by following the core's own pattern::

    from mpitree import extend

    @extend.entry_point                    # joins the bad-input catalogue test
    def my_decode(q, cache, comm=None, *, strategy="auto"):
        comm = extend.check_comm(comm)

        def prepare():                     # every local check, inside the guard
            ...validate q and cache...
            problem = extend.Problem.of(B, Hq, Hkv, D, Sq, "float32")
            opts = extend.Options.resolve(D, strategy)
            merge = (problem.rows, D, problem.acc, opts)   # the merger it needs
            signature = {**problem.signature(), **opts.signature()}
            return extend.Call(signature, payload, merge=merge)

        # the one agreement collective, then the agreed strategy's shared merger
        call, merger = extend.agree_merger(comm, prepare, like=q)
        records = merger.merge(fill)       # fill(records) runs inside the guard
        return extend.finish(records.reshape(B, Hq, Sq, -1), q)

The adapter's recipe:

- :func:`entry_point` marks a public function that communicates (it checks that
  MPI is usable and registers the function for the bad-input catalogue test);
  :func:`check_comm` checks the communicator, the one check that cannot be agreed.
- ``prepare()`` runs every local check and returns a :class:`Call`: the
  signature every rank must agree on (:class:`Problem` gives a decode's,
  :class:`Options` validates the strategy and the scale, and ``opts.needs_kv`` says
  whether the strategy moves K/V, which an adapter that merges records refuses),
  what the adapter needs afterwards, and the merger it needs.
- :func:`agree_merger` is the whole recipe after that: one agreement collective
  whose verdict raises on every rank when any rank's checks failed, then the
  agreed strategy's shared merger (``"auto"`` resolved with the agreed native-op
  fact and the options' node size). ``merger.merge(fill)`` runs ``fill(records)``
  inside the guard and merges the ``(rows, D + 2)`` records across ranks. A call
  that merges nothing (``merge=None``) needs only :func:`agree`.
- :func:`finish` turns the merged records into the output (and the lse).

An adapter whose records are ready before it communicates (its own kernel wrote
them, as the JAX adapter's does) merges them with a :class:`RecordsMerge`, as
:func:`mpitree.allreduce_state` does: ``merge(comm_arg, comm, key, records,
prepare)`` is the guarded call inside its entry point, and a call that recurs
with the same ``key`` (what ``prepare()``'s call depends on besides the records'
shape and dtype) runs, through the entry point's lane
(``@entry_point(lane=...)`` calling ``lane(comm_arg, key, records)``), as one
compiled call: the same agreement, the records copied in, the merge, and the
records copied out. ``examples/extend_adapter.py`` is a whole adapter written from
this module alone.

A rank's exception is raised there and :class:`mpitree.RankError` on the other
ranks. Sharded prefill, where each rank holds other queries, has two collectives
of its own: :func:`allgather_rows` hands every rank every rank's rows (in a
buffer the caller may keep for every layer), and :func:`flagged_allreduce`
carries a failure flag with a built-in reduction, so that a failure anywhere
raises on every rank.

Benchmarks and tools measure through the same layer, locally (no MPI), at no
cost when unused: :func:`phase_times` times the phases of the calls made inside a
``with`` block, :data:`traffic` counts the bytes handed to MPI, and :data:`tools`
holds the internals they time (the compiled kernel alone, its builds, a plan's
merger), which may change between minor versions.
"""

import types

from ._agreed import agree_merger
from ._checks import Problem
from ._decode_plan import full_checks, plan_merger
from ._guard import ENTRY_POINTS, Call, agree, check_comm, entry_point, flagged_allreduce
from ._invariant_step import invariant_pieces
from ._kernel import (
    Prepared,
    kernel_isa,
    kernel_levels,
    kernel_read_order,
    read_seconds,
    select_kernel,
)
from ._merger import Merger, merger_for
from ._options import Options
from ._prefill_collectives import allgather_rows
from ._records import RecordsMerge
from ._state import finish
from ._step import prepare_attention
from ._timers import phase_times
from ._traffic import traffic as _traffic

#: This rank's running count of the payload bytes mpitree's merges hand to MPI,
#: one object for the process: ``traffic.bytes`` (int, bytes) and
#: ``traffic.calls`` (int, MPI calls) since ``traffic.reset()`` zeroed both.
#: What each strategy passes to its MPI calls (the all-reduce buffer, the
#: all-gather send buffer, every ring message), not what the MPI library then
#: moves on the wire. Always on, local; for benchmarks and tools: a step's bytes are
#: ``extend.traffic.bytes`` after ``extend.traffic.reset()`` and the step.
traffic = _traffic


class _Tools(types.SimpleNamespace):
    """The core's internals that benchmarks and tests time: see :data:`tools`."""

    def __repr__(self):
        return "mpitree.extend.tools"


#: The internals benchmarks and tests time, in one namespace, local (no MPI) and
#: free to change between minor versions (everything else of the core is private):
#:
#: - ``tools.Prepared``: the compiled kernel alone, bound to one layout
#:   (``Prepared.of(q, k, v, scale)``, then ``.run(q, k, v, None, out)``).
#: - ``tools.read_seconds(x)``: seconds to stream-read a contiguous float32 array
#:   once, the read floor of the kernel.
#: - ``tools.kernel_isa()`` names the kernel build that runs, ``tools.kernel_levels()``
#:   lists the builds this CPU runs, ``tools.select_kernel(level)`` picks one and
#:   ``tools.kernel_read_order(force)`` says or forces how one row per KV head reads.
#: - ``tools.plan_merger(plan)``: a :class:`mpitree.DecodePlan`'s merger (its merge
#:   alone); ``with tools.full_checks():`` turns plans' fast path off.
#: - ``tools.Merger`` and ``tools.merger_for``: a merger of its own and the one a
#:   communicator shares; ``tools.prepare_attention`` and
#:   ``tools.invariant_pieces``: a local attention step and its canonical-tree
#:   pieces (``deterministic="invariant"``).
#: - ``tools.ENTRY_POINTS``: every :func:`entry_point`, by qualified name.
tools = _Tools(
    Prepared=Prepared,
    read_seconds=read_seconds,
    kernel_isa=kernel_isa,
    kernel_levels=kernel_levels,
    select_kernel=select_kernel,
    kernel_read_order=kernel_read_order,
    plan_merger=plan_merger,
    full_checks=full_checks,
    Merger=Merger,
    merger_for=merger_for,
    prepare_attention=prepare_attention,
    invariant_pieces=invariant_pieces,
    ENTRY_POINTS=ENTRY_POINTS,
)

__all__ = [
    "Call",
    "Options",
    "Problem",
    "RecordsMerge",
    "agree",
    "agree_merger",
    "allgather_rows",
    "check_comm",
    "entry_point",
    "finish",
    "flagged_allreduce",
    "phase_times",
    "tools",
    "traffic",
]
