"""deterministic="invariant": the same bits for any rank count and block-aligned placement.

Every rank also decodes the whole cache alone (a one-rank split of the world):
the sharded result must equal it bit for bit, so results agree across every p
the suite runs at (1, 2, 3, 4, 5, 8), and every placement drawn.
"""

import math

import numpy as np
import pytest
import torch
from helpers import atol, gathered_identical, world
from mpi4py import MPI
from numpy.testing import assert_allclose

import mpitree
from mpitree._invariant import _joiner, canonical_root, local_pieces
from mpitree._library import native_lib
from mpitree._state import combine_records
from mpitree._traffic import traffic

NPROCS = [1, 2, 3, 4, 5, 8]
BS = 8


def placement(kind, n_blocks, p, rng):
    """Sorted global block indices per rank: contiguous cuts, round-robin or a random deal."""
    if kind == "contiguous":
        cuts = np.sort(rng.integers(0, n_blocks + 1, p - 1))  # empty shards included
        edges = [0, *cuts.tolist(), n_blocks]
        return [np.arange(edges[r], edges[r + 1]) for r in range(p)]
    if kind == "interleaved":
        width = int(rng.integers(1, 4))  # runs of `width` blocks dealt round-robin
        owner = (np.arange(n_blocks) // width) % p
    else:
        owner = rng.integers(0, p, n_blocks)
    return [np.flatnonzero(owner == r) for r in range(p)]


class Case:
    """A global problem (numpy, float64 master copy) and its shards for one placement."""

    def __init__(self, seed, n, *, dtype=np.float32, q_len=1, hq=4, hkv=2, d=16, batch=2,
                 kv_len=False, positions=False, mask=False):  # fmt: skip
        rng = np.random.default_rng(seed)
        self.n, self.dtype, self.bs = n, dtype, BS
        self.q = rng.standard_normal((batch, hq, q_len, d))
        self.k = rng.standard_normal((batch, hkv, n, d))
        self.v = rng.standard_normal((batch, hkv, n, d))
        self.lens = rng.integers(0, n + 1, batch) if kv_len else None
        self.q_pos = self.k_pos = None
        if positions:
            self.k_pos = np.tile(np.arange(n), (batch, 1))
            ends = rng.integers(max(n - 2 * BS, q_len), n + 1, batch)
            self.q_pos = ends[:, None] - q_len + np.arange(q_len)
        self.mask = rng.random((batch, hq, q_len, n)) < 0.7 if mask else None
        self.rng = rng

    def cast(self, x):
        """``x`` in the case's dtype (torch bfloat16 as a tensor)."""
        if self.dtype == "bfloat16":
            return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16)
        return np.ascontiguousarray(x, self.dtype)

    def keys(self, blocks):
        """Global key indices of a shard holding ``blocks`` (sorted)."""
        parts = [np.arange(b * BS, min(self.n, (b + 1) * BS)) for b in blocks]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def shard(self, blocks, contiguous=False):
        """(k, v, keyword arguments) of a shard holding ``blocks``."""
        idx = self.keys(blocks)
        kw = {"deterministic": "invariant", "block_size": BS, "return_lse": True}
        if contiguous:
            kw["kv_start"] = int(blocks[0]) * BS if len(blocks) else 0
        else:
            kw["kv_blocks"] = np.asarray(blocks, np.int64)
        if self.lens is not None:
            kw["kv_len"] = (idx[None, :] < self.lens[:, None]).sum(1)
        if self.q_pos is not None:
            kw["q_pos"], kw["k_pos"] = self.q_pos, np.ascontiguousarray(self.k_pos[:, idx])
        if self.mask is not None:
            kw["mask"] = np.ascontiguousarray(self.mask[..., idx])
        return self.cast(self.k[:, :, idx]), self.cast(self.v[:, :, idx]), kw

    def reference(self):
        """The float64 reference on the inputs rounded to the case's dtype."""
        rounded = [as_numpy(self.cast(x)).astype(np.float64) for x in (self.q, self.k, self.v)]
        vis = np.ones((self.q.shape[0], 1, 1, self.n), bool)
        if self.lens is not None:
            vis = vis & (np.arange(self.n) < self.lens[:, None])[:, None, None, :]
        if self.q_pos is not None:
            vis = vis & (self.k_pos[:, None, None, :] <= self.q_pos[:, None, :, None])
        if self.mask is not None:
            vis = vis & self.mask
        return mpitree.reference_attention(*rounded, visible=vis)


