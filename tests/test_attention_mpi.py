"""A decode layer's one compiled call (``_attention._bound_step``), guarded or in its lane.

Once a layer's checked step has succeeded, later steps that repeat its layout run
the bound kernel, the merge and the output in one compiled call (or, where the
merge is not one persistent all-reduce, the kernel inside the merge, then the
output). A step's later layers take it in the entry point's lane, before the
guard. These tests hold that path to the checked one bit for bit, and to its
guarantees: a rank that diverges raises on every rank, NaN stays NaN, copies and
crops stay exact, MPI finalized raises.
"""

import copy

import mpitree.adapters.transformers as mtt
import pytest
import torch
from helpers import counting, world
from models import greedy, prompt, tiny_llama
from mpitree.adapters.transformers import _attention

from mpitree import RankError, _guard, _library, _merger, _steps, extend
from mpitree._strategies import allreduce

NEW_TOKENS = 8


def unfused(monkeypatch):
    """Make bound layers run the kernel inside the merge, then the output: not one call."""
    monkeypatch.setattr(_merger.Merger, "bind_layer", lambda self, bound: False)


def decode(model, ids, mask, cache, steps):
    """Greedy ``generate`` of ``steps`` tokens from a cache holding the prompt but its last token.

    Returns the tokens and the per-step logits ``(B, steps, vocab)``. Without a mask,
    every token is real (generate would take a generated pad id for padding).
    """
    out = greedy(model, ids, torch.ones_like(ids) if mask is None else mask, cache, steps)
    return out.sequences, torch.stack(out.logits, 1)


def decoding(layers, comm=None):
    """A tiny Llama and its cache after two decode steps: every layer bound.

    Returns the model, the cache and the tokens so far (the cache holds all but the last).
    """
    model = tiny_llama(layers=layers)
    model.set_attn_implementation("mpitree")
    ids, _ = prompt(17, False)
    cache = prefilled(model, ids, None, "interleave", comm)
    tokens, _ = decode(model, ids, None, cache, 2)
    return model, cache, tokens


