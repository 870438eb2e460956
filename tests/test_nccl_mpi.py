"""The ``nccl`` strategy: an all-gather of every rank's records, folded on the device in rank order.

Also ``DecodePlan(..., like=)``, whose device merger (``nccl`` or ``device-node``) is built
once with the plan.

No GPU here: tests/device_merge.py's CPU-tensor kind stands in for device memory
(registered for these tests only; the torch adapter's own ``"device"`` kind serves
CUDA tensors), the same code runs torch.distributed's gloo backend in place of NCCL,
and the Triton merge kernel runs under its interpreter. The ``cuda``-marked cases
run real NCCL where each rank has a GPU of its own, and the refusal of ranks that
share one, in tests/gpu_check.sh.
"""

import datetime

import numpy as np
import pytest
import torch
import torch.distributed as dist
from device_merge import DeviceTensor
from helpers import gathered_identical, make_problem, world
from mpi4py import MPI
from numpy.testing import assert_allclose
from test_node_mpi import records, same_bits
from test_triton_decode import (  # sets TRITON_INTERPRET=1 without a GPU
    CUDA,
    DTYPES,
    rounded,
    triton_selected,  # noqa: F401  (a fixture)
)

import mpitree
from mpitree import _buffers
from mpitree._decode_plan import plan_merger
from mpitree._guard import RankError
from mpitree._merger import Merger
from mpitree._registry import host_strategies
from mpitree._strategies import REGISTRY, auto_strategy, nccl, resolve

NPROCS = [1, 2, 3, 4]
LAYOUTS = ["uneven", "some_empty", "one_holds_all"]
# the device strategies a plan merges with, and their node sizes (device-node: one real
# node, and virtual nodes of 2 ranks: several nodes, their leaders all-reducing)
DEVICE_PLANS = [("nccl", None), ("device-node", 0), ("device-node", 2)]


@pytest.fixture
def stand_in():
    """The CPU-tensor device kind registered for one test (CUDA tensors need none)."""
    kinds = list(_buffers.KINDS["device"])
    _buffers.register_kind(DeviceTensor)
    try:
        yield DeviceTensor
    finally:
        _buffers.KINDS["device"][:] = kinds


def tensors(prob, rank, device="cpu"):
    """``prob``'s query and ``rank``'s shard (and its keywords) as tensors on ``device``."""
    k, v, kw = prob.shard(rank)
    q, k, v = (torch.from_numpy(x).to(device) for x in (prob.q, k, v))
    kw = {key: None if x is None else torch.from_numpy(x).to(device) for key, x in kw.items()}
    return q, k, v, kw


def assert_reference(prob, out, lse):
    """``out`` and ``lse`` (numpy) against ``prob``'s float64 reference; empty rows' lse -inf."""
    ref_out, ref_lse = prob.reference()
    assert_allclose(out, ref_out, atol=2e-5, rtol=0)
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), empty)
    assert_allclose(lse[~empty], ref_lse[~empty], rtol=2e-6, atol=2e-6)


def sizes_of(layout, p):
    """Keys per rank: uneven, every other rank empty, or one rank holding every key."""
    return {
        "uneven": [7, 1, 12, 4][:p],
        "some_empty": [0 if r % 2 else 9 + r for r in range(p)],
        "one_holds_all": [0] * (p - 1) + [23],
    }[layout]


def test_declared():
    """Listed, device buffers only, rank-ordered, never picked by "auto", not in the CLI."""
    cls = REGISTRY["nccl"]
    assert "nccl" in mpitree.STRATEGIES and cls.buffers == ("device",)
    assert cls.auto_priority is None and cls.reproducible and not cls.uses_op
    assert not cls.needs_kv and not cls.persistent
    assert "nccl" not in host_strategies()
    assert resolve("nccl", world(), True) == "nccl"
    assert resolve("nccl", world(), True, deterministic=True) == "nccl"  # already rank order
    for size in (1, 2, 5, 17):
        for native in (False, True):
            assert auto_strategy(size, native, 1, size, False) != "nccl"


