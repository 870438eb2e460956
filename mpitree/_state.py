"""The partial online-softmax state (m, d, n) of attention rows."""

import math

import numpy as np

from ._records import combine_records

_LN2 = math.log(2.0)


class State:
    """Partial attention state of a set of rows, packed as records ``[m, d, n_0..n_{D-1}]``.

    For each (batch, head, query) row over some set of keys with logits ``s_j``
    (already scaled, natural-log units): ``m = max_j s_j``,
    ``d = sum_j exp(s_j - m)`` and ``n = sum_j exp(s_j - m) v_j``. The attention
    output is ``n / d`` and the log-sum-exp is ``m + log(d)`` (natural log). The
    empty state ``m = -inf, d = 0, n = 0`` is the identity of :func:`combine`.

    Parameters
    ----------
    records : numpy.ndarray
        ``(..., D + 2)``, float32 or float64; wrapped without copying.
    """

    __slots__ = ("records",)

    def __init__(self, records):
        records = np.asarray(records)
        if records.dtype not in (np.float32, np.float64):
            raise TypeError(f"State records must be float32 or float64, got {records.dtype}")
        if records.ndim < 1 or records.shape[-1] < 3:
            raise ValueError(f"State records must have shape (..., D + 2), got {records.shape}")
        self.records = records

    @classmethod
    def empty(cls, shape, head_dim, dtype=np.float32):
        """Return the identity state: ``m = -inf``, ``d = 0``, ``n = 0``.

        Parameters
        ----------
        shape : tuple of int
            Row shape, e.g. ``(B, Hq, Sq)``.
        head_dim : int
            ``D``.
        dtype : numpy dtype, optional
            float32 (default) or float64.
        """
        rec = np.zeros((*shape, head_dim + 2), dtype=dtype)
        rec[..., 0] = -np.inf
        return cls(rec)

    @classmethod
    def from_lse(cls, out, lse, *, base="e"):
        """Build a state from an attention output and its log-sum-exp.

        Parameters
        ----------
        out : numpy.ndarray
            ``(..., D)``, any float dtype: normalised attention output over some keys.
        lse : numpy.ndarray
            ``(...)``: log-sum-exp of the scaled logits over the same keys; ``-inf``
            for a row that saw no key.
        base : {"e", 2}, optional
            Log base of ``lse``. mpitree works in natural log; FlashInfer's
            ``merge_state`` uses base 2, vLLM's ``merge_attn_states`` base e.

        Returns
        -------
        State
            ``(..., D + 2)`` records, float64 if ``out`` is float64, else float32.
        """
        out = np.asarray(out)
        dtype = np.float64 if out.dtype == np.float64 else np.float32
        lse = np.asarray(lse, dtype=dtype)
        if lse.shape != out.shape[:-1]:
            raise ValueError(f"lse shape {lse.shape} does not match out shape {out.shape}")
        if base == 2:
            lse = lse * dtype(_LN2)
        elif base != "e":
            raise ValueError(f"base must be 'e' or 2, got {base!r}")
        seen = ~np.isneginf(lse)
        rec = np.empty((*out.shape[:-1], out.shape[-1] + 2), dtype=dtype)
        rec[..., 0] = lse
        rec[..., 1] = seen
        rec[..., 2:] = np.where(seen[..., None], out, 0)
        return cls(rec)

    @property
    def m(self):
        """Running max of the logits, ``(...)``."""
        return self.records[..., 0]

    @property
    def d(self):
        """Softmax denominator relative to ``m``, ``(...)``."""
        return self.records[..., 1]

    @property
    def n(self):
        """Softmax numerator relative to ``m``, ``(..., D)``."""
        return self.records[..., 2:]

    @property
    def shape(self):
        """Row shape (records without the last axis)."""
        return self.records.shape[:-1]

    @property
    def head_dim(self):
        """``D``."""
        return self.records.shape[-1] - 2

    def output(self, dtype=None):
        """Return the attention output ``n / d``, ``(..., D)``; 0 for empty rows, NaN stays NaN.

        Parameters
        ----------
        dtype : numpy dtype, optional
            Output dtype (default: the records' dtype).
        """
        d = self.d[..., None]
        out = np.zeros(self.n.shape, dtype=self.records.dtype)
        np.divide(self.n, d, out=out, where=d != 0)  # NaN states stay NaN, never 0
        return out if dtype is None else out.astype(dtype, copy=False)

    def lse(self, *, base="e", dtype=np.float32):
        """Return the log-sum-exp ``m + log(d)``, ``(...)``; -inf for empty rows.

        Parameters
        ----------
        base : {"e", 2}, optional
            Natural log (default) or base 2.
        dtype : numpy dtype, optional
            Result dtype, float32 by default (computed in the records' dtype).
        """
        d = self.d
        lse = np.full(d.shape, -np.inf, dtype=self.records.dtype)
        np.log(d, out=lse, where=d != 0)
        lse += self.m
        if base == 2:
            lse /= _LN2
        elif base != "e":
            raise ValueError(f"base must be 'e' or 2, got {base!r}")
        return lse.astype(dtype, copy=False)

    def __repr__(self):
        return f"State(shape={self.shape}, head_dim={self.head_dim}, dtype={self.records.dtype})"


def combine(a, b):
    """Merge two states of the same rows: associative, commutative, empty is the identity.

    Parameters
    ----------
    a, b : State
        ``(..., D + 2)`` records each, broadcast-compatible row shapes.

    Returns
    -------
    State
        The state of the union of both key sets, in the wider of the two dtypes.
    """
    if a.head_dim != b.head_dim:
        raise ValueError(f"head dims differ: {a.head_dim} vs {b.head_dim}")
    return State(combine_records(a.records, b.records))