def prefilled(model, ids, mask, placement, comm=None):
    cache = mtt.ShardedCache(model.config, placement=placement, block_size=2, comm=comm)
    mtt.prefill(model, ids[:, :-1], cache, attention_mask=None if mask is None else mask[:, :-1])
    return cache


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize(
    "placement, padded, fused",
    [(p, padded, True) for p in mtt.PLACEMENTS for padded in (False, True)]
    + [(mtt.PLACEMENTS[0], True, False)],
    ids=lambda x: {False: "no", True: "yes"}.get(x, x) if isinstance(x, bool) else x,
)
def test_one_call_path_gives_the_checked_paths_bits(monkeypatch, placement, padded, fused):
    """Same logits, bit for bit, with and without the one-call path; tokens as eager's.

    Left padding gives the decode steps a visibility the kernel reads (on the ranks
    holding padded keys). The one-call path runs the whole step in one compiled call
    where the merge is one persistent all-reduce (MPICH; or one rank), and the kernel
    inside the merge, then the output, otherwise: both are held to the checked path.
    """
    model = tiny_llama(layers=3)
    ids, mask = prompt(21, padded)
    model.set_attn_implementation("eager")
    ref = greedy(model, ids, mask, None, NEW_TOKENS)
    model.set_attn_implementation("mpitree")
    runs = counting(monkeypatch)
    if not fused:
        unfused(monkeypatch)
    cache = prefilled(model, ids, mask, placement)
    tokens, logits = decode(model, ids, mask, cache, NEW_TOKENS)
    assert len(runs) >= (NEW_TOKENS - 1) * 3, len(runs)  # each layer after its checked step
    one_call = fused and (world().size == 1 or allreduce._PERSISTENT_OK)  # Open MPI: blocking
    assert set(runs) == {2 if one_call else 1}, set(runs)
    assert torch.equal(tokens, ref.sequences)
    with monkeypatch.context() as checked:
        checked.setattr(_attention, "_bound_step", lambda *a, **k: None)
        again = prefilled(model, ids, mask, placement)
        tokens2, logits2 = decode(model, ids, mask, again, NEW_TOKENS)
    assert torch.equal(tokens2, tokens) and torch.equal(logits2, logits)


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_copied_and_cropped_caches_decode_as_the_original(monkeypatch):
    """A deepcopy starts unbound (its buffers are others); a crop keeps the binding, exactly."""
    model = tiny_llama()
    model.set_attn_implementation("mpitree")
    ids, _ = prompt(17, False)
    cache = prefilled(model, ids, None, "interleave")
    tokens, _ = decode(model, ids, None, cache, 3)  # the cache holds all but the last token
    assert all(layer.fast is not None for layer in cache.layers)
    twin = copy.deepcopy(cache)
    assert all(layer.fast is None for layer in twin.layers)
    _, a = decode(model, tokens, None, cache, 3)
    _, b = decode(model, tokens, None, twin, 3)
    assert torch.equal(a, b)
    cache.crop(-3)  # back to `tokens` but its last: the next steps overwrite the dropped room
    runs = counting(monkeypatch, cache)
    _, c = decode(model, tokens, None, cache, 3)
    assert torch.equal(c, a) and runs


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_the_step_through_ctypes_gives_the_cpython_entrys_bits(monkeypatch):
    """Where ``mpitree._native_call`` was not built, the bound step goes through ctypes."""
    if _library._native_call is None:
        pytest.fail("mpitree._native_call was not built: the suite must run its path")
    model = tiny_llama(layers=2)
    model.set_attn_implementation("mpitree")
    ids, _ = prompt(17, False)
    outs = {}
    for way in ("cpython", "ctypes"):
        with monkeypatch.context() as patch:
            if way == "ctypes":
                patch.setattr(_library, "_native_call", None)
            cache = prefilled(model, ids, None, "interleave")
            runs = counting(patch, cache)
            _, outs[way] = decode(model, ids, None, cache, 4)
        steps = [layer.fast.bound.run for layer in cache.layers]  # counting's wrappers undone
        assert runs and all(
            (step.func is _library._native_call) == (way == "cpython") for step in steps
        ), (way, steps)
    assert torch.equal(outs["cpython"], outs["ctypes"])


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_decode_steps_build_nothing_and_share_one_merger(monkeypatch):
    """After the first steps, no merger and no binding is built; one merger serves every layer."""
    model, cache, tokens = decoding(3)
    mergers = {id(layer.fast.merger) for layer in cache.layers}
    buffers = [layer.fast.merger.records.ctypes.data for layer in cache.layers]
    built = []
    for cls in (_merger.Merger, _steps.Bound):
        real = cls.__init__
        monkeypatch.setattr(cls, "__init__", lambda *a, real=real: built.append(a) or real(*a))
    runs = counting(monkeypatch, cache)
    decode(model, tokens, None, cache, 4)
    assert not built and len(runs) == 4 * 3, (built, len(runs))  # one call per layer and step
    assert len(mergers) == 1 and {id(layer.fast.merger) for layer in cache.layers} == mergers
    assert [layer.fast.merger.records.ctypes.data for layer in cache.layers] == buffers


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_a_steps_later_layers_run_in_the_lane_past_the_guard(monkeypatch):
    """Bound in one compiled call, a step's later layers run in the entry point's lane:
    only its first layer enters the guard. Otherwise (Open MPI's blocking all-reduce at
    p > 1) every layer does, with the same bits either way."""
    model, cache, tokens = decoding(3)
    twin = copy.deepcopy(cache)
    entered, real = [], _guard.check_mpi_usable
    with monkeypatch.context() as patch:
        patch.setattr(_guard, "check_mpi_usable", lambda: entered.append(1) or real())
        runs = counting(patch, cache)
        _, got = decode(model, tokens, None, cache, 4)
    one_call = world().size == 1 or allreduce._PERSISTENT_OK
    assert all(layer.fast.fused == one_call for layer in cache.layers)
    assert len(runs) == 4 * 3 and len(entered) == (4 if one_call else 4 * 3), (runs, entered)
    monkeypatch.setattr(_attention, "_bound_step", lambda *a, **k: None)  # the checked path
    _, want = decode(model, tokens, None, twin, 4)
    assert torch.equal(got, want)


STEPS = 6  # one token a step, blocks of 2: at p = 3 the last rank's keys start at step 4


def by_hand(
    q_of,
    scaling_of=lambda step, layer: None,
    mask_of=lambda step: None,
    nan_at=None,
    kw_of=lambda step, layer: {},
):
    """Model steps by hand over two layers; return the outputs and the new values.

    ``q_of(step, layer)`` is the query, ``mask_of(step)`` the step's mask (every
    layer's), ``nan_at`` the step whose new key of kv head 0 is NaN, ``kw_of(step,
    layer)`` the call's further keyword arguments.
    """
    torch.manual_seed(0)
    cache = mtt.ShardedCache(tiny_llama().config, block_size=2)
    outs, values_in = [], []
    for step in range(STEPS):
        mask = mask_of(step)
        for layer in range(2):
            k, v = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)
            if step == nan_at:
                k[0, 0, 0, 5] = float("nan")
            keys, values = cache.update(k, v, layer)
            with torch.no_grad():
                out, _ = mtt.attention_interface(
                    None,
                    q_of(step, layer),
                    keys,
                    values,
                    mask,
                    scaling_of(step, layer),
                    **kw_of(step, layer),
                )
            outs.append(out)
            values_in.append(v)
    return outs, values_in