def test_refusal_rules():
    """Two ranks on one GPU, mixed devices, a rank lacking something: one message each."""
    ok = ("", "a", "cuda", 0)
    assert nccl.refusal([ok, ("", "a", "cuda", 1), ("", "b", "cuda", 0)]) == ""
    assert nccl.refusal([("", "a", "cpu", None)] * 3) == ""  # gloo: any number per host
    shared = nccl.refusal([ok, ("", "a", "cuda", 1), ("", "a", "cuda", 0)])
    assert "ranks 0 and 2 share GPU 0 on a" in shared and "NCCL refuses" in shared
    assert "one kind of device" in nccl.refusal([ok, ("", "a", "cpu", None)])
    lacking = nccl.refusal([ok, ("this torch has no NCCL backend", "a", "cuda", 1)])
    assert lacking == "strategy 'nccl' cannot run on rank 1: this torch has no NCCL backend"


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_tree_decode_matches_reference(stand_in, layout):
    """Exact against the float64 reference on uneven and empty shards, the same on every
    rank, and the same bits as ``device-node`` (one node: the same fold in rank order)."""
    comm = world()
    prob = make_problem(5, sizes_of(layout, comm.size), batch=2, q_len=3, positions=True,
                        mask="head")  # fmt: skip
    q, k, v, kw = tensors(prob, comm.rank)
    for _ in range(2):  # the second call reuses the cached merger and process group
        out, lse = mpitree.tree_decode(q, k, v, strategy="nccl", return_lse=True, **kw)
    assert isinstance(out, torch.Tensor) and out.device.type == "cpu"
    out, lse = out.numpy(), lse.numpy()
    assert_reference(prob, out, lse)
    assert gathered_identical(comm, out) and gathered_identical(comm, lse)
    node = mpitree.tree_decode(q, k, v, strategy="device-node", node_size=comm.size, **kw)
    assert same_bits(out, node.numpy())


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_merges_bits(stand_in, dtype):
    """The fold is the compiled op's combine in rank order: the ``node`` and ``device-node``
    strategies' bits on one node, step after step; ``allgather`` (numpy's exp, one pass)
    agrees to rounding."""
    comm = world()
    rows, dim = 9, 6
    mine = records(comm.rank, rows, dim, np.dtype(dtype))
    like = torch.zeros(1)
    made = [
        Merger(comm, rows, dim, dtype, "node", node_size=comm.size),
        Merger(comm, rows, dim, dtype, "allgather"),
        Merger(comm, rows, dim, dtype, "device-node", node_size=comm.size, like=like),
        Merger(comm, rows, dim, dtype, "nccl", like=like),
    ]
    host, gather, node, dev = made
    try:
        assert dev.kind.name == "device" and isinstance(dev.buf, torch.Tensor)
        want = host.merge(lambda out: out.__setitem__(Ellipsis, mine)).copy()
        close = gather.merge(lambda out: out.__setitem__(Ellipsis, mine)).copy()
        on_node = node.merge(lambda out: out.copy_(torch.from_numpy(mine))).copy()
        assert same_bits(on_node, want)
        for _ in range(3):
            got = dev.merge(lambda out: out.copy_(torch.from_numpy(mine))).copy()
            assert same_bits(got, want)
            assert gathered_identical(comm, got)
        finite = np.isfinite(want)
        assert np.array_equal(np.isfinite(close), finite)
        assert_allclose(close[finite], want[finite], rtol=1e-5 if dtype == "float32" else 1e-13)
    finally:
        for merger in made:
            merger.free()


@pytest.mark.parallel(nprocs=NPROCS)
def test_same_bits_run_after_run(stand_in):
    """Call after call, and under ``deterministic=True`` (which keeps it): the same bits."""
    comm = world()
    prob = make_problem(8, [5 + 3 * r for r in range(comm.size)], q_len=2)
    q, k, v, kw = tensors(prob, comm.rank)
    outs = [
        mpitree.tree_decode(q, k, v, strategy="nccl", deterministic=det, **kw).numpy()
        for det in (False, True, False, False)
    ]
    assert all(np.array_equal(out.view(np.uint32), outs[0].view(np.uint32)) for out in outs)
    assert gathered_identical(comm, outs[0])


