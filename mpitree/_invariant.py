"""World-size- and placement-invariant decoding: leaf blocks and one canonical merge tree.

In ``deterministic="invariant"`` mode the keys are cut into blocks of
``block_size`` keys aligned to global key indices. Each block's state (a *leaf*)
comes from one local-kernel call on a view of that block alone, so nothing
about where a rank's shard starts can change its bits. Leaves merge over one
canonical binary tree on global block indices: node ``(level, i)`` covers blocks
``[i * 2**level, (i + 1) * 2**level)`` and is ``combine(node(level - 1, 2i),
node(level - 1, 2i + 1))``, where a child no rank holds is skipped (the node is
then its other child, unchanged). A rank computes every node whose blocks it
holds all of (its *pieces*: the maximal ones, O(log) per run of adjacent
blocks); the pieces of all ranks travel once, and every rank finishes the same
tree from the same operands in the same order. The result is therefore the same
bits for any number of ranks and any block-aligned placement.

No communication here: the all-gather is in ``_invariant_merger.py``.
"""

from __future__ import annotations

import numpy as np

from ._kernel import Prepared
from ._kernel import _lib as _kernel_lib
from ._library import address
from ._local import BLOCK_SCORES, attend
from ._namespace import is_array, namespace
from ._state import N, combine_records, empty_records, width

_KEY = 16  # bytes of a piece's (level, index) key, two int64