@pytest.mark.parallel(nprocs=[2, 3])
def test_the_one_call_path_leaves_a_prompt_to_the_checked_path(monkeypatch):
    """Rows over more scores than attend's budget run in blocks there, whose bits differ.

    Three new tokens a step over two MHA layers, the budget cut to a few keys' scores:
    the ranks that hold no new key see every key (their one call applies) until
    the rows become a prompt (``mpitree._step.KernelSlot.prompt``), from then on they take
    the checked path. Outputs equal the checked path's, bit for bit, throughout.
    """
    from mpitree import _local

    monkeypatch.setattr(_local, "BLOCK_SCORES", 2 * 14)  # B * Hq * 14 keys: 3 rows a block
    q = torch.randn(1, 2, 3, 16, generator=torch.Generator().manual_seed(2))
    runs = counting(monkeypatch)

    def steps():
        torch.manual_seed(0)
        cache, outs = mtt.ShardedCache(tiny_llama().config, block_size=4), []
        for _ in range(STEPS):
            for layer in range(2):
                k, v = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16)
                keys, values = cache.update(k, v, layer)
                with torch.no_grad():
                    outs.append(mtt.attention_interface(None, q, keys, values, None)[0])
        return outs

    fast = steps()
    ran = len(runs)
    with monkeypatch.context() as checked:
        checked.setattr(_attention, "_bound_step", lambda *a, **k: None)
        slow = steps()
    assert all(torch.equal(a, b) for a, b in zip(fast, slow, strict=True))
    counts = world().allgather(ran)
    assert max(counts) > 0, counts  # some rank ran its one call before its rows grew a prompt


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize("change", ["scaling", "query shape"])
def test_a_later_layer_diverging_on_one_rank_raises_on_every_rank(monkeypatch, change):
    """The bound ranks run their one call into the merge; the odd rank's checks fail there.

    Under MPICH the bound ranks' whole step is one compiled call: its flag carries
    the odd rank's failure out of the all-reduce it starts itself.
    """
    comm = world()
    runs = counting(monkeypatch)
    q = torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(1))
    bad = comm.rank == comm.size - 1

    def odd(step, layer):
        return bad and step == STEPS - 1 and layer == 1

    def q_of(step, layer):
        return q[:, :2] if change == "query shape" and odd(step, layer) else q

    def scaling_of(step, layer):
        return 0.5 if change == "scaling" and odd(step, layer) else None

    with pytest.raises(ValueError) as info:
        by_hand(q_of, scaling_of)[0]
    if not bad:
        assert isinstance(info.value, RankError)
        assert runs and set(runs) == {2 if allreduce._PERSISTENT_OK else 1}, runs
    assert "differs from the step's first layer" in str(info.value)


