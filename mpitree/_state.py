"""The partial online-softmax state (m, d, n) of attention rows, and its record arithmetic."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._library import address, native_lib
from ._namespace import namespace
from ._options import dtype_name

_LN2 = math.log(2.0)

# The record layout, the Python half of its one definition (the C half: _native.h,
# MPITREE_REC_*): a row's partial state is ``width(D) = D + 2`` values
# ``[m, d, n_0..n_{D-1}]`` along the last axis.
M = 0  # m: the reference logit (the running max, or a fused kernel's lse)
D = 1  # d: the softmax denominator relative to m
N = slice(2, None)  # n: the softmax numerator relative to m, D values
WEIGHTED = slice(D, None)  # d and n: the fields a merge scales by its weights
# A merge buffer's last record is its flag: m is FLAG_FAILED on a rank whose local work
# failed, FLAG_CLEAR (the empty state's m) elsewhere; it merges like any record.
FLAG_CLEAR = -np.inf
FLAG_FAILED = 1.0


def width(head_dim):
    """Return the length of a record of head dimension ``head_dim``: ``D + 2``."""
    return head_dim + N.start


def merge_weights(m_parts, m, exp=None):
    """Return ``exp(m_part - shift)``: steps 2 and 3 of :func:`combine_records`.

    ``shift`` is ``m``, or 0 where ``m`` is -inf (every part empty). ``exp`` is the
    exponential to use (default: the arrays' framework's own).
    """
    ns = namespace(m_parts, m)
    shift = ns.where(ns.isneginf(m), 0, m)
    return (ns.exp if exp is None else exp)(m_parts - shift)


def combine_records(a, b, exp=None):
    """Merge two record arrays: the one definition of the (m, d, n) merge.

    Every other copy calls it or is held bit for bit to it
    (``tests/test_merge_definition.py``): the numpy fallback op (``_op.python_op``),
    invariant mode's numpy tree joins and the merge of sharded prefill's staircase
    (torch, ``adapters/transformers/_staircase.py``) call it; the ``allreduce3``
    strategy and :func:`merge_records` use its weights (:func:`merge_weights`); the
    compiled op (``_native_op.c``: ``combine_*``, the MPI op's and invariant mode's
    compiled joins) is its C half, tested bit for bit with its own exponential. (The
    compiled kernel's rescaling within a shard is its online softmax, not a merge of
    records: its own exponential, its bits pinned by ``tests/test_kernel.py``.)

    Record layout (:data:`M`, :data:`D`, :data:`N`, :func:`width`): ``(..., D + 2)`` as
    ``[m, d, n_0..n_{D-1}]``, float32 or float64; every step rounds in the records'
    dtype. Order of operations:

    1. ``m = max(ma, mb)``, NaN winning;
    2. ``shift = m``, or 0 where ``m`` is -inf (both sides empty);
    3. ``wa = exp(ma - shift)``, ``wb = exp(mb - shift)`` (one rounded subtraction,
       one exp each);
    4. each of ``d, n_0..n_{D-1}`` is ``wa * a + wb * b``: two rounded products,
       then one rounded sum, never a fused multiply-add. Where ``m`` is finite the
       larger side's weight is ``exp(0) = 1``: its fields enter unchanged.

    What follows: the empty state (``m = -inf, d = 0, n = 0``) is the identity, and
    two empties give the empty state, never NaN (``exp(-inf - 0) = 0``). Nothing is
    skipped, so a NaN anywhere in a record survives the merge (``0 * NaN = NaN``);
    a NaN ``m`` (a NaN score) makes every field NaN, and so does an ``m`` of +inf
    (an overflowing score: ``exp(inf - inf)`` is NaN). Commutative bit for bit
    (wherever no NaN payload is involved, and but for the sign of an ``m`` of 0
    against -0, which follows the order: the weights, ``n`` and ``d`` do not),
    associative up to rounding.

    Parameters
    ----------
    a, b : array
        ``(..., D + 2)`` records, numpy, CuPy or torch (any device), broadcast-compatible.
    exp : callable, optional
        The exponential of step 3 (default: the arrays' framework's own). The only
        step whose bits depend on the library: numpy's, torch's and the compiled
        op's own exponential (the same bits on every compiler, C library and CPU)
        differ in the last place; given the same exp, every copy
        of the merge gives the same bits.

    Returns
    -------
    array
        ``(..., D + 2)`` merged records, same framework and dtype.
    """
    ns = namespace(a, b)
    ma, mb = a[..., M, None], b[..., M, None]
    m = ns.maximum(ma, mb)
    wa = merge_weights(ma, m, exp)
    wb = merge_weights(mb, m, exp)
    return ns.concat([m, wa * a[..., WEIGHTED] + wb * b[..., WEIGHTED]], -1)


def merge_records(parts, axis=0):
    """Merge records stacked along ``axis`` in one pass (fixed order: bitwise reproducible).

    :func:`combine_records` over many parts at once: ``m`` is the max of all
    parts, each part is weighted by :func:`merge_weights`, and the weighted
    fields are summed along ``axis`` in index order (for two parts, the same bits
    as :func:`combine_records`).
    """
    ns = namespace(parts)
    m = parts[..., M].max(axis=axis)
    w = merge_weights(parts[..., M], ns.xp.expand_dims(m, axis))[..., None]
    return ns.concat([m[..., None], (w * parts[..., WEIGHTED]).sum(axis=axis)], -1)


def empty_records(records):
    """Set host records to the empty state in place."""
    records[..., M] = -np.inf
    records[..., WEIGHTED] = 0


def output_of(records, dtype=None):
    """Return ``n / d`` of host records, ``(..., D)``; 0 for empty rows, NaN stays NaN."""
    d = records[..., D, None]
    out = records[..., N] / np.where(d == 0, 1, d)  # an empty row has n = 0
    return out if dtype is None else out.astype(dtype, copy=False)


def _output_bshd(records):
    """Return ``n / d`` of host records ``(B, Hq, Sq, D + 2)`` as ``(B, Sq, Hq, D)``, C order."""
    b, h, s, w = records.shape
    lib = native_lib()
    if lib is None or records.dtype != np.float32 or not records.flags.c_contiguous:
        return np.ascontiguousarray(output_of(records).transpose(0, 2, 1, 3))
    dim = w - N.start
    out = np.empty((b, s, h, dim), np.float32)
    lib.mpitree_finish_f32(address(records), b, h, s, dim, address(out))
    return out


def _output_bhsd(records):
    """Return :func:`output_of` of float32 C-order host records in one compiled pass."""
    lib = native_lib()
    if lib is None or records.dtype != np.float32 or not records.flags.c_contiguous:
        return output_of(records)
    *rows, w = records.shape
    dim = w - N.start
    out = np.empty((*rows, dim), np.float32)
    lib.mpitree_finish_f32(address(records), 1, out.size // dim, 1, dim, address(out))
    return out


def lse_of(records, base="e", dtype=np.float32):
    """Return ``m + log(d)`` of host records, ``(...)``; -inf for empty rows."""
    d = records[..., D]
    lse = np.full(d.shape, -np.inf, dtype=records.dtype)
    np.log(d, out=lse, where=d != 0)
    lse += records[..., M]
    if base == 2:
        lse /= _LN2
    elif base != "e":
        raise ValueError(f"base must be 'e' or 2, got {base!r}")
    return lse.astype(dtype, copy=False)


def finish(records, like, return_lse=False, layout="bhsd", inputs=(), out=None):
    """Turn merged host records ``(B, Hq, Sq, D + 2)`` into ``like``'s framework and dtype.

    Returns the output in ``like``'s dtype and device: ``(B, Hq, Sq, D)`` with
    ``layout="bhsd"``, or ``(B, Sq, Hq, D)`` in C order with ``layout="bshd"``
    (what transformers' attention functions return; float32 records go through
    the compiled library in one pass). With ``return_lse``, also the lse
    ``(B, Hq, Sq)``, float32, natural log. The records are not aliased. With
    ``out`` (an array of ``like``'s framework, dtype, device and the output's
    shape, checked by the caller), the output is written into it and it is returned.

    ``inputs`` are the arrays the records were computed from (q, k, v): the one
    place where gradients are refused. If any is a torch tensor that requires grad
    (grad mode on), the results are tied to it through a node whose backward
    raises, so that a gradient never silently goes missing.
    """
    ns = namespace(like)
    name = dtype_name(like.dtype)
    host_dtype = None if name == "bfloat16" else np.dtype(name)
    if layout == "bshd":
        if records.ndim != 4:
            raise ValueError(f"layout='bshd' needs (B, Hq, Sq, D + 2) records, got {records.shape}")
        if return_lse and ns.name != "numpy":  # the lse reads them: down before the output
            records = ns.host_records(records)
        result = None if ns.name == "numpy" else ns.kernel_output(records, like, out, layout)
        if result is None:  # a device kernel finished none: the records are read on the host
            result = _output_bshd(records if ns.name == "numpy" else ns.host_records(records))
        if ns.name == "numpy" and host_dtype is not None:
            result = result.astype(host_dtype, copy=False)
    elif layout == "bhsd" and host_dtype == np.float32 and ns.name == "numpy":
        result = _output_bhsd(records)
    elif layout == "bhsd" and ns.name != "numpy":
        if return_lse:  # the lse is finished on the host: records a device kernel holds come down
            records = ns.host_records(records)
        result = ns.kernel_output(records, like, out)  # a device kernel MPITREE_KERNEL selects
        if result is None:
            records = ns.host_records(records)
            result = output_of(records)
    elif layout == "bhsd":
        result = output_of(records, host_dtype)
    else:
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    if ns.name != "numpy" and type(result) is np.ndarray:  # not yet on like's device
        result = ns.astype(ns.from_numpy(result, like), name)
    if out is not None and result is not out:
        out[...] = result
        result = out
    if not return_lse:
        return ns.refuse_gradient((result,), inputs)[0] if inputs else result
    lse = lse_of(records)
    results = (result, lse if ns.name == "numpy" else ns.from_numpy(lse, like))
    return ns.refuse_gradient(results, inputs) if inputs else results


def trusted_state(records):
    """Wrap ``records`` known to be valid (float32/64, ``(..., D + 2)``) without checking them."""
    state = State.__new__(State)
    state.records = records
    return state


class State:
    """Partial attention state of a set of rows, packed as records ``[m, d, n_0..n_{D-1}]``.

    For each (batch, head, query) row over some set of keys with logits ``s_j``
    (already scaled, natural-log units): ``m = max_j s_j``,
    ``d = sum_j exp(s_j - m)`` and ``n = sum_j exp(s_j - m) v_j``. The attention
    output is ``n / d`` and the log-sum-exp is ``m + log(d)`` (natural log). The
    empty state ``m = -inf, d = 0, n = 0`` is the identity of :func:`combine`. Any
    ``(m', d e^(m - m'), n e^(m - m'))`` is the same state (the merge gives the same
    output and lse): states from a fused kernel's output and lse are ``[lse, 1, out]``
    (``State.from_lse``; the bfloat16 CUDA path of ``local_state``), whose ``m`` is
    not the max logit.

    Parameters
    ----------
    records : numpy.ndarray
        ``(..., D + 2)``, float32 or float64; wrapped without copying.
    """

    __slots__ = ("records",)

    def __init__(self, records: np.ndarray) -> None:
        if not isinstance(records, np.ndarray):
            raise TypeError(f"State records must be a numpy array, got {type(records).__name__}")
        if records.dtype not in (np.float32, np.float64):
            raise TypeError(f"State records must be float32 or float64, got {records.dtype}")
        if records.ndim < 1 or records.shape[-1] < 3:
            raise ValueError(f"State records must have shape (..., D + 2), got {records.shape}")
        self.records = records

    @classmethod
    def empty(cls, shape: tuple[int, ...], head_dim: int, dtype: Any = np.float32) -> State:
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
        rec = np.empty((*shape, width(head_dim)), dtype=dtype)
        empty_records(rec)
        return cls(rec)

    @classmethod
    def from_lse(cls, out: np.ndarray, lse: np.ndarray, *, base: str | int = "e") -> State:
        """Build a state from an attention output and its log-sum-exp.

        Conventions for a row that saw no key differ: mpitree and FlashInfer write
        ``lse = -inf``; flash-attn (FA2) and vLLM's ``merge_attn_states`` write
        ``+inf`` (with output 0). Both become the empty state here, so such rows
        merge as the identity and never as NaN. A finite lse keeps its row.

        Parameters
        ----------
        out : numpy.ndarray
            ``(..., D)``, any float dtype: normalised attention output over some keys.
        lse : numpy.ndarray
            ``(...)``: log-sum-exp of the scaled logits over the same keys; ``-inf``
            or ``+inf`` for a row that saw no key.
        base : {"e", 2}, optional
            Log base of ``lse``. mpitree works in natural log; FlashInfer's
            ``merge_state`` uses base 2, vLLM's ``merge_attn_states`` and flash-attn
            base e.

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
        seen = ~np.isinf(lse)
        rec = np.empty((*out.shape[:-1], width(out.shape[-1])), dtype=dtype)
        rec[..., M] = np.where(seen, lse, -np.inf)
        rec[..., D] = seen
        rec[..., N] = np.where(seen[..., None], out, 0)
        return cls(rec)

    @property
    def m(self) -> np.ndarray:
        """Reference logit of each row (the running max, or a fused kernel's lse), ``(...)``."""
        return self.records[..., M]

    @property
    def d(self) -> np.ndarray:
        """Softmax denominator relative to ``m``, ``(...)``."""
        return self.records[..., D]

    @property
    def n(self) -> np.ndarray:
        """Softmax numerator relative to ``m``, ``(..., D)``."""
        return self.records[..., N]

    @property
    def shape(self) -> tuple[int, ...]:
        """Row shape (records without the last axis)."""
        return self.records.shape[:-1]

    @property
    def head_dim(self) -> int:
        """``D``."""
        return self.records.shape[-1] - N.start

    def output(self, dtype: Any = None) -> np.ndarray:
        """Return the attention output ``n / d``, ``(..., D)``; 0 for empty rows, NaN stays NaN.

        Parameters
        ----------
        dtype : numpy dtype, optional
            Output dtype (default: the records' dtype).
        """
        return output_of(self.records, dtype)

    def lse(self, *, base: str | int = "e", dtype: Any = np.float32) -> np.ndarray:
        """Return the log-sum-exp ``m + log(d)``, ``(...)``; -inf for empty rows.

        Parameters
        ----------
        base : {"e", 2}, optional
            Natural log (default) or base 2.
        dtype : numpy dtype, optional
            Result dtype, float32 by default (computed in the records' dtype).
        """
        return lse_of(self.records, base, dtype)

    def __repr__(self):
        return f"State(shape={self.shape}, head_dim={self.head_dim}, dtype={self.records.dtype})"


def combine(a: State, b: State) -> State:
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
    if not isinstance(a, State) or not isinstance(b, State):
        raise TypeError("combine takes two mpitree.State objects")
    if a.head_dim != b.head_dim:
        raise ValueError(f"head dims differ: {a.head_dim} vs {b.head_dim}")
    return State(combine_records(a.records, b.records))
