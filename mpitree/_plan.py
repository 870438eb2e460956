"""Decoding over a sharded KV cache: one-shot :func:`tree_decode`, reusable :class:`DecodePlan`."""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
from mpi4py import MPI

from ._agreed import agree_merger
from ._checks import Problem
from ._guard import Call, agree, check_comm, entry_point
from ._invariant import check_placement, leaf_records, local_pieces
from ._invariant_step import _placement_unused, invariant_pieces, invariant_signature
from ._kernel import Prepared
from ._local import BLOCK_SCORES
from ._namespace import Array
from ._options import INVARIANT, Options, dtype_name
from ._recurring import _RECURRING_SIZE, _options_key, _recurring_calls, _remember, _state_calls
from ._runtime import limit_blas_threads
from ._state import State, finish
from ._step import _layout, local_attention, prepare_attention, validated

FAST_PATH = True  # plans skip re-validating an unchanged layout (False: benchmarks, tests)


def _staged(x):
    """``x`` if its records must be staged from a device, else None."""
    return None if isinstance(x, np.ndarray) else x


class DecodePlan:
    """A decode step for fixed shapes, reusable across a decode loop.

    Construction is collective over ``comm``: one small agreement collective
    checks that every rank agrees on the shapes, dtype, scale and strategy, and
    the plan's merger preallocates the record buffer (and a persistent
    ``MPI_Allreduce_init`` request where the MPI library supports it). Each
    :meth:`decode` then pays only for local attention and one collective, which
    also carries every rank's verdict on its own inputs. Free it with
    :meth:`free` or a ``with`` block; a plan that is dropped frees its request
    when it is collected.

    Parameters
    ----------
    batch, q_heads, kv_heads, head_dim : int
        ``B``, ``Hq``, ``Hkv`` (``Hq % Hkv == 0``) and ``D``.
    q_len : int, optional
        ``Sq``, query tokens per step (default 1).
    dtype : dtype or str, optional
        dtype of q, k, v: float16, bfloat16 (torch), float32 (default) or float64;
        numpy, torch or a name.
    comm : mpi4py.MPI.Intracomm, optional
        Default: mpitree's private duplicate of ``COMM_WORLD``.
    scale : float, optional
        Logit scale, default ``1/sqrt(D)``.
    strategy : str, optional
        ``"auto"`` (default), ``"allreduce"``, ``"allreduce3"``, ``"allgather"``,
        ``"ring"`` or ``"hierarchical"`` (see :func:`tree_decode`).
    node_size : int, optional
        For ``"hierarchical"`` (and ``"auto"``): ranks per node. Default
        ``MPITREE_NODE_SIZE``, else 0 = the real nodes (MPI's shared-memory split);
        a positive value imposes virtual nodes of that many consecutive ranks.
    deterministic : bool or "invariant", optional
        True: merge the ranks' states in a fixed (rank) order, so that repeated
        runs with the same ranks and data are bitwise identical whatever order
        messages arrive in (an all-gather of the states instead of an all-reduce).
        ``"invariant"``: the same bits for any number of ranks and any placement
        whose shard boundaries fall on multiples of ``block_size`` keys: leaf
        states per block of keys merge over one canonical tree on global block
        indices. Each step then needs ``kv_start`` or ``kv_blocks``, and
        ``strategy`` must stay ``"auto"``.
    block_size : int, optional
        Keys per block in ``deterministic="invariant"`` mode (default 1024; a
        block is one local-kernel call, so smaller blocks cost more local time);
        must be left unset otherwise.
    validate : bool, optional
        Debug mode: every step also checks that q, k, v are finite and that q is the
        same on every rank (a checksum, one extra small collective per step).

    Attributes
    ----------
    strategy : str
        The strategy that runs (``"auto"`` resolved, agreed by every rank).
    problem : Problem
        The agreed shapes and dtype.
    """

    @entry_point
    def __init__(
        self,
        batch: int,
        q_heads: int,
        kv_heads: int,
        head_dim: int,
        *,
        q_len: int = 1,
        dtype: Any = np.float32,
        comm: MPI.Intracomm | None = None,
        scale: float | None = None,
        strategy: str = "auto",
        node_size: int | None = None,
        deterministic: bool | str = False,
        validate: bool = False,
        block_size: int | None = None,
    ) -> None:
        comm = check_comm(comm)

        def prepare():
            problem = Problem.of(batch, q_heads, kv_heads, head_dim, q_len, dtype)
            options = Options.resolve(
                problem.head_dim, strategy, scale, deterministic, node_size, validate,
                block_size=block_size, invariant=True,
            )  # fmt: skip
            sig = {**problem.signature(), **options.signature()}
            if options.deterministic == INVARIANT:
                invariant_signature(sig)
            merge = (problem.rows, problem.head_dim, problem.acc, options)
            return Call(sig, (problem, options), merge=merge)

        call, self._merger = agree_merger(comm, prepare, owned=True)
        self.problem, self.options = call.payload
        self.strategy = self._merger.strategy
        self.comm = comm
        self._ranks = comm.Get_size()  # for repr, which may run after MPI.Finalize()
        limit_blas_threads()
        self._lazy = _LazyStep(self)
        self._fast = None  # (layout, Prepared) of the last step that ran the full checks

    @property
    def scale(self) -> float:
        """The logit scale every rank agreed on."""
        return self.options.scale

    @property
    def node_size(self) -> int:
        """The virtual node size (0: real nodes) the plan's merges run on."""
        return self.options.node_size

    @entry_point
    def decode(
        self,
        q: Array,
        k: Array,
        v: Array,
        *,
        kv_len: Array | None = None,
        q_pos: Array | None = None,
        k_pos: Array | None = None,
        mask: Array | None = None,
        return_lse: bool = False,
        kv_start: int | None = None,
        kv_blocks: Array | None = None,
    ) -> Array | tuple[Array, Array]:
        """Run one decode step; collective over the plan's communicator.

        Parameters
        ----------
        q : array
            ``(B, Hq, Sq, D)``, identical on every rank: numpy, or torch/CuPy/JAX.
        k, v : array
            ``(B, Hkv, T, D)``: this rank's shard; ``T`` may differ per rank and be 0.
        kv_len, q_pos, k_pos, mask
            As in :func:`mpitree.tree_decode`.
        return_lse : bool, optional
            Also return the log-sum-exp.
        kv_start, kv_blocks
            This shard's place in the sequence, in ``deterministic="invariant"``
            mode only (give one): as in :func:`mpitree.tree_decode`.

        Returns
        -------
        out : array
            ``(B, Hq, Sq, D)`` in q's framework, dtype and device; 0 for rows that see
            no key.
        lse : array
            ``(B, Hq, Sq)``, float32, natural log; -inf for rows that see no key.
            Only with ``return_lse=True``.

        Raises
        ------
        Exception
            On every rank when any rank's inputs are invalid or do not match the
            plan; the plan stays usable.
        """
        args = (q, k, v, kv_len, q_pos, k_pos, mask)
        if self.options.deterministic == INVARIANT:
            return self._invariant(args, kv_start, kv_blocks, return_lse)
        if self.options.validate:
            step = agree(self.comm, lambda: self._validated(args)).payload
        else:
            step = self._lazy
            step.args, step.step = args, None
        if kv_start is not None or kv_blocks is not None:  # refused inside the merge's guard
            step = functools.partial(_placement_unused, kv_start, kv_blocks)
        records = self._merger.merge(step)
        return finish(records.reshape(*self.problem.row_shape, -1), q, return_lse, inputs=args[:3])

    def _invariant(self, args, kv_start, kv_blocks, return_lse):
        """One ``deterministic="invariant"`` step: leaves, pieces, the canonical tree."""
        problem, opts = self.problem, self.options
        checked = None
        if opts.validate:
            checked = agree(self.comm, lambda: self._validated(args)).payload

        def local():
            step = checked if checked is not None else self._step(args)
            return invariant_pieces(step, opts.block_size, kv_start, kv_blocks, problem.acc)

        records = self._merger.merge(local)
        return finish(records.reshape(*problem.row_shape, -1), args[0], return_lse, inputs=args[:3])

    def _step(self, args):
        """Check one step's inputs against the plan; return its :class:`Attention`."""
        problem, step = local_attention(*args, self.options.scale)
        if problem != self.problem:
            raise ValueError(f"inputs {problem} do not match the plan's {self.problem}")
        return step

    def _validated(self, args):
        """Validate mode: the step's :class:`Call`, with finiteness and q's checksum."""
        step = self._step(args)
        sig = validated(step, {**self.problem.signature(), **self.options.signature()})
        if self.options.deterministic == INVARIANT:
            invariant_signature(sig)
        return Call(sig, step)

    def free(self) -> None:
        """Release the plan's MPI request (buffers go with the object)."""
        if self._merger is not None:
            self._merger.free()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()

    def __repr__(self):
        return f"DecodePlan({self.problem}, strategy={self.strategy!r}, ranks={self._ranks})"


