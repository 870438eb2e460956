"""A Triton kernel merging a ``(p, rows, D + 2)`` stack of records in rank order.

The device half of a merge inside a node (issue 50): ``p`` ranks' records, stacked
in rank order, folded into one ``(rows, D + 2)`` array as
``combine_records(combine_records(s[0], s[1]), s[2]) ...`` (``mpitree._state``),
step for step: ``m`` the max with NaN winning (the left side's on a tie), the shift
0 where ``m`` is -inf, one rounded subtraction and one exponential per weight, two
rounded products and one rounded sum per field, never a fused multiply-add (the
kernel is compiled with ``enable_fp_fusion=False``). The exponential is the compiled
op's own (``merge_exp`` in ``_native_op.c``: Cody and Waite's reduction, a Taylor
polynomial in float64 by Horner's rule, the power of two set in its bits; float32
rounds its result once), so the kernel gives the bits of the MPI op that merges
between nodes, on any device.

Records are float32 or float64, C-contiguous, on any device Triton runs on; CPU
tensors run under Triton's interpreter (``TRITON_INTERPRET=1`` before triton's first
kernel is defined). The ``device-node`` strategy launches it once a step over a
node's shared slots (``mpitree._strategies.device_node``, ``_device_slots``).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - exercised only without triton
    raise ImportError(
        "mpitree.adapters._triton_merge needs Triton: pip install triton (CPU tensors run "
        f"under its interpreter, TRITON_INTERPRET=1); importing it failed: {exc}"
    ) from exc

__all__ = ["merge_stack"]

# merge_exp's constants (_native_op.c), exact in float64: ln 2 in two parts, 1 / ln 2,
# and the Taylor coefficients 1/13! .. 1/2! that its Horner loop takes in turn
LN2_HI = tl.constexpr(6.93147180369123816490e-01)
LN2_LO = tl.constexpr(1.90821492927058770002e-10)
INV_LN2 = tl.constexpr(1.44269504088896338700e00)
F13 = tl.constexpr(1.0 / 6227020800.0)
F12 = tl.constexpr(1.0 / 479001600.0)
F11 = tl.constexpr(1.0 / 39916800.0)
F10 = tl.constexpr(1.0 / 3628800.0)
F9 = tl.constexpr(1.0 / 362880.0)
F8 = tl.constexpr(1.0 / 40320.0)
F7 = tl.constexpr(1.0 / 5040.0)
F6 = tl.constexpr(1.0 / 720.0)
F5 = tl.constexpr(1.0 / 120.0)
F4 = tl.constexpr(1.0 / 24.0)
F3 = tl.constexpr(1.0 / 6.0)
F2 = tl.constexpr(1.0 / 2.0)
BLOCK_R = 16  # rows per program


@triton.jit
def _f64(value):
    """``value`` (a Python float) as a float64 scalar, exactly."""
    return tl.full([1], value, tl.float64)


@triton.jit
def _pow2(k):
    """2**k as float64, for -1022 <= k <= 1023: the exponent field set, exactly."""
    return ((k + 1023).to(tl.int64) << 52).to(tl.float64, bitcast=True)


@triton.jit
def _merge_exp(x):
    """exp(x) of float64 ``x``: ``merge_exp`` of ``_native_op.c``, operation for operation."""
    xc = tl.minimum(tl.maximum(x, -746.0), 710.0)  # NaN and out-of-range: fixed below
    t = xc * _f64(INV_LN2)
    k = tl.where(t < 0, t - 0.5, t + 0.5).to(tl.int32)  # truncates toward 0, as C's (int)
    kf = k.to(tl.float64)
    r = (xc - kf * _f64(LN2_HI)) - kf * _f64(LN2_LO)
    q = _f64(F13)
    q = q * r + _f64(F12)
    q = q * r + _f64(F11)
    q = q * r + _f64(F10)
    q = q * r + _f64(F9)
    q = q * r + _f64(F8)
    q = q * r + _f64(F7)
    q = q * r + _f64(F6)
    q = q * r + _f64(F5)
    q = q * r + _f64(F4)
    q = q * r + _f64(F3)
    q = q * r + _f64(F2)
    p = 1.0 + (r + (r * r) * q)
    big = k > 1023
    small = k < -1022
    scaled = p * _pow2(tl.where(big, 1023, tl.where(small, k + 600, k)))
    y = tl.where(big, scaled * 2.0, tl.where(small, scaled * _pow2(k * 0 - 600), scaled))
    y = tl.where(x < -745.2, 0.0, y)
    y = tl.where(x > 709.782712893384, float("inf"), y)
    return tl.where(x != x, x + x, y)


@triton.jit
def _weight(m_part, shift):
    """``exp(m_part - shift)`` rounded in the records' dtype (float32: once, from float64)."""
    return _merge_exp((m_part - shift).to(tl.float64)).to(m_part.dtype)