def as_numpy(x):
    return x.float().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def bits(x):
    return x.view(torch.int16).numpy() if isinstance(x, torch.Tensor) else x


def decode(case, comm, blocks, contiguous=False):
    k, v, kw = case.shard(blocks, contiguous)
    return mpitree.tree_decode(case.cast(case.q), k, v, comm, **kw)


def check_invariant(case, kinds=("contiguous", "interleaved", "random")):
    """Every placement of ``kinds`` equals the one-rank decode, bitwise, on every rank."""
    comm = world()
    p, n_blocks = comm.size, math.ceil(case.n / BS)
    solo = comm.Split(comm.rank)
    try:
        alone = decode(case, solo, np.arange(n_blocks), contiguous=True)
    finally:
        solo.Free()
    out, lse = alone
    ref_out, ref_lse = case.reference()
    tol = 2e-2 if case.dtype == "bfloat16" else atol(case.dtype)
    assert_allclose(as_numpy(out), ref_out, atol=tol, rtol=0)
    seen = np.isfinite(ref_lse)
    assert_allclose(as_numpy(lse)[seen], ref_lse[seen], atol=max(tol, 1e-5), rtol=1e-5)
    assert np.isneginf(as_numpy(lse)[~seen]).all()
    for kind in kinds:
        for trial in range(2):
            blocks = placement(kind, n_blocks, p, case.rng)[comm.rank]
            got = decode(case, comm, blocks, contiguous=kind == "contiguous" and trial == 0)
            for a, b in zip(got, alone, strict=True):
                assert np.array_equal(bits(a), bits(b)), (kind, trial)
            assert gathered_identical(comm, bits(got[0]))


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, "bfloat16"])
def test_same_bits_for_every_rank_count_and_placement(dtype):
    check_invariant(Case(1, 8 * 13 + 5, dtype=dtype, kv_len=True))


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("heads", [(4, 2), (4, 1), (3, 3)])
def test_gqa_positions_masks(heads):
    """GQA/MQA/MHA, Sq > 1 with positions and a per-head mask, ragged lengths."""
    hq, hkv = heads
    case = Case(2, 8 * 9 + 3, q_len=3, hq=hq, hkv=hkv, positions=True, mask=True, kv_len=True)
    check_invariant(case)


@pytest.mark.parallel(nprocs=NPROCS)
def test_long_prompt_rows_and_wide_head():
    """Many query rows (attend() then works in row blocks) and D = 130."""
    check_invariant(Case(3, 8 * 40, q_len=9, d=130, positions=True), kinds=("random",))


@pytest.mark.parallel(nprocs=NPROCS)
def test_no_keys_anywhere_and_one_block():
    comm = world()
    case = Case(4, 5)  # one short block, held by one rank
    check_invariant(case, kinds=("random",))
    empty = Case(5, 0)  # no key on any rank: output 0, lse -inf
    k, v, kw = empty.shard(np.zeros(0, np.int64))
    out, lse = mpitree.tree_decode(empty.cast(empty.q), k, v, comm, **kw)
    assert not out.any() and np.isneginf(lse).all()


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("validate", [False, True])
def test_plan_equals_tree_decode_over_a_growing_cache(validate):
    comm = world()
    case = Case(6, 8 * 20 + 6, q_len=2, positions=True)
    n_blocks = math.ceil(case.n / BS)
    blocks = placement("interleaved", n_blocks, comm.size, case.rng)[comm.rank]
    invariant = dict(deterministic="invariant", block_size=BS, validate=validate)
    with mpitree.DecodePlan(2, 4, 2, 16, q_len=2, **invariant) as plan:
        assert plan.strategy == "invariant"
        for keep in (n_blocks - 3, n_blocks):  # the cache grows between steps
            mine = blocks[blocks < keep]
            k, v, kw = case.shard(mine)
            kw = {key: kw[key] for key in ("kv_blocks", "q_pos", "k_pos")}
            q = case.cast(case.q)
            out, lse = plan.decode(q, k, v, return_lse=True, **kw)
            one = mpitree.tree_decode(
                q, k, v, deterministic="invariant", block_size=BS, return_lse=True, **kw
            )
            assert np.array_equal(out, one[0]) and np.array_equal(lse, one[1])


