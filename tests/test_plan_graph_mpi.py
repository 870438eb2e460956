"""A DecodePlan step with no allocation per step, and one a CUDA graph captures (issue 50, item 3).

Under ``MPITREE_KERNEL=triton`` a plan's steps reuse what they write: the key splits'
partial records live in a workspace made once per records buffer, and the output goes
into the caller's ``out=``. CPU tensors run under Triton's interpreter; the CUDA path's
device twin of the records (its copies down to the host and up again, and a one-rank
plan's records that never leave the device) runs on CPU tensors too where a test
routes them through it. The ``cuda``-marked cases count the device allocator's
allocations and capture a step in ``torch.cuda.CUDAGraph``.
"""

import numpy as np
import pytest
import torch
from helpers import make_problem, world
from numpy.testing import assert_allclose
from test_triton_decode import (
    DEVICES,
    DTYPES,
    adapter,
    rounded,
    tensors,
    triton_selected,  # noqa: F401  (a fixture)
)

import mpitree
from mpitree import RankError
from mpitree._decode_plan import plan_merger
from mpitree._library import address

SIZES = [70, 0, 100]  # uneven shards, one empty; more than one block of keys: key splits
SHAPE = dict(batch=1, q_heads=2, kv_heads=1)  # tiny: the interpreter runs a program in ~0.1 s


def workspace_of(plan, q):
    """Return the adapter's workspace of a plan's records (made by its first step)."""
    rec = plan_merger(plan).records.reshape(*plan.problem.row_shape, -1)
    return adapter.workspace(address(rec), rec.shape, q.device)


