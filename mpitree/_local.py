"""Local attention on this rank's shard: the compiled kernel, or one kernel for every namespace."""

from __future__ import annotations

import numpy as np

from ._checks import check_masking, check_qkv
from ._kernel import attend_native
from ._masks import keep_mask, visibility
from ._namespace import Array
from ._options import dtype_name, resolve_scale
from ._state import State

# Score elements per block of query rows: a long prompt never materialises its whole
# (queries x keys) score matrix (64 MB of float32 per block at most).
BLOCK_SCORES = 1 << 24


def weighted_values(ns, p, v, keep):
    """``p @ v`` where keys with weight 0 because they are excluded contribute exactly nothing.

    ``keep`` (broadcastable to p's shape, or None) marks visible keys. Values of
    excluded keys may be garbage (NaN/Inf in a cache's unused slots): they are
    selected out, never multiplied by 0. A visible key's non-finite value enters as
    plain arithmetic gives it, in its own column only: NaN, or an infinity on a key
    of weight 0, gives NaN; ``+-inf`` on a positive weight gives ``+-inf`` (both:
    NaN). Matmuls of 0/1 indicators count them, so nothing grows with their number.
    """
    if keep is None:
        return p @ v
    finite = ns.isfinite(v)
    if ns.all(finite):  # the usual case: no copy of v
        return p @ v
    n = p @ ns.where(finite, v, 0)
    bad = keep & ~ns.all(finite, axis=-1)[:, :, None, :]  # visible keys with such a value
    if not ns.any(bad):
        return n
    name = dtype_name(v.dtype)

    def count(rows, cols):
        return (ns.astype(rows, name) @ ns.astype(cols, name)) > 0

    nan = count(bad, v != v) | count(bad & (p == 0), ~finite & (v == v))
    big = bad & (p != 0)
    n = ns.where(count(big, v == np.inf), n + np.inf, n)  # n's own dtype throughout
    n = ns.where(count(big, v == -np.inf), n - np.inf, n)  # both: inf - inf, NaN
    return ns.where(nan, n + np.nan, n)


def grouped_keep(ns, lens, vis, q, k):
    """Visibility of every (row, key) in GQA-grouped layout ``(B, Hkv, G*Sq, T)``, or None."""
    b, hq, sq, _ = (int(s) for s in q.shape)
    hkv, t = int(k.shape[1]), int(k.shape[2])
    keep = keep_mask(ns, lens, vis, t, like=q)
    if keep is None:
        return None
    g, heads = hq // hkv, keep.shape[1]
    grouped = (hkv, g) if heads > 1 else (1, 1)
    keep = keep.reshape(keep.shape[0], *grouped, keep.shape[2], t)
    return ns.broadcast_to(keep, (b, hkv, g, sq, t)).reshape(b, hkv, g * sq, t)


# Garbage in excluded slots is the normal case: the products that touch it are selected
# away, so numpy's "invalid value" and overflow warnings there are noise.
quiet = np.errstate(invalid="ignore", over="ignore")


@quiet
def state_records(ns, q, k, v, scale, lens, vis, acc):
    """Return the ``(B, Hq, Sq, D + 2)`` records of q over k, v in namespace ``ns``, dtype ``acc``.

    Grouped matmuls (GQA without repeating K/V); functional, so it serves numpy,
    CuPy (cuBLAS), torch (any device) and JAX alike. Where no ``vis`` masks keys
    (``lens`` at most), bfloat16 CUDA tensors take the namespace's fused kernel
    instead (``fused_records``: torch's flash attention, K and V read once).
    """
    b, hq, sq, dim = (int(s) for s in q.shape)
    hkv, t = int(k.shape[1]), int(k.shape[2])
    g = hq // hkv
    if t == 0:
        empty = ns.full((b, hq, sq, 1), -np.inf, acc, like=q)
        return ns.concat([empty, ns.full((b, hq, sq, dim + 1), 0, acc, like=q)], -1)
    if vis is None and acc == "float32":  # no mask (kv_len at most): a fused kernel
        fused = ns.fused_records(q, k, v, scale, lens)
        if fused is not None:
            return fused
    keep = grouped_keep(ns, lens, vis, q, k)
    qs = ns.astype(q, acc).reshape(b, hkv, g * sq, dim) * scale
    s = qs @ ns.mT(ns.astype(k, acc))  # (B, Hkv, G*Sq, T)
    if keep is not None:
        s = ns.where(keep, s, -np.inf)
    m = ns.max(s, axis=-1)
    shift = ns.where(ns.isneginf(m), 0, m)
    p = ns.exp(s - shift[..., None])
    n = weighted_values(ns, p, ns.astype(v, acc), keep)
    rec = ns.concat([m[..., None], ns.sum(p, axis=-1)[..., None], n], -1)
    return rec.reshape(b, hq, sq, dim + 2)


