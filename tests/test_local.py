"""local_state on one process against the float64 reference, and its input checks."""

import numpy as np
import pytest
from helpers import atol, make_problem
from numpy.testing import assert_allclose

from mpitree import local_state


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize(
    "kw",
    [
        dict(q_heads=8, kv_heads=2),
        dict(q_heads=3, kv_heads=1, q_len=4, positions=True),
        dict(batch=3, kv_len=True, mask="head", q_len=2),
        dict(mask="shared", scale=2.5),
    ],
)
def test_local_state_matches_reference(dtype, kw):
    prob = make_problem(2, [29], dtype=dtype, **kw)
    k, v, extra = prob.shard(0)
    s = local_state(prob.q, k, v, scale=prob.scale, **extra)
    acc = np.float64 if dtype == np.float64 else np.float32
    assert s.records.dtype == acc and s.shape == prob.q.shape[:3]
    ref, ref_lse = prob.reference()
    assert_allclose(s.output(), ref, atol=atol(dtype) if dtype != np.float16 else 2e-5)
    fin = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(s.lse()), fin)
    assert_allclose(s.lse()[fin], ref_lse[fin], rtol=2e-6)


def test_local_state_accepts_strided_cache_views():
    """A slice of a preallocated cache (unit stride in D only) is accepted, not copied."""
    rng = np.random.default_rng(0)
    cache = rng.standard_normal((1, 2, 64, 8)).astype(np.float32)
    q = rng.standard_normal((1, 4, 1, 8)).astype(np.float32)
    view = cache[:, :, :10]
    assert not view.flags.c_contiguous
    a = local_state(q, view, view)
    b = local_state(q, view.copy(), view.copy())
    assert_allclose(a.records, b.records, rtol=1e-6)


def test_empty_shard_is_identity():
    q = np.ones((1, 2, 1, 4), np.float32)
    kv = np.zeros((1, 1, 0, 4), np.float32)
    s = local_state(q, kv, kv)
    assert np.all(np.isneginf(s.m)) and np.all(s.d == 0) and np.all(s.n == 0)
    assert np.all(s.output() == 0) and np.all(np.isneginf(s.lse()))


def test_float32_scale_does_not_upcast():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 1, 4)).astype(np.float32)
    k = rng.standard_normal((1, 2, 5, 4)).astype(np.float32)
    assert local_state(q, k, k, scale=np.float64(0.5)).records.dtype == np.float32


Q = np.zeros((2, 4, 1, 8), np.float32)
KV = np.zeros((2, 2, 5, 8), np.float32)


@pytest.mark.parametrize(
    "args, kw, exc, match",
    [
        ((Q[0], KV, KV), {}, ValueError, "q must have 4 dimensions"),
        ((Q, KV[..., ::2], KV[..., ::2]), {}, ValueError, "contiguous in its last dimension"),
        ((Q.tolist(), KV, KV), {}, TypeError, "numpy, torch, CuPy or JAX array"),
        ((Q.astype(np.int32), KV, KV), {}, TypeError, "float16, bfloat16, float32, float64"),
        ((Q, KV.astype(np.float64), KV), {}, TypeError, "dtypes differ"),
        ((Q, KV, KV[:, :, :3]), {}, ValueError, "k and v shapes differ"),
        ((Q, KV[:1], KV[:1]), {}, ValueError, "batch or D"),
        ((np.zeros((2, 3, 1, 8), np.float32), KV, KV), {}, ValueError, "multiple of kv heads"),
        ((Q, KV, KV), dict(kv_len=np.array([1, 6])), ValueError, "kv_len must lie in"),
        ((Q, KV, KV), dict(kv_len=np.array([1.0, 2.0])), TypeError, "integer"),
        ((Q, KV, KV), dict(kv_len=np.array([1])), ValueError, "shape"),
        ((Q, KV, KV), dict(q_pos=np.zeros((2, 1), int)), ValueError, "together"),
        (
            (Q, KV, KV),
            dict(q_pos=np.zeros((2, 2), int), k_pos=np.zeros((2, 5), int)),
            ValueError,
            "q_pos must have shape",
        ),
        ((Q, KV, KV), dict(mask=np.ones((2, 3, 1, 5), bool)), ValueError, "broadcastable"),
        ((Q, KV, KV), dict(mask=np.ones((2, 4, 1, 5), np.int8)), TypeError, "boolean"),
        ((Q, KV, KV), dict(scale=float("nan")), ValueError, "finite"),
        ((Q, KV, KV), dict(scale="x"), TypeError, "real number"),
    ],
)
def test_bad_local_input(args, kw, exc, match):
    with pytest.raises(exc, match=match):
        local_state(*args, **kw)
