"""StaticShardedCache: a transformers decode step a CUDA graph can hold (issue 50, item 3).

CPU tensors stand in for CUDA ones under ``MPITREE_KERNEL=triton`` (Triton's
interpreter): a decode step writes its token at a device index, attends over the
buffers' whole capacity with a device ``kv_len`` and, at one rank, keeps its records
on the device. The tests count what a step reads on the host and allocates (torch's
profiler), compare generate with one process's eager attention, and put garbage in
the capacity no step has written. The ``cuda``-marked cases capture a decode forward
in ``torch.cuda.CUDAGraph`` and replay it.
"""

import copy

import mpitree.adapters.transformers as mtt
import numpy as np
import pytest
import torch
from helpers import allocations_in_spans, world
from models import greedy, prompt, tiny_llama
from mpitree.adapters.transformers import _attention, _static_step
from numpy.testing import assert_allclose
from test_triton_decode import (
    kernel,
    triton_selected,  # noqa: F401  (a fixture)
)
from transformers.masking_utils import causal_mask_function

from mpitree import RankError

LAYERS = 2
CAPACITY = 24
SPAN = "mpitree static step"  # the profiler's name for the cache's updates and attention
PLACEMENTS = [("interleave", 2), ("last", None)]  # uneven shards at 2 and 3 ranks


def models():
    """The tiny Llama under mpitree's attention, and under eager attention (one process)."""
    model = tiny_llama(LAYERS)
    model.set_attn_implementation("mpitree")
    eager = tiny_llama(LAYERS)
    eager.set_attn_implementation("eager")
    return model, eager


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize(("placement", "block_size"), PLACEMENTS)
@pytest.mark.parametrize("padded", [False, True])
def test_generate_matches_one_process(placement, block_size, padded, triton_selected):  # noqa: F811
    """Greedy generate over a static cache: eager attention's tokens and logits, at any rank count,
    with uneven shards and a left-padded row; its decode steps run the Triton kernel."""
    model, eager = models()
    ids, mask = prompt(9, padded)
    cache = mtt.StaticShardedCache(
        model.config, max_cache_len=CAPACITY, placement=placement, block_size=block_size
    )
    got = greedy(model, ids, mask, cache, 6)
    want = greedy(eager, ids, mask, None, 6)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits, strict=True):
        assert_allclose(a.numpy(), b.numpy(), atol=2e-5, rtol=0)
    assert cache.get_seq_length() == 9 + 5
    held = world().allreduce(cache.local_length(0))
    assert held == 9 + 5  # every token on exactly one rank
    assert triton_selected["records"] >= 5 * LAYERS  # the decode steps' records: Triton's


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_without_the_triton_kernel_every_step_takes_the_checked_path(monkeypatch):
    """No MPITREE_KERNEL: a static cache's steps take ShardedCache's path over the tokens
    held (not capturable), with the same tokens and logits as one process's."""
    monkeypatch.delenv("MPITREE_KERNEL", raising=False)
    model, eager = models()
    ids, mask = prompt(9, True)
    cache = mtt.StaticShardedCache(model.config, max_cache_len=CAPACITY, block_size=2)
    got = greedy(model, ids, mask, cache, 4)
    want = greedy(eager, ids, mask, None, 4)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits, strict=True):
        assert_allclose(a.numpy(), b.numpy(), atol=2e-5, rtol=0)
    assert cache.capacity.facts is None  # no step took the device path


def decode_loop(model, cache, ids, steps, before=None):
    """Prefill ``ids``, then ``steps`` greedy decode steps; ``before(cache)`` runs before each.

    Returns the decode steps' logits.
    """
    out = []
    with torch.no_grad():
        token = model(ids, cache=cache).logits[:, -1:].argmax(-1)
        for i in range(steps):
            pos = torch.full((ids.shape[0], 1), ids.shape[1] + i)
            if before is not None:
                before(cache)
            logits = model(token, cache=cache, position_ids=pos).logits
            out.append(logits)
            token = logits[:, -1:].argmax(-1)
    return out


