"""Host fast paths with other frameworks' arrays: torch CPU tensors, numpy bfloat16.

The core suite runs without torch or ml_dtypes; this module needs both (the
test extra: torch, and jax, which brings ml_dtypes).
"""

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import torch
from numpy.testing import assert_allclose
from test_kernel import check_kernel_slot
from test_state import poisoned_state, random_state

from mpitree import combine, extend
from mpitree._namespace import namespace
from mpitree._state import combine_records
from mpitree._step import Attention


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
    slot.fill(Attention(namespace(q), lazy, k, v, 0.3, None, None), got)
    slot.fill(Attention(namespace(q), q.clone(), k, v, 0.3, None, None), want)
    np.testing.assert_array_equal(got, want)


def test_combine_records_torch_is_the_same_definition():
    """The torch merge (sharded prefill's staircase) is combine_records itself.

    Same NaN pattern; values within float32 rounding (torch's exp and numpy's differ by
    an ulp).
    """
    rng = np.random.default_rng(5)
    a, b = (poisoned_state(rng, (64,), 9, np.float32) for _ in range(2))
    got = combine_records(torch.from_numpy(a.records), torch.from_numpy(b.records)).numpy()
    ref = combine(a, b).records
    assert np.array_equal(np.isnan(got), np.isnan(ref))
    assert_allclose(got, ref, rtol=1e-6, atol=1e-7)


TORCH_NAMESPACE = """
import sys, numpy as np, torch, mpitree
from mpitree._namespace import namespace
assert "mpitree.adapters.torch" not in sys.modules
ns = namespace(torch.zeros(2))
print(type(ns).__module__, type(ns).__name__, "mpitree.adapters.torch" in sys.modules)
from mpitree._buffers import KINDS, kind_for
buf = kind_for(("host", "pinned"), torch.zeros(1))((2, 3), "float32", torch.zeros(1)).buf
assert KINDS["pinned"][0].__module__ == "mpitree.adapters.torch", KINDS  # its pinned kind
x = torch.zeros(1, 1, 1, 8)
print(type(buf).__name__, buf.shape, buf.dtype, ns.fused_records(x, x, x, 1.0))
"""


def test_torch_namespace_is_the_adapters_registered_on_first_sight():
    """The core keeps no torch device code: its first torch tensor imports the torch adapter,
    whose namespace (CUDA paths included) is then every tensor's and whose pinned buffer kind
    is registered; on the CPU nothing fuses, and a CPU tensor's records stage in host memory."""
    out = subprocess.run(
        [sys.executable, "-c", TORCH_NAMESPACE], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == [
        "mpitree.adapters.torch CudaTorch True",
        "ndarray (2, 3) float32 None",
    ], out.stdout
