"""A reusable decode plan: validated once, buffers and requests preallocated."""

import numpy as np

from ._local import attend, visibility
from ._reduce import Reducer, resolve_strategy
from ._ring import ring_reduce
from ._runtime import default_comm, limit_blas_threads
from ._state import State
from ._topology import node_size as resolve_node_size
from ._validate import (
    Shapes,
    agree,
    check_comm,
    check_finite,
    check_masking,
    check_shapes,
    check_strategy,
    checksum,
    resolve_scale,
)


def _invalid_elsewhere(rank):
    """Return the error raised on ranks whose own input was fine."""
    return ValueError(f"mpitree: invalid input on rank {rank} (see that rank's error)")


class DecodePlan:
    """A decode step for fixed shapes, reusable across a decode loop.

    Construction is collective over ``comm``: it checks with one small collective
    that every rank agrees on the shapes, dtype, scale and strategy, and
    preallocates the state buffer (and a persistent ``MPI_Allreduce_init``
    request where the MPI library supports it). Each :meth:`decode` then pays
    only for local attention and one collective. Free it with :meth:`free`, or
    use it as a context manager.

    Parameters
    ----------
    batch, q_heads, kv_heads, head_dim : int
        ``B``, ``Hq``, ``Hkv`` (``Hq % Hkv == 0``) and ``D``.
    q_len : int, optional
        ``Sq``, query tokens per step (default 1).
    dtype : numpy dtype, optional
        dtype of q, k, v: float16, float32 (default) or float64.
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
    deterministic : bool, optional
        Merge the ranks' states in a fixed (rank) order, so that repeated runs with
        the same ranks and data are bitwise identical whatever order messages
        arrive in. Costs an all-gather of the states instead of an all-reduce.
    validate : bool, optional
        Debug mode: every step also checks that q, k, v are finite and that q is the
        same on every rank (a checksum, one extra small collective per step).
    """

    def __init__(
        self,
        batch,
        q_heads,
        kv_heads,
        head_dim,
        *,
        q_len=1,
        dtype=np.float32,
        comm=None,
        scale=None,
        strategy="auto",
        node_size=None,
        deterministic=False,
        validate=False,
    ):
        def inspect():
            q = np.empty((batch, q_heads, q_len, head_dim), dtype=dtype)
            kv = np.empty((batch, kv_heads, 0, head_dim), dtype=dtype)
            return check_shapes(q, kv, kv)

        comm, shapes, scale, node_size = checked_call(
            comm,
            None,
            None,
            None,
            scale=scale,
            kv_len=None,
            q_pos=None,
            k_pos=None,
            mask=None,
            strategy=strategy,
            node_size=node_size,
            deterministic=deterministic,
            inspect=inspect,
        )
        self._setup(comm, shapes, scale, strategy, node_size, deterministic, validate, True)

    @classmethod
    def _agreed(cls, comm, shapes, scale, strategy, node_size, deterministic):
        """Build a one-shot plan for inputs already checked and agreed on."""
        plan = cls.__new__(cls)
        plan._setup(comm, shapes, scale, strategy, node_size, deterministic, False, False)
        return plan

    def _setup(self, comm, shapes, scale, strategy, node_size, deterministic, validate, persistent):
        """Allocate buffers and the reduction for a validated problem."""
        limit_blas_threads()
        self.comm = comm
        self.shapes = shapes
        self.scale = scale
        self.validate = validate
        self._agreement = dict(node_size=node_size, deterministic=deterministic)
        self._requested = strategy
        self.strategy = resolve_strategy(strategy, comm, node_size, deterministic)
        rows = shapes.rows
        if self.strategy == "ring":
            self._reducer = None
            self._records = np.empty((rows, shapes.head_dim + 2), dtype=shapes.acc_dtype)
        else:
            self._reducer = Reducer(
                comm, rows, shapes.head_dim, shapes.acc_dtype, self.strategy, persistent=persistent
            )
            self._records = self._reducer.records

    def decode(self, q, k, v, *, kv_len=None, q_pos=None, k_pos=None, mask=None, return_lse=False):
        """Run one decode step; collective over the plan's communicator.

        Parameters
        ----------
        q : numpy.ndarray
            ``(B, Hq, Sq, D)``, identical on every rank.
        k, v : numpy.ndarray
            ``(B, Hkv, T, D)``: this rank's shard; ``T`` may differ per rank and be 0.
        kv_len, q_pos, k_pos, mask
            As in :func:`mpitree.tree_decode`.
        return_lse : bool, optional
            Also return the log-sum-exp.

        Returns
        -------
        out : numpy.ndarray
            ``(B, Hq, Sq, D)`` in q's dtype; 0 for rows that see no key.
        lse : numpy.ndarray
            ``(B, Hq, Sq)``, float32, natural log; -inf for rows that see no key.
            Only with ``return_lse=True``.
        """
        error = lens = vis = None
        try:
            shapes = check_shapes(q, k, v)
            if shapes != self.shapes:
                raise ValueError(f"inputs {shapes} do not match the plan's {self.shapes}")
            check_masking(shapes, k.shape[2], kv_len, q_pos, k_pos, mask)
            lens, vis = visibility(shapes, k.shape[2], kv_len, q_pos, k_pos, mask)
            if self.validate:
                check_finite(q, k, v)
        except (TypeError, ValueError) as exc:
            error = exc
        if self.validate:
            agree(
                self.comm,
                error,
                self.shapes,
                self._requested,
                self.scale,
                q_sum=0 if error else checksum(q),
                **self._agreement,
            )
        sh = self.shapes
        records = self._records.reshape(sh.batch, sh.q_heads, sh.q_len, sh.head_dim + 2)
        if self.strategy == "ring":
            bad = ring_reduce(self.comm, q, k, v, self.scale, lens, vis, records, error is not None)
        else:
            if error is None:
                attend(q, k, v, self.scale, lens, vis, records)
            bad = self._reducer.run(failed=error is not None)
        if error is not None:
            raise error
        if bad is not None:
            raise _invalid_elsewhere(bad)
        state = State(records)
        out = state.output(q.dtype)
        return (out, state.lse()) if return_lse else out

    def free(self):
        """Release the plan's MPI request (buffers go with the object)."""
        if self._reducer is not None:
            self._reducer.free()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()

    def __repr__(self):
        return (
            f"DecodePlan({self.shapes}, strategy={self.strategy!r}, ranks={self.comm.Get_size()})"
        )


