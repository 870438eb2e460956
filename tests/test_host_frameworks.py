"""Host fast paths with other frameworks' arrays: torch CPU tensors, numpy bfloat16.

The core suite runs without torch or ml_dtypes; this module needs both (the
test extra: torch, and jax, which brings ml_dtypes).
"""

import ml_dtypes
import numpy as np
import pytest
import torch
from numpy.testing import assert_allclose
from test_kernel import check_kernel_slot
from test_state import poisoned_state, random_state

from mpitree import combine, extend


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_finish_heads_after_queries_for_torch(dtype):
    """A torch ``like`` gets a contiguous (B, Sq, Hq, D) tensor in its own dtype."""
    rec = random_state(np.random.default_rng(4), (1, 4, 2), 8).records
    like = torch.zeros(1, 4, 2, 8, dtype=getattr(torch, dtype))
    got = extend.finish(rec, like, layout="bshd")
    ref = extend.finish(rec, like).transpose(1, 2)
    assert got.dtype == like.dtype and got.is_contiguous() and got.shape == (1, 2, 4, 8)
    assert torch.equal(got, ref)


def test_finish_layouts_agree_on_a_numpy_bfloat16_dtype():
    """Both layouts give a bfloat16 numpy ``like`` the same (float32) host output."""
    rec = random_state(np.random.default_rng(6), (1, 2, 3), 4).records
    like = np.zeros(1, ml_dtypes.bfloat16)
    a, b = extend.finish(rec, like), extend.finish(rec, like, layout="bshd")
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a.transpose(0, 2, 1, 3), b)


def test_kernel_slot_over_torch_tensors(monkeypatch):
    """The KernelSlot checks over shared CPU tensors (element strides, not bytes)."""
    slot, q, k, v = check_kernel_slot(monkeypatch, torch.from_numpy, torch.Tensor.double)
    lazy = torch._neg_view(-q)  # negated lazily: the slot must read its values, not its memory
    got, want = (np.empty((q.shape[0] * q.shape[1], 18), np.float32) for _ in range(2))
    slot.fill(extend.Attention(extend.namespace(q), lazy, k, v, 0.3, None, None), got)
    slot.fill(extend.Attention(extend.namespace(q), q.clone(), k, v, 0.3, None, None), want)
    np.testing.assert_array_equal(got, want)


def test_combine_records_torch_is_the_same_definition():
    """The torch merge (sharded prefill's staircase) is combine_records itself.

    Same NaN pattern; values within float32 rounding (torch's exp and numpy's differ by
    an ulp).
    """
    rng = np.random.default_rng(5)
    a, b = (poisoned_state(rng, (64,), 9, np.float32) for _ in range(2))
    got = extend.combine_records(torch.from_numpy(a.records), torch.from_numpy(b.records)).numpy()
    ref = combine(a, b).records
    assert np.array_equal(np.isnan(got), np.isnan(ref))
    assert_allclose(got, ref, rtol=1e-6, atol=1e-7)