@triton.jit
def _merge_kernel(stack, out, p, rows, width, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    """One block of rows: fold the ``p`` ranks' records in rank order."""
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    col = tl.arange(0, BLOCK_W)
    live = row < rows
    at = row[:, None] * width + col[None, :]
    mask = live[:, None] & (col[None, :] < width)
    acc = tl.load(stack + at, mask=mask, other=0.0)
    acc_m = tl.load(stack + row * width, mask=live, other=0.0)
    for rank in range(1, p):
        base = stack + rank * rows * width
        part = tl.load(base + at, mask=mask, other=0.0)
        part_m = tl.load(base + row * width, mask=live, other=0.0)
        m = tl.where((acc_m != acc_m) | (acc_m >= part_m), acc_m, part_m)
        shift = tl.where(m == float("-inf"), 0.0, m).to(m.dtype)
        wa = _weight(acc_m, shift)
        wb = _weight(part_m, shift)
        fields = wa[:, None] * acc + wb[:, None] * part
        acc = tl.where(col[None, :] == 0, m[:, None], fields)
        acc_m = m
    tl.store(out + at, acc, mask=mask)


def merge_stack(stack, out=None):
    """Merge a stack of records in rank order on the stack's device: one launch.

    Parameters
    ----------
    stack : torch.Tensor
        ``(p, rows, D + 2)`` records, float32 or float64, C-contiguous: rank ``r``'s
        records at ``stack[r]``.
    out : torch.Tensor, optional
        ``(rows, D + 2)``, the stack's dtype and device, C-contiguous (default: a new one).

    Returns
    -------
    torch.Tensor
        ``out``: the records folded with ``combine_records`` in rank order, with the
        compiled op's exponential (``p = 0``: the empty state).

    Raises
    ------
    ValueError
        A stack not 3-D, not float32 or float64, not contiguous, or records shorter
        than 2; an ``out`` of another shape, dtype or device, or not contiguous.
    """
    if stack.dim() != 3 or stack.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"a (p, rows, D + 2) float32 or float64 stack, got {stack.dtype} "
                         f"{tuple(stack.shape)}")  # fmt: skip
    p, rows, width = stack.shape
    if width < 2 or not stack.is_contiguous():
        raise ValueError(f"records of D + 2 >= 2 values, C-contiguous, got {tuple(stack.shape)}")
    if out is None:
        out = torch.empty((rows, width), dtype=stack.dtype, device=stack.device)
    elif (
        out.shape != (rows, width)
        or out.dtype != stack.dtype
        or out.device != stack.device
        or not out.is_contiguous()
    ):
        raise ValueError(f"out must be a contiguous ({rows}, {width}) {stack.dtype} tensor "
                         f"on {stack.device}")  # fmt: skip
    if p == 0:
        out[..., 0] = float("-inf")
        out[..., 1:] = 0
        return out
    if rows:
        grid = (triton.cdiv(rows, BLOCK_R),)
        _merge_kernel[grid](
            stack, out, p, rows, width,
            BLOCK_R=BLOCK_R, BLOCK_W=triton.next_power_of_2(width), enable_fp_fusion=False,
        )  # fmt: skip
    return out
