"""The compiled float32 local kernel against the numpy reference kernel."""

import ctypes
import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.testing import assert_allclose

from mpitree import reference_attention
from mpitree._invariant_step import invariant_signature
from mpitree._kernel import (
    attend_native,
    kernel_arithmetic,
    kernel_isa,
    kernel_levels,
    kernel_read_order,
    native_kernel_available,
    select_kernel,
)
from mpitree._library import address, native_lib
from mpitree._local import state_records
from mpitree._namespace import namespace

pytestmark = pytest.mark.skipif(not native_kernel_available(), reason="native kernel not built")

# every build of the kernel this CPU runs (x86-64-v4 AVX-512, x86-64-v3 AVX2, baseline)
LEVELS = kernel_levels() or (0,)


@pytest.fixture(params=LEVELS, ids=lambda level: f"isa{level}")
def level(request):
    """Run the test on one build of the kernel, then restore the best."""
    assert select_kernel(request.param) == request.param
    yield request.param
    select_kernel(0)


def both(q, k, v, scale, lens, vis):
    b, hq, sq, dim = q.shape
    native = np.full((b, hq, sq, dim + 2), np.nan, np.float32)
    ref = np.full_like(native, np.nan)
    assert attend_native(q, k, v, scale, lens, vis, native)
    ref[...] = state_records(namespace(q), q, k, v, scale, lens, vis, "float32")
    return native, ref


def close(native, ref, dot_bound=0.0):
    """Same rows empty; same lse and normalised output within fp32 rounding of the logits.

    d and n are relative to m, so they are compared through lse = m + log(d) and n / d.
    A logit of size |s| carries fp32 rounding ~|s| * 2^-24 per term, whatever the order;
    a dot product's rounding grows with ``dot_bound`` = max scale * sum_i |q_i k_i|.
    """
    assert not np.isnan(native).any()
    assert np.array_equal(np.isneginf(native[..., 0]), np.isneginf(ref[..., 0]))
    fin = ~np.isneginf(ref[..., 0])
    lse_n = native[..., 0][fin] + np.log(native[..., 1][fin])
    lse_r = ref[..., 0][fin] + np.log(ref[..., 1][fin])
    tol = 2e-5 * max(1.0, float(np.abs(ref[..., 0][fin]).max(initial=0)) / 10)
    tol = max(tol, 2**-23 * dot_bound)
    assert_allclose(lse_n, lse_r, atol=tol, rtol=0)
    out_n = native[..., 2:] / np.where(native[..., 1:2] > 0, native[..., 1:2], 1)
    out_r = ref[..., 2:] / np.where(ref[..., 1:2] > 0, ref[..., 1:2], 1)
    assert_allclose(out_n, out_r, atol=tol, rtol=0)


@settings(max_examples=120, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    b=st.integers(1, 3),
    hkv=st.integers(1, 3),
    g=st.integers(1, 4),
    sq=st.integers(1, 3),
    dim=st.sampled_from([1, 3, 8, 17, 64, 128]),
    t=st.integers(0, 70),
    ragged=st.booleans(),
    masking=st.sampled_from([None, "shared", "head"]),
    strided=st.booleans(),
    logit=st.sampled_from([1.0, 300.0]),
)
def test_native_matches_numpy(seed, b, hkv, g, sq, dim, t, ragged, masking, strided, logit):
    for level in LEVELS:
        select_kernel(level)
        try:
            check_case(seed, b, hkv, g, sq, dim, t, ragged, masking, strided, logit)
        finally:
            select_kernel(0)


def check_case(seed, b, hkv, g, sq, dim, t, ragged, masking, strided, logit):
    rng = np.random.default_rng(seed)
    hq = hkv * g
    q = (rng.standard_normal((b, hq, sq, dim)) * logit).astype(np.float32)
    big = rng.standard_normal((b, hkv, t + 5, dim)).astype(np.float32)
    k = big[:, :, :t] if strided else np.ascontiguousarray(big[:, :, :t])
    v = rng.standard_normal((b, hkv, t, dim)).astype(np.float32)
    lens = rng.integers(0, t + 1, size=b) if ragged else None
    vis = None
    if masking:
        vis = rng.random((b, hq if masking == "head" else 1, sq, t)) < 0.6
    qa = np.abs(q).reshape(b, hkv, g * sq, dim)
    bound = 0.7 * float((qa @ np.abs(k).swapaxes(-1, -2)).max(initial=0))
    close(*both(q, k, v, 0.7, lens, vis), dot_bound=bound)