@pytest.mark.parallel(nprocs=[1, 2])
@pytest.mark.parametrize(
    "extra",
    [{"dropout": False}, {"dropout": 0, "softcap": None, "is_causal": True}],
    ids=["bool dropout", "keywords outside the lane's"],
)
def test_arguments_the_lane_leaves_run_guarded_with_the_same_bits(monkeypatch, extra):
    """Later layers whose arguments the lane does not take enter the guard, and agree.

    A dropout that is a bool, or keywords beyond those the lane takes (here ones the
    guarded call accepts), make every layer enter the guard; outputs equal the
    lane's, bit for bit.
    """
    q = torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(1))
    lanes, real = [], _attention._bound_step

    def bound_step(*args, **kwargs):
        out = real(*args, **kwargs)
        lanes.append(kwargs.get("lane") and out is not None)  # ran the bound step in the lane
        return out

    monkeypatch.setattr(_attention, "_bound_step", bound_step)
    outs, ran = {}, {}
    for name, kw in (("lane", {}), ("guarded", extra)):
        lanes.clear()
        outs[name] = by_hand(lambda step, layer: q, kw_of=lambda step, layer, kw=kw: kw)[0]
        ran[name] = lanes.count(True)
    one_call = world().size == 1 or allreduce._PERSISTENT_OK
    assert ran["guarded"] == 0 and (ran["lane"] > 0) == one_call, ran
    assert all(torch.equal(a, b) for a, b in zip(outs["lane"], outs["guarded"], strict=True))


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize(
    "kw, message",
    [
        ({"dropout": 0.5}, "dropout must be 0"),
        ({"sliding_window": 4}, "needs a mask for sliding_window"),
        ({"softcap": 30.0}, "has no softcap"),
    ],
    ids=["dropout", "sliding window, no mask", "softcap"],
)
def test_a_later_layer_the_lane_refuses_raises_on_every_rank(kw, message):
    """A later layer's argument that the attention refuses raises there, on every rank."""
    q = torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(1))

    def kw_of(step, layer):
        return kw if step == STEPS - 1 and layer == 1 else {}

    with pytest.raises(ValueError, match=message):
        by_hand(lambda step, layer: q, kw_of=kw_of)


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_nan_in_the_query_stays_nan_on_the_one_call_path(monkeypatch):
    """A NaN query row gives a NaN output row (never a number); other rows are untouched."""
    q = torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(1))
    nan = q.clone()
    nan[0, 1, 0, 3] = float("nan")

    def q_of(step, layer):
        return nan if step == STEPS - 1 and layer == 1 else q

    runs = counting(monkeypatch)
    out = by_hand(q_of)[0][-1]  # (B, Sq, Hq, D)
    assert runs
    assert torch.isnan(out[0, 0, 1]).all() and torch.isfinite(out[0, 0, [0, 2, 3]]).all()
    monkeypatch.setattr(_attention, "_bound_step", lambda *a, **k: None)
    checked = by_hand(q_of)[0][-1]
    torch.testing.assert_close(out, checked, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parallel(nprocs=[1, 2])
def test_a_query_with_the_negative_bit_is_read_by_its_values():
    """A later layer's query viewed with torch's negative bit (negated lazily) leaves the
    bound step to the checked path, which reads its values: the plain query's bits."""
    q = torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(1))
    lazy = torch._neg_view(-q)
    assert lazy.is_neg() and torch.equal(lazy, q)
    want, _ = by_hand(lambda step, layer: q)
    got, _ = by_hand(lambda step, layer: lazy if layer == 1 else q)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_a_nan_key_poisons_its_heads_on_every_rank_on_the_one_call_path(monkeypatch):
    """A NaN in one visible key of kv head 0: its query heads NaN on every rank, others not."""
    q = torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(1))
    runs = counting(monkeypatch)
    outs, _ = by_hand(lambda step, layer: q, nan_at=1)
    assert runs
    for out in outs[2:]:  # (B, Sq, Hq, D): heads 0 and 1 read kv head 0
        assert torch.isnan(out[0, 0, :2]).all() and torch.isfinite(out[0, 0, 2:]).all()
    monkeypatch.setattr(_attention, "_bound_step", lambda *a, **k: None)
    checked, _ = by_hand(lambda step, layer: q, nan_at=1)
    for a, b in zip(outs, checked, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_a_bound_shard_whose_every_key_is_masked_adds_nothing(monkeypatch):
    """A mask showing only the step's own token: elsewhere ``m = -inf``, no NaN, output = v."""
    q = torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(1))

    def newest_only(step):
        mask = torch.zeros(1, 1, 1, step + 1, dtype=torch.bool)
        mask[..., step] = True
        return mask

    runs = counting(monkeypatch)
    outs, values = by_hand(lambda step, layer: q, mask_of=newest_only)
    assert len(runs) >= 2, len(runs)  # the last step on every rank (p = 3: rank 2 from step 5)
    for out, v in zip(outs, values, strict=True):
        assert torch.equal(out[0, 0], v[0, :, 0].repeat_interleave(2, 0))


