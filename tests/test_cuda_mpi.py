"""The CUDA paths on a real GPU under real ranks (several ranks may share one GPU).

Every test here is ``cuda``-marked: it skips where no CUDA device is usable and runs
where one is (``benchmarks/gpu_check.sh`` runs this file on a lent GPU machine). The
CPU suite covers the same code over stand-ins (tests/standins.py); these tests run the
real frameworks on the device: torch and CuPy tensors in every dtype and strategy,
a decode loop, garbage in a cache's unused slots and visible NaN, inputs on two
devices, a transformers model's generate, and JAX arrays on the GPU.
"""

import numpy as np
import pytest
import torch
from helpers import make_problem, world
from numpy.testing import assert_allclose
from test_torch_mpi import CASES, DTYPES, STRATEGIES
from test_torch_mpi import run as run_torch

import mpitree
from mpitree._namespace import namespace

pytestmark = pytest.mark.cuda


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("case", list(CASES))
def test_torch_cuda_matches_reference(strategy, dtype_name, case):
    run_torch(strategy, dtype_name, case, [6, 0, 9][: world().size], device="cuda")


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("strategy", ["allreduce", "allgather", "allreduce3", "ring", "auto"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32", "float16"])
def test_real_cupy_matches_reference(strategy, dtype):
    cupy = pytest.importorskip("cupy")
    from mpitree.adapters import cupy as adapter
    from test_cupy_mpi import run as run_cupy

    out = run_cupy(adapter, strategy, dtype)
    assert out.device.id == cupy.cuda.Device().id


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_decode_plan_over_a_growing_cuda_cache(dtype):
    """A decode loop: one plan, cache tensors of fixed capacity on the GPU, garbage past kv_len."""
    comm = world()
    b, hq, hkv, d, cap = 2, 8, 2, 64, 40
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    rng = np.random.default_rng(7)
    k_all = rng.standard_normal((b, hkv, comm.size * cap, d))
    v_all = rng.standard_normal((b, hkv, comm.size * cap, d))
    k_all, v_all = (torch.from_numpy(x).to(dtype).double().numpy() for x in (k_all, v_all))
    lo, hi = comm.rank * cap, (comm.rank + 1) * cap
    k = torch.from_numpy(k_all[:, :, lo:hi]).to("cuda", dtype)
    v = torch.from_numpy(v_all[:, :, lo:hi]).to("cuda", dtype)
    with mpitree.DecodePlan(b, hq, hkv, d, dtype=dtype) as plan:
        for step in range(6):
            # each rank holds 5 + 3 * step + rank (capped) valid keys; the rest is garbage
            held = [min(cap, 5 + 3 * step + r) for r in range(comm.size)]
            mine = held[comm.rank]
            k[:, :, mine:], v[:, :, mine:] = float("nan"), float("inf")
            q64 = torch.from_numpy(rng.standard_normal((b, hq, 1, d))).to(dtype).double()
            kv_len = torch.full((b,), mine, dtype=torch.int32, device="cuda")
            out = plan.decode(q64.to("cuda", dtype), k, v, kv_len=kv_len)
            assert out.device.type == "cuda" and out.dtype == dtype
            if dtype == torch.bfloat16:  # the fused kernel answers, over each row's kv_len keys
                fused = namespace(k).fused_records(q64.to("cuda", dtype), k, v, d**-0.5, kv_len)
                assert fused is not None and torch.isfinite(fused[..., 1:]).all()
            keep = np.concatenate([np.arange(r * cap, r * cap + n) for r, n in enumerate(held)])
            ref, _ = mpitree.reference_attention(q64.numpy(), k_all[:, :, keep], v_all[:, :, keep])
            assert_allclose(out.double().cpu().numpy(), ref, atol=tol, rtol=0)
            k[:, :, mine:] = torch.from_numpy(k_all[:, :, lo + mine : hi]).to("cuda", dtype)
            v[:, :, mine:] = torch.from_numpy(v_all[:, :, lo + mine : hi]).to("cuda", dtype)


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_visible_nan_stays_in_its_column_and_masked_garbage_contributes_nothing(dtype):
    comm = world()
    prob = make_problem(3, [6, 5, 7][: comm.size], q_len=2, mask="head", dtype=np.float64)
    prob.q, prob.k, prob.v = (
        torch.from_numpy(x).to(dtype).double().numpy() for x in (prob.q, prob.k, prob.v)
    )
    if comm.size > 1:  # a visible key of the last rank's shard carries a NaN in column 3
        prob.mask[:, :, :, -1] = True
        prob.v[:, :, -1, 3] = np.nan
    k, v, kw = prob.shard(comm.rank)
    hidden = ~kw["mask"].any(axis=(1, 2))  # keys no query of a batch row sees
    k = k.copy()
    v = v.copy()
    k[np.broadcast_to(hidden[:, None, :, None], k.shape)] = np.inf
    v[np.broadcast_to(hidden[:, None, :, None], v.shape)] = np.nan
    on = [torch.from_numpy(x).to("cuda", dtype) for x in (prob.q, k, v)]
    out = mpitree.tree_decode(*on, mask=torch.from_numpy(kw["mask"]).cuda())
    got = out.double().cpu().numpy()
    ref, _ = prob.reference()
    assert np.array_equal(np.isnan(got), np.isnan(ref))
    fin = ~np.isnan(ref)
    assert_allclose(got[fin], ref[fin], atol=2e-2 if dtype == torch.bfloat16 else 2e-5, rtol=0)
    if comm.size > 1:
        assert np.isnan(got[..., 3]).any() and not np.isnan(np.delete(got, 3, -1)).any()


POISONS = {  # (which input, index given the poisoned key j, value)
    "clean": None,
    "nan value": ("v", lambda j: (slice(None), 0, j, 3), np.nan),
    "nan key": ("k", lambda j: (slice(None), 1, j), np.nan),
    "nan query": ("q", lambda j: (0, 2, 0, 5), np.nan),
    "inf value": ("v", lambda j: (slice(None), 1, j, 0), np.inf),
    "-inf value": ("v", lambda j: (slice(None), 1, j, 0), -np.inf),
    "inf key": ("k", lambda j: (slice(None), 0, j, 2), np.inf),
}


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("poison", list(POISONS))
def test_fused_kernel_gives_the_references_values_and_nan_pattern(dtype, poison):
    """Every key seen (no masking): half-precision CUDA takes torch's fused flash kernel."""
    comm = world()
    sizes = [300, 0, 257][: comm.size]
    prob = make_problem(9, sizes, q_heads=8, kv_heads=2, q_len=2, head_dim=64, dtype=np.float64)
    prob.q, prob.k, prob.v = (
        torch.from_numpy(x).to(dtype).double().numpy() for x in (prob.q, prob.k, prob.v)
    )
    if POISONS[poison] is not None:  # a key of the last rank's shard
        name, index, value = POISONS[poison]
        getattr(prob, name)[index(sum(sizes) - 5)] = value
    k, v, _ = prob.shard(comm.rank)
    on = [torch.from_numpy(x).to("cuda", dtype) for x in (prob.q, k, v)]
    ref, ref_lse = prob.reference()
    every = torch.ones(1, 1, 1, k.shape[2], dtype=torch.bool, device="cuda")
    for mask in (None, every):  # the fused kernel, then the matmuls
        out, lse = mpitree.tree_decode(*on, mask=mask, return_lse=True)
        got, got_lse = out.double().cpu().numpy(), lse.double().cpu().numpy()
        assert np.array_equal(np.isnan(got), np.isnan(ref)), (mask is None, poison)
        fin = ~np.isnan(ref)
        assert np.array_equal(got[fin] == np.inf, ref[fin] == np.inf)
        assert_allclose(got[fin], ref[fin], atol=2e-2 if dtype == torch.bfloat16 else 2e-3)
        assert np.array_equal(np.isnan(got_lse), np.isnan(ref_lse))
        lfin = np.isfinite(ref_lse)
        assert_allclose(got_lse[lfin], ref_lse[lfin], rtol=1e-5, atol=1e-4)
    if poison == "clean" and k.shape[2]:  # bfloat16: the fused kernel answered; float16: not
        fused = namespace(on[0]).fused_records(*on, 0.125)
        assert (fused is not None) == (dtype == torch.bfloat16)


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("layout", ["transposed", "padded rows", "host kv_len"])
def test_fused_kernel_over_other_layouts_matches_the_reference(layout):
    """transformers' (B, S, H, D).transpose(1, 2) layout, K/V rows padded past D (refused
    by the kernel: not 16-byte aligned rows), and a kv_len on the host for CUDA tensors."""
    comm = world()
    prob = make_problem(4, [70, 0, 33][: comm.size], batch=3, q_heads=8, kv_heads=2, q_len=1,
                        head_dim=64, kv_len=True, dtype=np.float64)  # fmt: skip
    prob.q, prob.k, prob.v = (
        torch.from_numpy(x).to(torch.bfloat16).double().numpy() for x in (prob.q, prob.k, prob.v)
    )
    k, v, kw = prob.shard(comm.rank)
    q = torch.from_numpy(prob.q).to("cuda", torch.bfloat16)
    k, v = (torch.from_numpy(x).to("cuda", torch.bfloat16) for x in (k, v))
    kv_len = torch.from_numpy(kw["kv_len"])
    if layout == "transposed":
        q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    elif layout == "padded rows":
        k, v = (torch.nn.functional.pad(x, (0, 3))[..., :64] for x in (k, v))
    if layout != "host kv_len":
        kv_len = kv_len.cuda()
    out = mpitree.tree_decode(q, k, v, kv_len=kv_len)
    ref, _ = prob.reference()
    assert_allclose(out.double().cpu().numpy(), ref, atol=2e-2, rtol=0)
    fused = namespace(q).fused_records(q, k, v, 0.125, kv_len)
    assert (fused is None) == (layout == "padded rows")


@pytest.mark.parallel(nprocs=[2, 3])
def test_inputs_on_another_device_on_one_rank_raise_on_every_rank():
    bad = world().rank == 1
    q = torch.zeros(1, 4, 1, 8, device="cuda")
    kv = torch.zeros(1, 2, 5, 8, device="cpu" if bad else "cuda")
    with pytest.raises((TypeError, ValueError), match=r"device|invalid input on rank 1"):
        mpitree.tree_decode(q, kv, kv)
    out = mpitree.tree_decode(q, kv.cuda(), kv.cuda())  # the next call works
    assert out.device.type == "cuda"


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("sharded_prefill", [False, True], ids=["replicated", "sharded"])
def test_transformers_generate_on_cuda_equals_one_process(sharded_prefill):
    import mpitree.adapters.transformers as mtt
    from models import greedy, prompt, tiny_llama

    model = tiny_llama().cuda()
    ids, mask = prompt(29, True)
    ids, mask = ids.cuda(), mask.cuda()
    model.set_attn_implementation("eager")
    ref = greedy(model, ids, mask, None, 8)
    cache = mtt.ShardedCache(model.config, block_size=4)
    model.set_attn_implementation("mpitree")
    if sharded_prefill:
        mtt.prefill(model, ids[:, :-1], cache, attention_mask=mask[:, :-1])
    got = greedy(model, ids, mask, cache, 8)
    assert torch.equal(got.sequences, ref.sequences)
    assert cache.layers[0].keys.device.type == "cuda"
    ours, theirs = (torch.stack(x.logits, 1).cpu().numpy() for x in (got, ref))
    assert_allclose(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("dtype", [np.float32, "bfloat16"], ids=["float32", "bfloat16"])
def test_jax_arrays_on_the_gpu_eagerly_and_a_clear_error_under_jit(dtype):
    """Eagerly, JAX arrays on the GPU decode (XLA's state there, the merge on the host);
    a jitted call compiled for the GPU is refused on every rank, and one on CPU inputs runs."""
    jax = pytest.importorskip("jax")
    gpu, cpu = jax.devices("gpu")[0], jax.devices("cpu")[0]
    from mpitree.adapters import jax as mj

    comm = world()
    prob = make_problem(5, [6, 0, 9][: comm.size], q_heads=8, kv_heads=2, dtype=np.float64)
    rounded = [jax.numpy.asarray(x, dtype) for x in (prob.q, prob.k, prob.v)]
    prob.q, prob.k, prob.v = (np.asarray(x, np.float64) for x in rounded)
    k, v, _ = prob.shard(comm.rank)
    ref, _ = prob.reference()
    tol = 2e-2 if dtype == "bfloat16" else 2e-5
    on_gpu = [jax.device_put(jax.numpy.asarray(x, dtype), gpu) for x in (prob.q, k, v)]
    out = mj.tree_decode(*on_gpu)
    assert out.devices() == {gpu} and out.dtype == on_gpu[0].dtype
    assert_allclose(np.asarray(out, np.float64), ref, atol=tol, rtol=0)
    mapped = jax.vmap(mj.tree_decode, in_axes=(0, None, None))  # eager vmap: XLA's state too
    twice = mapped(jax.numpy.stack([on_gpu[0]] * 2), *on_gpu[1:])
    assert_allclose(np.asarray(twice, np.float64), np.stack([ref] * 2), atol=tol, rtol=0)
    jitted = jax.jit(mj.tree_decode)
    with pytest.raises(ValueError, match="CPU only, and this program is compiled for cuda"):
        jitted(*on_gpu)
    on_cpu = [jax.device_put(x, cpu) for x in on_gpu]
    assert_allclose(np.asarray(jitted(*on_cpu), np.float64), ref, atol=tol, rtol=0)