class _LazyStep:
    """A plan step whose local checks run inside the merge's guard (no extra collective).

    Fast path: when a step has the layout (:func:`_layout`) of the last step that
    passed the full checks, and no positions or mask, only what can change within
    a layout is checked (K and V lengths agree, ``kv_len`` in range) and the C
    kernel runs with its prepared arguments. Any other step takes the full checks.
    """

    def __init__(self, plan):
        self.plan, self.args, self.step = plan, None, None
        self.q_len = plan.problem.q_len

    def fill(self, records):
        """Validate against the plan, then compute this shard's state."""
        plan, args = self.plan, self.args
        fast = plan._fast
        if (
            fast is not None
            and FAST_PATH
            and args[4] is None
            and args[5] is None
            and args[6] is None
        ):
            q, k, v, kv_len = args[:4]
            if _layout(q, k, v, kv_len) == fast[0] and self._fast(
                fast[1], q, k, v, kv_len, records
            ):
                return
        plan._fast = None
        self.step = plan._step(args)
        self.step.fill(records)
        self._prepare(records)

    def _fast(self, prepared, q, k, v, kv_len, records):
        """Run the prepared kernel if this step's length-dependent checks pass; else False."""
        t = k.shape[2]
        if v.shape[2] != t:
            return False
        if self.q_len > 1 and self.q_len > max(
            1, BLOCK_SCORES // max(1, self.plan.problem.batch * self.plan.problem.q_heads * t)
        ):
            return False  # a prompt: attend() splits it into blocks of rows
        lens = None
        if kv_len is not None:
            values = kv_len.tolist()
            if min(values) < 0 or max(values) > t:
                return False  # the full checks raise the error
            lens = prepared.lens
            lens[:] = values
        prepared.run(q, k, v, lens, records)
        return True

    def _prepare(self, records):
        """After a step passed the full checks: keep its layout and kernel arguments."""
        plan, step = self.plan, self.step
        q, k, v, kv_len, q_pos, k_pos, mask = self.args
        if q_pos is not None or k_pos is not None or mask is not None:
            return
        layout = _layout(q, k, v, kv_len)
        if layout is None or records.dtype != np.float32 or not records.flags.c_contiguous:
            return
        prepared = Prepared.of(q, k, v, step.scale)
        if prepared is not None:
            plan._fast = (layout, prepared)

    def block(self):
        """See :meth:`Attention.block`."""
        if self.step is None:  # the fast path ran: the ring needs the checked step
            self.step = self.plan._step(self.args)
        return self.step.block()

    def attend_block(self, *args):
        """See :meth:`Attention.attend_block`."""
        if self.step is None:
            self.step = self.plan._step(self.args)
        self.step.attend_block(*args)


