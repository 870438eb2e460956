"""Speculative decoding: pack a beam of draft candidates into a prefix tree, verify it.

A draft model proposes a beam of ``M`` candidate continuations of ``C`` tokens.
They share prefixes; packing deduplicates common *prefixes* (not tokens) into a
prefix tree whose ``L <= M * C`` nodes form one sequence, with a causal mask that
is exactly the tree, so one target-model forward pass verifies every candidate.

The functions are vectorised (no Python loop over tokens or beams) and take
numpy, torch or CuPy integer arrays through one code path; torch and CuPy are
recognised from ``sys.modules`` and never imported here. Results live on the
beam's device.

Example (the seed's)::

    beam = [[Mars is a red], [Mars is reddish when], [Mars is dark red]]
    dedup_prefix(beam)        -> [[0 0 0 0], [0 0 1 1], [0 0 2 2]]
    pack(beam).token_indices  -> [0 1 2 3 6 7 10 11]
    pack(beam).unpack_map     -> [[0 1 2 3], [0 1 4 5], [0 1 6 7]]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from ._agreed import agree_merger
from ._checks import check_qkv
from ._guard import Call, check_comm, entry_point
from ._namespace import Array, is_array, namespace
from ._registry import needs_kv
from ._state import State, combine_records, finish
from ._step import prepare_attention

__all__ = ["Packed", "dedup_prefix", "greedy_accept", "pack", "unpack", "verify_attention"]


def _check_beam(beam):
    """Validate a (B, M, C) integer beam; return its namespace."""
    if not is_array(beam):
        raise TypeError(f"beam must be a numpy, torch or CuPy array, got {type(beam).__name__}")
    ns = namespace(beam)
    if not ns.is_integer(beam):
        raise TypeError(f"beam must hold integer token ids, got dtype {beam.dtype}")
    if beam.ndim != 3:
        raise ValueError(f"beam must have shape (B, M, C), got {tuple(beam.shape)}")
    if beam.shape[1] < 1 or beam.shape[2] < 1:
        raise ValueError(f"beam needs M >= 1 candidates of C >= 1 tokens, got {tuple(beam.shape)}")
    return ns


def dedup_prefix(beam: Array) -> Array:
    """For every token, the lowest candidate index that shares its whole prefix.

    Parameters
    ----------
    beam : array
        ``(B, M, C)`` integer token ids (numpy, torch or CuPy).

    Returns
    -------
    array
        ``(B, M, C)`` int64: ``tree[b, m, c] = min{m' : beam[b, m', :c+1] == beam[b, m, :c+1]}``.
        A token is a node of the prefix tree where ``tree[b, m, c] == m``.

    Notes
    -----
    Compares every pair of candidates: time and memory ``O(B * M^2 * C)`` (one
    byte per pair and depth). ``B=8, M=64, C=16`` needs 0.5 MB; ``M=1024`` about
    134 MB per 8 batch rows.
    """
    ns = _check_beam(beam)
    same = beam[:, :, None, :] == beam[:, None, :, :]  # (B, M, M', C)
    prefix = ns.cumprod(ns.astype(same, "int64"), -1) > 0  # equal on the whole prefix up to c
    return ns.argmax(ns.astype(prefix, "int64"), 2)  # the first (lowest) match; m itself matches


@dataclass
class Packed:
    """A packed prefix tree: ``B`` batch rows padded to a common length ``L``.

    Attributes
    ----------
    tokens : array
        ``(B, L)`` token ids of the tree's nodes, candidate-major (the seed's order);
        padding slots repeat ``beam[b, 0, 0]``.
    token_indices : array
        ``(B, L)`` int64: index of each packed token in the flattened beam
        (``m * C + c``); 0 in padding slots.
    mask : array
        ``(B, L, L)`` bool: ``mask[b, i, j]`` iff packed token ``j`` is ``i`` or one of
        its ancestors. Padding rows attend only themselves; no row attends padding.
    position_offsets : array
        ``(B, L)`` int64: depth of each packed token within its candidate (0..C-1);
        0 in padding slots.
    unpack_map : array
        ``(B, M, C)`` int64 indices into ``L``: ``tokens[b, unpack_map[b]] == beam[b]``;
        never points at a padding slot.
    valid : array
        ``(B, L)`` bool: False at padding slots (rows pack to different lengths).
    position_ids : array or None
        ``(B, L)`` int64 absolute positions ``context_length[b] + position_offsets``
        when ``pack`` got a ``padding_mask``; else None.
    """

    tokens: object
    token_indices: object
    mask: object
    position_offsets: object
    unpack_map: object
    valid: object
    position_ids: object = None


def pack(beam: Array, padding_mask: Array | None = None) -> Packed:
    """Deduplicate a beam's common prefixes into one sequence with a tree mask.

    Parameters
    ----------
    beam : array
        ``(B, M, C)`` integer token ids (numpy, torch or CuPy).
    padding_mask : array of bool, optional
        ``(B, P)``: the prompts that precede the candidates, True at real tokens
        (left-padded prompts have False at the front). Used for ``position_ids``.

    Returns
    -------
    Packed
        See :class:`Packed`; all arrays on the beam's device.
    """
    ns = _check_beam(beam)
    b, m, c = beam.shape
    tree = dedup_prefix(beam)
    batch = ns.arange(b, beam)[:, None]
    depth = ns.arange(c, beam)
    new = tree == ns.arange(m, beam)[None, :, None]  # (B, M, C): a node of the tree
    new_flat = new.reshape(b, m * c)
    counts = ns.astype(new_flat, "int64").sum(-1)
    length = int(counts.max())
    slots = ns.arange(length, beam)
    valid = slots[None, :] < counts[:, None]
    order = ns.argsort(ns.astype(~new_flat, "int64"))[:, :length]  # nodes first, in beam order
    token_indices = order * valid
    flat = beam.reshape(b, m * c)
    tokens = flat[batch, token_indices]
    offsets = (token_indices % c) * valid
    rank = ns.astype(new_flat, "int64").cumsum(-1) - 1  # packed slot of each node
    unpack_map = rank[batch, (tree * c + depth).reshape(b, m * c)].reshape(b, m, c)
    # j is an ancestor-or-self of i iff depth_j <= depth_i and candidate m_i's
    # prefix of depth_j is node j
    rows = ns.astype(unpack_map, "int32")[batch, token_indices // c]  # (B, L, C): each node's path
    mask = rows[batch[:, :, None], slots[None, :, None], offsets[:, None, :]]  # (B, L, L)
    mask = mask == ns.astype(slots, "int32")[None, None, :]
    mask = mask & (offsets[:, None, :] <= offsets[:, :, None])
    mask = mask & valid[:, None, :] & valid[:, :, None]
    mask = mask | (ns.eye(length, beam)[None] & ~valid[:, :, None])
    position_ids = None
    if padding_mask is not None:
        if tuple(padding_mask.shape[:1]) != (b,) or padding_mask.ndim != 2:
            raise ValueError(
                f"padding_mask must have shape (B, P), got {tuple(padding_mask.shape)}"
            )
        context = ns.astype(padding_mask, "int64").sum(-1)
        position_ids = (context[:, None] + offsets) * valid
    return Packed(tokens, token_indices, mask, offsets, unpack_map, valid, position_ids)


def unpack(x_packed: Array, unpack_map: Array) -> Array:
    """Scatter per-packed-token values back to the beam's layout.

    Parameters
    ----------
    x_packed : array
        ``(B, L, ...)``: e.g. the target model's logits for the packed tokens.
    unpack_map : array
        ``(B, M, C)`` from :func:`pack`.

    Returns
    -------
    array
        ``(B, M, C, ...)``.
    """
    ns = namespace(unpack_map)
    b, m, c = unpack_map.shape
    batch = ns.arange(b, unpack_map)[:, None]
    return x_packed[batch, unpack_map.reshape(b, m * c)].reshape(b, m, c, *x_packed.shape[2:])


def greedy_accept(
    beam: Array, packed: Packed, logits: Array, context_logits: Array | None = None
) -> tuple[Array, Array, Array]:
    """Greedy verification: the candidate whose longest prefix matches the target's argmax.

    Parameters
    ----------
    beam : array
        ``(B, M, C)`` candidate token ids.
    packed : Packed
        ``pack(beam)``.
    logits : array
        ``(B, L, V)``: the target's logits at each packed token (its prediction of
        the token that follows it).
    context_logits : array, optional
        ``(B, V)``: the target's logits at the last context token, which verify each
        candidate's first token. Without them the first token counts as accepted.

    Returns
    -------
    index : array
        ``(B,)`` int64: the accepted candidate (the lowest index among the longest).
    accepted : array
        ``(B,)`` int64: how many of its tokens are accepted (0..C).
    bonus : array
        ``(B,)`` int64: the target's next token after the accepted ones.
    """
    ns = _check_beam(beam)
    b, _, c = beam.shape
    predicted = unpack(ns.astype(logits.argmax(-1), "int64"), packed.unpack_map)  # (B, M, C)
    first = beam[:, :, :1] == beam[:, :, :1]
    if context_logits is not None:
        first = beam[:, :, :1] == ns.astype(context_logits.argmax(-1), "int64")[:, None, None]
    ok = first if c == 1 else ns.concat([first, beam[:, :, 1:] == predicted[:, :, :-1]], -1)
    lengths = ns.astype(ok, "int64").cumprod(-1).sum(-1)  # (B, M)
    index = lengths.argmax(-1)
    batch = ns.arange(b, beam)
    accepted = lengths[batch, index]
    last = predicted[batch, index, (accepted - 1) * (accepted > 0)]
    if context_logits is not None:
        fallback = ns.astype(context_logits.argmax(-1), "int64")
        last = last * (accepted > 0) + fallback * (accepted == 0)
    return ns.astype(index, "int64"), ns.astype(accepted, "int64"), last


@entry_point
def verify_attention(
    q: Array,
    k_context: Array,
    v_context: Array,
    k_tree: Array,
    v_tree: Array,
    tree_mask: Array,
    comm: MPI.Intracomm | None = None,
    *,
    scale: float | None = None,
    kv_len: Array | None = None,
    owner: int | None = None,
    strategy: str = "auto",
    node_size: int | None = None,
    return_lse: bool = False,
) -> Array | tuple[Array, Array]:
    """Attention of packed draft tokens over a sharded context plus their tree, in one reduction.

    Every packed query sees the whole context (sharded across ranks) and, inside the
    packed block, exactly its ancestors and itself (``tree_mask``). The block's
    state is computed on one rank (``owner``) and folded into that rank's context
    state, so the whole verification is one tree reduction per layer. Collective
    over ``comm``; every rank validates every argument, and ranks must agree on
    ``owner``.

    Parameters
    ----------
    q : array
        ``(B, Hq, L, D)``: queries of the packed tokens, identical on every rank.
    k_context, v_context : array
        ``(B, Hkv, T, D)``: this rank's shard of the context's keys and values.
    k_tree, v_tree : array
        ``(B, Hkv, L, D)``: keys and values of the packed tokens (used on ``owner``).
    tree_mask : array
        ``(B, L, L)`` bool, ``Packed.mask``.
    comm : mpi4py.MPI.Intracomm, optional
        Default: mpitree's private communicator.
    scale, strategy, node_size, return_lse
        As in :func:`mpitree.tree_decode` (``"ring"`` is not available here).
    kv_len : array, optional
        int ``(B,)``: valid context keys in this rank's shard (ragged batches).
    owner : int, optional
        The rank that holds the packed block's K/V, ``0 <= owner < p``; default the
        last rank.

    Returns
    -------
    out : array
        ``(B, Hq, L, D)`` in q's framework and dtype (and lse ``(B, Hq, L)``
        float32, natural log).
    """
    comm = check_comm(comm)

    def prepare():
        size = comm.Get_size()
        who = size - 1 if owner is None else owner
        if isinstance(who, (bool, np.bool_)) or not isinstance(who, (int, np.integer)):
            raise TypeError(f"owner must be an int rank, got {who!r}")
        if not 0 <= who < size:
            raise ValueError(f"owner must be a rank in [0, {size}), got {who}")
        opts = dict(strategy=strategy, scale=scale, node_size=node_size)
        problem, opts, context, sig = prepare_attention(
            q, k_context, v_context, kv_len, None, None, None, opts
        )
        if needs_kv(opts.strategy):
            raise ValueError(f"verify_attention cannot run strategy={opts.strategy!r}")
        ns, tree_problem, length = check_qkv(q, k_tree, v_tree, names=("q", "k_tree", "v_tree"))
        if tree_problem != problem or length != problem.q_len:
            raise ValueError(
                f"k_tree/v_tree must be (B, Hkv, L={problem.q_len}, D) like q's shard, got "
                f"{tuple(k_tree.shape)}"
            )
        shape = (problem.batch, problem.q_len, problem.q_len)
        if not is_array(tree_mask) or not namespace(tree_mask).is_bool(tree_mask):
            raise TypeError("tree_mask must be a boolean array (Packed.mask)")
        if tuple(int(x) for x in tree_mask.shape) != shape:
            raise ValueError(f"tree_mask must have shape {shape}, got {tuple(tree_mask.shape)}")
        tree = None
        if comm.Get_rank() == who:
            vis = ns.contiguous(ns.asarray(tree_mask, like=q)[:, None])
            tree = type(context)(ns, q, k_tree, v_tree, opts.scale, None, vis)
        sig["owner"] = int(who)
        merge = (problem.rows, problem.head_dim, problem.acc, opts)
        return Call(sig, (problem, context, tree), merge=merge)

    call, merger = agree_merger(comm, prepare)
    problem, context, tree = call.payload

    def fill(records):
        context.fill(records)
        if tree is not None:  # the owner folds the tree's own state into its context state
            extra = State.empty(problem.row_shape, problem.head_dim, problem.acc).records
            tree.fill(extra.reshape(records.shape))
            records[...] = combine_records(records, extra.reshape(records.shape))

    records = merger.merge(fill)
    inputs = (q, k_context, v_context, k_tree, v_tree)
    return finish(records.reshape(*problem.row_shape, -1), q, return_lse, inputs=inputs)
