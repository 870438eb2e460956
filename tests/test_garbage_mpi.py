"""Excluded keys contribute exactly nothing: NaN and Inf in every excluded slot, every path.

A cache's unused slots hold whatever memory held (``np.empty``, paged slack):
keys excluded by ``kv_len``, by the mask or by position must not reach the
output even when their K or V is NaN or Inf. Each test fills every excluded slot
of the ranks' shards with NaN/+Inf/-Inf garbage and compares with the float64
reference computed on the clean cache, on every path: the C kernel, the numpy
kernel (float16/float64), torch (float32 through the C kernel on shared memory;
bfloat16/float16/float64 in torch), CuPy (stand-in), flash-attn (stand-in),
every merge strategy including the ring, the energy and spec verification.
"""

import importlib
import sys

import numpy as np
import pytest
import torch
from helpers import atol, make_problem, world
from numpy.testing import assert_allclose
from standins import fake_cupy, fake_flash_attn

import mpitree
from mpitree import energy, spec

EXCLUSIONS = ["kv_len", "mask", "positions"]
GARBAGE = np.array([np.nan, np.inf, -np.inf], dtype=np.float64)


def poisoned(prob, exclusion, rank):
    """This rank's shard with garbage in every slot the exclusion hides from every query."""
    k, v, kw = prob.shard(rank)
    k, v = k.copy(), v.copy()
    b, _, t, _ = k.shape
    hidden = np.zeros((b, t), bool)
    if exclusion == "kv_len":
        hidden = np.arange(t)[None, :] >= kw["kv_len"][:, None]
    elif exclusion == "mask":
        hidden = ~kw["mask"].any(axis=(1, 2))
    else:
        hidden = kw["k_pos"] > kw["q_pos"].max(axis=1, keepdims=True)
    junk = GARBAGE[np.arange(hidden.sum() * k.shape[1] * k.shape[3]) % 3].astype(k.dtype)
    for x in (k, v):
        sel = np.broadcast_to(hidden[:, None, :, None], x.shape)
        x[sel] = junk[: sel.sum()]
    assert hidden.any() or t == 0 or exclusion != "kv_len" or (kw["kv_len"] == t).all()
    return k, v, kw


def problem(exclusion, dtype, sizes, q_len=2):
    kw = dict(kv_len=exclusion == "kv_len", positions=exclusion == "positions")
    if exclusion == "mask":
        kw["mask"] = "shared"
    prob = make_problem(21, sizes, dtype=dtype, q_len=q_len, batch=2, **kw)
    if exclusion == "mask":  # keys 0 and 3 of every shard hidden from every query
        for lo in np.cumsum([0, *sizes[:-1]]):
            prob.mask[..., lo : lo + 1] = False
            prob.mask[..., lo + 3 : lo + 4] = False
    if exclusion == "positions":  # queries at 2..3 positions before the end: a hidden tail
        n = sum(sizes)
        prob.q_pos = np.tile(np.arange(n - 3 - q_len, n - 3), (2, 1))
    return prob


