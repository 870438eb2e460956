"""mpitree.adapters.torch under real ranks: every strategy, dtypes, masks, empty shards."""

import numpy as np
import pytest
import torch
from helpers import make_problem, world
from mpitree.adapters import torch as mt
from numpy.testing import assert_allclose

from mpitree import tree_decode

STRATEGIES = ["allreduce", "allreduce3", "allgather", "ring", "hierarchical", "auto"]
DTYPES = {
    "float32": (torch.float32, 2e-5),
    "float64": (torch.float64, 1e-12),
    "float16": (torch.float16, 2e-3),
    "bfloat16": (torch.bfloat16, 2e-2),
}
CASES = {
    "gqa": dict(q_heads=8, kv_heads=2),
    "positions": dict(batch=3, q_len=3, positions=True),
    "mask_per_head_ragged": dict(q_len=2, mask="head", kv_len=True),
}


def to_torch(x, dtype, device="cpu"):
    return None if x is None else torch.as_tensor(x).to(device=device, dtype=dtype)


def run(strategy, dtype_name, case, sizes, device="cpu"):
    comm = world()
    dtype, tol = DTYPES[dtype_name]
    prob = make_problem(3, sizes, dtype=np.float64, **CASES[case])
    # the reference sees exactly the rounded inputs the ranks see
    rounded = [
        torch.from_numpy(x).to(dtype).to(torch.float64).numpy() for x in (prob.q, prob.k, prob.v)
    ]
    prob.q, prob.k, prob.v = rounded
    k, v, kw = prob.shard(comm.rank)
    tkw = {name: None if x is None else torch.as_tensor(x).to(device) for name, x in kw.items()}
    out, lse = mt.tree_decode(
        to_torch(prob.q, dtype, device),
        to_torch(k, dtype, device),
        to_torch(v, dtype, device),
        strategy=strategy,
        return_lse=True,
        **tkw,
    )
    assert out.dtype == dtype and out.device.type == device and lse.dtype == torch.float32
    ref, ref_lse = prob.reference()
    got = out.to(torch.float64).cpu().numpy()
    assert not np.isnan(got).any()
    assert_allclose(got, ref, atol=tol, rtol=0)
    fin = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse.cpu().numpy()), fin)
    assert_allclose(lse.cpu().numpy()[fin], ref_lse[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.parallel(nprocs=[1, 2, 3, 4])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("case", list(CASES))
def test_torch_cpu_matches_reference(strategy, dtype_name, case):
    run(strategy, dtype_name, case, [6, 0, 9, 3][: world().size])


@pytest.mark.parallel(nprocs=[2, 3])
def test_torch_bad_input_raises_everywhere():
    q = torch.zeros(1, 4, 1, 8)
    kv = torch.zeros(1, 2, 5, 8)
    bad = world().rank == 1
    with pytest.raises(ValueError):
        mt.tree_decode(q, kv if not bad else torch.zeros(1, 3, 5, 8), kv)


def test_local_state_records_and_cuda_aware_override(monkeypatch):
    q = torch.ones(1, 2, 1, 4)
    kv = torch.zeros(1, 1, 0, 4)  # an empty shard: the identity state
    rec = mt.local_state(q, kv, kv)
    assert rec.shape == (1, 2, 1, 6) and torch.isneginf(rec[..., 0]).all()
    assert (rec[..., 1:] == 0).all()
    monkeypatch.setenv("MPITREE_CUDA_AWARE", "1")
    assert mt.cuda_aware() is True
    monkeypatch.setenv("MPITREE_CUDA_AWARE", "0")
    assert mt.cuda_aware() is False
    monkeypatch.delenv("MPITREE_CUDA_AWARE")
    assert mt.cuda_aware() is False  # the PyPI MPICH/Open MPI wheels are not CUDA-aware


@pytest.mark.cuda
@pytest.mark.parametrize("strategy", ["allreduce", "ring"])
def test_torch_cuda_staged_matches_reference(strategy):
    run(strategy, "bfloat16", "gqa", [6], device="cuda")


@pytest.mark.parallel(nprocs=[2, 3])
def test_disagreement_names_each_field_once():
    """The message names each differing field by its name, once, with each rank's value,
    even where ranks' signatures have different fields (torch arrays add buffer, staging)."""
    rank, last = world().rank, world().size - 1
    rng = np.random.default_rng(0)
    d = 16 if rank == last else 8
    q = rng.standard_normal((2, 4, 1, d)).astype(np.float32)
    k = rng.standard_normal((2, 2, 5, d)).astype(np.float32)
    v = k.copy()
    if rank == last:
        q, k, v = (torch.from_numpy(a) for a in (q, k, v))
    with pytest.raises(ValueError) as info:
        tree_decode(q, k, v, strategy="allreduce")
    message = str(info.value)
    assert message.startswith("mpitree: ranks disagree on head_dim, scale, buffer, staging ("), (
        message
    )
    others = "rank 0 has" if last == 1 else f"ranks 0-{last - 1} have"
    assert f"head_dim: {others} 8, rank {last} has 16;" in message, message
    assert f"buffer: {others} no buffer, rank {last} has 'host';" in message, message
    assert f"staging: {others} no staging, rank {last} has ('torch', 'cpu'))" in message, message
    assert "field " not in message and message.count("head_dim") == 2, message