def steps(plan, prob, dtype, device, rank, out=None):
    """Run three steps of a growing cache (garbage past kv_len); yield (out, reference)."""
    comm = world()
    q, k, v, _ = tensors(prob, dtype, device, rank)
    cap = int(k.shape[2])
    for fill in (0.4, 0.8, 1.0):
        lens = np.array([int(cap * fill)])
        garbage_k, garbage_v = k.clone(), v.clone()
        garbage_k[0, :, lens[0] :] = float("nan")
        garbage_v[0, :, lens[0] :] = float("inf")
        kv_len = torch.from_numpy(lens).to(device)
        got = plan.decode(q, garbage_k, garbage_v, kv_len=kv_len, out=out)
        prob.kv_len = comm.allgather(lens)
        yield got, prob.reference()[0]


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_plan_steps_reuse_their_memory(device, dtype_name, triton_selected):  # noqa: F811
    """``out=`` is returned step after step, the splits' partials are made once, results exact."""
    comm = world()
    dtype, tol = DTYPES[dtype_name]
    prob = rounded(make_problem(31, SIZES[: comm.size], **SHAPE), dtype)
    with mpitree.DecodePlan(1, 2, 1, 16, dtype=dtype) as plan:
        fresh = [got.clone() for got, _ in steps(plan, prob, dtype, device, comm.rank)]
        out = torch.full((1, 2, 1, 16), float("nan"), dtype=dtype, device=device)
        scratch = None
        for i, (got, ref) in enumerate(steps(plan, prob, dtype, device, comm.rank, out)):
            assert got is out
            assert torch.equal(got, fresh[i])  # the same bits as a new output
            assert_allclose(got.double().cpu().numpy(), ref, atol=tol, rtol=0)
            work = workspace_of(plan, out)
            now = {shape: x.data_ptr() for shape, x in work.scratch.items()}
            assert scratch is None or now == scratch
            scratch = now
        assert bool(scratch) == (SIZES[comm.rank] > 32)  # partials: where keys split
    assert triton_selected == {"records": 6, "output": 6}


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_device_twin_path(dtype_name, triton_selected, monkeypatch):  # noqa: F811
    """The CUDA path's records twin, run on CPU tensors: one rank's stay on the twin.

    With one rank the plan's host records are never written (the merge is the
    identity, the output is finished from the twin); with several they go down
    to the host for the merge and the merged records come up again. The lse
    (finished on the host) brings one rank's records down first.
    """
    monkeypatch.setattr(adapter, "shares_host", lambda device: False)
    comm = world()
    dtype, tol = DTYPES[dtype_name]
    prob = rounded(make_problem(32, SIZES[: comm.size], **SHAPE), dtype)
    with mpitree.DecodePlan(1, 2, 1, 16, dtype=dtype) as plan:
        host = plan_merger(plan).records
        host[...] = 7.0
        out = torch.empty((1, 2, 1, 16), dtype=dtype)
        for got, ref in steps(plan, prob, dtype, "cpu", comm.rank, out):
            assert got is out
            assert_allclose(got.double().numpy(), ref, atol=tol, rtol=0)
            assert np.all(host == 7.0) == (comm.size == 1)
            assert not workspace_of(plan, out).fresh  # the output took the twin's records
        q, k, v, _ = tensors(prob, dtype, "cpu", comm.rank)
        got, lse = plan.decode(q, k, v, return_lse=True)
        prob.kv_len = [None] * comm.size
        ref, ref_lse = prob.reference()
        assert_allclose(got.double().numpy(), ref, atol=tol, rtol=0)
        assert_allclose(lse.numpy(), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_a_bad_out_is_refused_on_every_rank():
    """A wrong ``out`` on one rank: every rank raises, and the plan goes on."""
    comm = world()
    prob = make_problem(33, [5, 0, 7][: comm.size], batch=2, q_heads=4, kv_heads=2)
    k, v, _ = prob.shard(comm.rank)
    q = prob.q.astype(np.float32)
    k, v = k.astype(np.float32), v.astype(np.float32)
    last = comm.size - 1
    with mpitree.DecodePlan(2, 4, 2, 16) as plan:
        fresh = plan.decode(q, k, v)
        cases = [
            (ValueError, "shape", np.empty((2, 4, 1, 8), np.float32)),
            (TypeError, "float64", np.empty((2, 4, 1, 16))),
            (TypeError, "framework", torch.empty((2, 4, 1, 16))),
            (ValueError, "read-only", np.broadcast_to(np.float32(0), (2, 4, 1, 16))),
        ]
        good = np.empty((2, 4, 1, 16), np.float32)
        for error, words, bad in cases:
            raised = error if comm.rank == last else RankError  # naming the rank and why
            with pytest.raises(raised, match=words):
                plan.decode(q, k, v, out=bad if comm.rank == last else good)
        got = plan.decode(q, k, v, out=good)
        assert got is good
        assert np.array_equal(got, fresh)
        assert_allclose(got, prob.reference()[0], atol=2e-5, rtol=0)


def allocations():
    """The CUDA caching allocator's count of allocations so far."""
    return torch.cuda.memory_stats()["allocation.all.allocated"]


@pytest.mark.cuda
@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_cuda_plan_steps_allocate_nothing(dtype_name, triton_selected):  # noqa: F811
    """After the first step, a CUDA plan's steps with ``out=`` allocate no device memory."""
    comm = world()
    dtype, tol = DTYPES[dtype_name]
    prob = rounded(make_problem(34, [300, 0, 500][: comm.size], **SHAPE), dtype)
    q, k, v, _ = tensors(prob, dtype, "cuda", comm.rank)
    out = torch.empty((1, 2, 1, 16), dtype=dtype, device="cuda")
    with mpitree.DecodePlan(1, 2, 1, 16, dtype=dtype) as plan:
        plan.decode(q, k, v, out=out)
        torch.cuda.synchronize()
        before = allocations()
        for _ in range(3):
            assert plan.decode(q, k, v, out=out) is out
        torch.cuda.synchronize()
        assert allocations() == before
    assert_allclose(out.double().cpu().numpy(), prob.reference()[0], atol=tol, rtol=0)


@pytest.mark.cuda
@pytest.mark.parallel(nprocs=[1])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_cuda_graph_replays_a_plan_step(dtype_name, triton_selected):  # noqa: F811
    """One rank: ``plan.decode`` captured once, replayed over new q, K, V and kv_len in place."""
    dtype, tol = DTYPES[dtype_name]
    cap = 600
    probs = [rounded(make_problem(40 + i, [cap], **SHAPE), dtype) for i in range(3)]
    q, k, v, _ = tensors(probs[0], dtype, "cuda")
    kv_len = torch.tensor([cap], device="cuda")
    out = torch.empty((1, 2, 1, 16), dtype=dtype, device="cuda")
    with mpitree.DecodePlan(1, 2, 1, 16, dtype=dtype) as plan:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up: Triton compiles, the workspace is made
            for _ in range(2):
                plan.decode(q, k, v, kv_len=kv_len, out=out)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            plan.decode(q, k, v, kv_len=kv_len, out=out)
        before = allocations()
        for i, prob in enumerate(probs):
            n = cap - 97 * i
            new_q, new_k, new_v, _ = tensors(prob, dtype, "cuda")
            q.copy_(new_q)
            k.copy_(new_k)
            v.copy_(new_v)
            k[:, :, n:] = float("nan")  # garbage past kv_len: never read
            kv_len.fill_(n)
            graph.replay()
            prob.kv_len = [np.array([n])]
            ref, _ = prob.reference()
            assert_allclose(out.double().cpu().numpy(), ref, atol=tol, rtol=0)
        assert allocations() == before


@pytest.mark.cuda
@pytest.mark.parallel(nprocs=[2, 3])
def test_cuda_graph_refuses_a_merge_across_ranks(triton_selected):  # noqa: F811
    """Several ranks: capturing a step is a clear error on every rank (MPI runs on the host)."""
    comm = world()
    dtype, _ = DTYPES["float32"]
    prob = rounded(make_problem(35, [300, 0, 500][: comm.size], **SHAPE), dtype)
    q, k, v, _ = tensors(prob, dtype, "cuda", comm.rank)
    out = torch.empty((1, 2, 1, 16), dtype=dtype, device="cuda")
    with mpitree.DecodePlan(1, 2, 1, 16, dtype=dtype) as plan:
        plan.decode(q, k, v, out=out)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="CUDA graph"):
            with torch.cuda.graph(graph):
                plan.decode(q, k, v, out=out)
        torch.cuda.synchronize()
        assert plan.decode(q, k, v, out=out) is out  # the plan goes on, uncaptured
    assert_allclose(out.double().cpu().numpy(), prob.reference()[0], atol=2e-5, rtol=0)