def fill_unused(cache):
    """Write NaN and infinities into every slot of every layer's buffers past what it holds."""
    for layer in cache.layers:
        keys, values, _ = layer.buffers
        keys[:, :, layer.local :] = float("nan")
        values[:, :, layer.local :] = float("inf")
        values[:, :, -1:] = -float("inf")  # the scratch slot


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_garbage_past_kv_len_changes_nothing(triton_selected):  # noqa: F811
    """NaN and infinities in the capacity no token fills: the same logits, bit for bit."""
    model, _ = models()
    ids, _ = prompt(7, False)
    clean = decode_loop(model, mtt.StaticShardedCache(max_cache_len=CAPACITY, block_size=2), ids, 4)
    cache = mtt.StaticShardedCache(max_cache_len=CAPACITY, block_size=2)
    dirty = decode_loop(model, cache, ids, 4, before=fill_unused)
    for a, b in zip(clean, dirty, strict=True):
        assert torch.equal(a, b)
        assert bool(torch.isfinite(b).all())


class HostReads:
    """Count reads of tensors on the host (``tolist``, ``item``, ``bool``...) while on."""

    NAMES = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")

    def __init__(self, monkeypatch):
        self.on, self.reads, self.copies = False, [], 0
        for name in self.NAMES:
            monkeypatch.setattr(torch.Tensor, name, self.counted(name, getattr(torch.Tensor, name)))
        copy = torch.Tensor.copy_

        def counted_copy(x, *args, **kwargs):
            self.copies += self.on
            return copy(x, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "copy_", counted_copy)
        for name in ("decode_records", "finish_output"):  # the interpreter reads its arguments
            monkeypatch.setattr(kernel, name, self.paused(getattr(kernel, name)))

    def counted(self, name, method):
        def read(x, *args, **kwargs):
            if self.on:
                self.reads.append(name)
            return method(x, *args, **kwargs)

        return read

    def paused(self, fn):
        def run(*args, **kwargs):
            on, self.on = self.on, False
            try:
                return fn(*args, **kwargs)
            finally:
                self.on = on

        return run

    def spanned(self, fn):
        """Wrap ``fn``: counted, inside a profiler span."""

        def run(*args, **kwargs):
            on, self.on = self.on, True
            try:
                with torch.profiler.record_function(SPAN):
                    return fn(*args, **kwargs)
            finally:
                self.on = on

        return run


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("padded", [False, True])
def test_a_decode_step_reads_nothing_on_the_host_and_allocates_nothing(
    padded,
    triton_selected,  # noqa: F811
    monkeypatch,
):
    """After warm-up, a decode step's cache updates and attention read no tensor on the
    host (without a mask, neither does the whole forward) and allocate nothing; one rank
    copies nothing (its records stay on the device), several ranks copy each layer's
    records down and the merged ones up, and nothing else."""
    reads = HostReads(monkeypatch)
    update = mtt.StaticShardedCache.update
    monkeypatch.setattr(mtt.StaticShardedCache, "update", reads.spanned(update))
    monkeypatch.setattr(_attention, "static_attend", reads.spanned(_static_step.attend))
    model, eager = models()
    ids, mask = prompt(9, padded)
    cache = mtt.StaticShardedCache(model.config, max_cache_len=CAPACITY, block_size=2)
    with torch.no_grad():
        token = model(ids, attention_mask=mask, cache=cache).logits[:, -1:].argmax(-1)
        sequence = torch.cat([ids, token], 1)
        for step in range(4):
            pos = torch.full((2, 1), sequence.shape[1] - 1)
            full = None if mask is None else torch.cat([mask, torch.ones(2, step + 1)], 1).long()

            def decode(token=token, pos=pos, full=full):
                return model(token, attention_mask=full, cache=cache, position_ids=pos).logits

            if step < 2:  # warm-up: the interpreter, the step's buffers, the merger
                logits = decode()
            else:
                reads.reads, reads.copies = [], 0
                reads.on = mask is None  # unpadded: the whole forward; padded: the spans
                made, spans, logits = allocations_in_spans(decode, SPAN)
                reads.on = False
                assert (spans, made) == (2 * LAYERS, 0)  # every layer's update and attention
                assert reads.reads == []
                assert reads.copies == (0 if world().size == 1 else 2 * LAYERS)
            expected = eager(sequence, attention_mask=full).logits[:, -1:]
            assert_allclose(logits.numpy(), expected.numpy(), atol=2e-5, rtol=0)
            token = logits[:, -1:].argmax(-1)
            sequence = torch.cat([sequence, token], 1)


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_a_one_rank_step_keeps_its_records_on_the_device(triton_selected):  # noqa: F811
    """One rank: the cache has no merger; several: its own, not the communicator's shared one."""
    model, _ = models()
    ids, _ = prompt(5, False)
    cache = mtt.StaticShardedCache(max_cache_len=CAPACITY)
    decode_loop(model, cache, ids, 1)
    merger = cache.capacity.merger
    if world().size == 1:
        assert merger is None
    else:
        assert merger is not None and merger.records.shape == (2 * 4, 16 + 2)
        other = mtt.StaticShardedCache(max_cache_len=CAPACITY)
        decode_loop(model, other, ids, 1)
        assert other.capacity.merger is not merger


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_a_prompt_past_capacity_raises_on_every_rank(triton_selected):  # noqa: F811
    """A prompt longer than max_cache_len, and a decode step past it, raise on every rank;
    the cache stays as it was and decodes on after the failed step's prompt is cut."""
    model, _ = models()
    ids, _ = prompt(9, False)
    with torch.no_grad():
        cache = mtt.StaticShardedCache(max_cache_len=8)
        with pytest.raises(ValueError, match="max_cache_len=8"):
            model(ids, cache=cache)
        assert cache.get_seq_length() == 0
        cache = mtt.StaticShardedCache(max_cache_len=10)
        model(ids, cache=cache)
        model(ids[:, :1], cache=cache, position_ids=torch.full((2, 1), 9))  # the 10th token
        with pytest.raises(ValueError, match="max_cache_len=10"):
            model(ids[:, :1], cache=cache, position_ids=torch.full((2, 1), 10))
        assert cache.get_seq_length() == 10
        cache.crop(-1)
        again = model(ids[:, :1], cache=cache, position_ids=torch.full((2, 1), 9)).logits
        assert bool(torch.isfinite(again).all())


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_a_bad_capacity_raises_on_every_rank():
    """max_cache_len not a positive int on one rank, or different on some: every rank raises."""
    comm = world()
    with pytest.raises(ValueError, match="max_cache_len"):
        mtt.StaticShardedCache(max_cache_len=0)
    bad = "16" if comm.rank == comm.size - 1 else 16
    with pytest.raises(ValueError, match=r"max_cache_len|rank"):
        mtt.StaticShardedCache(max_cache_len=bad)
    if comm.size > 1:
        with pytest.raises(ValueError, match="disagree on max_cache_len"):
            mtt.StaticShardedCache(max_cache_len=16 + comm.rank)
    with pytest.raises(ValueError, match="invariant"):
        mtt.StaticShardedCache(max_cache_len=16, deterministic="invariant")
    assert mtt.StaticShardedCache(max_cache_len=np.int64(16)).max_cache_len == 16  # an integer


