"""Sharded prefill's local attention through torch's fused CPU flash attention.

Under :func:`~._prefill.prefill` a rank computes the states of its own prompt
queries over every prompt key (all-gathered). The keys are sorted by global index,
so the keys a query sees (causal: index <= the query's; minus left padding) are a
prefix of them that grows with the query: a staircase. Queries in chunks (of
:data:`CHUNK` by default) see a common prefix in full (one fused call, no mask but
padding) plus a short diagonal band (one masked call); the two states merge
exactly. Work is the visible pairs only, about ``N^2 / (2p)`` per rank, with no
``(N / p, N)`` score matrix. The fused op
(``aten::_scaled_dot_product_flash_attention_for_cpu``) returns the natural-log
log-sum-exp, so its ``(out, lse)`` is the state ``(m, d, n) = (lse, 1, out)``.

The fused op masks with an additive bias, and a masked key's score or value still
enters its arithmetic: a NaN or infinite key or value, or a finite key whose score
overflows float32 to ``+inf``, would reach rows that must not see it (``NaN + -inf``
and ``inf + -inf`` are NaN, ``0 * NaN`` is NaN). So key rows that are not *tame*
(finite, with scores bounded below float32's overflow: :func:`_tame_keys`) are
handled apart: padded ones (seen by no query) are zeroed in a copy, and the chunks
are cut where a query first sees one, so that no call ever masks one out. A call
whose visible keys all score ``-inf`` for a row gives it lse 0, as if it saw no
key: such rows (only keys that are not tame can score ``-inf``) get the empty state,
weight 0 for those keys, as the merge and the decode kernel define it (``0 * NaN``
still NaN).
"""

from __future__ import annotations

import math

import torch

from mpitree._state import combine_records

CHUNK = 384  # queries per fused call (default); its diagonal band spans about CHUNK keys
# (16K queries over 8K keys, one thread: 13.1-13.3 s at 384, 13.4-13.6 s at 512)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TAME = 1e38  # a bound on |score| below float32's largest, 3.4e38 (see _tame_keys)


def _fused():
    """Return torch's fused CPU attention returning the log-sum-exp, or None."""
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def key_rows(vis, q_idx, k_idx):
    """Return the ``(B|1, T)`` keys any later query may see if ``vis`` is a staircase.

    ``vis`` is a built ``(B|1, 1|H, Nq, T)`` visibility (None: all visible), ``q_idx``
    and ``k_idx`` the queries' and keys' global indices. Returns None when ``vis`` is
    not ``causal & key_ok[b]`` exactly (a window that cuts, per-head masks): the
    caller then takes the general kernel. (Under transformers' causal mask the
    recipe gives ``key_ok`` without building ``vis``: see ``LayerStep.causal_keys``.)
    """
    if k_idx.numel() > 1 and not bool((k_idx[1:] > k_idx[:-1]).all()):
        return None
    if vis is None:  # every query sees every key: a staircase only if causality agrees
        everyone = int(k_idx.max()) <= int(q_idx.min())
        return torch.ones(1, k_idx.numel(), dtype=torch.bool) if everyone else None
    if vis.ndim != 4 or vis.shape[1] != 1 or vis.device.type != "cpu":
        return None
    # the latest query's row: a key past it is seen by no query, under causality or vis
    last = int(torch.argmax(q_idx))
    causal = k_idx[None, :] <= q_idx[:, None]
    ok = vis[:, 0, last, :]
    return ok if torch.equal(vis[:, 0], causal[None] & ok[:, None, :]) else None