@entry_point
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
    comm = check_comm(comm)
    options = dict(strategy=strategy, scale=scale, deterministic=deterministic)
    options.update(validate=validate, node_size=node_size, block_size=block_size, invariant=True)

    key = None
    if (
        kv_len is None
        and q_pos is None
        and k_pos is None
        and mask is None
        and kv_start is None
        and kv_blocks is None
        and validate is False
        and block_size is None
    ):
        key = _options_key(strategy, scale, deterministic, node_size)

    def prepare():
        cache = None
        if key is not None:
            layout = _layout(q, k, v, None)
            if layout is not None:
                cache, full = _recurring_calls(), (layout, key)
                found = cache.get(full)
                if found is not None:
                    hit = found.call_for(q, k, v)
                    if hit is not None:
                        cache.move_to_end(full)
                        return hit
        problem, opts, step, sig = prepare_attention(q, k, v, kv_len, q_pos, k_pos, mask, options)
        blocks = None
        if opts.deterministic == INVARIANT:
            invariant_signature(sig)
            blocks = check_placement(int(step.k.shape[2]), opts.block_size, kv_start, kv_blocks)
        else:
            _placement_unused(kv_start, kv_blocks)
        merge = (problem.rows, problem.head_dim, problem.acc, opts)
        call = Call(sig, (problem, opts, step, blocks), merge=merge)
        if cache is not None:
            _remember(full, call, step)
        return call

    call, merger = agree_merger(comm, prepare, like=_staged(q))
    problem, opts, step, blocks = call.payload
    limit_blas_threads()
    if blocks is not None:

        def local():
            return local_pieces(blocks, leaf_records(step, opts.block_size, len(blocks), acc))

        acc = problem.acc
        records = merger.merge(local).reshape(*problem.row_shape, -1)
        return finish(records, q, return_lse, inputs=(q, k, v))
    records = merger.merge(step)
    return finish(records.reshape(*problem.row_shape, -1), q, return_lse, inputs=(q, k, v))


@entry_point
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
    comm = check_comm(comm)

    key = _options_key(strategy, None, deterministic, node_size)

    def prepare():
        if type(state) is State and key is not None:
            full = (state.records.shape, state.records.dtype, key)
            found = _state_calls.get(full)
            if found is not None:
                return Call(found.signature, None, op=found.op, key=full, merge=found.merge)
        if not isinstance(state, State):
            raise TypeError(f"state must be an mpitree.State, got {type(state).__name__}")
        opts = Options.resolve(state.head_dim, strategy, None, deterministic, node_size)
        if opts.strategy == "ring":
            raise ValueError("strategy 'ring' moves K/V; use tree_decode for it")
        acc = dtype_name(state.records.dtype)
        sig = {"rows": tuple(state.shape), "head_dim": state.head_dim, "dtype": acc}
        sig.update(opts.signature())
        merge = (math.prod(state.shape), state.head_dim, acc, opts)
        if type(state) is not State or key is None:
            return Call(sig, None, merge=merge)
        call = Call(sig, None, key=full, merge=merge)
        if len(_state_calls) < _RECURRING_SIZE:
            _state_calls[full] = call
        return call

    call, merger = agree_merger(comm, prepare)
    rows = call.merge[0]
    records = state.records

    def fill(out):
        out[...] = records.reshape(rows, -1)

    return State(merger.merge(fill).reshape(records.shape).copy())
