"""The ``device-node`` strategy: a node's records merged on the device by one kernel in rank order.

No GPU here: tests/device_merge.py's CPU-tensor kind stands in for device memory
(registered for these tests only; the torch adapter's own ``"device"`` kind serves
CUDA tensors), the node's slots live in the ``node`` strategy's shared window, and
the Triton merge kernel runs under its interpreter. The ``cuda``-marked cases run the
same tests over CUDA tensors, the slots opened through CUDA IPC handles, where a GPU is.
"""

import numpy as np
import pytest
import torch
from device_merge import DeviceTensor
from helpers import gathered_identical, make_problem, world
from mpitree.adapters import _device_slots
from numpy.testing import assert_allclose
from test_node_mpi import records, same_bits
from test_triton_decode import CUDA, DEVICES  # sets TRITON_INTERPRET=1 without a GPU

import mpitree
from mpitree import _buffers
from mpitree._guard import RankError
from mpitree._merger import Merger
from mpitree._strategies import REGISTRY, resolve

NPROCS = [1, 2, 3, 4]
NODE_SIZES = [0, 1, 2, 3]  # one real node, one rank per node, uneven virtual nodes


@pytest.fixture
def stand_in():
    """The CPU-tensor device kind registered for one test (CUDA tensors need none)."""
    kinds = list(_buffers.KINDS["device"])
    _buffers.register_kind(DeviceTensor)
    try:
        yield DeviceTensor
    finally:
        _buffers.KINDS["device"][:] = kinds


def on(device, x):
    """``x`` (numpy or None) as a tensor on ``device``."""
    return None if x is None else torch.from_numpy(x).to(device)


