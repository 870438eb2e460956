"""deterministic="invariant" through transformers: generate's logits are the same bits for any p.

Every rank also runs the same generate with a cache over ``COMM_SELF`` (one
rank): the sharded run must equal it bit for bit, so the logits agree across
every p the suite runs at (1, 2, 3, 4) and both placements.
"""

import itertools
import math

import mpitree.adapters.transformers as mtt
import pytest
import torch
from helpers import world
from models import float64_logits, greedy, prompt, tiny_llama
from mpi4py import MPI
from numpy.testing import assert_allclose

from mpitree import _invariant_merger as strategy

NPROCS = [1, 2, 3, 4]
BLOCK = 8
NEW_TOKENS = 10


def run(model, ids, mask, comm, placement, prefilled):
    """Greedy generate, invariant cache over ``comm``: sequences, (steps, B, V) logits, cache."""
    cache = mtt.ShardedCache(
        model.config, comm=comm, placement=placement, deterministic="invariant", block_size=BLOCK
    )
    first = []
    if prefilled:  # the prompt but its last token, then generate from there
        first = [mtt.prefill(model, ids[:, :-1], cache, None if mask is None else mask[:, :-1])]
    out = greedy(model, ids, mask, cache, NEW_TOKENS)
    return out.sequences, torch.stack([*first, *out.logits]), cache


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_generate_logits_are_the_same_bits_for_any_rank_count(dtype):
    """Both placements, with and without left padding, from generate alone and after prefill."""
    comm = world()
    torch.set_num_threads(1)  # the dense layers too must run alike in both runs
    model = tiny_llama().to(dtype)
    model.set_attn_implementation("mpitree")
    for placement, padded, prefilled in itertools.product(mtt.PLACEMENTS, *[(False, True)] * 2):
        case = f"{placement}, padded={padded}, prefilled={prefilled}"
        ids, mask = prompt(37, padded)  # 5 blocks of 8: the last one partial, then decoded into
        seqs, logits, cache = run(model, ids, mask, comm, placement, prefilled)
        alone_seqs, alone_logits, _ = run(model, ids, mask, MPI.COMM_SELF, placement, prefilled)
        assert torch.equal(seqs, alone_seqs), case
        assert torch.equal(logits, alone_logits), case  # bitwise: the same for every p
        # every rank holds whole blocks, and together they hold every token once
        total = cache.get_seq_length()
        held = comm.allgather(cache.layers[0].positions.tolist())
        assert sorted(p for rank in held for p in rank) == list(range(total)), case
        for rank in held:
            pairs = zip(rank[1:], rank[:-1], strict=True)
            assert all(p % BLOCK == 0 or p == q + 1 for p, q in pairs), case
        if dtype == torch.float32:  # exact, against float64 on the whole sequence
            want = float64_logits(model, seqs, mask, ids.shape[1] - prefilled).transpose(0, 1)
            assert_allclose(logits.double().numpy(), want.numpy(), atol=1e-4, rtol=0, err_msg=case)


@pytest.mark.parallel(nprocs=[2, 3, 4])
@pytest.mark.parametrize("placement", mtt.PLACEMENTS)
def test_pieces_per_rank(placement, monkeypatch):
    """ "last" keeps a rank's blocks in one run: O(log) pieces travel, not one per block."""
    sent = []
    real = strategy.pack
    monkeypatch.setattr(
        strategy, "pack", lambda levels, *a: sent.append(len(levels)) or real(levels, *a)
    )
    model = tiny_llama(layers=1)
    model.set_attn_implementation("mpitree")
    ids, _ = prompt(256, False, batch=1)
    cache = mtt.ShardedCache(
        model.config, placement=placement, deterministic="invariant", block_size=BLOCK
    )
    with torch.no_grad():
        model(ids, cache=cache)
        model(ids[:, :1], cache=cache)
    blocks = -(-cache.local_length() // BLOCK)
    assert len(sent) == 2 and blocks >= 256 // BLOCK // world().size
    if placement == "interleave":  # no two of a rank's blocks are siblings: one piece each
        assert sent[-1] == blocks
    else:  # one run of blocks: at most two pieces per tree level
        assert max(sent) <= 2 * math.ceil(math.log2(blocks + 1)), (sent, blocks)


@pytest.mark.parallel(nprocs=[2, 3])
def test_invariant_needs_strategy_auto_and_a_positive_block():
    with pytest.raises(ValueError, match="leave strategy='auto'"):
        mtt.ShardedCache(deterministic="invariant", strategy="ring")
    with pytest.raises(ValueError, match="block_size"):
        mtt.ShardedCache(deterministic="invariant", block_size=0)
    cache = mtt.ShardedCache(deterministic="invariant")
    assert cache.sharding.block_size == 1024
    with pytest.raises(ValueError, match="leave strategy='auto'"):
        cache.strategy = "ring"
    assert mtt.ShardedCache().sharding.block_size == 64


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize("field", ["placement", "block_size"])
def test_placement_changed_on_one_rank_raises_on_every_rank(field):
    """Each step agrees on where tokens go: a rank that changed it would drop blocks silently."""
    model = tiny_llama(layers=1)
    model.set_attn_implementation("mpitree")
    ids, _ = prompt(24, False)
    cache = mtt.ShardedCache(model.config, deterministic="invariant", block_size=BLOCK)
    with torch.no_grad():
        model(ids, cache=cache)
        if world().rank == 1:
            setattr(cache.sharding, field, "last" if field == "placement" else 2 * BLOCK)
        with pytest.raises(ValueError, match=f"ranks disagree on {field}"):
            model(ids[:, :1], cache=cache)
    assert mtt.ShardedCache().sharding.block_size == 64
