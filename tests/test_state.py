"""State, combine and the native C combine: identity, commutativity, associativity, -inf."""

import ctypes

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.testing import assert_allclose

import mpitree
from mpitree import State, combine, local_state, reference_attention
from mpitree._library import native_lib


def random_state(rng, shape, dim, dtype=np.float32, empty_frac=0.2, big=False):
    rec = np.empty((*shape, dim + 2), dtype=dtype)
    rec[..., 0] = rng.standard_normal(shape) * (1e4 if big else 3)
    rec[..., 1] = rng.random(shape) * 5 + 0.1
    rec[..., 2:] = rng.standard_normal((*shape, dim))
    empty = rng.random(shape) < empty_frac
    rec[empty, 0] = -np.inf
    rec[empty, 1:] = 0
    return State(rec)


def output_and_lse(s):
    return s.output().astype(np.float64), s.lse().astype(np.float64)


seeds = st.integers(0, 2**32 - 1)
dims = st.sampled_from([1, 3, 8, 64, 130])
dtypes = st.sampled_from([np.float32, np.float64])


@settings(max_examples=60, deadline=None)
@given(seeds, dims, dtypes, st.booleans())
def test_empty_is_identity(seed, dim, dtype, big):
    a = random_state(np.random.default_rng(seed), (5,), dim, dtype, big=big)
    e = State.empty((5,), dim, dtype)
    assert np.array_equal(combine(a, e).records, a.records)
    assert np.array_equal(combine(e, a).records, a.records)
    ee = combine(e, e)
    assert np.all(np.isneginf(ee.m)) and not np.isnan(ee.records).any()


@settings(max_examples=60, deadline=None)
@given(seeds, dims, dtypes, st.booleans())
def test_commutative_bitwise(seed, dim, dtype, big):
    rng = np.random.default_rng(seed)
    a, b = (random_state(rng, (7,), dim, dtype, big=big) for _ in range(2))
    assert np.array_equal(combine(a, b).records, combine(b, a).records)


@settings(max_examples=60, deadline=None)
@given(seeds, dims, dtypes, st.booleans())
def test_associative_within_rounding(seed, dim, dtype, big):
    rng = np.random.default_rng(seed)
    a, b, c = (random_state(rng, (7,), dim, dtype, big=big) for _ in range(3))
    left, right = combine(combine(a, b), c), combine(a, combine(b, c))
    tol = 1e-5 if dtype == np.float32 else 1e-12
    lo, ll = output_and_lse(left)
    ro, rl = output_and_lse(right)
    assert_allclose(lo, ro, atol=tol * 10, rtol=tol)
    assert_allclose(rl, ll, rtol=tol, atol=tol)
    assert not np.isnan(left.records).any()


def test_combine_equals_attention_over_the_union():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, 3, 8))
    k = rng.standard_normal((2, 2, 20, 8))
    v = rng.standard_normal((2, 2, 20, 8))
    first = local_state(q, k[:, :, :7], v[:, :, :7])
    merged = combine(first, local_state(q, k[:, :, 7:], v[:, :, 7:]))
    ref, ref_lse = reference_attention(q, k, v)
    assert_allclose(merged.output(), ref, atol=1e-12)
    assert_allclose(merged.lse(), ref_lse, rtol=1e-6)


@pytest.mark.parametrize("base", ["e", 2])
def test_from_lse_roundtrip(base):
    rng = np.random.default_rng(1)
    s = random_state(rng, (3, 4), 8, np.float64)
    back = State.from_lse(s.output(), s.lse(base=base), base=base)
    assert_allclose(back.output(), s.output(), atol=1e-12)
    assert_allclose(back.lse(), s.lse(), rtol=1e-6)
    assert np.array_equal(np.isneginf(back.m), np.isneginf(s.m))
    if base == 2:
        assert_allclose(s.lse(base=2), s.lse() / np.log(2), rtol=1e-6)


def test_from_lse_validates():
    with pytest.raises(ValueError, match="lse shape"):
        State.from_lse(np.zeros((2, 3, 4)), np.zeros((2, 4)))
    with pytest.raises(ValueError, match="base"):
        State.from_lse(np.zeros((2, 4)), np.zeros(2), base=10)
    with pytest.raises(TypeError, match="float32 or float64"):
        State(np.zeros((2, 5), dtype=np.int32))
    with pytest.raises(ValueError, match="head dims differ"):
        combine(State.empty((2,), 4), State.empty((2,), 5))


