"""One-shot collective calls: :func:`tree_decode` and :func:`allreduce_state`."""

from __future__ import annotations

import functools
import math

import numpy as np
from mpi4py import MPI

from ._agreed import agree_merger
from ._guard import Call, check_comm, current_entry, entry_point
from ._invariant import check_placement, leaf_records, local_pieces
from ._invariant_step import _placement_unused, invariant_signature
from ._library import address
from ._namespace import Array
from ._options import INVARIANT, Options, dtype_name
from ._records import RecordsMerge
from ._registry import REGISTRY
from ._runtime import limit_blas_threads
from ._state import State, finish, trusted_state
from ._step import _layout, prepare_attention
from ._steps import STEPS, Layout, options_key, remember

# the entry points' own names: a step's compiled form is bound only from an outermost call
_DECODE_ENTRY, _STATE_ENTRY = f"{__name__}.tree_decode", f"{__name__}.allreduce_state"
_STATES = RecordsMerge(_STATE_ENTRY)  # allreduce_state's merge: its guarded call and its lane


def _staged(x):
    """``x`` if its records must be staged from a device, else None."""
    return None if isinstance(x, np.ndarray) else x


def _decode_step(
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
    """``tree_decode``'s lane: its bound :class:`Step` in one compiled call; else None.

    ``kv_len`` and a mask join it as a plan's lane takes them (:meth:`KernelSlot.load
    <mpitree._step.KernelSlot.load>`).
    """
    if (
        not STEPS
        or q_pos is not None
        or k_pos is not None
        or return_lse is not False
        or validate is not False
        or block_size is not None
        or kv_start is not None
        or kv_blocks is not None
    ):
        return None
    try:
        options = options_key(strategy, scale, deterministic, node_size)
        # a plain tuple equal to the Layout (a Layout is one): no constructor on the hot path
        step = STEPS.get((_DECODE_ENTRY, id(comm), options, _layout(q, k, v, kv_len, mask), None))
        merger = None if step is None else step.open(comm)
        # the compiled form: this call's arrays, shard length, lengths and mask (the step's
        # slot bound the layout of its key)
        struct = None if merger is None else step.compiled.struct
        if struct is None or not step.kernel.load(q, k, v, kv_len, struct, mask, fitted=True):
            return None  # lengths out of range, or a prompt: the full checks decide
        out = np.empty(q.shape, np.float32)
        target = address(out)
    except Exception:  # nothing has communicated: the guarded path decides
        return None
    settled = step.finish(merger, target, lambda call: step.decoded(call, q, k, v, mask))
    return out if settled is None else settled


def _state_step(state, comm=None, strategy="auto", *, deterministic=False, node_size=None):
    """``allreduce_state``'s lane: its bound :class:`Step` in one compiled call; else None."""
    if not STEPS or type(state) is not State:
        return None
    options = options_key(strategy, None, deterministic, node_size)
    out = _STATES.lane(comm, options, state.records)
    return None if out is None else trusted_state(out)


@entry_point(lane=_decode_step)
def tree_decode(
    q: Array,
    k: Array,
    v: Array,
    comm: MPI.Intracomm | None = None,
    *,
    scale: float | None = None,
    kv_len: Array | None = None,
    q_pos: Array | None = None,
    k_pos: Array | None = None,
    mask: Array | None = None,
    strategy: str = "auto",
    return_lse: bool = False,
    deterministic: bool = False,
    validate: bool = False,
    node_size: int | None = None,
    block_size: int | None = None,
    kv_start: int | None = None,
    kv_blocks: Array | None = None,
) -> Array | tuple[Array, Array]:
    """Exact attention of replicated queries over a KV cache sharded along the sequence.

    Collective over ``comm``: every rank passes the same ``q`` and its own shard of
    keys and values, and every rank receives the attention output over the
    concatenation of all shards (in any order: the merge is commutative), as one
    process would compute it. Only per-row states of ``D + 2`` numbers travel.

    Parameters
    ----------
    q : array
        ``(B, Hq, Sq, D)``, float16/bfloat16/float32/float64, identical on every
        rank. numpy, or torch (CPU or CUDA), CuPy or JAX: the framework is
        recognised without being imported, and results come back in it.
    k, v : array
        ``(B, Hkv, T, D)``, same dtype and framework as ``q``: this rank's shard;
        ``T`` may differ between ranks and may be 0. ``Hq % Hkv == 0`` (GQA/MQA:
        query head ``h`` uses kv head ``h // (Hq // Hkv)``; K/V are never repeated).
    comm : mpi4py.MPI.Intracomm, optional
        Default: mpitree's private duplicate of ``COMM_WORLD``.
    scale : float, optional
        Logit scale, default ``1/sqrt(D)``.
    kv_len : array, optional
        int ``(B,)``: valid keys per batch row in this shard; keys at index
        ``>= kv_len[b]`` are ignored.
    q_pos, k_pos : array, optional
        int ``(B, Sq)`` and ``(B, T)``: global positions; key j is visible to
        query i iff ``k_pos[b, j] <= q_pos[b, i]``. Give both or neither.
    mask : array, optional
        bool, broadcastable to ``(B, Hq or 1, Sq, T)``; True = attend. Combines
        with ``kv_len`` and positions (a key must pass all three).
    strategy : str, optional
        ``"allreduce"`` (one MPI_Allreduce with a native user op),
        ``"allreduce3"`` (the paper's Algorithm 3: MAX then two SUMs),
        ``"allgather"`` (gather states, merge locally), ``"ring"`` (Ring
        Attention baseline: K/V travel the ring), ``"hierarchical"`` (reduce
        inside each node, all-reduce among node leaders, broadcast inside nodes)
        or ``"auto"`` (default: ``"allreduce"`` on one node, ``"hierarchical"``
        across nodes under Open MPI; without the native op on every rank,
        ``"allgather"`` up to 8 ranks and ``"allreduce3"`` beyond).
    return_lse : bool, optional
        Also return the log-sum-exp.
    deterministic, validate, node_size, block_size
        As in :class:`DecodePlan`.
    kv_start : int, optional
        ``deterministic="invariant"`` only: global index of this shard's first key,
        a multiple of ``block_size`` (a contiguous shard).
    kv_blocks : array, optional
        ``deterministic="invariant"`` only: int ``(ceil(T / block_size),)``, the
        distinct global block index of each consecutive ``block_size`` keys of this
        shard (an interleaved placement). Only a shard's last block may be short.

    Returns
    -------
    out : array
        ``(B, Hq, Sq, D)`` in q's framework, dtype and device; 0 for rows that see
        no key on any rank.
    lse : array
        ``(B, Hq, Sq)``, float32, natural log; -inf for rows that see no key.
        Only with ``return_lse=True``.

    Raises
    ------
    Exception
        On every rank, when any rank's input is invalid (that rank raises its own
        ``TypeError``/``ValueError``, the others :class:`mpitree.RankError`) or
        ranks disagree on shapes, dtype, scale or strategy (``ValueError``).

    Notes
    -----
    Keys excluded by ``kv_len``, positions or the mask contribute exactly
    nothing: NaN or Inf in a cache's unused slots never reaches the output.
    Two collectives: the agreement and the merge (a :class:`DecodePlan` pays the
    agreement once).

    Examples
    --------
    >>> out = mpitree.tree_decode(q, k_shard, v_shard)  # doctest: +SKIP
    """
    comm_arg, comm = comm, check_comm(comm)
    options = dict(strategy=strategy, scale=scale, deterministic=deterministic)
    options.update(validate=validate, node_size=node_size, block_size=block_size, invariant=True)

    layout = None
    if (
        q_pos is None
        and k_pos is None
        and kv_start is None
        and kv_blocks is None
        and validate is False
        and block_size is None
    ):
        key = options_key(strategy, scale, deterministic, node_size)
        arrays = _layout(q, k, v, kv_len, mask)
        if key is not None and arrays is not None:
            layout = Layout(_DECODE_ENTRY, id(comm_arg), key, arrays)

    def prepare():
        if layout is not None:
            found = STEPS.get(layout)
            if found is not None:
                call = found.prepare(q, k, v, kv_len, mask)
                if call is not None:
                    return call
        problem, opts, step, sig = prepare_attention(q, k, v, kv_len, q_pos, k_pos, mask, options)
        blocks = None
        if opts.deterministic == INVARIANT:
            invariant_signature(sig)
            blocks = check_placement(int(step.k.shape[2]), opts.block_size, kv_start, kv_blocks)
        else:
            _placement_unused(kv_start, kv_blocks)
        merge = (problem.rows, problem.head_dim, problem.acc, opts)
        return Call(sig, (problem, opts, step, blocks), key=layout, merge=merge)

    call, merger = agree_merger(comm, prepare, like=_staged(q))
    problem, opts, step, blocks = call.payload
    limit_blas_threads()
    if blocks is not None:  # invariant mode: the leaves of its blocks, as pieces
        step = functools.partial(_leaf_pieces, step, blocks, opts.block_size, problem.acc)
    records = merger.merge(step).reshape(*problem.row_shape, -1)
    if layout is not None and blocks is None:
        _keep_decode(layout, call, comm_arg, comm, merger, return_lse, kv_len, mask)
    return finish(records, q, return_lse, inputs=(q, k, v))


def _leaf_pieces(att, blocks, block_size, acc):
    """Return an invariant-mode call's local work: its blocks' leaf records, as pieces."""
    return local_pieces(blocks, leaf_records(att, block_size, len(blocks), acc))


def _keep_decode(layout, call, comm_arg, comm, merger, return_lse, kv_len, mask):
    """After a guarded ``tree_decode`` of ``layout``: its :class:`Step`, bound where it may."""
    step = remember(layout, call, kv_len, mask)
    entry = current_entry()
    if step is not None and not return_lse and entry == _DECODE_ENTRY:
        step.bind(call, comm_arg, comm, merger, entry)


@entry_point(lane=_state_step)
def allreduce_state(
    state: State,
    comm: MPI.Intracomm | None = None,
    strategy: str = "auto",
    *,
    deterministic: bool = False,
    node_size: int | None = None,
) -> State:
    """Merge a :class:`State` across ranks; every rank gets the merged state.

    Parameters
    ----------
    state : State
        ``(..., D + 2)`` records, the same row shape and dtype on every rank.
    comm : mpi4py.MPI.Intracomm, optional
        Default: mpitree's private duplicate of ``COMM_WORLD``.
    strategy : {"auto", "allreduce", "allreduce3", "allgather", "hierarchical"}, optional
        ``"ring"`` needs K/V and is only available through :func:`tree_decode`.
    deterministic, node_size
        As in :class:`DecodePlan`.

    Returns
    -------
    State
        A new state with the same row shape and dtype.
    """
    comm_arg, comm = comm, check_comm(comm)
    records = state.records if isinstance(state, State) else None
    key = options_key(strategy, None, deterministic, node_size) if type(state) is State else None

    def prepare():
        if not isinstance(state, State):
            raise TypeError(f"state must be an mpitree.State, got {type(state).__name__}")
        opts = Options.resolve(state.head_dim, strategy, None, deterministic, node_size)
        if opts.strategy in REGISTRY and REGISTRY[opts.strategy].needs_kv:
            raise ValueError(f"strategy {opts.strategy!r} moves K/V; use tree_decode for it")
        acc = dtype_name(state.records.dtype)
        sig = {"rows": tuple(state.shape), "head_dim": state.head_dim, "dtype": acc}
        sig.update(opts.signature())
        merge = (math.prod(state.shape), state.head_dim, acc, opts)
        encoding = None if key is None else (key, records.shape, records.dtype)
        return Call(sig, None, key=encoding, merge=merge)

    return trusted_state(_STATES.merge(comm_arg, comm, key, records, prepare))
