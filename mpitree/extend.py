"""The documented extension API for adapters: the guarded path and the shared merger.

An adapter that brings its own local attention (a fused kernel, another cache
layout) joins mpitree's guarantees by following the core's own pattern::

    from mpitree import extend

    @extend.entry_point                    # joins the bad-input catalogue test
    def my_decode(q, cache, comm=None, *, strategy="auto"):
        comm = extend.check_comm(comm)

        def prepare():                     # every local check, inside the guard
            ...validate q and cache...
            opts = extend.Options.resolve(head_dim, strategy)
            merge = (rows, head_dim, "float32", opts)   # the merger it needs
            return extend.Call(signature, payload, merge=merge)

        # the one agreement collective, then the agreed strategy's shared merger
        call, merger = extend.agree_merger(comm, prepare, like=q)
        records = merger.merge(fill)       # fill(records) runs inside the guard
        return extend.finish(records.reshape(B, Hq, Sq, -1), q)

``agree_merger`` is the whole recipe: the native op the merge needs is created
inside the guard, ``"auto"`` resolves with the agreed native-op fact and the
options' node size, and every rank gets the same merger. With
``deterministic="invariant"`` it is the merger of canonical-tree pieces:
``merger.merge(lambda: extend.invariant_pieces(attention, block_size, kv_start,
kv_blocks, acc))`` returns the ``(rows, D + 2)`` records of the tree's root, and the
signature gains the kernel's arithmetic (``extend.invariant_signature``). A call that
merges nothing (``merge=None``) gets no merger: ``extend.agree`` alone is enough.

Sharded prefill (each rank holds other queries) has two collectives of its own,
in buffers the caller may keep for every layer: ``allgather_rows`` hands every
rank every rank's rows (in place). The transformers adapter gathers keys and
values with it, attends each rank's own queries locally, and carries the verdict
in a ``flagged_allreduce``. The other route gathers the queries instead:
``reduce_scatter_records`` merges each rank's partial states of all of them, laid
out by ``scatter_layout``, and hands every rank its own, a failure anywhere
raising on every rank. It moves more bytes than the keys and values (the
queries, then a state of every query from every rank), but each rank computes
over its own keys only.

Benchmarks and tools measure through the same layer, locally (no MPI):
``phase_times`` times the phases of calls made inside a ``with`` block
(the calls report them to ``phase_hook``),
``traffic`` counts the bytes handed to MPI, ``Prepared`` runs the compiled kernel
alone, ``read_seconds`` times the read floor, ``kernel_isa`` names the kernel
build (``kernel_levels`` lists the builds this CPU runs, ``select_kernel`` picks
one, ``kernel_read_order`` says or forces how one row per KV head reads),
``plan_merger`` gives a plan's merger (its merge alone) and
``full_checks`` turns a plan's fast path off. None of them costs anything
when unused.

Everything here is public and stable within a minor version; adapters in
``mpitree.adapters`` use nothing else of the core.
"""

from ._agreed import agree_merger
from ._checks import Problem, check_masking, check_qkv
from ._decode_plan import full_checks, plan_merger
from ._guard import (
    ENTRY_POINTS,
    Call,
    RankError,
    agree,
    check_comm,
    entry_point,
    flagged_allreduce,
)
from ._invariant_step import invariant_pieces, invariant_signature
from ._kernel import (
    BoundLayer,
    Prepared,
    kernel_isa,
    kernel_levels,
    kernel_read_order,
    read_seconds,
    select_kernel,
)
from ._local import attend, state_records
from ._masks import visibility
from ._merger import Merger, merger_for
from ._namespace import namespace
from ._options import INVARIANT, Options, acc_name, dtype_name
from ._prefill_collectives import allgather_rows, reduce_scatter_records, scatter_layout
from ._state import combine_records, empty_records, finish, merge_records
from ._step import Attention, KernelSlot, prepare_attention
from ._strategies import op_needed, resolve
from ._timers import phase_times
from ._traffic import hook as _hook
from ._traffic import traffic as _traffic

#: This rank's running count of the payload bytes mpitree's merges hand to MPI,
#: one object for the process: ``traffic.bytes`` (int, bytes) and
#: ``traffic.calls`` (int, MPI calls) since ``traffic.reset()`` zeroed both.
#: What each strategy passes to its MPI calls (the all-reduce buffer, the
#: all-gather send buffer, every ring message), not what the MPI library then
#: moves on the wire. Always on, local; for benchmarks and tools: a step's bytes are
#: ``extend.traffic.bytes`` after ``extend.traffic.reset()`` and the step.
traffic = _traffic

#: The phase hook ``phase_times`` observes through: ``phase_hook.observer`` is
#: None unless a ``phase_times`` block is open. An adapter step that times itself
#: (the transformers layer's checked local step, its ``"local"`` phase) reads it
#: once and, only where it is not None, reports to it: ``observer.enter(phase)``
#: opens the phase on this thread (False where it is open there already: run
#: untimed), then ``observer.timed(phase, fn, *args)`` returns ``fn(*args)`` and
#: closes it, its seconds appended to every open block. The phase names are
#: ``phase_times``'s; adapters never set ``observer``.
phase_hook = _hook

__all__ = [
    "Attention",
    "BoundLayer",
    "Call",
    "ENTRY_POINTS",
    "INVARIANT",
    "KernelSlot",
    "Merger",
    "Options",
    "Prepared",
    "Problem",
    "RankError",
    "acc_name",
    "agree",
    "agree_merger",
    "allgather_rows",
    "attend",
    "check_comm",
    "check_masking",
    "check_qkv",
    "combine_records",
    "dtype_name",
    "empty_records",
    "entry_point",
    "finish",
    "flagged_allreduce",
    "full_checks",
    "invariant_pieces",
    "invariant_signature",
    "kernel_isa",
    "kernel_levels",
    "kernel_read_order",
    "merge_records",
    "merger_for",
    "namespace",
    "op_needed",
    "phase_hook",
    "phase_times",
    "plan_merger",
    "prepare_attention",
    "read_seconds",
    "reduce_scatter_records",
    "resolve",
    "scatter_layout",
    "select_kernel",
    "state_records",
    "traffic",
    "visibility",
]
