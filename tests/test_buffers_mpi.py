"""Buffer kinds (mpitree._buffers): a merger's records in host, pinned or device memory.

No GPU here: tests/device_merge.py's kind keeps records in a CPU torch tensor,
standing in for device memory, and its strategy (one file, ``buffers =
("device",)``) merges them without treating them as numpy. Registered, the
strategy is listed, resolved and run by ``tree_decode`` like any other, exact
against the float64 reference; a call no kind serves is an error on every rank,
agreed before any merge.
"""

import numpy as np
import pytest
import torch
from device_merge import DeviceGather, DeviceTensor
from helpers import atol, gathered_identical, make_problem, world
from numpy.testing import assert_allclose

import mpitree
from mpitree import _buffers, _merger
from mpitree._guard import RankError
from mpitree._registry import REGISTRY
from mpitree._strategies import register, resolve

CASES = {
    "plain": {},
    "kv_len": dict(kv_len=True),
    "positions": dict(positions=True, q_len=3),
    "mask": dict(mask="head", q_len=2),
    "float64": dict(dtype=np.float64),
}


@pytest.fixture
def device_strategy():
    """The stand-in kind and strategy registered (as their module's import would), then removed."""
    kinds = list(_buffers.KINDS["device"])
    register_kind = _buffers.register_kind
    register_kind(DeviceTensor)
    register(DeviceGather)
    try:
        yield DeviceGather
    finally:
        REGISTRY.pop(DeviceGather.name, None)
        _buffers.KINDS["device"][:] = kinds


def test_kinds_of_the_core_and_their_choice():
    """The core registers host memory (and CuPy's pinned); a merger takes the nearest kind."""
    assert [k.__name__ for k in _buffers.KINDS["host"]] == ["Host"]
    host = _buffers.kind_for(("host", "pinned"), None)((3, 4), "float32")
    assert host.buf is host.host and host.buf.shape == (3, 4) and host.buf.dtype == np.float32
    assert host.to_host() is host.buf and host.address() == host.buf.ctypes.data
    assert _buffers.kind_for(("host", "pinned"), torch.zeros(1)) is _buffers.Host  # CPU tensor
    assert _buffers.kind_for(("device",), np.zeros(1)) is None
    with pytest.raises(ValueError, match="name is one of"):
        _buffers.register_kind(type("Disk", (_buffers.BufferKind,), {"name": "disk"}))
    with pytest.raises(ValueError, match="bools"):
        bad = {"name": "device", "host_memory": 1}
        _buffers.register_kind(type("Bad", (_buffers.BufferKind,), bad))
    # no device kind of the core's: only an adapter's (torch's, for CUDA tensors)
    assert all(k.__module__.startswith("mpitree.adapters.") for k in _buffers.KINDS["device"])
    again = type("CupyPinned", (_buffers.CupyPinned,), {"__module__": "mpitree._buffers"})
    pinned = list(_buffers.KINDS["pinned"])
    try:  # a module imported again registers its kind again: it replaces the one before
        _buffers.register_kind(again)
        assert (
            _buffers.KINDS["pinned"][0] is again
            and _buffers.CupyPinned not in _buffers.KINDS["pinned"]
        )
        assert len(_buffers.KINDS["pinned"]) == len(pinned)
    finally:
        _buffers.KINDS["pinned"][:] = pinned


def test_listed_and_resolved(device_strategy):
    """Registered, the one-file strategy is in every list and resolves to itself."""
    assert "devgather" in mpitree.STRATEGIES
    assert resolve("devgather", world(), True) == "devgather"
    assert _buffers.kind_for(device_strategy.buffers, torch.zeros(1)) is DeviceTensor


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_device_strategy_decodes_exactly(device_strategy, case):
    """tree_decode over torch tensors runs it in the device kind: the reference's result."""
    comm = world()
    p = comm.size
    sizes = [5 + 3 * r for r in range(p)]
    prob = make_problem(list(CASES).index(case), sizes, **CASES[case])
    k, v, extra = prob.shard(comm.rank)
    extra = {key: None if x is None else torch.from_numpy(x) for key, x in extra.items()}
    q, k, v = (torch.from_numpy(x) for x in (prob.q, k, v))
    for _ in range(2):  # the second call reuses the merger: its buffers allocated once
        out, lse = mpitree.tree_decode(q, k, v, strategy="devgather", return_lse=True, **extra)
        merger = DeviceGather.built[-1].merger
        assert isinstance(merger.kind, DeviceTensor) and isinstance(merger.buf, torch.Tensor)
        assert merger.kind.host is not merger.buf
    assert len({id(s) for s in DeviceGather.built if s.merger is merger}) == 1
    assert isinstance(out, torch.Tensor) and out.dtype == q.dtype
    out, lse = out.numpy(), lse.numpy()
    ref_out, ref_lse = prob.reference()
    dtype = prob.q.dtype
    assert_allclose(out.astype(np.float64), ref_out, atol=atol(dtype), rtol=0)
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), empty)
    assert_allclose(lse[~empty], ref_lse[~empty], rtol=2e-6, atol=max(atol(dtype), 2e-6))
    assert gathered_identical(comm, out) and gathered_identical(comm, lse)


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_a_call_no_kind_serves_raises_on_every_rank(device_strategy):
    """numpy arrays (host records), or a kind missing on the last rank: agreed errors, no hang."""
    comm = world()
    prob = make_problem(0, [4] * comm.size)
    k, v, _ = prob.shard(comm.rank)
    says = "strategy 'devgather' merges in device buffers, and no buffer kind"
    with pytest.raises(ValueError, match=says):
        mpitree.tree_decode(prob.q, k, v, strategy="devgather")
    state = mpitree.local_state(prob.q, k, v)
    with pytest.raises(ValueError, match=says):
        mpitree.allreduce_state(state, strategy="devgather")
    last = comm.rank == comm.size - 1
    if last:
        _buffers.KINDS["device"].remove(DeviceTensor)
    q, k, v = (torch.from_numpy(x) for x in (prob.q, k, v))
    with pytest.raises((ValueError, RankError)) as info:
        mpitree.tree_decode(q, k, v, strategy="devgather")
    assert info.type is (ValueError if last else RankError), info.value
    assert "no buffer kind" in str(info.value)
    # the same call with a kind everywhere runs (nothing was left half-built)
    if last:
        _buffers.register_kind(DeviceTensor)
    out = mpitree.tree_decode(q, k, v, strategy="devgather")
    assert_allclose(out.numpy().astype(np.float64), prob.reference()[0], atol=atol(np.float32))


def test_merger_repr_and_bind_refused_outside_host_memory(device_strategy):
    """A merger names its kind; a compiled layer step binds only to float32 host memory."""
    merger = _merger.Merger(world(), 2, 8, "float32", "devgather", like=torch.zeros(1))
    try:
        assert repr(merger) == "Merger('devgather', rows=2, D=8, float32, device)"
        assert merger.bind_layer(object()) is False
    finally:
        merger.free()
