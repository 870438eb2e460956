"""Local attention on this rank's shard: the numpy (or CuPy) reference kernel."""

import numpy as np

from ._kernel import attend_native
from ._state import State
from ._validate import check_masking, check_shapes, resolve_scale
from ._xp import namespace


def visibility(shapes, t, kv_len=None, q_pos=None, k_pos=None, mask=None):
    """Split masking into ragged lengths and one boolean visibility array.

    Returns
    -------
    lens : numpy.ndarray or None
        int64 ``(B,)``: keys used per batch row (``kv_len``).
    vis : numpy.ndarray or None
        bool ``(B, Hm, Sq, T)`` with ``Hm`` 1 or Hq, positions and mask folded; True = attend.
    """
    xp = namespace(k_pos, mask)
    lens = None if kv_len is None else xp.asarray(kv_len, dtype=np.int64)
    vis = None
    if q_pos is not None:
        vis = (k_pos[:, None, :] <= q_pos[:, :, None])[:, None]
    if mask is not None:
        m = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
        vis = m if vis is None else vis & m
    if vis is not None:
        shape = (shapes.batch, vis.shape[1], shapes.q_len, t)
        vis = xp.ascontiguousarray(xp.broadcast_to(vis, shape))
    return lens, vis


def _attend_numpy(q, k, v, scale, lens, vis, out):
    """Compute states with grouped matmuls (numpy, or cuBLAS via CuPy) in ``out``'s dtype."""
    xp = namespace(q)
    b, hq, sq, dim = q.shape
    hkv, t = k.shape[1], k.shape[2]
    g = hq // hkv
    acc = out.dtype
    rec = out.reshape(b, hkv, g * sq, dim + 2)
    if t == 0:
        rec[..., 0] = -np.inf
        rec[..., 1:] = 0
        return
    if lens is not None:
        keep = (xp.arange(t) < lens[:, None])[:, None, None, :]
        vis = keep if vis is None else vis & keep
    qs = q.astype(acc) * acc.type(scale)
    kk = k if k.dtype == acc else k.astype(acc)
    vv = v if v.dtype == acc else v.astype(acc)
    s = xp.matmul(qs.reshape(b, hkv, g * sq, dim), kk.swapaxes(-1, -2))
    if vis is not None:
        s = s.reshape(b, hkv, g, sq, t)
        v5 = vis.reshape(b, hkv, g, sq, t) if vis.shape[1] > 1 else vis[:, :, None]
        s = xp.where(v5, s, acc.type(-np.inf)).reshape(b, hkv, g * sq, t)
    m = s.max(axis=-1)
    shift = xp.where(xp.isneginf(m), 0, m)
    p = xp.exp(s - shift[..., None])
    rec[..., 0] = m
    rec[..., 1] = p.sum(axis=-1)
    xp.matmul(p, vv, out=rec[..., 2:])


def attend(q, k, v, scale, lens, vis, out):
    """Write the state of rows ``q`` over keys ``k, v`` into ``out`` records.

    q: (B, Hq, Sq, D); k, v: (B, Hkv, T, D); lens: None or int64 (B,); vis: None or
    bool (B, 1|Hq, Sq, T); out: (B, Hq, Sq, D + 2) float32/float64 records. Float32
    K/V run the compiled kernel (K and V read once), others the numpy reference.
    """
    if not attend_native(q, k, v, scale, lens, vis, out):
        _attend_numpy(q, k, v, scale, lens, vis, out)


def local_state(q, k, v, *, scale=None, kv_len=None, q_pos=None, k_pos=None, mask=None):
    """Compute this shard's partial attention state (no communication).

    Parameters
    ----------
    q : numpy.ndarray
        ``(B, Hq, Sq, D)``, float16/float32/float64.
    k, v : numpy.ndarray
        ``(B, Hkv, T, D)``, same dtype as ``q``; ``Hq % Hkv == 0``; ``T`` may be 0.
    scale : float, optional
        Logit scale, default ``1/sqrt(D)``.
    kv_len : numpy.ndarray, optional
        int ``(B,)``: keys at index ``>= kv_len[b]`` are ignored.
    q_pos, k_pos : numpy.ndarray, optional
        int ``(B, Sq)`` and ``(B, T)``: key j is visible to query i iff
        ``k_pos[b, j] <= q_pos[b, i]``. Give both or neither.
    mask : numpy.ndarray, optional
        bool, broadcastable to ``(B, Hq or 1, Sq, T)``; True = attend.

    Returns
    -------
    State
        ``(B, Hq, Sq, D + 2)`` records, float64 for float64 inputs, else float32.
    """
    shapes = check_shapes(q, k, v)
    t = k.shape[2]
    check_masking(shapes, t, kv_len, q_pos, k_pos, mask)
    scale = resolve_scale(scale, shapes.head_dim)
    out = np.empty(
        (shapes.batch, shapes.q_heads, shapes.q_len, shapes.head_dim + 2), dtype=shapes.acc_dtype
    )
    attend(q, k, v, scale, *visibility(shapes, t, kv_len, q_pos, k_pos, mask), out)
    return State(out)
