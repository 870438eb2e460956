"""DecodePlan: a decode step agreed once for fixed shapes, reused across a decode loop."""

from __future__ import annotations

import functools
import threading
from typing import Any

import numpy as np
from mpi4py import MPI

from ._agreed import agree_merger
from ._buffers import merged_alone
from ._checks import Problem, lane_output, output_error
from ._guard import Call, agree, check_comm, entry_point
from ._invariant_step import (
    _placement_unused,
    check_arithmetic,
    invariant_pieces,
    invariant_signature,
)
from ._library import address
from ._namespace import Array, is_array, namespace
from ._options import INVARIANT, Options
from ._runtime import limit_blas_threads
from ._state import finish, lse_of
from ._steps import Step
from ._traffic import hook

FAST_PATH = True  # plans skip re-validating an unchanged layout (False: benchmarks, tests)
_full_blocks = 0  # open extend.tools.full_checks blocks: FAST_PATH is (_full_blocks == 0)
_full_lock = threading.Lock()


def _decode_lane(
    plan,
    q,
    k,
    v,
    *,
    kv_len=None,
    q_pos=None,
    k_pos=None,
    mask=None,
    return_lse=False,
    kv_start=None,
    kv_blocks=None,
    out=None,
):
    """:meth:`DecodePlan.decode`'s lane: the plan's step in one compiled call; else None.

    It runs where the plan's step is bound once (:meth:`Step.compile
    <mpitree._steps.Step.compile>`), the step has no positions or placement, and
    a mask only as the kernel reads it (a C-contiguous bool numpy array
    ``(B, Hm, Sq, T)`` of the bound ``(B, Hm, Sq)``; ``return_lse`` a bool;
    ``out``, if given, a writeable C-contiguous float32 numpy array of q's
    shape), the fast path is on (no :class:`full_checks`
    block) and no observer is on the phase hook (``phase_times`` times the
    guarded path's phases), and its arrays, ``kv_len`` included (None, or a
    numpy integer array of the bound dtype and shape ``(B,)`` with every value
    in ``[0, T]``: a fixed-capacity cache's), have the layout of the last step
    that passed the full checks (:meth:`KernelSlot.load
    <mpitree._step.KernelSlot.load>`): the kernel over the shard (keys past a
    row's ``kv_len`` unread), the merge (this rank's flag clear) and the output,
    as the guarded path's fast branch computes them, bit for bit. Otherwise it
    returns None before any collective, and :meth:`DecodePlan.decode` runs: its
    merge is the same collective, so a rank whose checks fail there (a
    ``kv_len`` out of range, say) raises on every rank, those here included
    (:meth:`Merger.merge_layer <mpitree._merger.Merger.merge_layer>`).
    """
    try:
        compiled = plan._compiled
        if (
            compiled is None
            or q_pos is not None
            or k_pos is not None
            or (return_lse is not False and return_lse is not True)
            or kv_start is not None
            or kv_blocks is not None
            or not FAST_PATH
            or hook.observer is not None
            or not plan._step.kernel.load(q, k, v, kv_len, compiled.struct, mask)
        ):
            return None
        out = lane_output(out, q.shape)
        if out is None:
            return None  # the guarded path checks it and says what is wrong
        target = address(out)
    except Exception:  # nothing has communicated: the guarded path decides
        return None
    merger = plan._merger
    merger.merge_layer(compiled, target)
    if return_lse:  # the merged records stay in the merger's buffer until its next merge
        return out, lse_of(merger.records.reshape(*plan.problem.row_shape, -1))
    return out