def _part(fused, q, k, v, scale, allowed, kv_heads, tame=None):
    """Return ``(out, lse)`` of ``q`` over ``k``, ``v``: ``(B, Hq, S, D)``, ``(B, Hq, S)`` float32.

    ``allowed`` is a bool mask broadcastable to ``(B, 1, S, T)``; rows seeing no key,
    or only keys that score ``-inf`` (weight 0), get ``out = 0`` and ``lse = -inf``
    (the op gives them lse 0). ``tame`` is the ``(B, T)`` bool of :func:`_tame_keys`,
    None when all are: only a key that is not tame can score ``-inf``.
    """
    b, hq, s, d = q.shape
    g = hq // kv_heads
    folded = q.reshape(b, kv_heads, g * s, d)  # GQA: a kv head's query heads as one sequence
    bias = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill_(~allowed, float("-inf"))
    if bias.shape[2] != 1:
        bias = bias.repeat(1, 1, g, 1)
    out, lse = fused(folded, k, v, attn_mask=bias, scale=scale)
    out, lse = out.reshape(b, hq, s, d), lse.reshape(b, hq, s)
    seen = allowed.any(-1)  # (B|1, 1, S|1)
    idle = None if tame is None else _weightless(q, k, v, scale, allowed, tame, kv_heads)
    if idle is not None:  # the op cannot tell all scores -inf from no key either
        seen = seen & ~idle[0]
    if not bool(seen.all()):
        lse = lse.masked_fill(~seen, float("-inf"))
        out = out.masked_fill(~seen[..., None], 0)
    if idle is not None:
        out = out.masked_fill(idle[1], torch.nan)
    return out, lse


