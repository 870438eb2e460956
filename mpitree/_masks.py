"""Masks to visibility: ``kv_len``, positions and boolean masks folded into one rule."""

from __future__ import annotations


def visibility(ns, batch, q_len, t, kv_len=None, q_pos=None, k_pos=None, mask=None):
    """Split masking into ragged lengths and one boolean visibility array, in namespace ``ns``.

    A key is visible to a query iff it lies below ``kv_len``, its position is at or
    before the query's, and the mask allows it: all three must hold.

    Returns
    -------
    lens : array or None
        int64 ``(B,)`` contiguous: keys used per batch row (``kv_len``).
    vis : array or None
        bool ``(B, Hm, Sq, T)`` contiguous, ``Hm`` 1 or Hq: positions and mask folded;
        True = attend.
    """
    lens = None if kv_len is None else ns.astype(ns.asarray(kv_len), "int64")
    if lens is not None:
        lens = ns.contiguous(lens)
    vis = None
    if q_pos is not None:
        vis = (k_pos[:, None, :] <= q_pos[:, :, None])[:, None]
    if mask is not None:
        m = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
        vis = m if vis is None else vis & m
    if vis is not None:
        vis = ns.broadcast_to(vis, (batch, vis.shape[1], q_len, t))
        vis = ns.contiguous(vis)
    return lens, vis


def keep_mask(ns, lens, vis, t, like):
    """Fold ``lens`` into ``vis``: bool ``(B, Hm, Sq, T)`` (or broadcastable), or None."""
    if lens is None:
        return vis
    lens = ns.asarray(lens, like=like)  # on like's device (a kv_len given on the host)
    keep = (ns.arange(t, like)[None, :] < lens[:, None])[:, None, None, :]
    return keep if vis is None else vis & keep