def test_fully_masked_and_empty_rows_are_identity():
    q = np.ones((2, 2, 1, 8), np.float32)
    k = np.ones((2, 1, 5, 8), np.float32)
    vis = np.zeros((2, 1, 1, 5), bool)
    native, _ = both(q, k, k, 1.0, np.array([5, 0]), vis)
    assert np.all(np.isneginf(native[..., 0])) and np.all(native[..., 1:] == 0)


def test_falls_back_for_other_dtypes():
    q = np.ones((1, 1, 1, 4), np.float64)
    out = np.empty((1, 1, 1, 6), np.float64)
    assert not attend_native(q, q, q, 1.0, None, None, out)


def test_every_build_this_cpu_supports_is_tested():
    assert LEVELS[0] == select_kernel(0)
    names = []
    for lv in LEVELS:
        select_kernel(lv)
        names.append(kernel_isa())
    select_kernel(0)
    assert len(set(names)) == len(LEVELS), names


@pytest.mark.parametrize("g,sq", [(1, 1), (4, 1), (3, 2), (8, 1), (4, 2), (3, 3), (5, 3), (4, 8)])
@pytest.mark.parametrize("dim", [128, 72, 19, 8])
def test_v3_and_v4_builds_give_the_same_bits(g, sq, dim):
    """The builds block keys differently, but every sum takes its terms in one order.

    Every head dim: the kernel fuses each product into its sum itself in both builds,
    the scalar tails too (the compiler's own contraction fused them differently in the
    two). A CPU without AVX-512 runs one of them only: nothing to compare there (not a
    skip, which the test runner refuses for all but cuda- and cluster-marked tests).
    """
    if not {3, 4} <= set(LEVELS):
        return
    rng = np.random.default_rng([g, sq, dim])
    b, hkv, t = 2, 2, 600  # t > CHUNK, and not a multiple of any key block
    q = rng.standard_normal((b, hkv * g, sq, dim)).astype(np.float32)
    k, v = rng.standard_normal((2, b, hkv, t, dim)).astype(np.float32)
    lens = np.array([t, 437])
    vis = rng.random((b, hkv * g, sq, t)) < 0.7
    outs = []
    for level in (4, 3):
        select_kernel(level)
        try:
            for mask in (None, vis):
                out = np.zeros((b, hkv * g, sq, dim + 2), np.float32)
                assert attend_native(q, k, v, 0.3, lens, mask, out)
                outs.append(out)
        finally:
            select_kernel(0)
    np.testing.assert_array_equal(outs[0], outs[2])
    np.testing.assert_array_equal(outs[1], outs[3])


def _exact(shape, seed):
    """Float32 values in [-2, 2) from integer arithmetic alone (no generator's stream)."""
    i = np.arange(int(np.prod(shape)), dtype=np.uint64) + np.uint64(seed * 1_000_003)
    x = (i * np.uint64(2654435761)) % np.uint64(1 << 32)
    return ((x >> np.uint64(8)).astype(np.float64) / 2**22 - 2).astype(np.float32).reshape(shape)


# sha256 of golden_records' bytes: the same on every compiler and C library (GCC 11, 12,
# 13.2 and 13.3, clang 14 for the portable build). A change to the kernel's arithmetic
# changes them on purpose: then update them here, and say so (ranks must run one version).
GOLDEN = {
    # the x86-64-v3 and v4 builds
    "fused": "eb9c76e86b4f5ecfffb68a774994fe925bbbbd74ae05811fbd99a1705ad059e0",
    # the baseline build and portable C
    "unfused": "8e7ed77e947170fe4408bd1f27ba891ae8ceb9a18b34cfc4ebb6adc48b8bb082",
}