def test_declared_and_kinds():
    """Listed, device buffers only, never picked by "auto"; the torch kind serves CUDA only."""
    cls = REGISTRY["device-node"]
    assert "device-node" in mpitree.STRATEGIES and cls.buffers == ("device",)
    assert cls.auto_priority is None and cls.uses_op and not cls.reproducible
    assert resolve("device-node", world(), True) == "device-node"
    assert resolve("device-node", world(), True, deterministic=True) == "allgather"
    assert _device_slots.Device in _buffers.KINDS["device"]
    assert not _device_slots.Device.serves(torch.zeros(1))  # CPU tensors: the stand-in's
    assert not _device_slots.Device.serves(np.zeros(1))
    # the host strategies' choice is unchanged by a device kind: pinned for CUDA, host else
    assert _buffers.kind_for(("host", "pinned"), torch.zeros(1)) is _buffers.Host
    assert _buffers.kind_for(("device",), torch.zeros(1)) is None


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("node_size", NODE_SIZES)
@pytest.mark.parametrize("layout", ["uneven", "some_empty", "one_holds_all"])
def test_tree_decode_matches_reference(stand_in, device, node_size, layout):
    """Exact against the float64 reference on every node layout, the same on every rank."""
    comm = world()
    p = comm.size
    sizes = {
        "uneven": [7, 1, 12, 4][:p],
        "some_empty": [0 if r % 2 else 9 + r for r in range(p)],
        "one_holds_all": [0] * (p - 1) + [23],
    }[layout]
    prob = make_problem(5, sizes, batch=2, q_len=3, positions=True, mask="head")
    k, v, kw = prob.shard(comm.rank)
    q, k, v = (on(device, x) for x in (prob.q, k, v))
    kw = {key: on(device, x) for key, x in kw.items()}
    for _ in range(2):  # the second call reuses the cached merger and its slots
        out, lse = mpitree.tree_decode(
            q, k, v, strategy="device-node", node_size=node_size, return_lse=True, **kw
        )
    assert isinstance(out, torch.Tensor) and out.device.type == device
    out, lse = out.cpu().numpy(), lse.cpu().numpy()
    ref_out, ref_lse = prob.reference()
    assert_allclose(out, ref_out, atol=2e-5, rtol=0)
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), empty)
    assert_allclose(lse[~empty], ref_lse[~empty], rtol=2e-6, atol=2e-6)
    assert gathered_identical(comm, out) and gathered_identical(comm, lse)


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("node_size", NODE_SIZES)
def test_the_node_strategys_bits(stand_in, device, dtype, node_size):
    """The kernel's fold is the ``node`` strategy's (the compiled op's combine), bit for
    bit, on every layout, step after step (both sets of slots, then the first again)."""
    comm = world()
    rows, dim = 9, 6
    mine = records(comm.rank, rows, dim, np.dtype(dtype))
    like = torch.zeros(1, device=device)
    host = Merger(comm, rows, dim, dtype, "node", node_size=node_size)
    dev = Merger(comm, rows, dim, dtype, "device-node", node_size=node_size, like=like)
    try:
        assert dev.kind.name == "device" and isinstance(dev.buf, torch.Tensor)
        want = host.merge(lambda out: out.__setitem__(Ellipsis, mine)).copy()
        for _ in range(3):
            got = dev.merge(lambda out: out.copy_(torch.from_numpy(mine))).copy()
            assert same_bits(got, want)
            assert gathered_identical(comm, got)
    finally:
        host.free()
        dev.free()


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("device", DEVICES)
def test_same_bits_run_after_run(stand_in, device):
    """One node, any virtual node size as large as the communicator: the same bits."""
    comm = world()
    prob = make_problem(8, [5 + 3 * r for r in range(comm.size)], q_len=2)
    k, v, kw = prob.shard(comm.rank)
    q, k, v = (on(device, x) for x in (prob.q, k, v))
    kw = {key: on(device, x) for key, x in kw.items()}
    outs = [
        mpitree.tree_decode(q, k, v, strategy="device-node", node_size=size, **kw).cpu().numpy()
        for size in (0, comm.size, 0, 0)
    ]
    assert all(np.array_equal(out.view(np.uint32), outs[0].view(np.uint32)) for out in outs)
    assert gathered_identical(comm, outs[0])


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("node_size", NODE_SIZES)
def test_a_failing_rank_raises_on_every_rank(stand_in, device, node_size):
    """One rank's local work fails: its flag rides the slots and the leaders' merge."""
    comm = world()
    like = torch.zeros(1, device=device)
    merger = Merger(comm, 4, 8, "float32", "device-node", node_size=node_size, like=like)
    bad = comm.size - 1

    def local(out):
        if comm.rank == bad:
            raise ValueError("this rank's shard is broken")
        out.fill_(1.0)

    try:
        with pytest.raises(ValueError if comm.rank == bad else RankError, match="broken"):
            merger.merge(local)
        out = merger.merge(lambda out: out.fill_(1.0))  # then it merges again
        assert np.isfinite(out).all()
    finally:
        merger.free()


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_a_call_it_cannot_serve_raises_on_every_rank(stand_in):
    """numpy arrays, or CPU tensors without the stand-in on one rank: agreed errors."""
    comm = world()
    prob = make_problem(0, [4] * comm.size)
    k, v, _ = prob.shard(comm.rank)
    says = "strategy 'device-node' merges in device buffers, and no buffer kind"
    with pytest.raises(ValueError, match=says):
        mpitree.tree_decode(prob.q, k, v, strategy="device-node")
    last = comm.rank == comm.size - 1
    if last:  # CUDA IPC slots cannot hold CPU tensors: only the stand-in serves them
        _buffers.KINDS["device"].remove(DeviceTensor)
    q, k, v = (torch.from_numpy(x) for x in (prob.q, k, v))
    with pytest.raises((ValueError, RankError)) as info:
        mpitree.tree_decode(q, k, v, strategy="device-node")
    assert info.type is (ValueError if last else RankError), info.value
    assert "no buffer kind" in str(info.value)
    if last:
        _buffers.register_kind(DeviceTensor)
    out = mpitree.tree_decode(q, k, v, strategy="device-node")
    assert_allclose(out.numpy().astype(np.float64), prob.reference()[0], atol=2e-5)


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_the_error_names_what_the_call_got_and_what_the_kinds_serve(stand_in):
    """A plan of a torch dtype (its records are host records), CPU tensors a kind missing on
    one rank cannot serve: the error names the framework, dtype and device it got, and what
    the strategy's kinds serve, never "numpy arrays"."""
    comm = world()
    serve = "device kinds registered serve CPU torch tensors (the tests' stand-in"
    with pytest.raises(ValueError) as info:
        mpitree.DecodePlan(1, 2, 2, 8, dtype=torch.bfloat16, strategy="device-node")
    message = str(info.value)
    assert "serves a DecodePlan of dtype torch.bfloat16: a plan is made from a dtype" in message
    assert serve in message and "numpy arrays" not in message, message
    last = comm.rank == comm.size - 1
    if last:
        _buffers.KINDS["device"].remove(DeviceTensor)
    q = torch.zeros((1, 2, 1, 8), dtype=torch.float16)
    try:
        with pytest.raises((ValueError, RankError)) as info:
            mpitree.tree_decode(q, q, q, strategy="device-node")
    finally:
        if last:
            _buffers.register_kind(DeviceTensor)
    message = str(info.value)
    assert "serves torch.Tensor of torch.float16 on cpu; device kinds registered serve" in message
    assert "CUDA tensors where Triton is installed" in message, message


@pytest.mark.cuda
@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.skipif(not CUDA, reason="no CUDA device")
def test_without_triton_no_kind_serves_cuda_tensors(monkeypatch):
    """Without Triton the CUDA kind serves nothing: an agreed error on every rank."""
    monkeypatch.setattr(_device_slots, "_TRITON", [False])
    prob = make_problem(0, [4] * world().size)
    k, v, _ = prob.shard(world().rank)
    q, k, v = (torch.from_numpy(x).cuda() for x in (prob.q, k, v))
    with pytest.raises(ValueError, match="no buffer kind"):
        mpitree.tree_decode(q, k, v, strategy="device-node")


@pytest.mark.parallel(nprocs=[2, 3])
def test_cpu_tensors_need_the_interpreter(stand_in, monkeypatch):
    """CPU tensors without TRITON_INTERPRET=1: a clear error on every rank, not a hang."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        Merger(world(), 2, 4, "float32", "device-node", like=torch.zeros(1))
