"""The fused Triton decode kernel (``MPITREE_KERNEL=triton``), one process.

CPU tensors run under Triton's interpreter: this module sets ``TRITON_INTERPRET=1``
before triton is imported, where no CUDA device is usable. Where one is, the
interpreter stays off and the ``cuda``-marked cases run the compiled kernel instead
(the CPU cases are not collected there). Every case is checked against the float64
reference on the same rounded inputs; the shapes are tiny (the interpreter runs a
program in ~0.1 s).
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import make_problem
from numpy.testing import assert_allclose

import mpitree
from mpitree._masks import visibility
from mpitree._namespace import namespace
from mpitree._state import output_of

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from mpitree.adapters import _triton_decode as kernel  # noqa: E402  (after TRITON_INTERPRET)
from mpitree.adapters import torch as adapter  # noqa: E402

DEVICES = [pytest.param("cuda", marks=pytest.mark.cuda)] + ([] if CUDA else ["cpu"])
# records: float32 accumulation over exactly rounded inputs, whatever their dtype;
# outputs: that, then one rounding to the input dtype
DTYPES = {
    "float32": (torch.float32, 2e-5),
    "float16": (torch.float16, 2e-3),
    "bfloat16": (torch.bfloat16, 2e-2),
}
RECORDS_ATOL = 2e-5
CASES = {
    "gqa": dict(q_heads=8, kv_heads=2),
    "ragged": dict(batch=3, kv_len=True),
    "causal": dict(batch=3, q_len=3, positions=True),
    "mask_per_head": dict(q_len=2, mask="head", kv_len=True),
}


@pytest.fixture
def triton_selected(monkeypatch):
    """Select the kernel and count its calls: {"records": n, "output": n}."""
    monkeypatch.setenv("MPITREE_KERNEL", "triton")
    calls = {"records": 0, "output": 0}
    records, output = kernel.decode_records, kernel.finish_output

    def counted_records(*args, **kwargs):
        calls["records"] += 1
        return records(*args, **kwargs)

    def counted_output(*args, **kwargs):
        calls["output"] += 1
        return output(*args, **kwargs)

    monkeypatch.setattr(kernel, "decode_records", counted_records)
    monkeypatch.setattr(kernel, "finish_output", counted_output)
    return calls


def rounded(prob, dtype):
    """Round the problem's q, k, v to ``dtype`` (the reference sees what the kernel sees)."""
    prob.q, prob.k, prob.v = (
        torch.from_numpy(x).to(dtype).double().numpy() for x in (prob.q, prob.k, prob.v)
    )
    return prob


def tensors(prob, dtype, device, rank=0):
    """Return (q, k, v, masking keywords) of one shard as tensors on ``device``."""
    k, v, kw = prob.shard(rank)
    kw = {n: None if x is None else torch.as_tensor(x).to(device) for n, x in kw.items()}
    q, k, v = (torch.from_numpy(x).to(device, dtype) for x in (prob.q, k, v))
    return q, k, v, kw


def records_of(q, k, v, splits=None, **kw):
    """Return the kernel's records (host numpy), called directly with ``splits``."""
    ns = namespace(q)
    b, _, sq, _ = q.shape
    lens, vis = visibility(ns, b, sq, k.shape[2], kw.get("kv_len"), kw.get("q_pos"),
                           kw.get("k_pos"), kw.get("mask"))  # fmt: skip
    out = torch.empty((*q.shape[:3], q.shape[3] + 2), device=q.device)
    kernel.decode_records(q, k, v, q.shape[3] ** -0.5, lens, vis, out, splits=splits)
    return out.cpu().numpy()