def native_combine(a, b):
    lib = native_lib()
    io = np.array(b.records, copy=True, order="C")
    src = np.ascontiguousarray(a.records)
    lib.mpitree_combine(
        src.dtype.itemsize * 8,
        src.ctypes.data_as(ctypes.c_void_p),
        io.ctypes.data_as(ctypes.c_void_p),
        int(np.prod(src.shape[:-1])),
        a.head_dim,
    )
    return State(io)


@pytest.mark.skipif(not mpitree.native_op_available(), reason="native op not built")
@settings(max_examples=80, deadline=None)
@given(seeds, dims, dtypes, st.booleans())
def test_native_combine_matches_numpy(seed, dim, dtype, big):
    rng = np.random.default_rng(seed)
    a, b = (random_state(rng, (9,), dim, dtype, empty_frac=0.3, big=big) for _ in range(2))
    native, ref = native_combine(a, b), combine(a, b)
    tol = 2e-6 if dtype == np.float32 else 1e-14
    assert_allclose(native.records, ref.records, rtol=tol, atol=tol)
    assert np.array_equal(native.records, native_combine(b, a).records)
    assert not np.isnan(native.records).any()


def test_native_op_is_built():
    """The package build must produce the native op (CI installs with a compiler)."""
    from mpitree._library import load_error

    assert mpitree.native_op_available(), load_error()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("native", [True, False])
def test_finish_heads_after_queries_is_the_transpose_bitwise(dtype, native, monkeypatch):
    """finish(layout="bshd") is finish's output transposed to (B, Sq, Hq, D), bit for bit."""
    from mpitree import _state, extend

    if not native:
        monkeypatch.setattr(_state, "native_lib", lambda: None)
    rng = np.random.default_rng(3)
    rec = random_state(rng, (2, 5, 3), 19, dtype).records  # (B, Hq, Sq, D + 2), some empty
    rec[0, 1, 2, 2] = np.nan  # NaN stays NaN
    ref = extend.finish(rec, rec).transpose(0, 2, 1, 3)
    got = extend.finish(rec, rec, layout="bshd")
    assert got.shape == (2, 3, 5, 19) and got.flags.c_contiguous and got.dtype == dtype
    np.testing.assert_array_equal(got, ref)  # NaN compares equal to NaN here
    assert not np.shares_memory(got, rec)
    assert np.all(got[rec.transpose(0, 2, 1, 3)[..., 0] == -np.inf] == 0)  # empty rows give 0
    strided = np.asfortranarray(rec)  # not C-contiguous: the numpy path
    np.testing.assert_array_equal(extend.finish(strided, rec, layout="bshd"), ref)
    with pytest.raises(ValueError, match="layout"):
        extend.finish(rec, rec, layout="bhds")
    with pytest.raises(ValueError, match="needs"):
        extend.finish(rec[0], rec, layout="bshd")


def poisoned_state(rng, shape, dim, dtype):
    """Random records with every kind of non-finite state the kernels can produce."""
    rec = random_state(rng, shape, dim, dtype, empty_frac=0.3).records
    kind = rng.integers(0, 4, shape)
    rec[kind == 1, 0] = np.nan  # a NaN score: m is NaN (and so are d, n)
    rec[kind == 1, 1:] = np.nan
    empty_nan = np.isneginf(rec[..., 0]) & (kind == 2)  # weight-0 key with a NaN value
    rec[empty_nan, 2] = np.nan
    rec[kind == 3, 1 + dim] = np.nan  # a NaN value among finite scores
    return State(rec)


@pytest.mark.skipif(not mpitree.native_op_available(), reason="native op not built")
@settings(max_examples=80, deadline=None)
@given(seeds, dims, dtypes)
def test_native_combine_keeps_every_nan_as_numpy_does(seed, dim, dtype):
    """The C op and combine_records are one definition: NaN survives, the empty is -inf only."""
    rng = np.random.default_rng(seed)
    a, b = (poisoned_state(rng, (40,), dim, dtype) for _ in range(2))
    ref = combine(a, b).records
    tol = 2e-6 if dtype == np.float32 else 1e-14
    for got in (native_combine(a, b).records, native_combine(b, a).records):
        assert np.array_equal(np.isnan(got), np.isnan(ref))
        assert_allclose(got, ref, rtol=tol, atol=tol)  # NaN positions equal, values close
    # a NaN in either operand's row is a NaN in the merged row
    had = np.isnan(a.records).any(-1) | np.isnan(b.records).any(-1)
    assert np.array_equal(np.isnan(ref).any(-1), had)
    poisoned = np.isnan(a.m) | np.isnan(b.m)
    assert np.isnan(ref[poisoned]).all()