def check_placement(t, block_size, kv_start=None, kv_blocks=None):
    """Return the global block index of each of a shard's blocks: int64 ``(ceil(T / bs),)``.

    ``kv_start`` (int: the global index of the shard's first key, a multiple of
    ``block_size``) describes a contiguous shard; ``kv_blocks`` (int
    ``(ceil(T / bs),)``, distinct, non-negative) one cut into blocks held
    anywhere (interleaved). Exactly one must be given. Only a shard's last block
    may be shorter than ``block_size``.
    """
    count = -(-t // block_size)
    if (kv_start is None) == (kv_blocks is None):
        raise ValueError(
            "deterministic='invariant' needs this shard's place in the sequence: "
            "kv_start (contiguous) or kv_blocks (one global block index per block), not both"
        )
    if kv_start is not None:
        if isinstance(kv_start, (bool, np.bool_)) or not isinstance(kv_start, (int, np.integer)):
            raise TypeError(f"kv_start must be an int, got {kv_start!r}")
        if kv_start < 0 or kv_start % block_size:
            raise ValueError(
                f"kv_start={kv_start} is not a multiple of block_size={block_size}: "
                "deterministic='invariant' needs block-aligned shard boundaries"
            )
        return kv_start // block_size + np.arange(count, dtype=np.int64)
    if not is_array(kv_blocks) or not namespace(kv_blocks).is_integer(kv_blocks):
        raise TypeError(f"kv_blocks must be an integer array, got {type(kv_blocks).__name__}")
    blocks = np.asarray(namespace(kv_blocks).to_numpy(kv_blocks), dtype=np.int64).reshape(-1)
    if tuple(kv_blocks.shape) != (count,):
        raise ValueError(
            f"kv_blocks must have shape ({count},): one global block index per "
            f"block_size={block_size} keys of this shard (T={t}), got {tuple(kv_blocks.shape)}"
        )
    if count and (blocks.min() < 0 or blocks.max() >= 1 << 62):
        raise ValueError(f"kv_blocks must lie in [0, 2**62), got {blocks}")
    if len(np.unique(blocks)) != count:
        raise ValueError(f"kv_blocks must be distinct, got {blocks}")
    return blocks


def leaf_records(step, block_size, count, acc):
    """Return the state of each block of the shard alone: ``(count, B, Hq, Sq, D + 2)``, ``acc``.

    One local-kernel call per block, on a view of that block: the kernel's own
    chunking starts afresh at every block, wherever the shard starts.
    """
    ns = step.ns
    q, k, v, lens, vis = step.q, step.k, step.v, step.lens, step.vis
    b, hq, sq, dim = (int(s) for s in q.shape)
    leaves = np.empty((count, b, hq, sq, width(dim)), acc)
    t = int(k.shape[2])
    prepared = None
    if vis is None and acc == "float32" and sq <= BLOCK_SCORES // max(1, b * hq * block_size):
        prepared = Prepared.of(q, k, v, step.scale)  # host float32: the compiled kernel, bound once
    if prepared is not None and lens is not None:
        lo = np.arange(count, dtype=np.int64)[:, None] * block_size
        lens = np.clip(ns.to_numpy(lens)[None, :] - lo, 0, np.minimum(block_size, t - lo))
    for j in range(count):
        lo, hi = j * block_size, min(t, (j + 1) * block_size)
        kj, vj = k[:, :, lo:hi], v[:, :, lo:hi]
        if prepared is not None:
            prepared.run(q, kj, vj, None if lens is None else lens[j], leaves[j])
            continue
        part = None
        if lens is not None:
            part = lens - lo
            part = ns.where(part < 0, 0, ns.where(part > hi - lo, hi - lo, part))
        rows = None if vis is None else ns.contiguous(vis[..., lo:hi])
        attend(ns, q, kj, vj, step.scale, part, rows, leaves[j])
    return leaves


def _joiner(recs):
    """Return ``join(i, j)``: ``recs[i] = combine(recs[i], recs[j])``, in place (C-contiguous).

    The compiled combine (the MPI op's own code) when the compiled kernel runs,
    else numpy's :func:`combine_records`; the kernel's arithmetic rides in the
    agreement, so every rank joins alike. Both are commutative bit for bit
    (larger max first: ``big + exp(small - big) * small``).
    """
    lib = _kernel_lib()
    if lib is None or recs.dtype not in (np.float32, np.float64) or not len(recs):

        def join(i, j):
            recs[i] = combine_records(recs[i], recs[j])

        return join
    bits, base, stride = recs.dtype.itemsize * 8, address(recs), recs.strides[0]
    rows, dim = int(np.prod(recs.shape[1:-1])), recs.shape[-1] - N.start
    combine = lib.mpitree_combine

    def join(i, j):
        combine(bits, base + j * stride, base + i * stride, rows, dim)

    return join


def local_pieces(blocks, leaves):
    """Reduce a rank's leaves to its pieces: the maximal tree nodes whose blocks it holds all of.

    Returns int64 ``levels`` and ``index`` ``(k,)`` and records ``(k, *row_shape, D + 2)``.
    """
    order = np.argsort(blocks, kind="stable")
    recs = np.ascontiguousarray(leaves[order])  # a copy: joined in place
    index, slots = blocks[order].tolist(), list(range(len(order)))
    join = _joiner(recs)
    levels, indices, kept = [], [], []
    level = 0
    while index:
        up, up_slots, i = [], [], 0
        while i < len(index):
            node = index[i]
            if node % 2 == 0 and i + 1 < len(index) and index[i + 1] == node + 1:
                join(slots[i], slots[i + 1])
                up.append(node >> 1)
                up_slots.append(slots[i])
                i += 2
            else:
                levels.append(level)
                indices.append(node)
                kept.append(slots[i])
                i += 1
        index, slots, level = up, up_slots, level + 1
    return np.array(levels, np.int64), np.array(indices, np.int64), recs[kept]


def canonical_root(levels, index, recs, row_shape, head_dim, acc):
    """Finish the canonical tree from every rank's pieces; return its root ``(*row_shape, D + 2)``.

    The same pieces give the same bits on every rank, in whatever order they came:
    level by level, each sibling pair joins in index order. ``recs`` (C-contiguous)
    is overwritten. Raises ``ValueError`` (on every rank alike) when two ranks hold
    the same block.
    """
    root = np.empty((*row_shape, width(head_dim)), acc)
    if not len(levels):
        empty_records(root)
        return root
    arriving: dict = {}
    for slot, (level, i) in enumerate(zip(levels.tolist(), index.tolist(), strict=True)):
        arriving.setdefault(level, []).append((i, slot))
    join = _joiner(recs)
    top, nodes, level = max(arriving), {}, 0
    while True:
        for i, slot in arriving.get(level, ()):
            if i in nodes:
                raise ValueError(
                    f"mpitree: two ranks hold global block {i << level} (placements overlap)"
                )
            nodes[i] = slot
        if level >= top and len(nodes) == 1:
            root[...] = recs[next(iter(nodes.values()))]
            return root
        up = {}
        for i in sorted(nodes):
            if i % 2 and i - 1 in nodes:
                continue  # joined into its left sibling
            if i % 2 == 0 and i + 1 in nodes:
                join(nodes[i], nodes[i + 1])
            up[i >> 1] = nodes[i]
        nodes, level = up, level + 1


def pack(levels, index, recs):
    """Pack pieces as bytes ``(k, 16 + record bytes)``: the (level, index) key, then the records."""
    k, size = len(levels), int(np.prod(recs.shape[1:])) * recs.itemsize
    out = np.empty((k, _KEY + size), np.uint8)
    out[:, :_KEY] = np.stack([levels, index], 1).view(np.uint8).reshape(k, _KEY)
    out[:, _KEY:] = np.ascontiguousarray(recs).view(np.uint8).reshape(k, size)
    return out


def unpack(data, row_shape, head_dim, acc):
    """Unpack :func:`pack`'s ``(k, stride)`` bytes into (levels, index, records)."""
    keys = np.ascontiguousarray(data[:, :_KEY]).view(np.int64).reshape(-1, 2)
    recs = np.ascontiguousarray(data[:, _KEY:]).view(acc).reshape(-1, *row_shape, width(head_dim))
    return keys[:, 0], keys[:, 1], recs


def piece_bytes(rows, head_dim, acc):
    """Return the bytes one piece travels as: its key and ``rows`` records of ``D + 2``."""
    return _KEY + rows * width(head_dim) * np.dtype(acc).itemsize
