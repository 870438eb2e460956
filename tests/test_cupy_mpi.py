"""mpitree.adapters.cupy (and the core's CuPy path) under real ranks.

CuPy needs a CUDA GPU. Without one, the dispatch and staging (device records,
host reductions, results back on the device) run over a stand-in ``cupy``
module whose arrays are *not* numpy arrays and refuse implicit conversion, as
real CuPy arrays do (tests/standins.py); ``test_real_cupy_on_cuda`` runs the
real thing.
"""

import importlib
import sys

import numpy as np
import pytest
from helpers import make_problem, world
from numpy.testing import assert_allclose
from standins import FakeCupyArray, fake_cupy

STRATEGIES = ["allreduce", "allgather", "allreduce3", "ring", "auto"]


def test_stand_in_is_not_a_numpy_array():
    x = fake_cupy().asarray(np.zeros(3))
    assert not isinstance(x, np.ndarray) and not issubclass(FakeCupyArray, np.ndarray)
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(x)


@pytest.fixture
def adapter(monkeypatch):
    """The adapter imported over the stand-in cupy module."""
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy())
    monkeypatch.delitem(sys.modules, "mpitree.adapters.cupy", raising=False)
    yield importlib.import_module("mpitree.adapters.cupy")
    sys.modules.pop("mpitree.adapters.cupy", None)


def run(cp, strategy, dtype, deterministic=False):
    comm = world()
    prob = make_problem(
        5, [6, 0, 9, 3][: comm.size], q_len=2, kv_len=True, mask="head", dtype=dtype
    )
    k, v, kw = prob.shard(comm.rank)
    xp = sys.modules["cupy"]
    dev = {name: None if x is None else xp.asarray(x) for name, x in kw.items()}
    out, lse = cp.tree_decode(
        xp.asarray(prob.q),
        xp.asarray(k),
        xp.asarray(v),
        strategy=strategy,
        return_lse=True,
        deterministic=deterministic,
        **dev,
    )
    assert isinstance(out, xp.ndarray) and out.dtype == dtype and lse.dtype == np.float32
    ref, ref_lse = prob.reference()
    got = out.get().astype(np.float64)
    assert not np.isnan(got).any()
    assert_allclose(got, ref, atol=2e-3 if dtype == np.float16 else 2e-5, rtol=0)
    fin = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse.get()), fin)
    assert_allclose(lse.get()[fin], ref_lse[fin], rtol=1e-5, atol=1e-5)
    local = cp.local_state(xp.asarray(prob.q), xp.asarray(k), xp.asarray(v), **dev)
    assert isinstance(local, xp.ndarray) and local.shape == (*prob.q.shape[:3], prob.q.shape[3] + 2)
    return out


@pytest.mark.parallel(nprocs=[1, 2, 3, 4])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32", "float16"])
def test_cupy_arrays_match_the_float64_reference(adapter, strategy, dtype):
    run(adapter, strategy, dtype)


@pytest.mark.parallel(nprocs=[3])
def test_deterministic_is_bitwise_the_same_as_the_ranks_gather(adapter):
    a = run(adapter, "allreduce", np.float32, deterministic=True)
    b = run(adapter, "allgather", np.float32)
    assert np.array_equal(a.get(), b.get())


@pytest.mark.parallel(nprocs=[2])
def test_mixed_frameworks_are_refused_on_every_rank(adapter):
    q = sys.modules["cupy"].asarray(np.zeros((1, 4, 1, 8), np.float32))
    kv = sys.modules["cupy"].asarray(np.zeros((1, 2, 5, 8), np.float32))
    bad = np.zeros((1, 2, 5, 8), np.float32) if world().rank == 1 else kv
    with pytest.raises(
        (TypeError, ValueError), match=r"different frameworks|invalid input on rank 1"
    ):
        adapter.tree_decode(q, bad, kv)


@pytest.mark.cuda
@pytest.mark.parallel(nprocs=[1, 2])
def test_real_cupy_on_cuda():
    pytest.importorskip("cupy")
    from mpitree.adapters import cupy as cp

    for strategy in ("allreduce", "allgather"):
        run(cp, strategy, np.float32)