def _weightless(q, k, v, scale, allowed, tame, kv_heads):
    """Return the rows that see keys, none tame and all scoring ``-inf``, or None.

    Returns ``(B, Hq, S)`` bool and ``(B, Hq, S, D)`` bool: where ``sum_j 0 * v_j`` is
    NaN (a non-finite value of a key the row sees), as plain arithmetic gives.
    """
    b, hq, s, d = q.shape
    blind = ~(allowed & tame[:, None, None, :]).any(-1)  # (B|1, 1, S|1): no tame key seen
    cols = torch.nonzero(~tame.all(0)).flatten()
    if not cols.numel() or not bool(blind.any()):
        return None
    folded = q.reshape(b, kv_heads, -1, d)
    scores = torch.einsum("bhsd,bhtd->bhst", folded, k[:, :, cols]).reshape(b, hq, s, -1)
    seen = allowed[..., cols].expand(b, hq, s, -1)
    top = scores.mul_(scale).masked_fill_(~seen, -torch.inf).amax(-1)
    idle = blind & seen.any(-1) & (top == -torch.inf)
    bad = (~torch.isfinite(v[:, :, cols])).float().repeat_interleave(hq // kv_heads, 1)
    return idle, idle[..., None] & (seen.float() @ bad > 0)


def _records(part):
    """Return the records ``[lse, d, out]`` of a part's ``(out, lse)``: ``d = (lse != -inf)``.

    The same state as ``[m, d, n]`` (see the module's docstring). A row with no key has
    ``lse = -inf``, ``out = 0`` (NaN where :func:`_part` found ``0 * NaN``): the merge
    gives it weight 0.
    """
    o, lse = part
    seen = (lse != float("-inf")).to(o.dtype)
    return torch.cat([lse[..., None], seen[..., None], o], -1)


def _write(out, rows, part, band):
    """Write the records ``[m, d, n]`` of the union of two disjoint parts into ``out[:, :, rows]``.

    Either part may be None (not both). Two parts merge by the one definition of the
    merge, :func:`mpitree._state.combine_records` (torch's exponential); a row with no
    key in either gets the empty state.
    """
    recs = [_records(p) for p in (part, band) if p is not None]
    out[:, :, rows] = recs[0] if len(recs) == 1 else combine_records(*recs)


def staircase_records(q, k, v, scale, q_idx, k_idx, key_ok, out=None, chunk=None):
    """Fill the states of the queries ``q`` over the keys ``k``, visible pairs only.

    Parameters
    ----------
    q : torch.Tensor
        ``(B, Hq, Nq, D)`` float32/bfloat16/float16 on the CPU, finite (:func:`available`),
        queries in any order.
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
        ``(B, Hq, Nq, D + 2)`` float32, any strides (e.g. a view of records in
        another layout): written in place and returned.
    chunk : int, optional
        Queries per fused call (default :data:`CHUNK`).

    Returns
    -------
    torch.Tensor
        ``(B, Hq, Nq, D + 2)`` float32 records ``[m, d, n]``, natural log, in ``q``'s
        query order (``out`` when given).
    """
    fused = _fused()
    q, k, v = (x.float() for x in (q, k, v))  # accumulate and combine in float32
    tame = _tame_keys(q, k, v, scale)
    k, v = _hide_padding(k, v, key_ok, tame)
    tame = tame | ~key_ok  # padding: now zeros
    tame = None if bool(tame.all()) else tame
    b, hq, nq, d = q.shape
    hkv = k.shape[1]
    order = torch.argsort(q_idx, stable=True)
    sorted_idx = q_idx[order]
    if out is None:
        out = torch.empty(b, hq, nq, d + 2, dtype=torch.float32)
    for start, stop in _chunks(tame, k_idx, key_ok, sorted_idx, chunk or CHUNK):
        rows = order[start:stop]
        idx = sorted_idx[start:stop]
        lo = int(torch.searchsorted(k_idx, idx[0], right=True))
        hi = int(torch.searchsorted(k_idx, idx[-1], right=True))
        qc = q[:, :, rows]
        part = band = None
        if lo:
            full = key_ok[:, None, None, :lo]
            fin = None if tame is None else tame[:, :lo]
            part = _part(fused, qc, k[:, :, :lo], v[:, :, :lo], scale, full, hkv, fin)
        if hi > lo:
            seen = (k_idx[None, lo:hi] <= idx[:, None])[None, None] & key_ok[:, None, None, lo:hi]
            fin = None if tame is None else tame[:, lo:hi]
            band = _part(fused, qc, k[:, :, lo:hi], v[:, :, lo:hi], scale, seen, hkv, fin)
        if part is None and band is None:
            out[:, :, rows] = torch.tensor([float("-inf")] + [0.0] * (d + 1))
        else:
            _write(out, rows, part, band)
    return out


def _tame_keys(q, k, v, scale):
    """``(B, T)`` bool: key rows finite in every head whose scores cannot overflow float32.

    A score is a sum of ``D`` products, so it stays below ``D * max|q| * max|k_j|``
    (times the scale, if it is above 1, whichever factor the op applies it to). Past
    :data:`_TAME` a finite key may score ``+-inf``: such rows go with the non-finite ones.
    """
    reach = _largest(q) * q.shape[-1] * max(1.0, scale)  # q is finite (see available)
    big = torch.maximum(k.amax((1, 3)), -k.amin((1, 3)))  # NaN propagates: not tame
    values = torch.maximum(v.amax((1, 3)), -v.amin((1, 3)))
    return (big * reach < _TAME) & torch.isfinite(values)


def _largest(x):
    """``max |x|`` as a float (NaN if ``x`` holds one), in one pass without a copy."""
    low, high = torch.aminmax(x)
    return float(torch.maximum(high, -low))


def _hide_padding(k, v, key_ok, tame):
    """Return ``k``, ``v`` with rows that are not tame and that no query sees (padding) set to 0."""
    hidden = ~tame & ~key_ok
    if not bool(hidden.any()):
        return k, v
    keep = ~hidden[:, None, :, None]
    return torch.where(keep, k, 0.0), torch.where(keep, v, 0.0)


def _chunks(tame, k_idx, key_ok, sorted_idx, chunk):
    """Yield ``(start, stop)`` of the sorted queries' chunks.

    A chunk starts every ``chunk`` queries, and where a query first sees a
    key row that is not tame (``tame``: see :func:`staircase_records`; None: all are):
    no chunk's band then masks one out.
    """
    nq = sorted_idx.numel()
    cuts = set(range(0, nq, chunk))
    if tame is not None:
        bad = (~tame & key_ok).any(0)
        cuts.update(torch.searchsorted(sorted_idx, k_idx[bad]).tolist())
    cuts = sorted(c for c in cuts if c < nq)
    yield from zip(cuts, [*cuts[1:], nq], strict=True)


def available(q):
    """Return whether ``q``'s prefill can take the fused path (CPU, a supported dtype, finite).

    A query with an infinite entry scores ``+-inf`` or NaN against nearly any key, and
    the op's additive mask would let keys it must not see (future, padding) into its
    row (``NaN + -inf`` is NaN): the general kernel never reads them.
    """
    fits = q.device.type == "cpu" and q.dtype in DTYPES and _fused() is not None
    return fits and math.isfinite(_largest(q))
