"""Gradients never silently vanish: a backward through mpitree's attention raises on every rank.

mpitree computes attention from host records merged across ranks, with no backward.
Torch inputs that require grad (grad mode on) get results tied to them by a node whose
backward raises a clear error; forward values are the same as under ``no_grad``.
Before, ``backward()`` succeeded and left the attention's inputs without their gradient
(``q_proj.weight.grad is None`` where eager attention gives one).
"""

import mpitree.adapters.torch as mtorch
import mpitree.adapters.transformers as mtt
import numpy as np
import pytest
import torch
from helpers import world
from models import prompt, tiny_llama

import mpitree

NPROCS = [1, 2, 3, 4]
MESSAGE = "mpitree's attention has no backward"


def shard(requires=("q",)):
    rng = np.random.default_rng(world().rank)
    q = torch.from_numpy(np.random.default_rng(0).standard_normal((1, 4, 1, 8)).astype(np.float32))
    k, v = (torch.from_numpy(rng.standard_normal((1, 2, 6, 8)).astype(np.float32)) for _ in "kv")
    for name, x in zip("qkv", (q, k, v), strict=True):
        x.requires_grad_(name in requires)
    return q, k, v


CALLS = {
    "tree_decode": lambda q, k, v: mpitree.tree_decode(q, k, v),
    "tree_decode lse": lambda q, k, v: mpitree.tree_decode(q, k, v, return_lse=True)[1],
    "torch adapter": lambda q, k, v: mtorch.tree_decode(q, k, v),
    "DecodePlan": lambda q, k, v: mpitree.DecodePlan(1, 4, 2, 8).decode(q, k, v),
    "invariant": lambda q, k, v: mpitree.tree_decode(
        q, k, v, deterministic="invariant", block_size=6, kv_start=6 * world().rank
    ),
    "ring": lambda q, k, v: mpitree.tree_decode(q, k, v, strategy="ring"),
    "allreduce3": lambda q, k, v: mpitree.tree_decode(q, k, v, strategy="allreduce3"),
    "allgather": lambda q, k, v: mpitree.tree_decode(q, k, v, strategy="allgather"),
    "hierarchical": lambda q, k, v: mpitree.tree_decode(q, k, v, strategy="hierarchical"),
    "allreduce": lambda q, k, v: mpitree.tree_decode(q, k, v, strategy="allreduce"),
    "float16": lambda q, k, v: mpitree.tree_decode(*(x.half() for x in (q, k, v))),
    "empty shard on rank 0": lambda q, k, v: mpitree.tree_decode(
        q, *((x[:, :, :0] if world().rank == 0 else x) for x in (k, v))
    ),
    "bfloat16": lambda q, k, v: mpitree.tree_decode(*(x.bfloat16() for x in (q, k, v))),
    "float64": lambda q, k, v: mpitree.tree_decode(*(x.double() for x in (q, k, v))),
    "verify_attention": lambda q, k, v: mpitree.spec.verify_attention(
        q, k, v, k[:, :, :1], v[:, :, :1], torch.ones(1, 1, 1, dtype=torch.bool)
    ),
}


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("requires", ["q", "k", "qkv"])
@pytest.mark.parametrize("call", list(CALLS))
def test_backward_through_the_core_raises(call, requires):
    q, k, v = shard(requires)
    out = CALLS[call](q, k, v)
    with torch.no_grad():
        plain = CALLS[call](q, k, v)
    assert not plain.requires_grad
    assert torch.equal(out.detach(), plain)  # the forward is unchanged
    assert out.requires_grad
    with pytest.raises(RuntimeError, match=MESSAGE):
        out.sum().backward()


@pytest.mark.parallel(nprocs=NPROCS)
def test_nothing_requires_grad_costs_nothing():
    q, k, v = shard(requires=())
    out = mpitree.tree_decode(q, k, v)
    assert not out.requires_grad and out.grad_fn is None


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("cache", ["ShardedCache", "last", "invariant", "none"])
def test_backward_through_a_transformers_model_raises(cache):
    model = tiny_llama()
    ids, _ = prompt(9, False)
    model.set_attn_implementation("eager")
    model(ids, use_cache=False).logits.sum().backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None  # eager has one
    model.zero_grad(set_to_none=True)
    model.set_attn_implementation("mpitree")
    options = {"last": {"placement": "last"}, "invariant": {"deterministic": "invariant"}}

    def kwargs():
        if cache == "none":
            return {}
        return {"cache": mtt.ShardedCache(model.config, **options.get(cache, {}))}

    logits = model(ids, use_cache=cache != "none", **kwargs()).logits
    with torch.no_grad():
        plain = model(ids, use_cache=cache != "none", **kwargs()).logits
    assert torch.equal(logits.detach(), plain)
    with pytest.raises(RuntimeError, match=MESSAGE):
        logits.sum().backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is None  # nothing half-done