MESSAGE = "mpitree's attention has no backward"


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_backward_through_a_static_decode_step_raises(triton_selected):  # noqa: F811
    """A decode step under grad mode (the device path) ties its output to a backward that
    raises, as every mpitree attention does: gradients never silently vanish."""
    model = tiny_llama()
    model.set_attn_implementation("mpitree")
    ids, _ = prompt(6, False)
    cache = mtt.StaticShardedCache(model.config, max_cache_len=16)
    with torch.no_grad():
        token = model(ids, cache=cache).logits[:, -1:].argmax(-1)
        plain = model(token, cache=copy.deepcopy(cache), position_ids=torch.full((2, 1), 6))
    logits = model(token, cache=cache, position_ids=torch.full((2, 1), 6)).logits
    assert cache.capacity.facts is not None  # the step took the device path
    assert torch.equal(logits.detach(), plain.logits)
    with pytest.raises(RuntimeError, match=MESSAGE):
        logits.sum().backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is None


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_a_later_layers_other_scaling_raises_on_every_rank(triton_selected):  # noqa: F811
    """A decode step's later layer with another scaling than its first layer's raises on
    every rank (as a ShardedCache's does), never attends with the first layer's."""
    g = torch.Generator().manual_seed(0)
    cache = mtt.StaticShardedCache(max_cache_len=16, block_size=2)
    for layer in (0, 1):
        k = torch.randn(2, 2, 6, 16, generator=g)
        keys, values = cache.update(k, k, layer)
        mtt.attention_interface(None, torch.randn(2, 4, 6, 16, generator=g), keys, values, None)
    q = torch.randn(2, 4, 1, 16, generator=g)
    k = torch.randn(2, 2, 1, 16, generator=g)
    keys, values = cache.update(k, k, 0)
    mtt.attention_interface(None, q, keys, values, None)
    assert cache.capacity.facts is not None  # the step took the device path
    keys, values = cache.update(k, k, 1)
    with pytest.raises((ValueError, RankError), match=r"scaling|rank"):
        mtt.attention_interface(None, q, keys, values, None, scaling=0.5)