# one split and three; the other dtypes: as many splits as the kernel picks
SPLITS = [("float32", 1), ("float32", 3), ("float16", None), ("bfloat16", None)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("dtype_name", "splits"), SPLITS)
@pytest.mark.parametrize("case", list(CASES))
def test_records_match_reference(device, dtype_name, splits, case):
    dtype, _ = DTYPES[dtype_name]
    prob = rounded(make_problem(11, [70], **CASES[case]), dtype)
    q, k, v, kw = tensors(prob, dtype, device)
    rec = records_of(q, k, v, splits=splits, **kw)
    ref, ref_lse = prob.reference()
    assert_allclose(output_of(rec.astype(np.float64)), ref, atol=RECORDS_ATOL, rtol=0)
    seen = np.isfinite(ref_lse)
    lse = rec[..., 0] + np.log(np.where(seen, rec[..., 1], 1))
    assert_allclose(lse[seen], ref_lse[seen], atol=1e-5, rtol=1e-6)
    assert (rec[~seen][:, 0] == -np.inf).all() and (rec[~seen][:, 1:] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_local_state_and_output_through_selection(device, dtype_name, triton_selected):
    """local_state (the core's, the adapter's) and tree_decode run it; the finish is exact."""
    dtype, tol = DTYPES[dtype_name]
    prob = rounded(make_problem(12, [50], q_len=2, mask="head", kv_len=True), dtype)
    q, k, v, kw = tensors(prob, dtype, device)
    state = mpitree.local_state(q, k, v, **kw)
    assert triton_selected == {"records": 1, "output": 0}
    again = mpitree.local_state(q, k, v, **kw)
    assert state.records.tobytes() == again.records.tobytes()  # the same bits, run after run
    on_device = adapter.local_state(q, k, v, **kw)  # the records as a tensor on q's device
    assert on_device.device.type == device
    assert on_device.cpu().numpy().tobytes() == state.records.tobytes()
    ref, _ = prob.reference()
    assert_allclose(state.output().astype(np.float64), ref, atol=RECORDS_ATOL, rtol=0)
    out = mpitree.tree_decode(q, k, v, **kw)
    assert triton_selected == {"records": 4, "output": 1}
    assert out.dtype == dtype and out.device.type == device
    assert_allclose(out.double().cpu().numpy(), ref, atol=tol, rtol=0)
    host = torch.from_numpy(output_of(state.records)).to(dtype)  # the host's finish, rounded
    assert torch.equal(
        kernel.finish_output(torch.from_numpy(state.records).to(device), dtype).cpu(), host
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_finish_kernel_is_the_host_finish_bit_for_bit(device, dtype_name):
    """n / d rounded once: empty rows give 0, NaN stays NaN, the same bits as the host's."""
    dtype, _ = DTYPES[dtype_name]
    rng = np.random.default_rng(5)
    rec = rng.standard_normal((2, 3, 2, 7)).astype(np.float32) * 50
    rec[..., 1] = np.abs(rec[..., 1]) + 1e-3
    rec[0, 0, 0, 0], rec[0, 0, 0, 1:] = -np.inf, 0  # an empty row
    rec[1, 2, 1, 4] = np.nan
    host = torch.from_numpy(output_of(rec)).to(dtype)
    got = kernel.finish_output(torch.from_numpy(rec).to(device), dtype).cpu()
    assert got.dtype == dtype
    assert torch.equal(got.isnan(), host.isnan())
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(host))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_garbage_in_excluded_slots_contributes_nothing(device, splits, dtype_name):
    """NaN and Inf past kv_len and in masked-out slots: exactly the clean result."""
    dtype, _ = DTYPES[dtype_name]
    prob = rounded(make_problem(13, [64], batch=2, q_len=2, mask="head", kv_len=True), dtype)
    q, k, v, kw = tensors(prob, dtype, device)
    clean = records_of(q, k, v, splits=splits, **kw)
    lens = kw["kv_len"].cpu().numpy()
    dirty_k, dirty_v = k.clone(), v.clone()
    for b, n in enumerate(lens):
        dirty_k[b, :, n:] = float("nan")
        dirty_v[b, :, n:, ::2] = float("inf")
        dirty_v[b, :, n:, 1::2] = float("nan")
    hidden = ~prob.mask.any(axis=(1, 2))  # keys no row of a batch entry sees
    for b in range(hidden.shape[0]):
        cols = torch.from_numpy(np.flatnonzero(hidden[b]))
        dirty_k[b, :, cols] = float("inf")
        dirty_v[b, :, cols] = float("nan")
    dirty = records_of(q, dirty_k, dirty_v, splits=splits, **kw)
    assert clean.tobytes() == dirty.tobytes()
    ref, _ = prob.reference()
    assert_allclose(output_of(dirty.astype(np.float64)), ref, atol=RECORDS_ATOL, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [1, 2])
def test_nan_in_a_visible_key_poisons_its_rows_only(device, splits):
    """A NaN value (its column) or score (its row) seen by some rows only: theirs alone."""
    prob = make_problem(14, [48], batch=1, q_heads=2, kv_heads=1, q_len=2, mask="head")
    prob.mask[:] = True
    prob.mask[0, 1, :, 40] = False  # head 1 never sees key 40
    prob.v[0, 0, 40, 3] = np.nan
    prob.v[0, 0, 10, 5] = np.inf  # visible, weight > 0: +inf in column 5 of every row
    q, k, v, kw = tensors(prob, torch.float32, device)
    rec = records_of(q, k, v, splits=splits, **kw)
    ref, _ = prob.reference()
    out = output_of(rec.astype(np.float64))
    assert np.isnan(out[0, 0, :, 3]).all() and np.isfinite(out[0, 1, :, 3]).all()
    assert np.array_equal(np.isnan(out), np.isnan(ref))
    assert np.array_equal(np.isposinf(out), np.isposinf(ref))
    fin = np.isfinite(ref)
    assert_allclose(out[fin], ref[fin], atol=RECORDS_ATOL, rtol=0)
    prob.v[0, 0, 10, 5] = 0
    prob.k[0, 0, 7, 0] = np.nan  # a NaN score: only head 0's rows see key 7
    prob.mask[0, 1, :, 7] = False
    q, k, v, kw = tensors(prob, torch.float32, device)
    out = output_of(records_of(q, k, v, splits=splits, **kw).astype(np.float64))
    assert np.isnan(out[0, 0]).all() and np.isfinite(out[0, 1]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_empty_shard_and_rows_are_the_empty_state(device, triton_selected):
    """T = 0, kv_len = 0 and rows that see nothing: m = -inf, d = 0, n = 0, never NaN."""
    q = torch.randn(2, 4, 2, 16, device=device)
    k = torch.randn(2, 2, 0, 16, device=device)
    state = mpitree.local_state(q, k, k)
    k = torch.full((2, 2, 40, 16), float("nan"), device=device)
    lens = torch.tensor([0, 0], device=device)
    for rec in (state.records, records_of(q, k, k, kv_len=lens)):
        assert (rec[..., 0] == -np.inf).all() and (rec[..., 1:] == 0).all()
    mask = torch.zeros(2, 1, 2, 40, dtype=torch.bool, device=device)
    rec = records_of(q, torch.randn_like(k), k, splits=2, mask=mask)
    assert (rec[..., 0] == -np.inf).all() and (rec[..., 1:] == 0).all()
    assert not mpitree.tree_decode(q, k[:, :, :0], k[:, :, :0]).isnan().any()


@pytest.mark.parametrize("device", DEVICES)
def test_decode_plan_over_a_growing_cache(device, triton_selected):
    """A plan's steps (float32: the compiled kernel's own dtype) run the Triton kernel."""
    prob = make_problem(15, [40], batch=2, q_heads=4, kv_heads=2)
    q, k, v, _ = tensors(prob, torch.float32, device)
    with mpitree.DecodePlan(2, 4, 2, 16) as plan:
        for step, n in enumerate((10, 25, 40)):
            lens = torch.tensor([n, n - 5], device=device)
            out = plan.decode(q, k, v, kv_len=lens)
            prob.kv_len = [lens.cpu().numpy()]
            ref, _ = prob.reference()
            assert_allclose(out.double().cpu().numpy(), ref, atol=2e-5, rtol=0)
            assert triton_selected == {"records": step + 1, "output": step + 1}


def test_unknown_kernel_name_is_refused(monkeypatch):
    monkeypatch.setenv("MPITREE_KERNEL", "tritonn")
    q = torch.randn(1, 2, 1, 8)
    with pytest.raises(ValueError, match="MPITREE_KERNEL must be 'triton' or unset"):
        mpitree.local_state(q, q, q)


def test_default_kernels_never_call_triton(monkeypatch, triton_selected):
    monkeypatch.delenv("MPITREE_KERNEL")
    q = torch.randn(1, 2, 1, 8)
    mpitree.tree_decode(q, q, q)
    assert triton_selected == {"records": 0, "output": 0}


def test_missing_triton_names_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    monkeypatch.delitem(sys.modules, "mpitree.adapters._triton_decode")
    monkeypatch.delattr(mpitree.adapters, "_triton_decode")
    monkeypatch.setenv("MPITREE_KERNEL", "triton")
    q = torch.randn(1, 2, 1, 8)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[triton\]'"):
        mpitree.local_state(q, q, q)


if not CUDA:  # CPU tensors: the interpreter is on only where no GPU is

    def test_cpu_tensors_need_the_interpreter(monkeypatch, triton_selected):
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        q = torch.randn(1, 2, 1, 8)
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            mpitree.local_state(q, q, q)


COMPILE = """
import inspect, os
os.environ.pop("TRITON_INTERPRET", None)
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from mpitree.adapters import _triton_decode as kernel

def build(fn, types, constexprs):
    names = list(inspect.signature(fn.fn).parameters)
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i64") for n in names}
    consts = {(names.index(n),): v for n, v in constexprs.items()}
    compiled = compile(ASTSource(fn, signature, consts), target=GPUTarget("cuda", 80, 32))
    assert compiled.asm["cubin"], fn

ptrs = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "lens": "*i64", "vis": "*u8", "out": "*fp32"}
build(kernel._split_kernel, {**ptrs, "scale": "fp32"}, dict(
    DIM=128, HAS_LENS=True, HAS_VIS=True, BLOCK_R=16, BLOCK_N=64, BLOCK_D=128))
build(kernel._combine_kernel, {"part": "*fp32", "out": "*fp32"}, dict(WIDTH=130, BLOCK_W=256))
build(kernel._finish_kernel, {"rec": "*fp32", "out": "*bf16"}, dict(DIM=128, BLOCK_D=128))
print("compiled")
"""


def test_kernels_compile_for_a_gpu(tmp_path):
    """Each kernel (its most general form) compiles to a cubin for sm_80, with no GPU here.

    The interpreter runs Python, not Triton's compiler: this is what catches, without a
    GPU, what only the compiler refuses (a non-constexpr global, a type that changes
    across a loop). ptxas ships in triton's wheel.
    """
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path)}
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run(
        [sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0 and "compiled" in res.stdout, res.stdout + res.stderr[-3000:]