def checked_call(
    comm,
    q,
    k,
    v,
    *,
    scale,
    kv_len,
    q_pos,
    k_pos,
    mask,
    strategy="auto",
    node_size=None,
    deterministic=False,
    validate=False,
    extra=None,
    inspect=None,
):
    """Validate one call's inputs locally, then agree across ranks (raising on all ranks).

    ``inspect()``, if given, validates the inputs and returns their :class:`Shapes`
    (for plans and framework adapters); by default q, k, v and the masking
    arguments are checked as numpy arrays. ``extra``, if given, is one more local
    check. Both raise TypeError/ValueError. Returns the resolved
    ``(comm, shapes, scale, node_size)``. One small collective.
    """
    comm = default_comm() if comm is None else comm
    check_comm(comm)
    error = shapes = None
    try:
        check_strategy(strategy)
        if inspect is not None:
            shapes = inspect()
        else:
            shapes = check_shapes(q, k, v)
            check_masking(shapes, k.shape[2], kv_len, q_pos, k_pos, mask)
        scale = resolve_scale(scale, shapes.head_dim)
        node_size = resolve_node_size(node_size)
        if validate:
            check_finite(q, k, v)
        if extra is not None:
            extra()
    except (TypeError, ValueError) as exc:
        error = exc
    q_sum = checksum(q) if validate and error is None else 0
    agree(
        comm,
        error,
        shapes,
        strategy,
        scale,
        node_size=node_size,
        deterministic=deterministic,
        q_sum=q_sum,
    )
    return comm, shapes, scale, node_size