def golden_records():
    """The kernel's records over fixed inputs: row blocks of 1 to 8, ragged, masked."""
    out_bytes = []
    shapes = [
        (4, 4, 1, 128, 700),
        (8, 2, 1, 72, 600),
        (9, 3, 1, 64, 555),
        (16, 2, 1, 128, 513),
        (8, 2, 3, 19, 300),
        (4, 1, 8, 160, 260),
        (2, 2, 1, 256, 1000),
    ]
    for n, (hq, hkv, sq, dim, t) in enumerate(shapes):
        q = _exact((2, hq, sq, dim), 3 * n)
        k, v = _exact((2, 2, hkv, t, dim), 3 * n + 1)
        vis = _exact((2, hq, sq, t), 3 * n + 2) > -1.2
        lens = np.array([t, t // 2 + 3])
        ways = ("prefetch", "address order") if hq == hkv and sq == 1 else ("timed",)
        for way in ways:
            for kv_len, mask in ((None, None), (lens, None), (None, vis), (lens, vis)):
                assert kernel_read_order(way) == way.replace("timed", "undecided")
                out = np.full((2, hq, sq, dim + 2), np.nan, np.float32)
                assert attend_native(q, k, v, 1 / np.sqrt(dim), kv_len, mask, out)
                out_bytes.append(out.astype("<f4").tobytes())
    kernel_read_order("timed")
    return b"".join(out_bytes)


def test_every_compiler_gives_these_bits(level):
    """The kernel's bits depend on its build's class (fused or not), not on the compiler.

    The kernel spells out which products fuse with their sums and computes its own
    exponentials; the compiler contracts nothing (``-ffp-contract=off``). GCC 13.3's
    own contraction, before, left the address-order score loop unfused and fused the
    prefetching one: the two read orders, chosen by timing, gave different bits.
    """
    try:
        digest = hashlib.sha256(golden_records()).hexdigest()
    finally:
        kernel_read_order("timed")
    kind = "fused" if level >= 3 else "unfused"
    assert digest == GOLDEN[kind], f"{kind} build ({kernel_isa()}) gives new bits: {digest}"


@pytest.mark.parametrize("g", [4, 8])
@pytest.mark.parametrize("dim", [128, 19])
def test_a_rows_bits_do_not_depend_on_what_its_block_mates_see(level, g, dim):
    """A row that sees every key gives the same bits whether or not the rows it shares a
    block with exclude some: a seen key's term rounds alike in masked and unmasked chunks."""
    rng = np.random.default_rng([g, dim, level])
    t = 600
    q = rng.standard_normal((1, g, 1, dim)).astype(np.float32)
    k, v = rng.standard_normal((2, 1, 1, t, dim)).astype(np.float32)
    all_seen = np.ones((1, g, 1, t), bool)
    some = all_seen.copy()
    some[0, 1:, 0] = rng.random((g - 1, t)) < 0.6  # the other rows exclude 40% of the keys
    outs = []
    for mask in (all_seen, some):
        out = np.zeros((1, g, 1, dim + 2), np.float32)
        assert attend_native(q, k, v, 0.3, None, mask, out)
        outs.append(out)
    np.testing.assert_array_equal(outs[0][0, 0], outs[1][0, 0])


def test_invariant_mode_agrees_on_the_arithmetic_not_the_build():
    """The v3 and v4 builds give the same bits: ranks on either share an invariant run."""
    seen = {}
    try:
        for level in LEVELS:
            select_kernel(level)
            seen[level] = invariant_signature({})["kernel"]
    finally:
        select_kernel(0)
    assert seen.get(4, seen.get(3)) == seen.get(3, seen.get(4))
    fused = {seen[level] for level in seen if level >= 3}
    assert fused <= {"C kernel, fused multiply-adds"}
    assert seen.get(1, "C kernel, unfused") == "C kernel, unfused"


def _libm():
    """The C library's math part (its fenv functions), on x86-64 Linux; else None."""
    import ctypes.util
    import platform

    if platform.machine() != "x86_64" or platform.system() != "Linux":
        return None  # the constants and fenv_t layout below are x86-64 glibc's (and musl's)
    return ctypes.CDLL(ctypes.util.find_library("m"))


def test_flushing_subnormals_joins_the_arithmetic():
    """Flush-to-zero and denormals-are-zero (MXCSR bits 15 and 6, what
    ``torch.set_flush_denormal(True)`` sets) are read on each call."""
    libm = _libm()
    before = kernel_arithmetic()
    assert "subnormal" not in before
    if native_lib() is None or libm is None:
        return
    env, seen = (ctypes.c_uint8 * 32)(), {}  # fenv_t: 32 bytes, MXCSR at byte 28
    assert libm.fegetenv(env) == 0
    default = int.from_bytes(bytes(env[28:32]), "little")
    try:
        for name, bits in (("results", 0x8000), ("inputs", 0x40), ("both", 0x8040)):
            env[28:32] = (default | bits).to_bytes(4, "little")
            assert libm.fesetenv(env) == 0
            seen[name] = kernel_arithmetic()[len(before) :]
    finally:
        env[28:32] = default.to_bytes(4, "little")
        libm.fesetenv(env)
    assert seen == {
        "results": ", subnormal results flushed to zero",
        "inputs": ", subnormal inputs read as zero",
        "both": ", subnormals flushed to zero",
    }
    assert kernel_arithmetic() == before


def test_the_rounding_direction_joins_the_arithmetic():
    """Another rounding direction (``fesetround``) changes the bits too: it is read as well."""
    libm = _libm()
    if native_lib() is None or libm is None:
        return
    before = kernel_arithmetic()
    seen = {}
    try:
        for name, mode in (("down", 0x400), ("up", 0x800), ("toward zero", 0xC00)):
            assert libm.fesetround(mode) == 0
            seen[name] = kernel_arithmetic()
    finally:
        libm.fesetround(0)
    assert seen == {name: f"{before}, rounding {name}" for name in seen}
    assert kernel_arithmetic() == before


@pytest.mark.parametrize("g,sq", [(1, 1), (2, 1), (4, 1), (3, 1), (8, 1), (4, 3), (1, 7)])
@pytest.mark.parametrize("dim", [128, 72, 19])
def test_long_shards_cross_chunks(level, g, sq, dim):
    """Shards of several chunks (online rescaling, prefetch to the end), ragged and masked."""
    rng = np.random.default_rng([g, sq, dim, level])
    b, hkv, t = 2, 2, 777
    hq = hkv * g
    q = (rng.standard_normal((b, hq, sq, dim)) * 3).astype(np.float32)
    k = rng.standard_normal((b, hkv, t, dim)).astype(np.float32)
    v = rng.standard_normal((b, hkv, t, dim)).astype(np.float32)
    k[0, :, 300:310] *= 4  # a later maximum: the running state is rescaled
    lens = np.array([t, 513])
    vis = rng.random((b, hq, sq, t)) < 0.9
    for args in ((None, None), (lens, None), (lens, vis), (None, vis[:, :1])):
        qa = np.abs(q).reshape(b, hkv, g * sq, dim)
        bound = float((qa @ np.abs(k).swapaxes(-1, -2)).max()) / np.sqrt(dim)
        close(*both(q, k, v, 1 / np.sqrt(dim), *args), dot_bound=bound)


def tree_visibility(rng, b, heads, nodes, t):
    """``(b, heads, nodes, t)`` bool: every cached key visible, the last ``nodes`` a random tree."""
    vis = np.ones((b, heads, nodes, t), bool)
    for i in range(b * heads):
        parent = [-1] + [int(rng.integers(0, j)) for j in range(1, nodes)]
        tree = np.eye(nodes, dtype=bool)
        for j in range(1, nodes):
            tree[j] |= tree[parent[j]]  # ancestor-or-self
        vis.reshape(b * heads, nodes, t)[i, :, t - nodes :] = tree
    return vis


@pytest.mark.parametrize("g,nodes", [(4, 2), (4, 5), (4, 8), (1, 8), (3, 5), (2, 16)])
@pytest.mark.parametrize("heads_mask", [False, True])
def test_tree_rows_over_a_visible_prefix_match_float64(level, g, nodes, heads_mask):
    """A draft tree's rows over a cache: the whole prefix visible, a tree mask on the last keys.

    The kernel skips the per-key mask of a chunk that a row sees whole; the tree's own
    keys straddle a chunk boundary (256), a hidden tree key holds NaN for the rows
    that do not see it, and a row block mixes rows that see it with rows that do not.
    Checked against ``reference_attention`` in float64.
    """
    rng = np.random.default_rng([g, nodes, heads_mask, level])
    b, hkv, dim, t = 2, 2, 128, 512 + nodes // 2
    hq = hkv * g
    q = rng.standard_normal((b, hq, nodes, dim)).astype(np.float32)
    k = rng.standard_normal((b, hkv, t, dim)).astype(np.float32)
    v = rng.standard_normal((b, hkv, t, dim)).astype(np.float32)
    vis = tree_visibility(rng, b, hq if heads_mask else 1, nodes, t)
    out = np.full((b, hq, nodes, dim + 2), np.nan, np.float32)
    assert attend_native(q, k, v, 0.1, None, vis, out)
    want, lse = reference_attention(q, k, v, scale=0.1, visible=vis)
    assert_allclose(out[..., 0] + np.log(out[..., 1]), lse, atol=2e-5, rtol=0)
    assert_allclose(out[..., 2:] / out[..., 1:2], want, atol=2e-5, rtol=0)
    # the last key is seen by its own node only: NaN there reaches no other row
    v[:, :, -1] = np.nan
    assert attend_native(q, k, v, 0.1, None, vis, out)
    sees = np.broadcast_to(vis[..., -1], (b, hq, nodes))
    assert np.isnan(out[..., 2:]).any(-1)[sees].all()
    assert not np.isnan(out[~sees]).any()


@pytest.mark.parametrize("g,sq", [(4, 1), (1, 1), (2, 3), (3, 2), (4, 2), (3, 3), (8, 2)])
def test_garbage_in_excluded_slots_contributes_nothing(level, g, sq):
    """NaN/inf in keys and values no row sees, or only some rows see, never leak."""
    rng = np.random.default_rng([g, sq, level])
    b, hkv, t, dim = 2, 2, 600, 64
    hq = hkv * g
    q = rng.standard_normal((b, hq, sq, dim)).astype(np.float32)
    k = rng.standard_normal((b, hkv, t, dim)).astype(np.float32)
    v = rng.standard_normal((b, hkv, t, dim)).astype(np.float32)
    lens = np.array([t, 400])
    vis = rng.random((b, hq, sq, t)) < 0.7  # rows of a block see different keys
    hidden = ~vis.reshape(b, hkv, g * sq, t).any(2)  # keys no row of a group sees
    garbage = np.where(rng.random((b, hkv, t, 1)) < 0.5, np.nan, np.inf).astype(np.float32)
    k2, v2 = k.copy(), v.copy()
    k2[1, :, 400:] = garbage[1, :, 400:]
    v2[1, :, 400:] = -garbage[1, :, 400:]
    k2[hidden], v2[hidden] = np.nan, np.inf
    clean, _ = both(q, k, v, 0.125, lens, vis)
    dirty, ref = both(q, k2, v2, 0.125, lens, vis)
    assert not np.isnan(dirty).any()
    np.testing.assert_array_equal(dirty, clean)
    close(dirty, ref)
    # a key only some rows of a block see: its garbage value reaches no row that skips it
    vis2 = vis.copy()
    vis2[..., 5] = False
    vis2[:, 0, 0, 5] = True
    v3 = v.copy()
    v3[:, :, 5] = np.nan
    out, _ = both(q, k, v3, 0.125, None, vis2)
    rows = out.reshape(b, hkv, g * sq, dim + 2)
    assert np.isnan(rows[:, 0, 0]).all() or np.isnan(rows[:, 0, 0, 2:]).any()
    assert not np.isnan(rows[:, 0, 1:]).any() and not np.isnan(rows[:, 1:]).any()


def check_kernel_slot(monkeypatch, share, double):
    """Check a KernelSlot over arrays shared by ``share``; return (slot, q, k, v) of its last call.

    A bound slot gives Attention.fill's records bitwise; a growing cache binds once,
    and new strides, heads or dtype (``double``: a float64 query of the bound shape,
    never run through the float32 binding) rebind it.
    """
    from mpitree import _step

    rng = np.random.default_rng(5)
    slot, binds = _step.KernelSlot(), []
    real_of = _step.Prepared.of
    monkeypatch.setattr(_step.Prepared, "of", lambda *a: binds.append(1) or real_of(*a))
    kbuf, vbuf = rng.standard_normal((2, 2, 2, 40, 16)).astype(np.float32)
    wide = rng.standard_normal((2, 2, 40, 20)).astype(np.float32)[..., :16]  # other strides
    cases = [(kbuf[:, :, :t], vbuf[:, :, :t]) for t in (10, 11, 12)]  # a growing cache
    cases += [(wide[:, :, :12], vbuf[:, :, :12]), (kbuf[:, :1, :12], vbuf[:, :1, :12])]

    def same(q, k, v):
        att = _step.Attention(namespace(q), q, k, v, 0.3, None, None)
        got = np.empty((q.shape[0] * q.shape[1], 18), np.float32)
        ref = np.empty_like(got)
        slot.fill(att, got)
        att.fill(ref)
        np.testing.assert_array_equal(got, ref)

    for k, v in cases:
        q = share(rng.standard_normal((2, 2 * k.shape[1], 1, 16)).astype(np.float32))
        k, v = share(k), share(v)
        same(q, k, v)
    assert len(binds) == 3, binds  # the growing cache once; new strides; fewer heads
    same(double(q), k, v)  # the float32 binding never runs a float64 query
    same(q, k, v)
    assert len(binds) == 5, binds
    return slot, q, k, v


def test_kernel_slot_rebinds_on_a_new_layout_and_matches_attention_fill(monkeypatch):
    check_kernel_slot(monkeypatch, lambda x: x, lambda x: x.astype(np.float64))


@pytest.mark.parametrize("sq", [1, 7])
def test_every_bound_kernel_runs_a_prompt_as_attend_does(monkeypatch, sq):
    """One rule of what a prompt is, for a layer's KernelSlot, a plan and a recurring call.

    :func:`attend` runs a step whose scores exceed its budget in blocks of rows; a
    kernel over all rows at once can round differently (here: MHA, 7 rows). Each
    bound kernel gives Attention.fill's bits, the plan's and the one-shot call's
    also those of their full checks, on both sides of the budget.
    """
    from mpi4py import MPI

    import mpitree
    from mpitree import _local, _step, extend

    rng = np.random.default_rng(9)
    b, h, t, dim = 2, 4, 300, 64
    q = rng.standard_normal((b, h, sq, dim)).astype(np.float32)
    k, v = (rng.standard_normal((b, h, t, dim)).astype(np.float32) * 3 for _ in "kv")
    att = _step.Attention(namespace(q), q, k, v, 0.1, None, None)
    whole = np.empty((b * h * sq, dim + 2), np.float32)
    att.fill(whole)
    plan = mpitree.DecodePlan(b, h, h, dim, q_len=sq, comm=MPI.COMM_SELF, scale=0.1)
    split_bits = []
    for budget in (_local.BLOCK_SCORES, b * h * t):  # one block; blocks of one row
        monkeypatch.setattr(_local, "BLOCK_SCORES", budget)
        assert _step.KernelSlot.prompt(b, h, sq, t) == (sq > 1 and budget == b * h * t)
        ref = np.empty_like(whole)
        att.fill(ref)
        split_bits.append(ref)
        slot, got = _step.KernelSlot(), np.empty_like(whole)
        for _ in range(2):  # binds, then runs bound
            slot.fill(att, got)
            np.testing.assert_array_equal(got, ref)
        out = extend.finish(ref.reshape(b, h, sq, dim + 2), q)
        for _ in range(3):  # full checks, then the bound fast path; a one-shot call:
            np.testing.assert_array_equal(plan.decode(q, k, v), out)  # checked, seen, bound
            np.testing.assert_array_equal(
                mpitree.tree_decode(q, k, v, comm=MPI.COMM_SELF, scale=0.1), out
            )
    plan.free()
    if sq > 1:  # the case is real: split rows round differently here
        assert not np.array_equal(split_bits[0], split_bits[1])


def test_a_prompt_binds_no_kernel_step_after_step(monkeypatch):
    """A plan's or a one-shot call's prompt steps build no kernel arguments the slot cannot run.

    Each such step failed the bound kernel's prompt check, took the full checks and
    then bound the kernel afresh (scratch, argument struct) for the next step to refuse.
    """
    from mpi4py import MPI

    import mpitree
    from mpitree import _kernel, _local

    rng = np.random.default_rng(4)
    b, h, sq, t, dim = 1, 2, 3, 40, 8
    q = rng.standard_normal((b, h, sq, dim)).astype(np.float32)
    k, v = (rng.standard_normal((b, h, t + 8, dim)).astype(np.float32) for _ in "kv")
    monkeypatch.setattr(_local, "BLOCK_SCORES", b * h * t)  # sq rows over t keys: a prompt
    built = []
    real = _kernel.Prepared.of
    monkeypatch.setattr(_kernel.Prepared, "of", lambda *a: built.append(1) or real(*a))
    plan = mpitree.DecodePlan(b, h, h, dim, q_len=sq, comm=MPI.COMM_SELF)
    for n in range(t, t + 8):  # the cache grows in place: every step a prompt
        ref = mpitree.reference_attention(q, k[:, :, :n], v[:, :, :n])[0]
        np.testing.assert_allclose(plan.decode(q, k[:, :, :n], v[:, :, :n]), ref, atol=2e-5)
        out = mpitree.tree_decode(q, k[:, :, :n], v[:, :, :n], comm=MPI.COMM_SELF)
        np.testing.assert_allclose(out, ref, atol=2e-5)
    plan.free()
    assert built == []


@pytest.mark.parametrize("g", [3, 9])  # 9: a block of 8 rows and one of 1
@pytest.mark.parametrize("poison", ["nan key", "inf key", "nan value"])
def test_nan_scores_poison_the_row_in_every_build(level, poison, g):
    """Every build's max lets NaN win, as numpy's does: one definition of "poisoned".

    A row with a NaN score gets ``m = NaN`` (never -inf, which would read as empty
    and be dropped by the merge); a weight-0 key's NaN value stays NaN in ``n``.
    """
    rng = np.random.default_rng(2)
    b, hkv, t, dim = 2, 2, 300, 20  # t > CHUNK: the NaN chunk is not the first
    q = np.abs(rng.standard_normal((b, hkv * g, 1, dim)).astype(np.float32)) + 0.1
    k = rng.standard_normal((b, hkv, t, dim)).astype(np.float32)
    v = rng.standard_normal((b, hkv, t, dim)).astype(np.float32)
    if poison == "nan key":
        k[0, 1, 280] = np.nan
    elif poison == "inf key":
        q[0, g:, :, 1] = -1.0
        k[0, 1, 280] = np.inf
    else:
        k[0, 1, 280] = -np.inf
        v[0, 1, 280, 4] = np.nan
    native = np.zeros((b, hkv * g, 1, dim + 2), np.float32)
    assert attend_native(q, k, v, 0.3, None, None, native)
    ref = state_records(namespace(q), q, k, v, 0.3, None, None, "float32")
    assert np.array_equal(np.isnan(native), np.isnan(ref))
    assert np.isnan(native).any()
    if poison != "nan value":
        assert np.isnan(native[0, g : 2 * g, :, 0]).all()  # the poisoned rows' m
    fin = ~np.isnan(ref)
    assert_allclose(native[fin], ref[fin], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dim", [128, 64, 72, 19, 160, 256])
@pytest.mark.parametrize("case", ["plain", "ragged", "masked", "poisoned"])
def test_one_row_in_address_order_is_bitwise_the_prefetching_path(level, dim, case):
    """One row per KV head over contiguous key rows may read in address order (no prefetch).

    The same sums in the same order: its records equal, bit for bit, those of the same
    data laid out with key rows apart (the prefetching path) and those of the same
    contiguous rows read prefetching, over several chunks.
    """
    rng = np.random.default_rng([dim, level, len(case)])
    b, h, t = 2, 3, 777
    q = (rng.standard_normal((b, h, 1, dim)) * 3).astype(np.float32)
    apart = rng.standard_normal((2, b, h, t, dim + 5)).astype(np.float32)[..., :dim]
    k, v = apart
    lens, vis = None, None
    if case == "ragged":
        lens = np.array([t, 513])
        k[1, :, 513:] = v[1, :, 513:] = np.nan  # garbage past the length
    elif case == "masked":
        vis = rng.random((b, h, 1, t)) < 0.9
        k[~vis[:, :, 0]] = v[~vis[:, :, 0]] = np.nan  # garbage where the head's row never looks
    elif case == "poisoned":
        k[0, 1, 600, 3] = np.nan
        v[1, 2, 290, 5] = np.inf
    records = []
    together = np.ascontiguousarray(k), np.ascontiguousarray(v)
    try:
        for (kk, vv), way in (
            ((k, v), "timed"),
            (together, "prefetch"),
            (together, "address order"),
        ):
            assert kernel_read_order(way) == way.replace("timed", "undecided")
            out = np.full((b, h, 1, dim + 2), -7.0, np.float32)
            assert attend_native(q, kk, vv, 1 / np.sqrt(dim), lens, vis, out)
            records.append(out)
    finally:
        kernel_read_order("timed")
    assert np.array_equal(records[0], records[1], equal_nan=True)
    assert np.array_equal(records[0], records[2], equal_nan=True)
    ref = state_records(namespace(q), q, k, v, 1 / np.sqrt(dim), lens, vis, "float64")
    assert np.array_equal(np.isnan(records[1]), np.isnan(ref))
    if case == "poisoned":
        assert np.isnan(records[1][0, 1, 0, 0]) and np.isposinf(records[1][1, 2, 0, 7])
    else:  # excluded garbage contributes nothing: every record finite, as float64 says
        assert np.isfinite(records[1]).all()
        assert_allclose(records[1], ref, rtol=1e-4, atol=1e-4)


def test_the_timed_read_order_decides_after_eight_large_calls_and_changes_no_bit(level):
    """Large one-row calls time both ways in turn, then keep one; every call gives the same bits."""
    rng = np.random.default_rng(level)
    q = rng.standard_normal((1, 4, 1, 64)).astype(np.float32)
    k, v = rng.standard_normal((2, 1, 4, 8192, 64)).astype(np.float32)  # 16 MiB read a call
    small = k[:, :, :64], v[:, :, :64]
    outs = []
    try:
        assert kernel_read_order("timed") == "undecided"
        for _ in range(3):  # below 8 MiB: not timed
            assert attend_native(q, *small, 0.125, None, None, np.empty((1, 4, 1, 66), np.float32))
        assert kernel_read_order() == "undecided"
        for i in range(9):
            out = np.empty((1, 4, 1, 66), np.float32)
            assert attend_native(q, k, v, 0.125, None, None, out)
            outs.append(out)
            assert (kernel_read_order() == "undecided") == (i < 7), i
        assert kernel_read_order(level=level) in ("address order", "prefetch")
    finally:
        kernel_read_order("timed")
    for out in outs[1:]:
        assert np.array_equal(out, outs[0])
    ref = state_records(namespace(q), q, k, v, 0.125, None, None, "float64")
    assert_allclose(outs[0], ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "bad, error, match",
    [
        *[(dict(force=f), ValueError, "force is one of") for f in ("sideways", 1, True, b"ab")],
        *[(dict(level=x), ValueError, "kernel level") for x in (2, -1, 7, 2**32 + 3)],
        *[(dict(level=x), TypeError, "kernel level") for x in (True, 3.0, "4")],
    ],
)
def test_kernel_read_order_refuses_what_is_not_a_way_or_level(bad, error, match):
    """Only None and the three names are ways, only 0, 4, 3, 1 levels: nothing else is taken."""
    before = kernel_read_order()
    with pytest.raises(error, match=match):
        kernel_read_order(**bad)
    assert kernel_read_order() == before


@pytest.mark.parametrize(
    "bad, error",
    [
        *[(level, ValueError) for level in (2, -1, 5, 2**31)],
        *[(level, TypeError) for level in (True, 3.7, "3", None)],
    ],
)
def test_select_kernel_refuses_what_is_not_a_level(bad, error):
    """Only 0, 4, 3 and 1 select a build; nothing else silently picks one."""
    before = kernel_isa()
    with pytest.raises(error, match="kernel level"):
        select_kernel(bad)
    assert kernel_isa() == before


def _address_cases():
    """Arrays of every layout the compiled calls get: (name, array)."""
    base = np.arange(60, dtype=np.float32).reshape(3, 4, 5)
    frozen = base.copy()
    frozen.flags.writeable = False
    return [
        ("C order", base),
        ("Fortran order", np.asfortranarray(base)),
        ("Fortran order, big-endian", np.asfortranarray(base.astype(">f4"))),
        ("Fortran order, records", np.asfortranarray(np.zeros((3, 2), "f4,i8"))),
        ("big-endian", base.astype(">f4")),
        ("records", np.zeros(3, "f4,i8")),
        ("objects", np.empty((3, 4), object)),
        ("offset view", base[1:]),
        ("read-only", frozen),
        ("strided (not contiguous)", base[:, ::2]),
        ("transposed, not contiguous", base.transpose(1, 0, 2)),
        ("zero-size", base[:, :0]),
        ("0-d", np.ones((), np.float32)),
        ("int64", np.arange(7, dtype=np.int64)),
        ("float16", base.astype(np.float16)),
    ]


@pytest.mark.parametrize("name, x", _address_cases(), ids=[c[0] for c in _address_cases()])
def test_address_is_the_first_elements_address(name, x):
    """address(x) (the buffer protocol where it can) is what x.ctypes.data says, for the
    layouts and dtypes here (only float32 and int64 arrays reach the compiled calls)."""
    assert address(x) == x.ctypes.data