@pytest.mark.parallel(nprocs=NPROCS)
def test_bytes_per_rank_stay_logarithmic():
    """Contiguous shards of at most n blocks send at most 2 log2(n + 1) pieces (and a header).

    A rank sends as many pieces as the most any rank had in the previous merge
    (padding), plus any it has beyond that.
    """
    comm = world()
    case = Case(7, 8 * 300)
    n_blocks = case.n // BS
    record = 16 + 2 * 4 * 1 * (16 + 2) * 4  # key + B * Hq * Sq records of D + 2 float32
    most = 1  # blocks on any rank in this or the previous merge
    for _ in range(4):
        blocks = placement("contiguous", n_blocks, comm.size, case.rng)[comm.rank]
        most = max(comm.allreduce(len(blocks), op=MPI.MAX), most)
        k, v, kw = case.shard(blocks, contiguous=True)
        traffic.reset()
        mpitree.tree_decode(case.cast(case.q), k, v, comm, **kw)
        if comm.size > 1:
            pieces = (traffic.bytes - 16) / record  # a 16-byte header, then the pieces
            assert pieces == int(pieces) and 1 <= pieces <= 2 * math.log2(most + 1), pieces
        most = comm.allreduce(len(blocks), op=MPI.MAX)


def join(a, b):
    """The tree's own combine of two records (compiled or numpy, as the kernel build says)."""
    pair = np.stack([a, b])
    _joiner(pair)(0, 1)
    assert_allclose(pair[0], combine_records(a, b), rtol=1e-6, atol=1e-6)
    return pair[0]


@pytest.mark.parallel(nprocs=[1])
def test_canonical_tree_is_the_fixed_balanced_tree():
    """Pieces from any split finish to the recursive tree's root, bitwise."""
    rng = np.random.default_rng(8)
    held = np.sort(rng.choice(100, 60, replace=False))
    leaves = rng.standard_normal((100, 3, 6)).astype(np.float32)
    leaves[:, :, 0] *= 5
    leaves[:, :, 1] = np.abs(leaves[:, :, 1])

    def node(level, i):
        if level == 0:
            return leaves[i] if i in held else None
        a, b = node(level - 1, 2 * i), node(level - 1, 2 * i + 1)
        return a if b is None else b if a is None else join(a, b)

    expect = node(7, 0)
    for parts in (1, 2, 7, 60):
        owner = rng.integers(0, parts, len(held))
        pieces = [local_pieces(held[owner == r], leaves[held[owner == r]]) for r in range(parts)]
        levels, index, recs = (np.concatenate(x) for x in zip(*pieces, strict=True))
        order = rng.permutation(len(levels))  # arrival order does not matter
        root = canonical_root(levels[order], index[order], recs[order], (3,), 4, np.float32)
        assert np.array_equal(root, expect)


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_unaligned_boundary_raises_on_every_rank():
    comm = world()
    bad = comm.size - 1
    q, kv = np.ones((1, 2, 1, 4), np.float32), np.ones((1, 1, 8, 4), np.float32)
    start = 8 * comm.rank + (3 if comm.rank == bad else 0)
    with pytest.raises(ValueError) as info:
        mpitree.tree_decode(q, kv, kv, deterministic="invariant", block_size=8, kv_start=start)
    if comm.rank == bad:
        assert "not a multiple of block_size=8" in str(info.value)
    else:
        assert isinstance(info.value, mpitree.RankError) and info.value.rank == bad
    with mpitree.DecodePlan(1, 2, 1, 4, deterministic="invariant", block_size=8) as plan:
        with pytest.raises(ValueError, match=r"not a multiple|invalid input on rank"):
            plan.decode(q, kv, kv, kv_start=start)
        out = plan.decode(q, kv, kv, kv_start=8 * comm.rank)  # the plan stays usable
        assert_allclose(out, np.ones((1, 2, 1, 4)), rtol=1e-6)


def last_rank_flushes(comm):
    """Turn on flush-to-zero on the last rank only; False (and nothing on) on every rank
    where some rank has no compiled library to read it, or no flush-to-zero."""
    flushing = comm.rank == comm.size - 1
    can = native_lib() is not None and torch.set_flush_denormal(flushing)
    if comm.allreduce(can, MPI.LAND):
        return True
    torch.set_flush_denormal(False)
    return False


