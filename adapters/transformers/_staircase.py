"""Sharded prefill's local attention through torch's fused CPU flash attention.

Under :func:`~._prefill.prefill` a rank computes the partial states of every prompt
query over its own keys. Its keys are sorted by global index, so the keys a query
sees (causal: index <= the query's; minus left padding) are a prefix of them that
grows with the query: a staircase. Queries in chunks of :data:`CHUNK` see a common
prefix in full (one fused call, no mask but padding) plus a short diagonal band
(one masked call); the two states merge exactly. Work is the visible pairs only,
about ``N^2 / (2p)`` per rank, with no ``(N, N/p)`` score matrix. The fused op
(``aten::_scaled_dot_product_flash_attention_for_cpu``) returns the natural-log
log-sum-exp, so its ``(out, lse)`` is the state ``(m, d, n) = (lse, 1, out)``.
"""

from __future__ import annotations

import torch

from mpitree import extend

CHUNK = 512  # queries per fused call: the diagonal band costs about CHUNK / p keys each
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fused():
    """Return torch's fused CPU attention returning the log-sum-exp, or None."""
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def key_rows(vis, q_idx, k_idx):
    """Return the ``(B|1, T)`` keys every later query may see if ``vis`` is a staircase.

    ``vis`` is the ``(B|1, 1|H, Nq, T)`` visibility (None: all visible), ``q_idx`` and
    ``k_idx`` the queries' and keys' global indices. Returns None when ``vis`` is
    not ``causal & key_ok[b]`` exactly (a window, per-head masks): the caller then
    takes the general kernel.
    """
    if k_idx.numel() > 1 and not bool((k_idx[1:] > k_idx[:-1]).all()):
        return None
    if vis is None:  # every query sees every key: a staircase only if causality agrees
        everyone = int(k_idx.max()) <= int(q_idx.min())
        return torch.ones(1, k_idx.numel(), dtype=torch.bool) if everyone else None
    causal = k_idx[None, :] <= q_idx[:, None]
    if vis.ndim != 4 or vis.shape[1] != 1:
        return None
    last = int(torch.argmax(q_idx))
    if int(q_idx[last]) < int(k_idx.max()):  # a key no query reaches: not a prefill shape
        return None
    ok = vis[:, 0, last, :]
    return ok if torch.equal(vis[:, 0], causal[None] & ok[:, None, :]) else None


def _part(fused, q, k, v, scale, allowed, kv_heads):
    """State records ``(B, Hq, S, D + 2)`` float32 of ``q`` over ``k``/``v`` under ``allowed``.

    ``allowed`` is a bool mask broadcastable to ``(B, 1, S, T)``; rows seeing no key
    get the empty state.
    """
    b, hq, s, d = q.shape
    g = hq // kv_heads
    folded = q.reshape(b, kv_heads, g * s, d)  # GQA: a kv head's query heads as one sequence
    bias = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill_(~allowed, float("-inf"))
    if bias.shape[2] != 1:
        bias = bias.repeat(1, 1, g, 1)
    out, lse = fused(folded, k, v, attn_mask=bias, scale=scale)
    out, lse = out.reshape(b, hq, s, d), lse.reshape(b, hq, s)
    rec = torch.cat([lse[..., None], torch.ones_like(lse)[..., None], out], -1)
    seen = allowed.any(-1)  # (B|1, 1, S|1): rows seeing no key; the op gives them lse 0
    if bool(seen.all()):
        return rec
    empty = torch.zeros(d + 2)
    empty[0] = float("-inf")
    return torch.where(seen[..., None], rec, empty)


def staircase_records(q, k, v, scale, q_idx, k_idx, key_ok, out=None):
    """Fill the states of every query over this rank's keys, visible pairs only.

    Parameters
    ----------
    q : torch.Tensor
        ``(B, Hq, Nq, D)`` float32/bfloat16/float16 on the CPU, queries in any order.
    k, v : torch.Tensor
        ``(B, Hkv, T, D)``, same dtype, ``T >= 1``, keys sorted by global index.
    scale : float
        Logit scale.
    q_idx, k_idx : torch.Tensor
        int64 ``(Nq,)`` and ``(T,)`` global indices; key j is visible to query i iff
        ``k_idx[j] <= q_idx[i]`` and ``key_ok[b, j]``.
    key_ok : torch.Tensor
        bool ``(B|1, T)``: False at (left) padding.
    out : torch.Tensor, optional
        ``(B, Hq, Nq, D + 2)`` float32, any strides (e.g. a view of the merge's
        records in their own layout): written in place and returned.

    Returns
    -------
    torch.Tensor
        ``(B, Hq, Nq, D + 2)`` float32 records ``[m, d, n]``, natural log, in ``q``'s
        query order (``out`` when given).
    """
    fused = _fused()
    q, k, v = (x.float() for x in (q, k, v))  # accumulate and combine in float32
    b, hq, nq, d = q.shape
    hkv = k.shape[1]
    order = torch.argsort(q_idx, stable=True)
    sorted_idx = q_idx[order]
    if out is None:
        out = torch.empty(b, hq, nq, d + 2, dtype=torch.float32)
    for start in range(0, nq, CHUNK):
        rows = order[start : start + CHUNK]
        idx = sorted_idx[start : start + CHUNK]
        lo = int(torch.searchsorted(k_idx, idx[0], right=True))
        hi = int(torch.searchsorted(k_idx, idx[-1], right=True))
        qc = q[:, :, rows]
        rec = None
        if lo:
            full = key_ok[:, None, None, :lo]
            rec = _part(fused, qc, k[:, :, :lo], v[:, :, :lo], scale, full, hkv)
        if hi > lo:
            band = (k_idx[None, lo:hi] <= idx[:, None])[None, None] & key_ok[:, None, None, lo:hi]
            part = _part(fused, qc, k[:, :, lo:hi], v[:, :, lo:hi], scale, band, hkv)
            rec = part if rec is None else extend.combine_records(rec, part)
        if rec is None:
            rec = torch.zeros(b, hq, len(rows), d + 2)
            rec[..., 0] = float("-inf")
        out[:, :, rows] = rec
    return out


def available(q):
    """Return whether ``q``'s prefill can take the fused path (CPU, a supported dtype)."""
    return q.device.type == "cpu" and q.dtype in DTYPES and _fused() is not None
