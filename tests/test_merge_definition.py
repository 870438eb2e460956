"""One merge definition: every copy of the (m, d, n) combine equals combine_records, bit for bit.

The copies: the compiled op (``_native_op.c``, through ``mpitree_combine`` and through
the MPI op ``record_op`` registers), the numpy fallback op (``_op.python_op``),
``allreduce3``'s three reductions, ``merge_records`` (allgather, ring), invariant mode's
tree joins (compiled or numpy) and the torch merge of sharded prefill's staircase. All
follow the definition's order of operations. The producers and consumers of records
are held to the layout the same way: states from an ``(out, lse)`` pair
(``State.from_lse``, the staircase's parts) and the finishing step (``output_of``,
``lse_of``, the compiled ``mpitree_finish_f32``, the JAX adapter's own).

The one library-dependent step is the exponential: numpy's, torch's
and the compiled op's own (``mpitree_merge_exp``, the same bits on every compiler,
C library and CPU) differ in the last place on many inputs, so each copy is
compared with ``combine_records`` evaluated with that copy's own exponential
(``exp=``), and then every bit must agree. NaN payloads are not
compared (the C op writes a fresh NaN where numpy keeps an operand's), NaN
positions are.

The records hold every kind of row: ordinary, equal maxima on both sides, empty
(-inf, 0, 0), empty with a NaN value, NaN score (all NaN), a NaN value among finite
scores, an overflowed score (m = +inf with NaN d and n, what a kernel gives), maxima
of +/-1e30 (float32) or +/-1e300 (float64), values near the dtype's largest
(overflow to inf) and subnormal values.
"""

import hashlib
import threading
import types

import numpy as np
import pytest
import torch
from mpi4py import MPI
from mpitree.adapters.transformers import _staircase

from mpitree import _invariant, _op
from mpitree._library import native_lib
from mpitree._state import (
    FLAG_CLEAR,
    D,
    M,
    N,
    State,
    _output_bhsd,
    _output_bshd,
    combine_records,
    empty_records,
    finish,
    lse_of,
    merge_records,
    output_of,
    width,
)
from mpitree._strategies.allreduce3 import Allreduce3

DTYPES = (np.float32, np.float64)
DIMS = (1, 7, 64)
SEEDS = range(8)
ROWS = 100  # every pair of kinds once
KINDS = 10

needs_native = pytest.mark.skipif(native_lib() is None, reason="native op not built")


def merge_exp(x):
    """The compiled op's own exp (float64) or expf (float32), elementwise: what it calls."""
    x = np.ascontiguousarray(x)
    y = np.empty_like(x)
    native_lib().mpitree_merge_exp(8 * x.itemsize, x.ctypes.data, y.ctypes.data, x.size)
    return y


def torch_exp(x):
    """torch's exp of a numpy array, back as numpy."""
    return torch.exp(torch.from_numpy(np.ascontiguousarray(x))).numpy()