@pytest.mark.parallel(nprocs=NPROCS)
def test_a_failing_rank_raises_on_every_rank(stand_in):
    """One rank's local work fails: its flag rides the all-gather to every rank."""
    comm = world()
    merger = Merger(comm, 4, 8, "float32", "nccl", like=torch.zeros(1))
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


@pytest.mark.parallel(nprocs=[1, 2, 3, 4])
def test_bad_input_on_one_rank_raises_on_every_rank(stand_in):
    """A bad shard on one rank: its own error there, RankError naming it elsewhere; then
    the strategy merges again."""
    comm = world()
    prob = make_problem(3, [4 + r for r in range(comm.size)], q_len=1)
    q, k, v, kw = tensors(prob, comm.rank)
    bad = comm.size - 1
    wrong = k[:, :, :, :3] if comm.rank == bad else k  # another head dim
    with pytest.raises(ValueError) as info:
        mpitree.tree_decode(q, wrong, v, strategy="nccl", **kw)
    assert info.type is (ValueError if comm.rank == bad else RankError), info.value
    if comm.rank != bad:
        assert f"invalid input on rank {bad}" in str(info.value)
    out = mpitree.tree_decode(q, k, v, strategy="nccl", **kw)
    assert_allclose(out.numpy(), prob.reference()[0], atol=2e-5, rtol=0)


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_decode_plan_refuses_on_every_rank(stand_in):
    """A plan without ``like=`` a tensor builds its merger at construction over host records
    (it does not know the arrays' device), which no device kind serves: an agreed error on
    every rank, naming ``like=``; and so with ``like=`` a numpy array."""
    with pytest.raises(ValueError, match="strategy 'nccl' merges in device buffers") as info:
        mpitree.DecodePlan(2, 4, 2, 16, strategy="nccl")
    assert "without like=" in str(info.value)
    with pytest.raises(ValueError, match="strategy 'nccl' merges in device buffers"):
        mpitree.DecodePlan(2, 4, 2, 16, strategy="nccl", like=np.zeros(1, np.float32))
    with mpitree.DecodePlan(2, 4, 2, 16) as plan:  # the communicator still works
        assert plan.strategy in host_strategies()


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("strategy, node_size", DEVICE_PLANS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_plan_merges_on_the_device(stand_in, strategy, node_size, layout):
    """``like=`` a tensor: the plan's device merger is built once with it; each step merges
    in it, exact against the float64 reference on uneven and empty shards, the same bits
    step after step, as ``tree_decode``'s, and on every rank."""
    comm = world()
    prob = make_problem(5, sizes_of(layout, comm.size), batch=2, q_len=3, positions=True,
                        mask="head")  # fmt: skip
    q, k, v, kw = tensors(prob, comm.rank)
    opts = dict(strategy=strategy, node_size=node_size)
    with mpitree.DecodePlan(2, 4, 2, 16, q_len=3, like=q, **opts) as plan:
        merger = plan_merger(plan)
        assert plan.strategy == strategy and merger.kind.name == "device"
        assert isinstance(merger.buf, torch.Tensor) and merger.buf.device == q.device
        assert "like=torch tensors on cpu" in repr(plan)
        steps = [plan.decode(q, k, v, return_lse=True, **kw) for _ in range(3)]
        assert plan_merger(plan) is merger
    out, lse = steps[0]
    assert isinstance(out, torch.Tensor) and out.device == q.device and out.dtype == q.dtype
    out, lse = out.numpy(), lse.numpy()
    assert_reference(prob, out, lse)
    for again, again_lse in steps[1:]:
        assert same_bits(again.numpy(), out) and same_bits(again_lse.numpy(), lse)
    assert same_bits(mpitree.tree_decode(q, k, v, **opts, **kw).numpy(), out)
    assert gathered_identical(comm, out) and gathered_identical(comm, lse)


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("strategy, node_size", DEVICE_PLANS)
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_plan_loop_through_the_triton_kernel(
    stand_in,
    strategy,
    node_size,
    dtype_name,
    triton_selected,  # noqa: F811
):
    """A decode loop, the last rank's shard growing a token a step and every other rank's
    empty or not, with ``MPITREE_KERNEL=triton``: the kernel writes each step's records
    straight into the plan's device buffer; exact against the float64 reference, as
    ``tree_decode``, the same bits on every rank."""
    comm = world()
    dtype, tol = DTYPES[dtype_name]
    p, last, steps = comm.size, comm.size - 1, 3
    sizes = [0 if r % 2 else 4 + r for r in range(p)]
    final = rounded(make_problem(9, [*sizes[:-1], sizes[-1] + steps], q_heads=8), dtype)
    k_all, v_all, _ = final.shard(comm.rank)
    rng = np.random.default_rng(3)
    opts = dict(strategy=strategy, node_size=node_size)
    like = torch.empty(0, dtype=dtype)
    with mpitree.DecodePlan(2, 8, 2, 16, dtype=dtype, like=like, **opts) as plan:
        for step in range(1, steps + 1):
            t = sizes[comm.rank] + (step if comm.rank == last else 0)
            q = rng.standard_normal((2, 8, 1, 16))
            q = torch.from_numpy(q).to(dtype)
            k, v = (torch.from_numpy(x[:, :, :t]).to(dtype) for x in (k_all, v_all))
            calls = dict(triton_selected)
            out = plan.decode(q, k, v)
            assert triton_selected["records"] == calls["records"] + 1
            assert out.dtype == dtype and out.device == like.device
            n = sum(sizes) + step  # the last rank's keys come last in the concatenation
            keys, values = final.k[:, :, :n], final.v[:, :, :n]
            ref, _ = mpitree.reference_attention(q.double().numpy(), keys, values)
            got = out.double().numpy()
            assert_allclose(got, ref, atol=tol, rtol=0)
            assert same_bits(mpitree.tree_decode(q, k, v, **opts).double().numpy(), got)
            assert gathered_identical(comm, got)


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("strategy", ["auto", "allreduce", "allgather", "hierarchical", "ring"])
def test_host_strategies_with_like_keep_their_bits(strategy):
    """``like=`` a CPU tensor under a host strategy (and ``"auto"``, which stays one): host
    records, the same bits as a plan without it, step after step."""
    comm = world()
    prob = make_problem(6, [5 + 2 * r for r in range(comm.size)], q_len=2)
    q, k, v, kw = tensors(prob, comm.rank)
    with (
        mpitree.DecodePlan(2, 4, 2, 16, q_len=2, strategy=strategy, like=q) as plan,
        mpitree.DecodePlan(2, 4, 2, 16, q_len=2, strategy=strategy) as plain,
    ):
        assert plan.strategy == plain.strategy and plan.strategy in host_strategies()
        assert plan_merger(plan).kind.name == "host"
        for _ in range(2):
            out = plan.decode(q, k, v, **kw)
            assert isinstance(out, torch.Tensor)
            assert same_bits(out.numpy(), plain.decode(q, k, v, **kw).numpy())
    assert_allclose(out.numpy(), prob.reference()[0], atol=2e-5, rtol=0)


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("strategy", ["nccl", "device-node", "auto"])
@pytest.mark.parametrize("wrong", ["numpy", "meta"])
def test_a_step_elsewhere_raises_on_every_rank(stand_in, strategy, wrong):
    """A plan made for CPU tensors given numpy arrays, or tensors on another device (meta),
    on one rank: its own ValueError there, a RankError naming it elsewhere, before anything
    reads them; then the plan steps again."""
    comm = world()
    bad = comm.size - 1
    prob = make_problem(4, [3 + r for r in range(comm.size)])
    q, k, v, _ = tensors(prob, comm.rank)
    with mpitree.DecodePlan(2, 4, 2, 16, strategy=strategy, like=q) as plan:
        args = (q, k, v)
        if comm.rank == bad:
            args = (
                (prob.q, *prob.shard(bad)[:2]) if wrong == "numpy" else [x.to("meta") for x in args]
            )
        with pytest.raises(ValueError) as info:
            plan.decode(*args)
        assert info.type is (ValueError if comm.rank == bad else RankError), info.value
        got = "numpy arrays" if wrong == "numpy" else "torch tensors on meta"
        message = str(info.value)
        assert (
            f"made for torch tensors on cpu (like=) and its records live there; got {got}"
            in message
        )
        out = plan.decode(q, k, v)
    assert_allclose(out.numpy(), prob.reference()[0], atol=2e-5, rtol=0)


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_a_plan_it_cannot_make_raises_on_every_rank(stand_in):
    """``like=`` no array on one rank, a tensor no kind serves on one rank (its stand-in
    missing), or a tensor on some ranks only: agreed errors on every rank; then a plan is
    made over the same communicator."""
    comm = world()
    last = comm.rank == comm.size - 1
    with pytest.raises((TypeError, RankError)) as info:
        mpitree.DecodePlan(2, 4, 2, 16, like="cpu" if last else torch.zeros(1))
    assert info.type is (TypeError if last else RankError), info.value
    assert "like= takes a numpy, torch, CuPy or JAX array" in str(info.value)
    if last:
        _buffers.KINDS["device"].remove(DeviceTensor)
    try:
        with pytest.raises((ValueError, RankError)) as info:
            mpitree.DecodePlan(2, 4, 2, 16, strategy="nccl", like=torch.zeros(1))
    finally:
        if last:
            _buffers.register_kind(DeviceTensor)
    assert info.type is (ValueError if last else RankError), info.value
    assert "no buffer kind" in str(info.value)
    if comm.size > 1:
        with pytest.raises(ValueError, match="ranks disagree"):
            mpitree.DecodePlan(2, 4, 2, 16, like=None if last else torch.zeros(1))
    with mpitree.DecodePlan(2, 4, 2, 16, strategy="nccl", like=torch.zeros(1)) as plan:
        assert plan_merger(plan).kind.name == "device"


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("strategy", ["nccl", "device-node"])
def test_a_plan_without_what_it_needs_raises_on_every_rank(stand_in, monkeypatch, strategy):
    """CPU tensors without the interpreter (where there is a merge to run): the same
    ValueError on every rank, before any torch collective; for ``nccl`` also gloo missing
    on one rank. Then a plan is made."""
    comm = world()
    last = comm.size - 1

    def no_group(*args):
        raise AssertionError("a process group was made")

    sub = comm.Dup()  # a communicator with no process group yet
    try:
        monkeypatch.setattr(nccl, "Group", no_group)
        if strategy == "nccl":
            if comm.rank == last:
                monkeypatch.setattr(dist, "is_gloo_available", lambda: False)
            says = f"strategy 'nccl' cannot run on rank {last}: this torch has no GLOO backend"
            with pytest.raises(ValueError, match=says):
                mpitree.DecodePlan(2, 4, 2, 16, comm=sub, strategy="nccl", like=torch.zeros(1))
            monkeypatch.setattr(dist, "is_gloo_available", lambda: True)
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        if strategy == "nccl" or comm.size > 1:  # device-node's one rank merges nothing
            with pytest.raises(ValueError, match=f"strategy '{strategy}' .*TRITON_INTERPRET=1"):
                mpitree.DecodePlan(2, 4, 2, 16, comm=sub, strategy=strategy, like=torch.zeros(1))
        monkeypatch.undo()
        prob = make_problem(2, [3 + r for r in range(comm.size)])
        q, k, v, kw = tensors(prob, comm.rank)
        with mpitree.DecodePlan(2, 4, 2, 16, comm=sub, strategy=strategy, like=q) as plan:
            out = plan.decode(q, k, v, **kw)
        assert_allclose(out.numpy(), prob.reference()[0], atol=2e-5, rtol=0)
    finally:
        sub.Free()


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_a_call_it_cannot_serve_raises_on_every_rank(stand_in):
    """numpy arrays, or CPU tensors without the stand-in on one rank: agreed errors."""
    comm = world()
    prob = make_problem(0, [4] * comm.size)
    k, v, _ = prob.shard(comm.rank)
    with pytest.raises(ValueError, match="strategy 'nccl' merges in device buffers"):
        mpitree.tree_decode(prob.q, k, v, strategy="nccl")
    last = comm.rank == comm.size - 1
    if last:
        _buffers.KINDS["device"].remove(DeviceTensor)
    q, k, v = (torch.from_numpy(x) for x in (prob.q, k, v))
    with pytest.raises((ValueError, RankError)) as info:
        mpitree.tree_decode(q, k, v, strategy="nccl")
    assert info.type is (ValueError if last else RankError), info.value
    assert "no buffer kind" in str(info.value)


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_a_missing_backend_on_one_rank_raises_on_every_rank(stand_in, monkeypatch):
    """gloo (NCCL, for CUDA tensors) missing on one rank: the same error on every rank,
    before any torch collective; and the interpreter missing for CPU tensors."""
    comm = world()
    last = comm.size - 1
    if comm.rank == last:
        monkeypatch.setattr(dist, "is_gloo_available", lambda: False)
    says = f"strategy 'nccl' cannot run on rank {last}: this torch has no GLOO backend"
    with pytest.raises(ValueError, match=says):
        Merger(comm, 2, 4, "float32", "nccl", like=torch.zeros(1))
    monkeypatch.undo()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="rank 0: CPU tensors need TRITON_INTERPRET=1"):
        Merger(comm, 2, 4, "float32", "nccl", like=torch.zeros(1))


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize("fails", ["opening", "joining", "making"])
@pytest.mark.parametrize("made", ["merger", "plan"])
def test_a_failed_rendezvous_raises_on_every_rank(stand_in, monkeypatch, fails, made):
    """The store failing on rank 0 or on the last rank, or the group on rank 0 (the others
    wait out the timeout in gloo's connect): a RuntimeError on every rank, not a hang, for a
    merger or a plan (``like=`` a tensor) being made."""
    comm = world()
    bad = comm.size - 1 if fails == "joining" else 0
    monkeypatch.setattr(nccl, "TIMEOUT", datetime.timedelta(seconds=3))

    def broken(*args, **kwargs):
        raise RuntimeError("no sockets today")

    def make():
        if made == "plan":
            plan = mpitree.DecodePlan(1, 2, 2, 4, comm=sub, strategy="nccl", like=torch.zeros(1))
            return plan_merger(plan)
        return Merger(sub, 2, 4, "float32", "nccl", like=torch.zeros(1))

    if comm.rank == bad:
        monkeypatch.setattr(*((dist, "TCPStore") if fails != "making" else (nccl, "_backend")),
                            broken)  # fmt: skip
    sub = comm.Dup()  # a communicator with no group yet
    try:
        with pytest.raises(RuntimeError, match=f"strategy 'nccl': {fails}.* failed on rank {bad}"):
            make()
        monkeypatch.undo()
        merger = make()  # then it is made
        assert np.isfinite(merger.merge(lambda out: out.fill_(1.0))).all()
        merger.free()
    finally:
        sub.Free()


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_the_users_default_group_is_left_alone(stand_in):
    """Its group is its own: no default group made, and a user's default group unchanged."""
    comm = world()
    prob = make_problem(2, [3 + r for r in range(comm.size)])
    q, k, v, kw = tensors(prob, comm.rank)
    mpitree.tree_decode(q, k, v, strategy="nccl", **kw)
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        before = dist.group.WORLD
        sub = MPI.COMM_WORLD.Dup()  # a new communicator: a new group of its own
        try:
            out = mpitree.tree_decode(q, k, v, comm=sub, strategy="nccl", **kw)
        finally:
            sub.Free()
        assert dist.group.WORLD is before and dist.get_world_size() == 1
        assert_allclose(out.numpy(), prob.reference()[0], atol=2e-5, rtol=0)
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.parallel(nprocs=[1, 2, 3, 4])
@pytest.mark.skipif(not CUDA, reason="no CUDA device")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_real_nccl_on_a_gpu_each(layout):
    """Real NCCL, each rank on its own GPU: exact, the same on every rank, run after run."""
    comm = world()
    if torch.cuda.device_count() < comm.size:
        pytest.skip(f"{comm.size} ranks need a GPU each, {torch.cuda.device_count()} here")
    device = f"cuda:{comm.rank}"
    prob = make_problem(5, sizes_of(layout, comm.size), batch=2, q_len=3, positions=True,
                        mask="head")  # fmt: skip
    q, k, v, kw = tensors(prob, comm.rank, device)
    outs = [mpitree.tree_decode(q, k, v, strategy="nccl", **kw) for _ in range(3)]
    assert outs[0].device == torch.device(device)
    outs = [out.cpu().numpy() for out in outs]
    assert_allclose(outs[0], prob.reference()[0], atol=2e-5, rtol=0)
    assert all(same_bits(out, outs[0]) for out in outs)
    assert gathered_identical(comm, outs[0])