class DecodePlan:
    """A decode step for fixed shapes, reusable across a decode loop.

    Construction is collective over ``comm``: one small agreement collective
    checks that every rank agrees on the shapes, dtype, scale and strategy, and
    the plan's merger preallocates the record buffer (and a persistent
    ``MPI_Allreduce_init`` request where the MPI library supports it). Each
    :meth:`decode` then pays only for local attention and one collective, which
    also carries every rank's verdict on its own inputs; a step over host float32
    numpy arrays with the layout of the last step that passed the full checks
    (``kv_len`` and a C-contiguous bool ``(B, Hm, Sq, T)`` mask allowed, no
    positions) runs as one compiled call where the merge is one persistent
    all-reduce or there is one rank (its step bound once).
    Free it with :meth:`free` or a ``with`` block; a plan that is dropped frees its
    request when it is collected.

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
    like : array, optional
        An array of the framework and on the device that every step's q, k and v
        will have (e.g. ``torch.empty(0, device="cuda:1")``, or the first step's q);
        only its framework and device are read, not its shape or dtype. The plan's
        records then live in the memory the strategy merges in for such arrays,
        allocated once here: device memory for ``strategy="nccl"`` and
        ``"device-node"`` (torch tensors; the merge runs on the device), pinned host
        memory for CUDA tensors under a host strategy, host memory otherwise. Every
        step's arrays must then be of that framework and device (torch: the same
        ``tensor.device``), else an error on every rank. Default None: host records,
        and arrays of any framework and device (their records staged through the host).

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
        like: Any = None,
    ) -> None:
        comm = check_comm(comm)
        staged = None if like is None or isinstance(like, np.ndarray) else like

        def prepare():
            where = None if like is None else _where(like)
            problem = Problem.of(batch, q_heads, kv_heads, head_dim, q_len, dtype)
            options = Options.resolve(
                problem.head_dim, strategy, scale, deterministic, node_size, validate,
                block_size=block_size, invariant=True,
            )  # fmt: skip
            sig = {**problem.signature(), **options.signature()}
            if options.deterministic == INVARIANT:
                invariant_signature(sig)
            merge = (problem.rows, problem.head_dim, problem.acc, options)
            return Call(sig, (problem, options, where), merge=merge)

        call, self._merger = agree_merger(comm, prepare, like=staged, owned=True, dtype=dtype)
        self.problem, self.options, self._where = call.payload
        self._arithmetic = call.signature.get("kernel")  # invariant mode: what ranks agreed
        self.strategy = self._merger.strategy
        self.comm = comm
        self._ranks = comm.Get_size()  # for repr, which may run after MPI.Finalize()
        limit_blas_threads()
        self._step = Step(call, self.problem, self.options)  # its kernel: the last checked layout
        # its fast form (decode's lane): numpy arrays only, which a plan for others refuses
        self._compiled = self._step.compile(self._merger) if staged is None else None
        opts = self.options
        if self._ranks == 1 and opts.deterministic != INVARIANT and self._merger.kind.host_memory:
            merged_alone(self._merger.records)  # a device kernel may keep them on the device

    @property
    def scale(self) -> float:
        """The logit scale every rank agreed on."""
        return self.options.scale

    @property
    def node_size(self) -> int:
        """The virtual node size (0: real nodes) the plan's merges run on."""
        return self.options.node_size

    @entry_point(lane=_decode_lane)
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
        out: Array | None = None,
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
        out : array, optional
            ``(B, Hq, Sq, D)`` of q's framework (not JAX), dtype and device: the
            output is written into it and it is returned, as FlashInfer's
            ``run(..., out=)`` and vLLM's preallocated ``output`` do. With torch
            tensors and ``MPITREE_KERNEL=triton`` a step then allocates nothing
            (docs/frameworks.md, "CUDA graphs"); default: a new array each step.

        Returns
        -------
        out : array
            ``(B, Hq, Sq, D)`` in q's framework, dtype and device; 0 for rows that see
            no key. ``out`` itself where it was given (unless torch tracks gradients
            through q, k or v: then a copy tied to them).
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
        opts, step = self.options, self._step
        checked = None
        if opts.validate:
            checked = agree(self.comm, functools.partial(step.validated, args)).payload
        if opts.deterministic == INVARIANT:  # leaves, pieces, the canonical tree
            local = functools.partial(self._pieces, args, checked, kv_start, kv_blocks)
        elif kv_start is not None or kv_blocks is not None:  # refused inside the merge's guard
            local = functools.partial(_placement_unused, kv_start, kv_blocks)
        elif checked is not None:
            local = checked
        else:
            local = step
            step.args, step.checked, step.fast = args, None, FAST_PATH
        problem = self.problem
        if out is not None:  # a bad one is refused inside the merge's guard
            bad = output_error(out, q, (*problem.row_shape, problem.head_dim))
            local = local if bad is None else functools.partial(_refuse, bad)
        if self._where is not None:  # a plan made for arrays like ``like``: refused elsewhere
            bad = _misplaced(self._where, q)
            local = local if bad is None else functools.partial(_refuse, bad)
        records = self._merger.merge(local).reshape(*problem.row_shape, -1)
        return finish(records, q, return_lse, inputs=args[:3], out=out)

    def _pieces(self, args, checked, kv_start, kv_blocks):
        """Return a ``deterministic="invariant"`` step's local work: this shard's pieces."""
        check_arithmetic(self._arithmetic)
        att = checked if checked is not None else self._step.check(args)
        opts = self.options
        return invariant_pieces(att, opts.block_size, kv_start, kv_blocks, self.problem.acc)

    def free(self) -> None:
        """Release the plan's MPI request (buffers go with the object); collective.

        Call it on every rank of the plan's communicator, as its construction was:
        a freed plan still decodes, with a blocking all-reduce in place of its
        persistent one, and those two do not match each other across ranks.
        """
        if self._merger is not None:
            self._merger.free()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()

    def __repr__(self):
        like = "" if self._where is None else f", like={_placed(self._where)}"
        return f"DecodePlan({self.problem}, strategy={self.strategy!r}, ranks={self._ranks}{like})"