def records(seed, dim, dtype, side):
    """``(ROWS, dim + 2)`` records; row i's kind is digit ``side`` of i, so two sides meet in
    every pair of kinds (and the third in another order)."""
    rng = np.random.default_rng([seed, dim, np.dtype(dtype).itemsize, side])
    big_m = 1e30 if dtype == np.float32 else 1e300
    huge = np.finfo(dtype).max * 0.75  # two of them with weight 1 overflow
    tiny = np.finfo(dtype).smallest_subnormal
    rec = np.empty((ROWS, dim + 2), dtype)
    rec[:, 0] = rng.standard_normal(ROWS) * 3
    rec[:, 1] = rng.random(ROWS) * 5 + 0.1
    rec[:, 2:] = rng.standard_normal((ROWS, dim))
    kind = (np.arange(ROWS) // KINDS**side + side) % KINDS

    def rows(k):
        return (kind == k).sum()

    rec[(kind == 1) | (kind == 8), 0] = 2.0  # two such rows: equal maxima, weights exp(0)
    rec[kind == 2] = 0
    rec[kind == 2, 0] = -np.inf  # empty
    rec[kind == 3] = 0
    rec[kind == 3, 0] = -np.inf
    rec[kind == 3, 2] = np.nan  # empty with a NaN value (weight 0 times NaN)
    rec[kind == 4] = np.nan  # a NaN score poisons the row
    rec[kind == 5, 1 + dim] = np.nan  # a NaN value among finite scores
    rec[kind == 6, 0] = np.inf  # an overflowed score: the kernels give d, n NaN
    rec[kind == 6, 1:] = np.nan
    rec[kind == 7, 0] = rng.choice([-big_m, big_m], rows(7))
    rec[kind == 8, 2:] = rng.choice([-huge, huge], (rows(8), dim))
    rec[kind == 9, 2:] = rng.integers(-3, 4, (rows(9), dim)) * tiny
    return rec


@pytest.fixture(autouse=True)
def quiet_invalid():
    """inf - inf and 0 * inf are part of the cases: no RuntimeWarning (errors here)."""
    with np.errstate(all="ignore"):
        yield


def assert_same_bits(got, want):
    """Equal bit for bit, NaN payloads aside (NaN positions must match)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan), f"NaN at {np.argwhere(np.isnan(got) != nan)[:5]}"
    uint = np.uint32 if got.dtype == np.float32 else np.uint64
    diff = got.view(uint) != want.view(uint)
    diff &= ~nan
    assert not diff.any(), f"{diff.sum()} values differ, first at {np.argwhere(diff)[:5]}"


cases = pytest.mark.parametrize(
    "seed, dim, dtype", [(s, d, t) for t in DTYPES for d in DIMS for s in SEEDS]
)


def test_records_cover_every_kind():
    """The generator pairs every kind with others, and hits each kind of result."""
    a, b = records(1, 7, np.float64, 0), records(1, 7, np.float64, 1)
    out = combine_records(a, b)
    assert np.isnan(out[:, 0]).any() and np.isnan(out[:, 1:]).all(-1).any()
    assert (np.isnan(out).any(-1) & ~np.isnan(out[:, 0])).any()  # a NaN value, finite m
    assert (np.isfinite(a[:, 0]) & (a[:, 0] == b[:, 0])).any()  # equal maxima
    assert np.isinf(out[:, 2:]).any() and (np.abs(out[:, 2:]) < np.finfo(out.dtype).tiny).any()
    both_empty = np.isneginf(a[:, 0]) & np.isneginf(b[:, 0]) & ~np.isnan(a + b).any(-1)
    assert both_empty.any() and (out[both_empty, 1:] == 0).all()


@needs_native
@cases
def test_c_op_is_the_definition(seed, dim, dtype):
    """``mpitree_combine`` and the registered MPI op (the code MPI runs) give the definition's bits.

    The C op skips the product by ``exp(0) = 1`` and the sum with ``b`` is written
    ``b + s * a``: both exact rewrites of step 4. It differs only on a record with
    ``m = +inf`` and finite fields, which no kernel produces (there the definition
    gives NaN, the C op the +inf side's fields); the records hold the kernels' form.
    """
    a, b = records(seed, dim, dtype, 0), records(seed, dim, dtype, 1)
    lib = native_lib()
    for x, y in ((a, b), (b, a)):
        want = combine_records(x, y, exp=merge_exp)
        io = y.copy()
        lib.mpitree_combine(8 * x.itemsize, x.ctypes.data, io.ctypes.data, ROWS, dim)
        assert_same_bits(io, want)
        rec, op = _op.record_op(dtype, dim + 2)
        io = y.copy()
        op.Reduce_local([x, ROWS, rec], [io, ROWS, rec])
        assert_same_bits(io, want)


def exp_inputs(dtype):
    """Arguments of the merge's exp: a grid over where it is finite and nonzero, small
    magnitudes, the points around its cut-offs and the special values. Only exactly
    rounded operations make them (no random stream, no libm), so every machine has
    the same inputs."""
    lo, hi = (-104.0, 89.0) if dtype == np.float32 else (-746.0, 710.0)
    i = np.arange(20001)
    grid = lo + (hi - lo) * i / 20000
    i = np.arange(1600)
    small = -np.ldexp(1 + (i % 16) / 16, -(i // 16))  # 2**-99 .. 2**0, 16 mantissas each
    edges = [709.782712893384, 709.79, -745.1, -745.13, -745.2, -708.4, -103.9, 88.72, 88.73]
    special = [0.0, -0.0, -np.inf, np.inf, np.nan, 1e-300, -1e-300]
    return np.concatenate([grid, small, -small, edges, special]).astype(dtype)


# sha256 of merge_exp(exp_inputs(dtype)): plain IEEE arithmetic with no contraction, so
# every compiler, C library and CPU gives these bits
MERGE_EXP_GOLDEN = {
    np.float32: "375725d6525d6db31c9c5a08f07816e21d265f200bd1f4fa8285b877ccb7615f",
    np.float64: "16bacf32aa71e51b920c35a72dcc08146461af12a1b7a747d341e06a8a7efb21",
}


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_exp_gives_the_same_bits_everywhere(dtype):
    """The compiled op's exp is mpitree's own: libm's differs between C libraries and, in
    glibc, between CPUs with and without FMA, which let ranks round a merge apart."""
    digest = hashlib.sha256(merge_exp(exp_inputs(dtype)).tobytes()).hexdigest()
    assert digest == MERGE_EXP_GOLDEN[dtype], f"new bits: {digest}"


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_exp_is_accurate(dtype):
    """Within 1 ulp of exp (float64, against long double's; float32 within 0.501 ulp of
    float64's: rounded once), exactly 1 at 0, 0 at -inf and below the subnormals, inf
    past the largest double, NaN kept. The grid, and the points where an earlier
    evaluation (1 + r(1 + r/2(...)), rounding last near sqrt(2)) reached 1.19 ulp."""
    worst = [-573.579291913326, -417.6210195453852, -25.991053243835296, -0.9988114269237685]
    x = np.concatenate([exp_inputs(dtype), np.array(worst, dtype)])
    got = merge_exp(x)
    if dtype == np.float32:
        want = np.exp(x.astype(np.float64))
        ulp = np.spacing(want.astype(np.float32)).astype(np.float64)
        tol = 0.501  # rounded once from a double within about 1 double ulp
    else:
        want = np.exp(x.astype(np.longdouble))  # x86: 11 more bits; aarch64: quad
        ulp = np.spacing(want.astype(np.float64)).astype(np.longdouble)
        tol = 1.0
    finite = (want > 0) & (want <= np.finfo(dtype).max)
    err = np.abs(got[finite].astype(want.dtype) - want[finite]) / ulp[finite]
    assert err.max() <= tol, f"{err.max():.3f} ulp at x = {x[finite][err.argmax()]!r}"
    special = merge_exp(np.array([0.0, -0.0, -np.inf, np.inf, np.nan, -1000.0, 1000.0], dtype))
    assert special[:2].tolist() == [1.0, 1.0] and special[2] == 0 and special[5] == 0
    assert np.isposinf(special[3]) and np.isposinf(special[6]) and np.isnan(special[4])


@cases
def test_numpy_fallback_op_is_the_definition(seed, dim, dtype):
    """The Python MPI op used without the compiled library is combine_records itself."""
    a, b = records(seed, dim, dtype, 0), records(seed, dim, dtype, 1)
    rec, op = _op.python_op(dtype, dim + 2)
    try:
        io = b.copy()
        op.Reduce_local([a, len(a), rec], [io, len(io), rec])
    finally:
        op.Free()
        rec.Free()
    assert_same_bits(io, combine_records(a, b))


@cases
def test_torch_merge_is_the_definition(seed, dim, dtype):
    """The staircase's torch merge (``combine_records`` on tensors), with torch's exp."""
    a, b = records(seed, dim, dtype, 0), records(seed, dim, dtype, 1)
    got = combine_records(torch.from_numpy(a), torch.from_numpy(b))
    assert got.dtype == torch.from_numpy(a).dtype
    assert_same_bits(got.numpy(), combine_records(a, b, exp=torch_exp))


@cases
def test_merge_records_of_two_is_the_definition(seed, dim, dtype):
    """allgather's and the ring's many-part merge: for two parts, combine_records' bits."""
    a, b = records(seed, dim, dtype, 0), records(seed, dim, dtype, 1)
    assert_same_bits(merge_records(np.stack([a, b])), combine_records(a, b))


class ThreadComm:
    """``p`` ranks as threads of this process; Allreduce combines in rank order.

    MAX is numpy's maximum (NaN wins; an MPI library's MAX need not propagate NaN,
    so on real ranks a poisoned row's m may come out finite, its d and n NaN all
    the same) and SUM adds rank 0, 1, ... in turn.
    """

    def __init__(self, rank, size, shared):
        self.rank, self.size, self.shared = rank, size, shared

    def Get_size(self):
        return self.size

    def Get_rank(self):
        return self.rank

    def Allreduce(self, sendbuf, recvbuf, op):
        assert sendbuf is MPI.IN_PLACE and op in (MPI.MAX, MPI.SUM)
        slots, barrier = self.shared
        slots[self.rank] = recvbuf.copy()
        barrier.wait()
        out = slots[0].copy()
        for part in slots[1 : self.size]:
            out = np.maximum(out, part) if op == MPI.MAX else out + part
        barrier.wait()
        recvbuf[...] = out


def allreduce3(parts):
    """Run the allreduce3 strategy's reduce on ``len(parts)`` thread ranks; return each buffer."""
    size = len(parts)
    shared = ([None] * size, threading.Barrier(size, timeout=30))
    bufs = [np.concatenate([p, np.zeros((1, p.shape[1]), p.dtype)]) for p in parts]
    errors = []

    def rank(r):
        try:
            kind = types.SimpleNamespace(buf=bufs[r], host=bufs[r])  # host memory: one array
            merger = types.SimpleNamespace(comm=ThreadComm(r, size, shared), buf=bufs[r], kind=kind)
            with np.errstate(all="ignore"):  # a thread starts with numpy's default errstate
                assert Allreduce3(merger).reduce(None, False) is False
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)
            shared[1].abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [buf[:-1] for buf in bufs]


@cases
def test_allreduce3_is_the_definition(seed, dim, dtype):
    """allreduce3's MAX, weights, products and SUM: two ranks give combine_records' bits,
    three give merge_records' (the sum in rank order; a real MPI may order a sum of
    three or more differently, within rounding)."""
    a, b = records(seed, dim, dtype, 0), records(seed, dim, dtype, 1)
    want = combine_records(a, b)
    for got in allreduce3([a, b]):
        assert_same_bits(got, want)
    c = records(seed, dim, dtype, 2)
    want = merge_records(np.stack([a, b, c]))
    for got in allreduce3([a, b, c]):
        assert_same_bits(got, want)


def test_layout():
    """The record layout's one definition: ``[m, d, n_0..n_{D-1}]``, ``D + 2`` wide."""
    rec = np.arange(width(3), dtype=np.float64)
    assert width(3) == 5 and rec[M] == 0 and rec[D] == 1 and rec[N].tolist() == [2, 3, 4]
    empty = np.ones((2, width(3)))
    empty_records(empty)
    assert (empty[:, M] == FLAG_CLEAR).all() and (empty[:, D:] == 0).all()
    state = State(rec)
    assert state.head_dim == 3 and state.m == rec[M] and state.d == rec[D]
    assert state.n.tolist() == rec[N].tolist()


@needs_native
@cases
def test_invariant_tree_joins_are_the_definition(seed, dim, dtype, monkeypatch):
    """Invariant mode's tree joins ``recs[i] = combine(recs[i], recs[j])``: the compiled op's
    code with its own exp (it merges ``recs[j]`` into ``recs[i]``), or numpy's
    combine_records."""
    a, b = records(seed, dim, dtype, 0), records(seed, dim, dtype, 1)
    for x, y in ((a, b), (b, a)):
        pair = np.stack([x, y])
        _invariant._joiner(pair)(0, 1)
        assert_same_bits(pair[0], combine_records(y, x, exp=merge_exp))
        assert_same_bits(pair[1], y)
    monkeypatch.setattr(_invariant, "_kernel_lib", lambda: None)
    pair = np.stack([a, b])
    _invariant._joiner(pair)(0, 1)
    assert_same_bits(pair[0], combine_records(a, b))


def lse_parts(seed, dim, dtype, side):
    """``(out, lse)`` of every kind of row: the lse of :func:`records`' m (finite, equal on
    both sides, -inf, NaN, +inf, +-1e30 or +-1e300), an output with NaN, huge and subnormal
    values; out is 0 where lse is -inf (what the staircase's parts give) but where it is
    NaN (a row that saw keys of weight 0 and a NaN value)."""
    rec = records(seed, dim, dtype, side)
    lse, out = rec[:, M].copy(), rec[:, N].copy()
    empty = np.isneginf(lse)
    out[empty] = np.where(np.isnan(out[empty]), np.nan, 0)
    return out, lse


def lse_records(out, lse, d):
    """Records ``[lse, d, out]``, laid out by the definition's constants."""
    rec = np.empty((*lse.shape, width(out.shape[-1])), out.dtype)
    rec[..., M], rec[..., D], rec[..., N] = lse, d, out
    return rec


def staircase_write(*parts):
    """The staircase's ``_write`` of one or two ``(out, lse)`` parts, as numpy records."""
    rows, dim = parts[0][0].shape
    out = torch.full((1, 1, rows, width(dim)), 7.0, dtype=torch.from_numpy(parts[0][0]).dtype)
    tensors = [(torch.from_numpy(o)[None, None], torch.from_numpy(m)[None, None]) for o, m in parts]
    _staircase._write(out, torch.arange(rows), *tensors, *[None] * (2 - len(parts)))
    return out[0, 0].numpy()


@cases
def test_staircase_merge_is_the_definition(seed, dim, dtype):
    """Sharded prefill's staircase: each part ``(out, lse)`` is the state ``[lse, 1, out]``
    (``d = 0`` where lse is -inf: the same state, as the merge weighs it 0), and two parts
    merge to combine_records' bits with torch's exp; a row with no key is the empty state
    (never NaN, unless a NaN value came with it)."""
    (oa, la), (ob, lb) = lse_parts(seed, dim, dtype, 0), lse_parts(seed, dim, dtype, 1)
    one = lse_records(oa, la, 1)
    want = combine_records(one, lse_records(ob, lb, 1), exp=torch_exp)
    assert_same_bits(staircase_write((oa, la), (ob, lb)), want)
    assert_same_bits(
        staircase_write((ob, lb), (oa, la)),
        combine_records(lse_records(ob, lb, 1), one, exp=torch_exp),
    )
    empty = np.isneginf(la)
    assert_same_bits(staircase_write((oa, la)), lse_records(oa, la, ~empty))
    both = empty & np.isneginf(lb) & ~np.isnan(oa + ob).any(-1)
    assert both.any() and (want[both, M] == FLAG_CLEAR).all() and (want[both, D:] == 0).all()
    assert np.isnan(want[np.isnan(la) | np.isnan(lb)][:, D:]).all()


@cases
def test_from_lse_is_the_definition(seed, dim, dtype):
    """``State.from_lse``: ``[lse, 1, out]`` where lse is finite (or NaN: a poisoned row),
    the empty state where it is +-inf; its output and lse give back out and lse bit for
    bit, and its states merge as combine_records of those records."""
    (oa, la), (ob, lb) = lse_parts(seed, dim, dtype, 0), lse_parts(seed, dim, dtype, 1)
    a, b = State.from_lse(oa, la), State.from_lse(ob, lb)
    seen = ~np.isinf(la)
    assert a.records.dtype == dtype
    assert_same_bits(a.records[seen], lse_records(oa, la, 1)[seen])
    assert (a.m[~seen] == FLAG_CLEAR).all() and (a.records[~seen, D:] == 0).all()
    finite = np.isfinite(la)
    assert_same_bits(a.output()[finite], oa[finite])
    assert_same_bits(a.lse(dtype=dtype)[finite], la[finite])
    assert (a.output()[~seen] == 0).all() and np.isneginf(a.lse()[~seen]).all()
    merged = combine_records(a.records, b.records)
    want = combine_records(lse_records(oa, la, 1), lse_records(ob, lb, 1))
    both = seen & ~np.isinf(lb)
    assert_same_bits(merged[both], want[both])
    assert np.isnan(merged[np.isnan(la) | np.isnan(lb)][:, D:]).all()
    never = ~seen & np.isinf(lb)
    assert never.any() and not np.isnan(merged[never]).any()


def finishing_records(seed, dim, dtype):
    """Records as the merge leaves them, ``(2, 5, 10, D + 2)``: every kind of row, ``d = 0``
    (empty, n = 0) among them, and ``d`` NaN, +inf and subnormal."""
    rec = records(seed, dim, dtype, 0)
    rec[3::10, D] = np.finfo(dtype).smallest_subnormal
    rec[5::10, D] = np.inf
    return rec.reshape(2, 5, 10, width(dim))


@cases
def test_finishing_is_the_definition(seed, dim, dtype):
    """The finishing step, ``n / d`` (0 for an empty row, NaN stays NaN) and
    ``m + log(d)`` (-inf for an empty row): output_of, the compiled ``mpitree_finish_f32``
    (float32, both layouts) and ``finish`` give the same bits."""
    rec = finishing_records(seed, dim, dtype)
    out = output_of(rec)
    empty, nan = rec[..., D] == 0, np.isnan(rec).any(-1)
    assert empty.any() and (out[empty & ~nan] == 0).all()
    assert np.isnan(out[np.isnan(rec[..., D:]).any(-1)]).any(-1).all()
    lse = lse_of(rec, dtype=dtype)
    assert np.isneginf(lse[empty]).all()
    assert_same_bits(lse[~empty], (np.log(rec[..., D]) + rec[..., M])[~empty])
    bshd = np.ascontiguousarray(out.transpose(0, 2, 1, 3))
    if dtype == np.float32 and native_lib() is not None:
        assert_same_bits(_output_bshd(rec), bshd)
        assert_same_bits(_output_bhsd(rec), out)
    assert_same_bits(finish(rec, rec[..., N]), out)
    assert_same_bits(finish(rec, rec[..., N], layout="bshd"), bshd)
    got, got_lse = finish(rec, rec[..., N], return_lse=True)
    assert_same_bits(got, out)
    assert_same_bits(got_lse, lse_of(rec))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", DIMS)
def test_jax_finishing_is_the_definition(dim, dtype):
    """The JAX adapter finishes merged records itself: ``m + log(d)`` gives lse_of's bits
    with XLA's log in place of numpy's, and ``n / d`` output_of's within 1 ulp, with the
    same zeros, infinities and NaNs: XLA on the CPU does not round every float32
    division correctly, and it flushes a subnormal result to zero (its sign kept)."""
    jax = pytest.importorskip("jax")
    from mpitree.adapters import jax as mj

    x64 = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)  # float64 records stay float64
    try:
        for seed in SEEDS:
            rec = finishing_records(seed, dim, dtype)
            out, lse = (np.asarray(x) for x in mj._finish(jax.numpy.asarray(rec)))
            want = output_of(rec)
            flushed = (np.abs(want) < np.finfo(dtype).tiny) & (want != 0) & (out == 0)
            want = np.where(flushed, np.copysign(0, want), want).astype(dtype)
            nan = np.isnan(want)
            assert np.array_equal(np.isnan(out), nan)
            assert np.array_equal(np.isinf(out), np.isinf(want))
            np.testing.assert_array_max_ulp(out[~nan], want[~nan], maxulp=1)
            d = rec[..., D]
            empty = d == 0
            log = np.asarray(jax.numpy.log(jax.numpy.asarray(np.where(empty, 1, d))))
            assert_same_bits(lse, np.where(empty, -np.inf, rec[..., M] + log))
            assert np.isneginf(lse_of(rec)[empty]).all() and np.isneginf(lse[empty]).all()
    finally:
        jax.config.update("jax_enable_x64", x64)