@pytest.mark.cuda
@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.skipif(not CUDA, reason="no CUDA device")
def test_ranks_sharing_a_gpu_are_refused_on_every_rank():
    """Two ranks on one GPU: a ValueError on every rank before any NCCL call, not a hang."""
    comm = world()
    prob = make_problem(1, [4] * comm.size)
    q, k, v, kw = tensors(prob, comm.rank, "cuda:0")
    with pytest.raises(ValueError, match="share GPU 0"):
        mpitree.tree_decode(q, k, v, strategy="nccl", **kw)
    out = mpitree.tree_decode(q, k, v, strategy="device-node", **kw)  # which merges them
    assert_allclose(out.cpu().numpy(), prob.reference()[0], atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="share GPU 0"):
        mpitree.DecodePlan(2, 4, 2, 16, strategy="nccl", like=q)
    with mpitree.DecodePlan(2, 4, 2, 16, strategy="device-node", like=q) as plan:
        assert plan_merger(plan).buf.device == q.device
        out = plan.decode(q, k, v, **kw)
    assert out.device == q.device
    assert_allclose(out.cpu().numpy(), prob.reference()[0], atol=2e-5, rtol=0)


@pytest.mark.cuda
@pytest.mark.parallel(nprocs=[1, 2, 3, 4])
@pytest.mark.skipif(not CUDA, reason="no CUDA device")
def test_real_nccl_plan_on_a_gpu_each():
    """A plan with ``like=`` a CUDA tensor over real NCCL, each rank on its own GPU: its
    records on that GPU, exact, the same bits step after step and on every rank; CPU
    tensors on one rank refused on every rank."""
    comm = world()
    if torch.cuda.device_count() < comm.size:
        pytest.skip(f"{comm.size} ranks need a GPU each, {torch.cuda.device_count()} here")
    device = f"cuda:{comm.rank}"
    prob = make_problem(5, sizes_of("some_empty", comm.size), batch=2, q_len=3, positions=True,
                        mask="head")  # fmt: skip
    q, k, v, kw = tensors(prob, comm.rank, device)
    with mpitree.DecodePlan(2, 4, 2, 16, q_len=3, strategy="nccl", like=q) as plan:
        assert plan_merger(plan).buf.device == q.device
        outs = [plan.decode(q, k, v, **kw) for _ in range(3)]
        bad = comm.rank == comm.size - 1
        with pytest.raises(ValueError, match="made for torch tensors on cuda"):
            plan.decode(*((x.cpu() for x in (q, k, v)) if bad else (q, k, v)), **kw)
    assert outs[0].device == q.device
    outs = [out.cpu().numpy() for out in outs]
    assert_allclose(outs[0], prob.reference()[0], atol=2e-5, rtol=0)
    assert all(same_bits(out, outs[0]) for out in outs)
    assert gathered_identical(comm, outs[0])


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("strategy, node_size", DEVICE_PLANS)
def test_a_step_whose_q_requires_grad_leaves_no_graph_on_the_plans_records(
    stand_in, strategy, node_size
):
    """The records a step writes into the plan's device buffer never join autograd: after
    a step whose q requires grad, the buffer requires none and holds no graph (it grew by
    nodes every later step, a leak over a decode loop), and the steps keep their bits."""
    comm = world()
    prob = make_problem(6, sizes_of("uneven", comm.size), batch=2)
    q, k, v, kw = tensors(prob, comm.rank)
    with mpitree.DecodePlan(2, 4, 2, 16, like=q, strategy=strategy, node_size=node_size) as plan:
        first = plan.decode(q, k, v, **kw)
        tracked = plan.decode(q.clone().requires_grad_(), k, v, **kw)
        later = [plan.decode(q, k, v, **kw) for _ in range(3)]
        buf = plan_merger(plan).buf
        assert not buf.requires_grad and buf.grad_fn is None
    assert same_bits(tracked.detach().numpy(), first.numpy())
    assert all(same_bits(x.numpy(), first.numpy()) for x in later)