@pytest.mark.parallel(nprocs=[2, 3])
def test_a_rank_that_flushes_subnormals_raises_on_every_rank():
    """Flush-to-zero changes the bits: a rank that set it (torch, a -ffast-math library)
    makes the call raise on every rank instead of rounding apart; unset, it passes."""
    comm = world()
    q, kv = np.ones((1, 2, 1, 4), np.float32), np.ones((1, 1, 8, 4), np.float32)
    kw = dict(deterministic="invariant", block_size=8, kv_start=8 * comm.rank)
    if not last_rank_flushes(comm):
        return
    try:
        with pytest.raises(ValueError, match="ranks disagree on kernel") as info:
            mpitree.tree_decode(q, kv, kv, **kw)
        assert "subnormals flushed to zero" in str(info.value)
    finally:
        torch.set_flush_denormal(False)
    assert_allclose(mpitree.tree_decode(q, kv, kv, **kw), np.ones((1, 2, 1, 4)), rtol=1e-6)


@pytest.mark.parallel(nprocs=[2, 3])
def test_a_plan_raises_when_a_rank_starts_flushing_subnormals():
    """A plan agrees once: a rank that sets flush-to-zero later raises in the step, on every
    rank, and the plan works again once it is unset."""
    comm = world()
    q, kv = np.ones((1, 2, 1, 4), np.float32), np.ones((1, 1, 8, 4), np.float32)
    flushing = comm.rank == comm.size - 1
    with mpitree.DecodePlan(1, 2, 1, 4, deterministic="invariant", block_size=8) as plan:
        if not last_rank_flushes(comm):
            return
        try:
            with pytest.raises(ValueError) as info:
                plan.decode(q, kv, kv, kv_start=8 * comm.rank)
        finally:
            torch.set_flush_denormal(False)
        if flushing:
            assert "subnormals flushed to zero', not the" in str(info.value)
        else:
            assert isinstance(info.value, mpitree.RankError)
            assert info.value.rank == comm.size - 1
        out = plan.decode(q, kv, kv, kv_start=8 * comm.rank)
    assert_allclose(out, np.ones((1, 2, 1, 4)), rtol=1e-6)


@pytest.mark.parallel(nprocs=[2, 3])
def test_overlapping_blocks_raise_on_every_rank():
    q, kv = np.ones((1, 2, 1, 4), np.float32), np.ones((1, 1, 8, 4), np.float32)
    with pytest.raises(ValueError, match="two ranks hold global block 8"):
        mpitree.tree_decode(q, kv, kv, deterministic="invariant", block_size=8, kv_start=64)


@pytest.mark.parallel(nprocs=[1, 2])
def test_options_outside_invariant_mode_are_refused():
    q, kv = np.ones((1, 2, 1, 4), np.float32), np.ones((1, 1, 8, 4), np.float32)
    with pytest.raises(ValueError, match="only used with deterministic='invariant'"):
        mpitree.tree_decode(q, kv, kv, kv_start=0)
    with pytest.raises(ValueError, match="only used with deterministic='invariant'"):
        mpitree.tree_decode(q, kv, kv, block_size=8)
    with pytest.raises(ValueError, match="leave strategy='auto'"):
        mpitree.tree_decode(q, kv, kv, deterministic="invariant", strategy="ring", kv_start=0)
    with pytest.raises(ValueError, match="needs this shard's place"):
        mpitree.tree_decode(q, kv, kv, deterministic="invariant")
    with pytest.raises(ValueError, match="supported by tree_decode, DecodePlan and"):
        mpitree.allreduce_state(mpitree.State.empty((2,), 4), deterministic="invariant")
    with mpitree.DecodePlan(1, 2, 1, 4) as plan:
        with pytest.raises(ValueError, match="only used with deterministic='invariant'"):
            plan.decode(q, kv, kv, kv_start=0)


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_default_block_size():
    """Without block_size, blocks hold 1024 keys; the last rank's shard is short."""
    comm = world()
    rng = np.random.default_rng(9)
    q = rng.standard_normal((1, 2, 1, 8)).astype(np.float32)
    k, v = rng.standard_normal((2, 1, 1, 1024 * comm.size - 100, 8)).astype(np.float32)
    lo, hi = 1024 * comm.rank, 1024 * (comm.rank + 1)
    got = mpitree.tree_decode(
        q, k[:, :, lo:hi], v[:, :, lo:hi], deterministic="invariant", kv_start=lo, return_lse=True
    )
    solo = comm.Split(comm.rank)
    alone = mpitree.tree_decode(
        q, k, v, solo, deterministic="invariant", kv_blocks=np.arange(comm.size), return_lse=True
    )
    solo.Free()
    assert all(np.array_equal(a, b) for a, b in zip(got, alone, strict=True))
    assert_allclose(got[0], mpitree.reference_attention(q, k, v)[0], atol=2e-5, rtol=0)