def poison(x, index):
    """Write NaN, +Inf and -Inf in turn into ``x[:, :, index]`` (``index``: key slots)."""
    junk = torch.tensor([float("nan"), float("inf"), float("-inf")])
    shape = (*x.shape[:2], len(index), x.shape[3])
    x[:, :, index] = junk[torch.arange(torch.Size(shape).numel()) % 3].reshape(shape)


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("placement", mtt.PLACEMENTS)
def test_garbage_in_spare_room_and_padding_keys_contributes_nothing(monkeypatch, placement):
    """NaN/Inf in the buffers' spare room and in row 1's padding keys: the same bits.

    Row 1 is left-padded by 5: its padding keys are hidden by the step's visibility,
    which the bound kernel reads on the ranks that hold them.
    """
    model = tiny_llama()
    model.set_attn_implementation("mpitree")
    ids, mask = prompt(21, True)
    clean = prefilled(model, ids, mask, placement)
    tokens, _ = decode(model, ids, mask, clean, 2)  # the cache holds all but the last token
    mask = torch.cat([mask, torch.ones_like(tokens[:, ids.shape[1] :])], 1)
    dirty = copy.deepcopy(clean)  # unbound: its first step binds it
    for layer in dirty.layers:
        keys, values = layer._buffers[:2]
        n = layer.keys.shape[2]
        for x in (keys, values):
            poison(x, torch.arange(n, x.shape[2]))
            poison(x[1:], (layer.positions < 5).nonzero()[:, 0])
    _, want = decode(model, tokens, mask, clean, 4)
    runs = counting(monkeypatch)
    _, got = decode(model, tokens, mask, dirty, 4)
    assert torch.isfinite(want).all() and torch.equal(got, want)
    assert len(runs) >= 3 * len(dirty.layers), len(runs)  # every layer after its checked step


@pytest.mark.parallel(nprocs=[1, 2])
def test_phase_times_splits_the_one_call_step_into_its_phases(monkeypatch):
    """Timed, a layer's one compiled call counts one merge, one kernel and one collective."""
    model, cache, tokens = decoding(3)
    runs = counting(monkeypatch, cache)
    with extend.phase_times() as times:
        decode(model, tokens, None, cache, 3)
    assert len(runs) == 3 * 3, runs
    for phase in ("merge", "kernel", "collective"):
        assert len(times[phase]) == len(runs), (phase, times[phase])
    pairs = zip(times["merge"], times["kernel"], times["collective"], strict=True)
    assert all(0 < kernel and 0 <= coll and kernel + coll <= merge for merge, kernel, coll in pairs)
    assert all(layer.fast.bound.struct.timed == 0 for layer in cache.layers)  # timers off again


@pytest.fixture
def private_comm():
    """A duplicate of the world, freed after: mergers a test breaks on purpose die with it
    (the ranks' tests share one process, and mergers are cached per communicator)."""
    comm = world().Dup()
    yield comm
    comm.Free()


@pytest.mark.parallel(nprocs=[1, 2])
def test_an_unbound_or_freed_merge_takes_the_general_path(monkeypatch, private_comm):
    """``merge_layer`` on a layer not bound to its merger, or after the merger was freed,
    runs the kernel inside the merge and then finishes: the same bits, no crash."""
    model, cache, tokens = decoding(2, private_comm)
    ref = copy.deepcopy(cache)
    more, _ = decode(model, tokens, None, ref, 2)  # a copy binds afresh, in a later call
    _, want = decode(model, more, None, ref, 3)
    with monkeypatch.context() as patch:  # as an adapter ignoring bind_layer's False would
        patch.setattr(_merger.Merger, "bind_layer", lambda self, bound: True)  # binds nothing
        twin = copy.deepcopy(cache)
        decode(model, tokens, None, twin, 2)
        runs = counting(patch)
        _, unbound = decode(model, more, None, twin, 3)
    assert torch.equal(unbound, want) and set(runs) == {1}, set(runs)
    for layer in twin.layers:
        assert layer.fast.fused and layer.fast.bound.merger is None
        assert layer.fast.bound.run(0) == 3  # unbound: nothing ran
    decode(model, tokens, None, cache, 2)
    for layer in cache.layers:
        layer.fast.merger.free()
    _, freed = decode(model, more, None, cache, 3)
    assert torch.equal(freed, want)


@pytest.mark.parallel(nprocs=[2])
def test_an_mpi_error_inside_the_one_call_step_raises_on_every_rank(private_comm):
    """MPI_Start failing inside the compiled step (its request freed behind mpitree's back)
    raises ``mpi4py.MPI.Exception``, as mpi4py's own call would: no crash, no hang.

    Under Open MPI the all-reduce is blocking: no layer takes the one call."""
    from mpi4py import MPI

    model, cache, tokens = decoding(2, private_comm)
    fused = [layer.fast.fused for layer in cache.layers]
    assert fused == [allreduce._PERSISTENT_OK] * len(fused), fused
    if not allreduce._PERSISTENT_OK:
        return
    cache.layers[0].fast.merger._impl._request.Free()  # the handle is now MPI_REQUEST_NULL
    with pytest.raises(MPI.Exception):
        decode(model, tokens, None, cache, 1)
