"""The transformers decode layer's allocations per step (issue 50, item 3).

CPU tensors stand in for CUDA ones: under ``MPITREE_KERNEL=triton`` with the torch
adapter told that CPU tensors do not share the host (its CUDA path: the records'
device twin, their copies down to the host and up again), a decode step of a tiny
Llama over a :class:`ShardedCache` runs the layer as it runs on a GPU, under Triton's
interpreter. torch's profiler counts the allocations made inside the cache's updates.
What still keeps the layer out of a CUDA graph is in
docs/frameworks.md ("A step without allocation, and CUDA graphs").
"""

import mpitree.adapters.transformers as mtt
import numpy as np
import pytest
import torch
from helpers import allocations_in_spans
from models import prompt, tiny_llama
from mpitree.adapters import torch as adapter
from mpitree.adapters.transformers import _attention, _cache
from numpy.testing import assert_allclose
from test_triton_decode import triton_selected  # noqa: F401  (a fixture)

LAYERS = 2
SPAN = "mpitree cache update"  # the profiler's name for the cache's updates


@pytest.fixture
def layer_spans(monkeypatch):
    """Run every cache update inside a profiler span."""
    update = _cache.ShardedCache.update

    def spanned(*args, **kwargs):
        with torch.profiler.record_function(SPAN):
            return update(*args, **kwargs)

    monkeypatch.setattr(_cache.ShardedCache, "update", spanned)


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_a_decode_steps_cache_updates_allocate_nothing(
    triton_selected,  # noqa: F811
    layer_spans,
    monkeypatch,
):
    """After warm-up a decode step's cache updates allocate nothing (the step's token
    index is a view of a kept range); the merge's host records are written every step
    (the layer's merger is shared with every call on the communicator: it is never
    marked merged alone). The logits are eager attention's at every step and rank count."""
    monkeypatch.setattr(adapter, "shares_host", lambda device: False)  # the CUDA path,
    monkeypatch.setattr(_attention, "_bind", lambda *args: None)  # where no host kernel binds
    model = tiny_llama(LAYERS)
    model.set_attn_implementation("mpitree")
    eager = tiny_llama(LAYERS)
    eager.set_attn_implementation("eager")
    ids, _ = prompt(9, False, batch=1)
    cache = mtt.ShardedCache(model.config)
    with torch.no_grad():
        token = model(ids, cache=cache).logits[:, -1:].argmax(-1)
        sequence = torch.cat([ids, token], 1)
        for step in range(4):
            pos = sequence.shape[1] - 1

            def decode(token=token, pos=pos):
                return model(token, cache=cache, position_ids=torch.tensor([[pos]])).logits

            if step < 2:  # warm-up: Triton's interpreter, the workspace, the merger
                logits = decode()
            else:
                records = cache.sharding.step.merger.records
                records[...] = 7.0
                made, spans, logits = allocations_in_spans(decode, SPAN)
                assert spans == LAYERS and made == 0  # every layer's update, allocating nothing
                assert not np.all(records == 7.0)
            expected = eager(sequence).logits[:, -1:]
            assert_allclose(logits.numpy(), expected.numpy(), atol=2e-5, rtol=0)
            token = logits[:, -1:].argmax(-1)
            sequence = torch.cat([sequence, token], 1)
    assert triton_selected["records"] > 0  # the layer's records came from the Triton kernel


def test_a_split_models_devices_each_keep_their_token_range(monkeypatch):
    """A model split over devices (its layers alternating between two here: "cpu" and
    "meta") gets every step's token index as a view of its own device's kept range: no
    range is made again at a device crossing, and each view is on its layer's device."""
    from mpi4py import MPI

    made = []
    arange = torch.arange

    def counted(*args, **kwargs):
        made.append(kwargs["device"])
        return arange(*args, **kwargs)

    monkeypatch.setattr(torch, "arange", counted)
    sharding = _cache.Sharding(MPI.COMM_SELF, "last", 1, "auto", False)
    devices = (torch.device("cpu"), torch.device("meta"))
    for idx in range(10, 300):
        for layer in range(4):
            device = devices[layer // 2]
            token = sharding.token(idx, device)
            assert token.device == device and token.shape == (1,)
            if device.type == "cpu":
                assert int(token) == idx
    # one range per device, and one more each when the index outgrew 256: 4 in all
    assert sorted(d.type for d in made) == ["cpu", "cpu", "meta", "meta"]