def sizes():
    return [7, 0, 9, 5][: world().size] if world().size <= 4 else [7] * world().size


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize("exclusion", EXCLUSIONS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
@pytest.mark.parametrize("strategy", ["allreduce", "allreduce3", "allgather", "ring"])
def test_numpy_paths(exclusion, dtype, strategy):
    prob = problem(exclusion, dtype, sizes())
    k, v, kw = poisoned(prob, exclusion, world().rank)
    out, lse = mpitree.tree_decode(prob.q, k, v, strategy=strategy, return_lse=True, **kw)
    ref, ref_lse = prob.reference()
    assert not np.isnan(out).any()
    assert_allclose(out.astype(np.float64), ref, atol=atol(dtype), rtol=0)
    fin = np.isfinite(ref_lse)
    assert_allclose(lse[fin], ref_lse[fin], atol=1e-4, rtol=1e-5)


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize("q_len", [1, 2])
def test_plan_compiled_lane_with_kv_len(q_len):
    """A plan's later steps over a fixed-capacity cache with garbage past ``kv_len`` run
    its one compiled call (where its merge binds: one persistent all-reduce) and read
    none of the garbage."""
    from mpitree._library import native_lib
    from mpitree._strategies.allreduce import _PERSISTENT_OK

    prob = problem("kv_len", np.float32, sizes(), q_len=q_len)
    k, v, kw = poisoned(prob, "kv_len", world().rank)
    ref, ref_lse = prob.reference()
    b, hq, _, dim = prob.q.shape
    with mpitree.DecodePlan(b, hq, k.shape[1], dim, q_len=q_len, comm=world()) as plan:
        compiled, runs = plan._compiled, []
        assert (compiled is not None) == (native_lib() is not None and _PERSISTENT_OK)
        if compiled is not None:
            run = compiled.run
            compiled.run = lambda out: runs.append(1) or run(out)
        for _ in range(3):  # the first step checks and binds; the others run compiled
            out, lse = plan.decode(prob.q, k, v, return_lse=True, **kw)
            assert not np.isnan(out).any()
            assert_allclose(out.astype(np.float64), ref, atol=2e-5, rtol=0)
            fin = np.isfinite(ref_lse)
            assert_allclose(lse[fin], ref_lse[fin], atol=1e-4, rtol=1e-5)
    # an empty shard copied afresh (numpy gives it zero strides) binds no kernel: its
    # steps take the checked path beside the others' compiled calls
    assert len(runs) == (2 if compiled is not None and k.size else 0), runs


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize("exclusion", EXCLUSIONS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
def test_torch_paths(exclusion, dtype):
    tdtype = getattr(torch, dtype)
    prob = problem(exclusion, np.float64, sizes())
    prob.q, prob.k, prob.v = (  # the reference sees the rounded inputs
        torch.from_numpy(x).to(tdtype).double().numpy() for x in (prob.q, prob.k, prob.v)
    )
    k, v, kw = poisoned(prob, exclusion, world().rank)
    t = {name: None if x is None else torch.from_numpy(x) for name, x in kw.items()}
    q, k, v = (torch.from_numpy(x).to(tdtype) for x in (prob.q, k, v))
    out = mpitree.tree_decode(q, k, v, **t)
    assert out.dtype == tdtype and not torch.isnan(out).any()
    tol = {"float32": 2e-5, "float64": 1e-12, "float16": 2e-3, "bfloat16": 2e-2}[dtype]
    assert_allclose(out.double().numpy(), prob.reference()[0], atol=tol, rtol=0)
    local = importlib.import_module("mpitree.adapters.torch").local_state(q, k, v, **t)
    assert not torch.isnan(local).any()


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize("exclusion", EXCLUSIONS)
def test_cupy_path(exclusion, monkeypatch):
    cp = fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    prob = problem(exclusion, np.float32, sizes())
    k, v, kw = poisoned(prob, exclusion, world().rank)
    dev = {name: None if x is None else cp.asarray(x) for name, x in kw.items()}
    out = mpitree.tree_decode(cp.asarray(prob.q), cp.asarray(k), cp.asarray(v), **dev)
    assert isinstance(out, cp.ndarray)
    assert_allclose(out.get(), prob.reference()[0], atol=2e-5, rtol=0)


@pytest.mark.parallel(nprocs=[2, 3])
def test_flash_attn_path_never_reads_past_the_lengths(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn())
    monkeypatch.delitem(sys.modules, "mpitree.adapters.flash_attn", raising=False)
    fa = importlib.import_module("mpitree.adapters.flash_attn")
    prob = problem("kv_len", np.float32, sizes())
    k, v, kw = poisoned(prob, "kv_len", world().rank)
    flash = [
        torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1, 3))) for x in (prob.q, k, v)
    ]
    out = fa.tree_decode(*flash, cache_seqlens=torch.from_numpy(kw["kv_len"]).int())
    assert_allclose(out.transpose(1, 2).numpy(), prob.reference()[0], atol=2e-5, rtol=0)


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize("exclusion", EXCLUSIONS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_energy_paths(exclusion, dtype):
    prob = problem(exclusion, dtype, sizes())
    k, v, kw = poisoned(prob, exclusion, world().rank)
    ref, ref_lse = prob.reference()
    zeta = np.random.default_rng(5).standard_normal(prob.q.shape).astype(dtype) * 0.1
    tol = 1e-4 if dtype == np.float32 else 1e-10
    for algorithm in ("fused", "paper"):
        f, grad = energy.tree_energy(prob.q, k, v, algorithm=algorithm, **kw)
        assert_allclose(grad, ref, atol=tol, rtol=0)
        fin = np.isfinite(ref_lse)
        assert_allclose(f[fin], ref_lse[fin], atol=tol, rtol=0)
        f_z, grad_z = energy.tree_energy(prob.q, k, v, zeta=zeta, algorithm=algorithm, **kw)
        assert np.isfinite(grad_z).all() and not np.isnan(f_z).any()
    mean, var = energy.attention_variance(prob.q, k, v, **kw)
    assert_allclose(mean, ref, atol=tol, rtol=0)
    assert np.isfinite(var).all()


@pytest.mark.parallel(nprocs=[2, 3])
def test_spec_verification_with_garbage_past_the_context_lengths():
    prob = problem("kv_len", np.float32, sizes(), q_len=3)
    k, v, kw = poisoned(prob, "kv_len", world().rank)
    rng = np.random.default_rng(9)
    k_tree, v_tree = (rng.standard_normal((2, 2, 3, 16)).astype(np.float32) for _ in range(2))
    tree = np.tril(np.ones((2, 3, 3), bool))
    out = spec.verify_attention(prob.q, k, v, k_tree, v_tree, tree, kv_len=kw["kv_len"])
    keys = np.concatenate([prob.k, k_tree], axis=2)
    values = np.concatenate([prob.v, v_tree], axis=2)
    visible = np.concatenate(
        [np.broadcast_to(prob.visible(), (2, 1, 3, prob.k.shape[2])), tree[:, None]], axis=-1
    )
    ref, _ = mpitree.reference_attention(prob.q, keys, values, visible=visible)
    assert_allclose(out, ref, atol=2e-5, rtol=0)


def test_free_energy_gradient_ignores_garbage_in_keys_no_row_sees():
    rng = np.random.default_rng(0)
    q, k, v = (torch.from_numpy(rng.standard_normal((1, 2, 3, 8))) for _ in range(3))
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    mask[..., 1] = False
    k[:, :, 1], v[:, :, 1] = float("nan"), float("inf")
    zeta = torch.zeros(q.shape, dtype=torch.float64, requires_grad=True)
    energy.free_energy(q, k, v, zeta, mask=mask).sum().backward()
    keep = [0, 2]
    ref, _ = mpitree.reference_attention(q.numpy(), k[:, :, keep].numpy(), v[:, :, keep].numpy())
    assert_allclose(zeta.grad.numpy(), ref, atol=1e-12, rtol=0)


def test_reference_attention_itself_ignores_hidden_garbage():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 2, 1, 4)) for _ in range(3))
    k = np.concatenate([k, np.full((1, 2, 1, 4), np.nan)], axis=2)
    v = np.concatenate([v, np.full((1, 2, 1, 4), np.inf)], axis=2)
    visible = np.array([True, False])[None, None, None, :]
    out, lse = mpitree.reference_attention(q, k, v, visible=visible)
    ref, ref_lse = mpitree.reference_attention(q, k[:, :, :1], v[:, :, :1])
    assert np.array_equal(out, ref) and np.array_equal(lse, ref_lse)