@pytest.mark.parametrize("strategy", ["nccl", "device-node", "ring"])
def test_a_static_step_refuses_strategies_that_do_not_merge_host_records(strategy):
    """Its merger's records are host memory (pinned on CUDA): a strategy that merges device
    buffers only, or moves K/V, is refused in the step's checks (so on every rank)."""
    cache = mtt.StaticShardedCache(max_cache_len=16)
    cache.sharding.strategy = strategy
    q, k = torch.zeros(1, 4, 1, 8), torch.zeros(1, 2, 3, 8)
    with pytest.raises(ValueError, match=strategy):
        _static_step._checked(q, k, k, None, None, cache.sharding)


@pytest.mark.parallel(nprocs=[2, 3])
def test_one_ranks_bad_step_raises_on_every_rank(triton_selected):  # noqa: F811
    """A decode step whose query differs on one rank raises on every rank, none hangs."""
    model, _ = models()
    ids, _ = prompt(5, False)
    cache = mtt.StaticShardedCache(max_cache_len=CAPACITY)
    decode_loop(model, cache, ids, 1)
    layer = cache.layers[0]
    k = torch.zeros(2, 2, 1, 16)
    keys, values = cache.update(k, k, 0)
    comm = world()
    q = torch.zeros(2, 4 if comm.rank else 2, 1, 16)
    with pytest.raises((ValueError, RankError)):
        mtt.attention_interface(None, q, keys, values, None)
    assert layer.length == 6  # rolled back to where it was


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_a_padding_mask_short_of_the_capacity_raises_on_every_rank(triton_selected):  # noqa: F811
    """The padding is gathered over the whole capacity: one that covers less is refused."""
    model, _ = models()
    ids, _ = prompt(5, False)
    cache = mtt.StaticShardedCache(max_cache_len=CAPACITY)
    decode_loop(model, cache, ids, 1)
    k = torch.zeros(2, 2, 1, 16)
    q = torch.zeros(2, 4, 1, 16)
    for cover, fails in ((CAPACITY - 1, True), (CAPACITY, False)):
        keys, values = cache.update(k, k, 0)
        padding = torch.ones(2, cover, dtype=torch.bool)
        mask = mtt.ShardMask(causal_mask_function, 2, False, padding=padding)
        if fails:
            with pytest.raises(ValueError, match=f"max_cache_len={CAPACITY}"):
                mtt.attention_interface(None, q, keys, values, mask)
            assert cache.get_seq_length() == 6
        else:
            out, _ = mtt.attention_interface(None, q, keys, values, mask)
            assert out.shape == (2, 1, 4, 16) and bool(torch.isfinite(out).all())