def block_rows(b, hq, t):
    """Query rows per block of :func:`attend` over ``t`` keys (a step of more is a prompt)."""
    return max(1, BLOCK_SCORES // max(1, b * hq * t))


def attend(ns, q, k, v, scale, lens, vis, out):
    """Write the state of q over this shard into records ``out`` ``(B, Hq, Sq, D + 2)``.

    ``out`` is host memory (numpy), or an array of the inputs' own framework (a
    merger's buffer of a device kind, ``mpitree._buffers``), written in place.
    Host float32 inputs (numpy, or CPU torch tensors shared without a copy) run
    the compiled kernel into numpy records (K and V read once); everything else
    runs :func:`state_records` in its own namespace, staged into ``out``. Many query
    rows (a prompt) run in blocks of rows whose scores fit ``BLOCK_SCORES``
    elements, each block reading only the keys up to the last one it can see.
    """
    b, hq, sq, _ = (int(s) for s in q.shape)
    t = int(k.shape[2])
    step = block_rows(b, hq, t)
    if step >= sq:
        _attend_block(ns, q, k, v, scale, lens, vis, out)
        return
    for i in range(0, sq, step):
        rows = vis[:, :, i : i + step] if vis is not None else None
        stop = t
        if rows is not None:
            stop = ns.last_true(rows.reshape(-1, t).any(0)) + 1
            rows = ns.contiguous(rows[..., :stop])
        part = lens if lens is None or stop == t else ns.where(lens > stop, stop, lens)
        view = out[:, :, i : i + step]
        host = isinstance(out, np.ndarray)  # the compiled kernel writes contiguous records
        block = np.empty(view.shape, out.dtype) if host else view
        _attend_block(
            ns, q[:, :, i : i + step], k[:, :, :stop], v[:, :, :stop], scale, part, rows, block
        )
        if host:
            view[...] = block


def _attend_block(ns, q, k, v, scale, lens, vis, out):
    """:func:`attend` for one block of query rows."""
    if ns.name != "numpy" and ns.kernel_records(q, k, v, scale, lens, vis, out):
        return  # a device kernel MPITREE_KERNEL selects wrote them
    if ns.on_host(q) and dtype_name(k.dtype) == "float32" and out.dtype == np.float32:
        host = [ns.to_numpy(x) for x in (q, k, v)]
        lens_h = None if lens is None else ns.to_numpy(lens)
        vis_h = None if vis is None else ns.to_numpy(vis)
        if attend_native(*host, scale, lens_h, vis_h, out):
            return
    rec = state_records(ns, q, k, v, scale, lens, vis, dtype_name(out.dtype))
    if ns.name == "numpy" or not isinstance(out, np.ndarray):  # in the records' own framework
        out[...] = ns.stop_gradient(rec)  # a merger's device buffer never joins a graph
    else:
        out[...] = ns.to_numpy(rec)


def local_state(
    q: Array,
    k: Array,
    v: Array,
    *,
    scale: float | None = None,
    kv_len: Array | None = None,
    q_pos: Array | None = None,
    k_pos: Array | None = None,
    mask: Array | None = None,
) -> State:
    """Compute this shard's partial attention state (no communication).

    Parameters
    ----------
    q : array
        ``(B, Hq, Sq, D)``, float16/bfloat16/float32/float64: numpy, torch, CuPy or
        JAX (the same framework for every argument).
    k, v : array
        ``(B, Hkv, T, D)``, same dtype as ``q``; ``Hq % Hkv == 0``; ``T`` may be 0.
    scale : float, optional
        Logit scale, default ``1/sqrt(D)``.
    kv_len : array, optional
        int ``(B,)``: keys at index ``>= kv_len[b]`` are ignored.
    q_pos, k_pos : array, optional
        int ``(B, Sq)`` and ``(B, T)``: key j is visible to query i iff
        ``k_pos[b, j] <= q_pos[b, i]``. Give both or neither.
    mask : array, optional
        bool, broadcastable to ``(B, Hq or 1, Sq, T)``; True = attend.

    Returns
    -------
    State
        ``(B, Hq, Sq, D + 2)`` host records, float64 for float64 inputs, else
        float32. Keys excluded by ``kv_len``, positions or the mask contribute
        exactly nothing, whatever their values.
    """
    ns, problem, t = check_qkv(q, k, v)
    kv_len, q_pos, k_pos, mask = check_masking(ns, problem, t, kv_len, q_pos, k_pos, mask)
    scale = resolve_scale(scale, problem.head_dim)
    out = np.empty((*problem.row_shape, problem.head_dim + 2), dtype=problem.acc)
    lens, vis = visibility(ns, problem.batch, problem.q_len, t, kv_len, q_pos, k_pos, mask)
    attend(ns, q, k, v, scale, lens, vis, out)
    return State(out)
