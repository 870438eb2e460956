"""Vectorised merge of packed (m, d, n) records (numpy or CuPy); the reference combine."""

import numpy as np

from ._xp import namespace


def _weights(m_parts, m):
    """Return exp(m_part - m), with 0 where m_part is -inf (the empty state)."""
    xp = namespace(m_parts)
    shift = xp.where(xp.isneginf(m), 0, m)
    return xp.exp(m_parts - shift)[..., None]


def combine_records(a, b):
    """Merge two record arrays of shape (..., D + 2) laid out as [m, d, n_0..n_{D-1}].

    Associative and commutative; an all -inf record is the identity; never NaN
    unless an input holds NaN.
    """
    m = np.maximum(a[..., 0], b[..., 0])
    out = np.empty(np.broadcast_shapes(a.shape, b.shape), dtype=np.result_type(a, b))
    out[..., 0] = m
    out[..., 1:] = _weights(a[..., 0], m) * a[..., 1:] + _weights(b[..., 0], m) * b[..., 1:]
    return out


def merge_records(parts, axis=0):
    """Merge records stacked along ``axis`` in one pass (fixed order: bitwise reproducible)."""
    xp = namespace(parts)
    m = parts[..., 0].max(axis=axis)
    w = _weights(parts[..., 0], xp.expand_dims(m, axis))
    out = xp.empty(m.shape + parts.shape[-1:], dtype=parts.dtype)
    out[..., 0] = m
    out[..., 1:] = (w * parts[..., 1:]).sum(axis=axis)
    return out
