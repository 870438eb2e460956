"""``MPITREE_KERNEL=triton`` under real ranks: tree_decode and DecodePlan through the kernel.

Uneven and empty shards, GQA, causal positions, per-head masks with ragged lengths,
garbage past ``kv_len``, in every dtype the kernel takes; checked against the float64
reference over the concatenated cache. CPU tensors run under Triton's interpreter
(``test_triton_decode`` sets ``TRITON_INTERPRET=1`` where no GPU is); the
``cuda``-marked cases run the compiled kernel where one is.
"""

import numpy as np
import pytest
import torch
from helpers import make_problem, world
from numpy.testing import assert_allclose
from test_buffers_mpi import device_strategy  # noqa: F401  (a fixture)
from test_triton_decode import (
    DEVICES,
    DTYPES,
    rounded,
    tensors,
    triton_selected,  # noqa: F401  (a fixture)
)

import mpitree

CASES = {
    "gqa": dict(q_heads=8, kv_heads=2),
    "causal": dict(batch=3, q_len=3, positions=True),
    "mask_per_head_ragged": dict(q_len=2, mask="head", kv_len=True),
}


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("case", list(CASES))
def test_tree_decode_through_triton(device, dtype_name, case, triton_selected):  # noqa: F811
    comm = world()
    dtype, tol = DTYPES[dtype_name]
    prob = rounded(make_problem(21, [6, 0, 9][: comm.size], **CASES[case]), dtype)
    q, k, v, kw = tensors(prob, dtype, device, comm.rank)
    out, lse = mpitree.tree_decode(q, k, v, return_lse=True, **kw)
    assert triton_selected == {"records": 1, "output": 1}
    assert out.dtype == dtype and out.device.type == device
    ref, ref_lse = prob.reference()
    assert_allclose(out.double().cpu().numpy(), ref, atol=tol, rtol=0)
    fin = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse.cpu().numpy()), fin)
    assert_allclose(lse.cpu().numpy()[fin], ref_lse[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_decode_plan_through_triton(device, dtype_name, triton_selected):  # noqa: F811
    """A growing cache of fixed capacity, NaN past kv_len; each step's bits repeat."""
    comm = world()
    dtype, tol = DTYPES[dtype_name]
    cap = [12, 0, 20][comm.rank]  # uneven shards, one empty
    sizes = [12, 0, 20][: comm.size]
    prob = rounded(make_problem(22, sizes, batch=2, q_heads=4, kv_heads=2), dtype)
    q, k, v, _ = tensors(prob, dtype, device, comm.rank)
    with mpitree.DecodePlan(2, 4, 2, 16, dtype=dtype) as plan:
        for step, fill in enumerate((0.3, 0.7, 1.0)):
            lens = np.array([int(cap * fill), int(cap * fill) // 2])
            garbage_k, garbage_v = k.clone(), v.clone()
            for b, n in enumerate(lens):
                garbage_k[b, :, n:] = float("nan")
                garbage_v[b, :, n:] = float("inf")
            kv_len = torch.from_numpy(lens).to(device)
            out = plan.decode(q, garbage_k, garbage_v, kv_len=kv_len)
            again = plan.decode(q, garbage_k, garbage_v, kv_len=kv_len)
            assert torch.equal(out, again)
            everyone = comm.allgather(lens)
            prob.kv_len = everyone
            ref, _ = prob.reference()
            assert_allclose(out.double().cpu().numpy(), ref, atol=tol, rtol=0)
            assert triton_selected == {"records": 2 * step + 2, "output": 2 * step + 2}


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_records_land_in_a_device_kinds_buffer(device_strategy, triton_selected, monkeypatch):  # noqa: F811
    """Through a strategy over a device kind, the kernel writes the merger's own tensor.

    No host staging between the kernel and the merge: the records the kernel
    writes are the merger's buffer (tests/device_merge.py's CPU-tensor kind stands
    in for device memory).
    """
    from test_triton_decode import kernel

    written, records = [], kernel.decode_records
    monkeypatch.setattr(
        kernel, "decode_records", lambda *a, **kw: written.append(a[6]) or records(*a, **kw)
    )
    comm = world()
    dtype, tol = DTYPES["bfloat16"]
    prob = rounded(make_problem(23, [6, 0, 9][: comm.size], **CASES["gqa"]), dtype)
    q, k, v, kw = tensors(prob, dtype, "cpu", comm.rank)
    comm = comm.Dup()  # a merger of its own: one cached by an earlier test is not rebuilt
    try:
        out = mpitree.tree_decode(q, k, v, strategy=device_strategy.name, comm=comm, **kw)
    finally:
        comm.Free()
    buf = device_strategy.built[-1].merger.buf
    assert [x.data_ptr() for x in written] == [buf.data_ptr()]
    ref, _ = prob.reference()
    assert_allclose(out.double().numpy(), ref, atol=tol, rtol=0)
