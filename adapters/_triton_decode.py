"""A fused Triton decode kernel: a shard's (m, d, n) records split over its keys, and n / d.

Three kernels, one launch each: :func:`_split_kernel` (flash-decoding: each program
reads one K/V head's range of keys once for a whole block of its query group's rows,
an online softmax in float32), :func:`_combine_kernel` (the splits' partial records
merged in split order, as :func:`mpitree._state.merge_records` merges them) and
:func:`_finish_kernel` (the output ``n / d`` in the caller's dtype). With one split
the first writes the records itself. Records follow ``mpitree._state``'s layout
(``[m, d, n_0..n_{D-1}]`` along the last axis of ``(B, Hq, Sq, D + 2)``); the rows of
a GQA group (``Hq / Hkv`` heads by ``Sq`` queries) are contiguous there, so a block of
them is one program's rows.

Keys past ``kv_len`` are never loaded; keys a row does not see (positions, masks)
get a score of -inf by selection, and their values, whatever they hold, are never
multiplied into that row: ``p @ v`` runs on values with non-finite entries set to 0,
and a visible key's NaN or infinity enters only its own rows, as
:func:`mpitree._local.weighted_values` gives it. Products are float32 (``ieee``
precision: no TF32), for every input dtype.

Imports triton: the torch adapter imports this module only when ``MPITREE_KERNEL=triton``
selects it. CPU tensors run under Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import torch

from ._hint import missing

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - exercised only without triton
    raise missing("MPITREE_KERNEL=triton", "triton", exc) from exc

__all__ = ["decode_records", "finish_output", "interpreted"]

INF = tl.constexpr(float("inf"))  # a kernel reads only constexpr globals


@triton.jit
def _split_kernel(
    q, k, v, lens, vis, out,
    scale, T, SQ, G, HKV, R, NRB, CHUNK,
    qs0, qs1, qs2, qs3, ks0, ks1, ks2, ks3, vs0, vs1, vs2, vs3,
    ms0, ms1, ms2, ms3, os0, os1, os2, os3, os_split,
    DIM: tl.constexpr, HAS_LENS: tl.constexpr, HAS_VIS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One (batch, K/V head, block of rows, split of keys): its partial records."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    rb = pid % NRB
    bh = pid // NRB
    b = (bh // HKV).to(tl.int64)  # 64-bit offsets: a long cache's strides overflow 32 bits
    hk = bh % HKV
    hi = T
    if HAS_LENS:
        hi = tl.minimum(tl.load(lens + b).to(tl.int32), T)
    lo = split * CHUNK
    hi = tl.minimum(hi, lo + CHUNK)

    r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    rows = r < R
    g = r // SQ
    s = (r % SQ).to(tl.int64)
    h = (hk * G + g).to(tl.int64)
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    dims = d < DIM
    qp = q + b * qs0 + h[:, None] * qs1 + s[:, None] * qs2 + d[None, :] * qs3
    qf = tl.load(qp, mask=rows[:, None] & dims[None, :], other=0.0).to(tl.float32) * scale

    m_i = tl.full([BLOCK_R], -INF, tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        t = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
        inside = t < hi
        kv_mask = inside[:, None] & dims[None, :]
        kp = k + b * ks0 + hk.to(tl.int64) * ks1 + t[:, None] * ks2 + d[None, :] * ks3
        kf = tl.load(kp, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.dot(qf, tl.trans(kf), input_precision="ieee")
        keep = rows[:, None] & inside[None, :]
        if HAS_VIS:
            mp = vis + b * ms0 + h[:, None] * ms1 + s[:, None] * ms2 + t[None, :] * ms3
            keep = keep & (tl.load(mp, mask=keep, other=0) != 0)
        scores = tl.where(keep, scores, -INF)
        m_new = tl.maximum(m_i, tl.max(scores, 1))  # a NaN score: NaN p, d and n, whatever m
        shift = tl.where(m_new == -INF, 0.0, m_new)
        alpha = tl.exp(m_i - shift)
        p = tl.exp(scores - shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vp = v + b * vs0 + hk.to(tl.int64) * vs1 + t[:, None] * vs2 + d[None, :] * vs3
        vf = tl.load(vp, mask=kv_mask, other=0.0).to(tl.float32)
        finite = tl.abs(vf) < INF  # False for NaN too
        acc = acc * alpha[:, None] + tl.dot(p, tl.where(finite, vf, 0.0), input_precision="ieee")
        if tl.sum(tl.where(finite, 0, 1)) > 0:  # a non-finite value: only visible keys count
            seen = tl.where(keep, 1.0, 0.0)
            zero = tl.where(keep & (p == 0), 1.0, 0.0)
            big = tl.where(keep & (p != 0), 1.0, 0.0)
            isnan = tl.where(vf != vf, 1.0, 0.0)
            isinf = tl.where(finite | (vf != vf), 0.0, 1.0)
            pinf = tl.where(vf == INF, 1.0, 0.0)
            ninf = tl.where(vf == -INF, 1.0, 0.0)
            nan = tl.dot(seen, isnan, input_precision="ieee") + tl.dot(
                zero, isinf, input_precision="ieee"
            )
            acc = tl.where(tl.dot(big, pinf, input_precision="ieee") > 0, acc + INF, acc)
            acc = tl.where(tl.dot(big, ninf, input_precision="ieee") > 0, acc - INF, acc)
            acc = tl.where(nan > 0, acc + float("nan"), acc)
        m_i = m_new

    base = out + split.to(tl.int64) * os_split + b * os0 + h * os1 + s * os2
    tl.store(base, m_i, mask=rows)
    tl.store(base + os3, l_i, mask=rows)
    tl.store(base[:, None] + (d[None, :] + 2) * os3, acc, mask=rows[:, None] & dims[None, :])


@triton.jit
def _combine_kernel(
    part, out, SPLITS, HQ, SQ, ps_split, ps0, ps1, ps2, ps3, os0, os1, os2, os3,
    WIDTH: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """One row: merge its splits' partial records in split order (NaN winning the max)."""
    row = tl.program_id(0).to(tl.int64)
    s = row % SQ
    h = (row // SQ) % HQ
    b = row // (SQ * HQ)
    src = part + b * ps0 + h * ps1 + s * ps2
    c = tl.arange(0, BLOCK_W) + 1  # d, then n: the fields a merge weights
    fields = c < WIDTH
    m = tl.load(src)
    for i in range(1, SPLITS):
        m = tl.maximum(m, tl.load(src + i * ps_split), propagate_nan=tl.PropagateNan.ALL)
    shift = tl.where(m == -INF, 0.0, m)
    acc = tl.zeros([BLOCK_W], tl.float32)
    for i in range(0, SPLITS):
        one = src + i * ps_split
        acc += tl.exp(tl.load(one) - shift) * tl.load(one + c * ps3, mask=fields, other=0.0)
    dst = out + b * os0 + h * os1 + s * os2
    tl.store(dst, m)
    tl.store(dst + c * os3, acc, mask=fields)


@triton.jit
def _finish_kernel(rec, out, rs, os, DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """One row: ``n / d`` (0 for an empty row, NaN stays NaN), rounded once to out's dtype."""
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dims = d < DIM
    den = tl.load(rec + row * rs + 1 + tl.zeros([BLOCK_D], tl.int32))
    num = tl.load(rec + row * rs + 2 + d, mask=dims, other=0.0)
    res = tl.math.div_rn(num, tl.where(den == 0, 1.0, den))
    if out.dtype.element_ty == tl.bfloat16:
        res = _bfloat16_rtne(res)
    tl.store(out + row * os + d, res.to(out.dtype.element_ty), mask=dims)


@triton.jit
def _bfloat16_rtne(x):
    """float32 to bfloat16 rounded to nearest, ties to even, in integer arithmetic.

    What the GPU's conversion and torch's ``.to(torch.bfloat16)`` give; Triton's
    interpreter truncates instead. NaN stays NaN (quieted), overflow gives infinity.
    """
    bits = x.to(tl.uint32, bitcast=True).to(tl.int64)
    up = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    top = tl.where(x != x, (bits >> 16) | 0x40, up) & 0xFFFF
    return top.to(tl.uint16).to(tl.bfloat16, bitcast=True)


def interpreted():
    """Whether Triton runs its interpreter (``TRITON_INTERPRET=1``): CPU tensors only then."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _launching(x):
    """Return the context to launch kernels on ``x``'s device in; refuse one Triton cannot run on.

    On CPU tensors (the interpreter runs the kernels in numpy) numpy's warnings on
    non-finite arithmetic are silenced: garbage in excluded slots is the normal case,
    selected away as on the device.
    """
    if x.device.type != "cpu":
        return contextlib.nullcontext()
    if not interpreted():
        raise RuntimeError(
            "MPITREE_KERNEL=triton on CPU tensors needs Triton's interpreter: set "
            "TRITON_INTERPRET=1 before the first decode (or unset MPITREE_KERNEL)"
        )
    return np.errstate(all="ignore")


def _splits(x, programs, t, block_n):
    """Return the key splits: programs enough to fill the device, a block of keys or more each."""
    blocks = triton.cdiv(t, block_n)
    if x.device.type == "cuda":
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        want = triton.cdiv(2 * sms, programs)
    else:
        want = 4
    return max(1, min(blocks, want))


def _mask_strides(vis):
    """Return a mask's strides, 0 along a head axis of 1 (one mask for every head)."""
    if vis is None:
        return 0, 0, 0, 0
    s0, s1, s2, s3 = vis.stride()
    return s0, s1 if vis.shape[1] > 1 else 0, s2, s3


def decode_records(q, k, v, scale, lens, vis, out, splits=None, scratch=None):
    """Write the records of q over k, v into ``out``, a float32 tensor on q's device.

    Parameters
    ----------
    q : torch.Tensor
        ``(B, Hq, Sq, D)``, float16, bfloat16 or float32 (any strides).
    k, v : torch.Tensor
        ``(B, Hkv, T, D)``, q's dtype and device; ``Hq % Hkv == 0``.
    scale : float
        The logit scale.
    lens : torch.Tensor or None
        int ``(B,)`` in ``[0, T]``: keys used per batch row (those past are never read).
    vis : torch.Tensor or None
        bool ``(B, 1 or Hq, Sq, T)``: True = attend.
    out : torch.Tensor
        float32 ``(B, Hq, Sq, D + 2)`` records, written in place.
    splits : int, optional
        Key splits (default: enough programs to fill the device); the records'
        bits depend on it, and on nothing else but the inputs.
    scratch : dict, optional
        The caller's scratch, kept across calls: the splits' partial records are
        allocated there once per shape and reused (a plan's steps allocate nothing).
        Without it, each call with more than one split allocates them.
    """
    quiet = _launching(q)
    b, hq, sq, dim = (int(x) for x in q.shape)
    hkv, t = int(k.shape[1]), int(k.shape[2])
    if t == 0 or b * hq * sq == 0:
        out[..., 0] = float("-inf")
        out[..., 1:] = 0
        return
    g = hq // hkv
    rows = g * sq
    block_r = max(16, min(64, triton.next_power_of_2(rows)))
    block_n = 64 if q.device.type == "cuda" else 32
    block_d = max(16, triton.next_power_of_2(dim))
    nrb = triton.cdiv(rows, block_r)
    programs = b * hkv * nrb
    splits = splits or _splits(q, programs, t, block_n)
    chunk = triton.cdiv(triton.cdiv(t, splits), block_n) * block_n
    splits = triton.cdiv(t, chunk)
    if lens is not None:
        lens = lens.to(q.device)
    if vis is not None:
        vis = vis.to(q.device).view(torch.uint8)
    part = out if splits == 1 else _partials(scratch, (splits, *out.shape), q.device)
    ps = part.stride()[-4:]
    with quiet:
        _split_kernel[(programs, splits)](
            q, k, v, lens if lens is not None else q, vis if vis is not None else q, part,
            float(scale), t, sq, g, hkv, rows, nrb, chunk,
            *q.stride(), *k.stride(), *v.stride(), *_mask_strides(vis),
            *ps, part.stride(0) if splits > 1 else 0,
            DIM=dim, HAS_LENS=lens is not None, HAS_VIS=vis is not None,
            BLOCK_R=block_r, BLOCK_N=block_n, BLOCK_D=block_d,
        )  # fmt: skip
        if splits > 1:
            _combine_kernel[(b * hq * sq,)](
                part, out, splits, hq, sq, part.stride(0), *ps, *out.stride(),
                WIDTH=dim + 2, BLOCK_W=triton.next_power_of_2(dim + 1),
            )  # fmt: skip


def _partials(scratch, shape, device):
    """Return a float32 ``shape`` tensor for the splits' partials: ``scratch``'s, made once."""
    if scratch is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    part = scratch.get(shape)
    if part is None:
        part = scratch[shape] = torch.empty(shape, dtype=torch.float32, device=device)
    return part


def finish_output(records, dtype, out=None):
    """Return ``n / d`` of float32 records ``(..., D + 2)`` on their device, in ``dtype``.

    The same values as :func:`mpitree._state.output_of` rounded to ``dtype``: one
    IEEE division, then one rounding to nearest.

    Parameters
    ----------
    records : torch.Tensor
        float32 ``(..., D + 2)``.
    dtype : torch.dtype
        The output's dtype.
    out : torch.Tensor, optional
        ``(..., D)`` of ``dtype`` on the records' device, written in place and
        returned (nothing allocated when it and the records are contiguous);
        default: a new tensor.
    """
    quiet = _launching(records)
    records = records.contiguous()
    *shape, w = records.shape
    dim = w - 2
    target = out
    if out is None or not out.is_contiguous():
        target = torch.empty((*shape, dim), dtype=dtype, device=records.device)
    n = target.numel() // max(dim, 1)
    if n and dim:
        with quiet:
            block_d = max(16, triton.next_power_of_2(dim))
            _finish_kernel[(n,)](records, target, w, dim, DIM=dim, BLOCK_D=block_d)
    if out is None:
        return target
    if target is not out:
        out.copy_(target)
    return out