def _where(like):
    """Return where ``like`` lives (its namespace's :meth:`device`); raise if not an array."""
    if not is_array(like):
        kind = type(like)
        raise TypeError(
            "mpitree: like= takes a numpy, torch, CuPy or JAX array (of the steps' framework "
            f"and device), got {kind.__module__}.{kind.__qualname__}"
        )
    return namespace(like).device(like)


_ARRAYS = {"torch": "torch tensors", "cupy": "CuPy arrays", "jax": "JAX arrays"}


def _placed(where):
    """Name the arrays that live at ``where`` (:func:`_where`): for an error, the repr."""
    if len(where) == 1:
        return "numpy arrays"
    device = where[1]
    if isinstance(device, tuple):  # JAX: the devices of the array's sharding
        device = ", ".join(map(str, device))
    return f"{_ARRAYS.get(where[0], where[0])} on {device}"


def _misplaced(where, q):
    """Return the error of a step whose q does not live at ``where`` (:func:`_where`), or None.

    Never raises: a q that is no array is left to the step's own checks.
    """
    try:
        got = namespace(q).device(q)
    except Exception:
        return None
    if got == where:
        return None
    return ValueError(
        f"mpitree: this DecodePlan was made for {_placed(where)} (like=) and its records live "
        f"there; got {_placed(got)} (make a plan for them, with like= one of them)"
    )


def _refuse(error, *records):
    """Raise ``error`` as a step's local work (a bad ``out``): every rank raises it."""
    raise error


def plan_merger(plan):
    """Return the merger a :class:`DecodePlan`'s steps merge through (local).

    For benchmarks: ``plan_merger(plan).merge(lambda records: None)`` times one
    step's merge alone, the local work already done. The merger belongs to the
    plan (``plan.free()`` frees it).

    Parameters
    ----------
    plan : DecodePlan
        A plan not yet freed.

    Returns
    -------
    Merger
        Its records buffer ``merger.buf`` is ``(rows + 1, D + 2)`` in the plan's
        accumulation dtype (the last record: the failure flag). An
        ``InvariantMerger`` for a ``deterministic="invariant"`` plan.
    """
    if not isinstance(plan, DecodePlan):
        raise TypeError(f"mpitree: plan_merger takes a DecodePlan, not {type(plan).__name__}")
    return plan._merger


class full_checks:
    """Inside a ``with`` block, every :class:`DecodePlan` step takes the full checks (local).

    A plan normally skips re-validating a step whose layout is unchanged (its
    fast path). For benchmarks and tests, this turns the fast path off in this
    process while any block is open, so a step costs what it costs without it;
    the results are the same. The fast path comes back when the last open block
    ends, in whatever order blocks end (nested, the same instance re-entered, a
    generator's block closed inside a later one, another thread's). Cheap to
    enter, so a benchmark may wrap single steps.

    Examples
    --------
    >>> with extend.tools.full_checks():              # doctest: +SKIP
    ...     plan.decode(q, k, v)                      # re-validated
    """

    __slots__ = ()

    def __enter__(self):
        global FAST_PATH, _full_blocks
        with _full_lock:
            _full_blocks += 1
            FAST_PATH = False

    def __exit__(self, *exc):
        global FAST_PATH, _full_blocks
        with _full_lock:
            if _full_blocks == 0:
                raise RuntimeError("mpitree: a full_checks block left more often than entered")
            _full_blocks -= 1
            FAST_PATH = _full_blocks == 0
        return False