def tree_decode(
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
):
    """Exact attention of replicated queries over a KV cache sharded along the sequence.

    Collective over ``comm``: every rank passes the same ``q`` and its own shard of
    keys and values, and every rank receives the attention output over the
    concatenation of all shards (in any order: the merge is commutative), as one
    process would compute it. Only per-row states of ``D + 2`` numbers travel.

    Parameters
    ----------
    q : numpy.ndarray
        ``(B, Hq, Sq, D)``, float16/float32/float64, identical on every rank.
    k, v : numpy.ndarray
        ``(B, Hkv, T, D)``, same dtype as ``q``: this rank's shard; ``T`` may
        differ between ranks and may be 0. ``Hq % Hkv == 0`` (GQA/MQA: query head
        ``h`` uses kv head ``h // (Hq // Hkv)``; K/V are never repeated).
    comm : mpi4py.MPI.Intracomm, optional
        Default: mpitree's private duplicate of ``COMM_WORLD``.
    scale : float, optional
        Logit scale, default ``1/sqrt(D)``.
    kv_len : numpy.ndarray, optional
        int ``(B,)``: valid keys per batch row in this shard; keys at index
        ``>= kv_len[b]`` are ignored.
    q_pos, k_pos : numpy.ndarray, optional
        int ``(B, Sq)`` and ``(B, T)``: global positions; key j is visible to
        query i iff ``k_pos[b, j] <= q_pos[b, i]``. Give both or neither.
    mask : numpy.ndarray, optional
        bool, broadcastable to ``(B, Hq or 1, Sq, T)``; True = attend. Combines
        with ``kv_len`` and positions (a key must pass all three).
    strategy : str, optional
        ``"allreduce"`` (one MPI_Allreduce with a native user op),
        ``"allreduce3"`` (the paper's Algorithm 3: MAX then two SUMs),
        ``"allgather"`` (gather states, merge locally), ``"ring"`` (Ring
        Attention baseline: K/V travel the ring), ``"hierarchical"`` (reduce
        inside each node, all-reduce among node leaders, broadcast inside nodes)
        or ``"auto"`` (default: ``"allreduce"`` on one node, ``"hierarchical"``
        across nodes; without the native op, ``"allgather"`` up to 8 ranks and
        ``"allreduce3"`` beyond).
    return_lse : bool, optional
        Also return the log-sum-exp.
    deterministic, validate, node_size
        As in :class:`DecodePlan`. In validate mode q's checksum joins the one
        agreement collective every call already makes.

    Returns
    -------
    out : numpy.ndarray
        ``(B, Hq, Sq, D)`` in q's dtype; 0 for rows that see no key on any rank.
    lse : numpy.ndarray
        ``(B, Hq, Sq)``, float32, natural log; -inf for rows that see no key.
        Only with ``return_lse=True``.

    Raises
    ------
    TypeError, ValueError
        On every rank, when any rank's input is invalid or ranks disagree on
        shapes, dtype, scale or strategy.

    Examples
    --------
    >>> out = mpitree.tree_decode(q, k_shard, v_shard)  # doctest: +SKIP
    """
    comm, shapes, scale, node_size = checked_call(
        comm,
        q,
        k,
        v,
        scale=scale,
        kv_len=kv_len,
        q_pos=q_pos,
        k_pos=k_pos,
        mask=mask,
        strategy=strategy,
        node_size=node_size,
        deterministic=deterministic,
        validate=validate,
    )
    plan = DecodePlan._agreed(comm, shapes, scale, strategy, node_size, deterministic)
    with plan:
        return plan.decode(
            q, k, v, kv_len=kv_len, q_pos=q_pos, k_pos=k_pos, mask=mask, return_lse=return_lse
        )


def allreduce_state(
    state, comm=None, strategy="auto", *, check=True, deterministic=False, node_size=None
):
    """Merge a :class:`State` across ranks; every rank gets the merged state.

    Parameters
    ----------
    state : State
        ``(..., D + 2)`` records, the same row shape and dtype on every rank.
    comm : mpi4py.MPI.Intracomm, optional
        Default: mpitree's private duplicate of ``COMM_WORLD``.
    strategy : {"auto", "allreduce", "allreduce3", "allgather", "hierarchical"}, optional
        ``"ring"`` needs K/V and is only available through :func:`tree_decode`.
    check : bool, optional
        Check cross-rank agreement on shape, dtype and strategy first (one small
        extra collective). Pass False in a loop once the shapes are known good.
    deterministic, node_size
        As in :class:`DecodePlan`.

    Returns
    -------
    State
        A new state with the same row shape and dtype.
    """
    comm = default_comm() if comm is None else comm
    check_comm(comm)
    error = shapes = None
    try:
        if not isinstance(state, State):
            raise TypeError(f"state must be an mpitree.State, got {type(state).__name__}")
        check_strategy(strategy)
        if strategy == "ring":
            raise ValueError("strategy 'ring' moves K/V; use tree_decode for it")
        rows = int(np.prod(state.shape))
        shapes = Shapes(rows, 1, 1, 1, state.head_dim, state.records.dtype)
        node_size = resolve_node_size(node_size)
    except (TypeError, ValueError) as exc:
        error = exc
    if check:
        agree(comm, error, shapes, strategy, node_size=node_size, deterministic=deterministic)
    elif error is not None:
        raise error
    strategy = resolve_strategy(strategy, comm, node_size, deterministic)
    reducer = Reducer(
        comm, shapes.rows, shapes.head_dim, shapes.dtype, strategy, node_size=node_size
    )
    reducer.records[...] = state.records.reshape(shapes.rows, -1)
    bad = reducer.run()
    if bad is not None:
        raise _invalid_elsewhere(bad)
    return State(reducer.records.reshape(state.records.shape).copy())