def capture_setup(device, dtype):
    """The tiny model on ``device``, a prefilled static cache and one token's input buffers."""
    model, eager = models()
    model, eager = model.to(device, dtype), eager.to(device, dtype)
    ids, _ = prompt(9, False, batch=1)
    ids = ids.to(device)
    cache = mtt.StaticShardedCache(model.config, max_cache_len=32)
    with torch.no_grad():
        token = model(ids, cache=cache).logits[:, -1:].argmax(-1)
    pos = torch.full((1, 1), ids.shape[1], device=device)
    return model, eager, ids, cache, token, pos


def allocations():
    """The CUDA caching allocator's count of allocations so far."""
    return torch.cuda.memory_stats()["allocation.all.allocated"]


@pytest.mark.cuda
@pytest.mark.parallel(nprocs=[1])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_cuda_graph_replays_a_decode_forward(dtype_name, triton_selected):  # noqa: F811
    """One rank: the model's decode forward captured once, replayed token after token: eager
    attention's logits at every step, and no device allocation in a replay."""
    dtype = getattr(torch, dtype_name)
    tol = 2e-5 if dtype == torch.float32 else 5e-2
    model, eager, ids, cache, token, pos = capture_setup("cuda", dtype)
    sequence = torch.cat([ids, token], 1)
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: Triton compiles, the step's buffers are made
            logits = model(token, cache=cache, position_ids=pos).logits
        torch.cuda.current_stream().wait_stream(side)
        token = logits[:, -1:].argmax(-1)
        sequence = torch.cat([sequence, token], 1)
        pos += 1
        held = cache.get_seq_length()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = model(token, cache=cache, position_ids=pos).logits
        assert cache.get_seq_length() == held  # capturing ran nothing on the device
        for _ in range(5):
            torch.cuda.synchronize()
            before = allocations()
            graph.replay()
            torch.cuda.synchronize()
            assert allocations() == before
            expected = eager(sequence).logits[:, -1:]
            assert_allclose(
                logits.float().cpu().numpy(), expected.float().cpu().numpy(), atol=tol, rtol=0
            )
            token.copy_(logits[:, -1:].argmax(-1))  # the next replay's input, in place
            sequence = torch.cat([sequence, token], 1)
            pos += 1
    assert int(cache.layers[0].counters[0]) == held + 5  # the device's length: every replay
    assert cache.get_seq_length() == held  # the host's: eager steps only


@pytest.mark.cuda
@pytest.mark.parallel(nprocs=[2, 3])
def test_cuda_graph_refuses_a_decode_forward_across_ranks(triton_selected):  # noqa: F811
    """Several ranks: capturing a decode forward raises on every rank; eager steps go on."""
    model, eager, ids, cache, token, pos = capture_setup("cuda", torch.float32)
    with torch.no_grad():
        model(token, cache=cache, position_ids=pos)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="CUDA graph"):
            with torch.cuda.graph(graph):
                model(token, cache=cache, position_ids=pos + 1)
        torch.cuda.synchronize()
        assert cache.get_seq_length() == ids.shape[1] + 1  # the refused step stored nothing
        logits = model(token, cache=cache, position_ids=pos + 1).logits
        expected = eager(torch.cat([ids, token, token], 1)).logits[:, -1:]
    assert_allclose(logits.cpu().numpy(), expected.cpu().numpy(), atol=2e-5, rtol=0)
