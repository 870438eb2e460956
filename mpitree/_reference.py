"""Single-process float64 reference attention: naive, independent of the kernels."""

import numpy as np
from numpy.typing import ArrayLike


@np.errstate(invalid="ignore", over="ignore")
def reference_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    scale: float | None = None,
    visible: ArrayLike | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Single-process float64 attention over a whole (unsharded) KV cache.

    A deliberately naive implementation (one query head at a time, explicit
    softmax) to check distributed results against.

    Parameters
    ----------
    q : array_like
        ``(B, Hq, Sq, D)``.
    k, v : array_like
        ``(B, Hkv, N, D)``, ``Hq % Hkv == 0``; query head ``h`` uses kv head
        ``h // (Hq // Hkv)``.
    scale : float, optional
        Logit scale, default ``1/sqrt(D)``.
    visible : array_like of bool, optional
        Broadcastable to ``(B, Hq, Sq, N)``; True = attend. Hidden keys never
        reach the result, whatever their values (NaN and Inf included).

    Returns
    -------
    out : numpy.ndarray
        ``(B, Hq, Sq, D)``, float64; 0 for rows that see no key (every visible
        score -inf). Plain IEEE arithmetic otherwise: a NaN score, or a NaN/Inf
        value of a visible key (even one of weight 0), makes the output NaN.
    lse : numpy.ndarray
        ``(B, Hq, Sq)``, float64, natural log; -inf for rows that see no key,
        NaN for a row with a NaN score.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    b, hq, sq, dim = q.shape
    hkv, n = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(dim) if scale is None else float(scale)
    if visible is None:
        visible = np.ones((1, 1, 1, n), dtype=bool)
    visible = np.broadcast_to(visible, (b, hq, sq, n))
    out = np.zeros((b, hq, sq, dim))
    lse = np.full((b, hq, sq), -np.inf)
    for h in range(hq):
        kh, vh = k[:, h // (hq // hkv)], v[:, h // (hq // hkv)]
        s = np.einsum("bqd,bnd->bqn", q[:, h], kh) * scale
        s = np.where(visible[:, h], s, -np.inf)
        m = s.max(axis=-1, initial=-np.inf)  # NaN if any visible score is NaN
        empty = np.isneginf(m)  # every visible score is -inf (or no key is visible)
        p = np.exp(s - np.where(empty, 0, m)[..., None])
        den = p.sum(axis=-1)
        # select the visible keys' values: hidden slots may hold NaN/Inf (0 * NaN = NaN)
        num = np.where(visible[:, h, :, :, None], p[..., None] * vh[:, None], 0).sum(axis=-2)
        out[:, h] = num / np.where(den == 0, 1, den)[..., None]
        lse[:, h] = np.where(empty, -np.inf, m + np.log(np.where(den == 0, 1, den)))
    return out, lse
