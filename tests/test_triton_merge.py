"""The Triton merge kernel (``adapters/_triton_merge.py``) under Triton's interpreter, on CPU.

A ``(p, rows, D + 2)`` stack folded in rank order must give, bit for bit, what folding
``combine_records`` in rank order gives with the compiled op's exponential (the
kernel's own is ``merge_exp`` of ``_native_op.c``, operation for operation): every kind
of row of ``test_merge_definition`` (empty states, -inf, NaN scores and values,
overflow, subnormals), the flag record, one rank and none. Where CUDA is, the same
cases run on the GPU (compiled, ``enable_fp_fusion=False``), held to the same bits.
"""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton defines the kernels
triton = pytest.importorskip("triton")
DEVICE = "cuda" if CUDA else "cpu"

import triton.language as tl  # noqa: E402
from mpitree.adapters._triton_merge import _merge_exp, merge_stack  # noqa: E402
from test_merge_definition import (  # noqa: E402
    assert_same_bits,
    exp_inputs,
    merge_exp,
    needs_native,
    records,
)

from mpitree._state import FLAG_CLEAR, FLAG_FAILED, combine_records  # noqa: E402

pytestmark = needs_native  # the reference's exponential is the compiled op's


@pytest.fixture(autouse=True)
def quiet_invalid():
    """inf - inf and 0 * inf are part of the cases (the interpreter computes in numpy)."""
    with np.errstate(all="ignore"):
        yield


def on_device(array):
    """A numpy array as a torch tensor on the device the kernels run on here."""
    return torch.from_numpy(array).to(DEVICE)


def folded(stack):
    """``combine_records`` folded over the stack in rank order, with the C op's exp."""
    acc = stack[0]
    for part in stack[1:]:
        acc = combine_records(acc, part, exp=merge_exp)
    return acc


def stack_of(p, seed, dim, dtype, flags=()):
    """``p`` ranks' records of every kind (four kinds of side: ordinary, all empty, empty
    with NaN values), then each rank's flag record (``FLAG_FAILED`` for ``flags``)."""
    parts = [records(seed + r // 4, dim, dtype, r % 4) for r in range(p)]
    stack = np.stack(parts)
    flag = np.zeros((p, 1, dim + 2), dtype)
    flag[:, 0, 0] = [FLAG_FAILED if r in flags else FLAG_CLEAR for r in range(p)]
    return np.ascontiguousarray(np.concatenate([stack, flag], axis=1))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("dim", [1, 7, 64])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
def test_kernel_is_the_rank_ordered_fold(p, dim, dtype):
    stack = stack_of(p, 3, dim, dtype)
    got = merge_stack(on_device(stack))
    assert got.dtype == on_device(stack).dtype and tuple(got.shape) == stack.shape[1:]
    assert got.device == on_device(stack).device
    assert_same_bits(got.cpu().numpy(), folded(stack))
    assert got.cpu().numpy()[-1, 0] == FLAG_CLEAR


@pytest.mark.parametrize("p, flags", [(1, {0}), (3, {1}), (4, {0, 3})])
def test_flag_record_rides(p, flags):
    """A rank's failure flag (m = 1 on its flag record) reaches the merged flag, d = n = 0."""
    stack = stack_of(p, 5, 7, np.float32, flags)
    got = merge_stack(on_device(stack)).cpu().numpy()
    assert_same_bits(got, folded(stack))
    assert got[-1, 0] == FLAG_FAILED and not got[-1, 1:].any()


def test_out_none_rows_and_bad_input():
    stack = stack_of(3, 7, 7, np.float32)
    out = torch.full(stack.shape[1:], 7.0, device=DEVICE)
    assert merge_stack(on_device(stack), out=out) is out
    assert_same_bits(out.cpu().numpy(), folded(stack))
    empty = merge_stack(torch.zeros((0, 5, 9), device=DEVICE))  # no rank: the empty state
    assert torch.isneginf(empty[:, 0]).all() and not empty[:, 1:].any()
    assert merge_stack(torch.zeros((3, 0, 9), device=DEVICE)).shape == (0, 9)
    for bad in (torch.zeros((2, 3)), torch.zeros((2, 3, 4), dtype=torch.float16),
                torch.zeros((2, 3, 1)), torch.zeros((2, 4, 3)).transpose(1, 2)):  # fmt: skip
        with pytest.raises(ValueError):
            merge_stack(bad)
    with pytest.raises(ValueError, match="out must be"):
        merge_stack(on_device(stack), out=torch.zeros(3, 9, device=DEVICE))


@triton.jit
def _exp_kernel(x, y, n, BLOCK: tl.constexpr):
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = at < n
    v = tl.load(x + at, mask=live, other=0.0)
    tl.store(y + at, _merge_exp(v.to(tl.float64)).to(v.dtype), mask=live)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_kernel_exp_is_the_compiled_ops(dtype):
    """The kernel's exponential gives ``merge_exp``'s bits on its whole input set."""
    x = exp_inputs(dtype)
    y = torch.empty(len(x), dtype=torch.from_numpy(x).dtype, device=DEVICE)
    grid = (triton.cdiv(len(x), 1024),)
    _exp_kernel[grid](on_device(x), y, len(x), BLOCK=1024, enable_fp_fusion=False)
    assert_same_bits(y.cpu().numpy(), merge_exp(x))
