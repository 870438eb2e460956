"""Runtime contracts: strides, threads, lifetimes, the library, shared facts, conventions."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from helpers import make_problem, world
from launch import mpiexec, run
from numpy.testing import assert_allclose

import mpitree
from mpitree._kernel import attend_native, native_kernel_available

ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------------------
# strides that are not whole elements are copied, never misread
# --------------------------------------------------------------------------------------
def structured_cache(b=2, h=2, t=37, d=16, seed=0):
    """K/V as fields of a structured cache with a 1-byte flag per token (odd byte strides)."""
    rng = np.random.default_rng(seed)
    cache = np.zeros((b, h, t), dtype=[("flag", "u1"), ("k", "<f4", (d,)), ("v", "<f4", (d,))])
    cache["k"] = rng.standard_normal((b, h, t, d))
    cache["v"] = rng.standard_normal((b, h, t, d))
    cache["flag"] = 1
    return cache["k"], cache["v"]


@pytest.mark.skipif(not native_kernel_available(), reason="native kernel not built")
def test_kernel_copies_views_whose_strides_are_not_whole_elements():
    k, v = structured_cache()
    assert any(s % 4 for s in k.strides)  # the case that used to be misread
    q = np.random.default_rng(1).standard_normal((2, 4, 1, 16)).astype(np.float32)
    view = np.empty((2, 4, 1, 18), np.float32)
    copy = np.empty_like(view)
    assert attend_native(q, k, v, 0.25, None, None, view)
    assert attend_native(
        q, np.ascontiguousarray(k), np.ascontiguousarray(v), 0.25, None, None, copy
    )
    assert np.array_equal(view, copy)


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("strategy", ["allreduce", "ring"])
def test_decode_over_structured_cache_fields_is_exact(strategy):
    comm = world()
    k, v = structured_cache(seed=comm.rank)
    q = np.random.default_rng(7).standard_normal((2, 4, 1, 16)).astype(np.float32)
    out = mpitree.tree_decode(q, k, v, strategy=strategy)
    ks = np.concatenate([structured_cache(seed=r)[0] for r in range(comm.size)], axis=2)
    vs = np.concatenate([structured_cache(seed=r)[1] for r in range(comm.size)], axis=2)
    assert_allclose(out, mpitree.reference_attention(q, ks, vs)[0], atol=2e-5, rtol=0)


@pytest.mark.parallel(nprocs=[2, 3])
def test_ring_takes_strided_kv_len():
    comm = world()
    prob = make_problem(4, [6, 4, 8][: comm.size], kv_len=True)
    k, v, kw = prob.shard(comm.rank)
    strided = np.repeat(kw["kv_len"], 2)[::2]  # a non-contiguous view
    assert not strided.flags.c_contiguous
    out = mpitree.tree_decode(prob.q, k, v, kv_len=strided, strategy="ring")
    assert_allclose(out, prob.reference()[0], atol=2e-5, rtol=0)


# --------------------------------------------------------------------------------------
# threads: library loading and op creation are locked; concurrent decodes are exact
# --------------------------------------------------------------------------------------
THREADS = """
import threading, warnings
import numpy as np
from mpi4py import MPI
warnings.simplefilter("error")
from mpitree import _library, _op
from mpitree._state import combine_records

# 1. eight threads race to load the library: every one must get it
start = threading.Barrier(8)
seen = []
def load():
    start.wait()
    seen.append(_op.native_op_available())
ts = [threading.Thread(target=load) for _ in range(8)]
[t.start() for t in ts]; [t.join() for t in ts]
assert seen == [True] * 8, seen

# 2. 20 trials: three threads create ops for three new widths at once; each op must
#    combine records of its own width (a shared slot would use another's D)
comm = MPI.COMM_WORLD
rng = np.random.default_rng(comm.rank)
for trial in range(20):
    widths = [3 + 3 * trial + i for i in range(3)]
    start = threading.Barrier(3)
    ops = {}
    def create(w):
        start.wait()
        ops[w] = _op.record_op(np.float32, w)
    ts = [threading.Thread(target=create, args=(w,)) for w in widths]
    [t.start() for t in ts]; [t.join() for t in ts]
    for w in widths:
        rec, op = ops[w]
        mine = rng.standard_normal((5, w)).astype(np.float32)
        mine[:, 1] = np.abs(mine[:, 1]) + 0.1
        parts = np.array(comm.allgather(mine))
        out = mine.copy()
        comm.Allreduce(MPI.IN_PLACE, [out, 5, rec], op)
        ref = parts[0]
        for p in parts[1:]:
            ref = combine_records(ref, p)
        assert np.allclose(out, ref, rtol=1e-5, atol=1e-5), (trial, w)
assert len(_op._ops) == 60 and _op._next_slot[32] == 60
if comm.rank == 0:
    print("threads ok")
"""


@pytest.mark.timeout(120)
def test_concurrent_library_loading_and_op_creation():
    res = run(2, [sys.executable, "-c", THREADS], timeout=100)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "threads ok" in res.stdout


CONCURRENT_DECODES = """
import threading
import numpy as np
from mpi4py import MPI
import mpitree
world = MPI.COMM_WORLD
comms = [world.Dup() for _ in range(2)]  # one communicator per thread
errors = []
def decode(i):
    rng = np.random.default_rng([i, 0])
    for step in range(40):
        q = rng.standard_normal((1, 4, 1, 8 + 8 * i)).astype(np.float32)
        ks = rng.standard_normal((world.size, 1, 2, 5, 8 + 8 * i)).astype(np.float32)
        vs = rng.standard_normal(ks.shape).astype(np.float32)
        out = mpitree.tree_decode(q, ks[world.rank], vs[world.rank], comms[i])
        ref, _ = mpitree.reference_attention(q, np.concatenate(ks, 2), np.concatenate(vs, 2))
        if not np.allclose(out, ref, atol=2e-5):
            errors.append((i, step, float(np.abs(out - ref).max())))
ts = [threading.Thread(target=decode, args=(i,)) for i in range(2)]
[t.start() for t in ts]; [t.join() for t in ts]
assert not errors, errors
if world.rank == 0:
    print("concurrent ok")
"""


@pytest.mark.timeout(120)
def test_two_threads_decoding_on_their_own_communicators_are_exact():
    res = run(2, [sys.executable, "-c", CONCURRENT_DECODES], timeout=100)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "concurrent ok" in res.stdout


THREE_THREADS_WARM = """
import threading
import numpy as np
from mpi4py import MPI
import mpitree
world = MPI.COMM_WORLD
comms = [world.Dup() for _ in range(3)]
errors = []
def decode(i):
    rng = np.random.default_rng([i, 1])
    q = rng.standard_normal((1, 4, 1, 8)).astype(np.float32)
    ks = rng.standard_normal((world.size, 1, 2, 5, 8)).astype(np.float32)
    ref, _ = mpitree.reference_attention(q, np.concatenate(ks, 2), np.concatenate(ks, 2))
    k = ks[world.rank]
    for step in range(60):  # warm calls take the one compiled call: it blocks in MPI
        if step % 7 == 6:
            mpitree.allreduce_state(mpitree.local_state(q, k, k), comms[i])
            continue
        out = mpitree.tree_decode(q, k, k, comms[i])
        if not np.allclose(out, ref, atol=2e-5):
            errors.append((i, step))
ts = [threading.Thread(target=decode, args=(i,)) for i in range(3)]
[t.start() for t in ts]; [t.join() for t in ts]
assert not errors, errors
if world.rank == 0:
    print("warm threads ok")
"""


@pytest.mark.timeout(120)
def test_threads_on_the_warm_compiled_call_do_not_block_each_other():
    """Three threads, each on its own communicator, repeat one call: its compiled form.

    The compiled call blocks in MPI; it once held the GIL there, so a rank's other
    threads (what the other rank waited for) never ran: a hang.
    """
    res = run(2, [sys.executable, "-c", THREE_THREADS_WARM], timeout=100)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "warm threads ok" in res.stdout


EXIT_AFTER_A_FINALIZER = """
import sys, weakref
weakref.finalize(sys, print, "")  # as importing torch first makes one, before mpitree's hook
import numpy as np
import mpitree
q, k = np.ones((1, 4, 1, 8), np.float32), np.ones((1, 2, 5, 8), np.float32)
mpitree.tree_decode(q, k, k)
plan = mpitree.DecodePlan(1, 4, 2, 8)  # kept to the exit: its request is on mpitree's comm
plan.decode(q, k, k)
print("decoded")
"""


def test_a_plan_kept_to_the_exit_exits_cleanly():
    """A plan alive at exit, another library's finalizer made first: exit 0, no abort.

    weakref's exit hook ran the plan's finalizer after mpitree's had freed the
    communicator its request was on: MPICH aborted freeing the request (exit 1).
    """
    res = run(2, [sys.executable, "-c", EXIT_AFTER_A_FINALIZER], timeout=60)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "Assertion failed" not in out and "Abort" not in out, out
    assert res.stdout.count("decoded") == 2


# --------------------------------------------------------------------------------------
# lifetimes: a dropped plan frees its persistent request
# --------------------------------------------------------------------------------------
PLAN_DROP = """
import gc, resource, numpy as np, mpitree
from mpi4py import MPI
def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20
q = np.ones((1, 8, 1, 64), np.float32)
kv = np.ones((1, 2, 16, 64), np.float32)
def churn(n):
    for _ in range(n):
        plan = mpitree.DecodePlan(1, 8, 2, 64, strategy="allreduce")
        plan.decode(q, kv, kv)  # dropped without free()
    gc.collect()
churn(500)
before = rss_mb()
churn(4000)
after = rss_mb()
growth = MPI.COMM_WORLD.allreduce(after - before, op=MPI.MAX)
if MPI.COMM_WORLD.rank == 0:
    print(f"growth {growth:.2f} MB")
"""


@pytest.mark.timeout(240)
def test_dropped_plans_free_their_requests():
    res = run(2, [sys.executable, "-c", PLAN_DROP], timeout=220)
    assert res.returncode == 0, res.stdout + res.stderr
    growth = float(res.stdout.split("growth")[1].split()[0])
    assert growth < 4.0, res.stdout  # it grew by ~73 MB over 4000 plans when leaked


# --------------------------------------------------------------------------------------
# settings are honoured: node_size in plans
# --------------------------------------------------------------------------------------
@pytest.mark.parallel(nprocs=[3, 4])
@pytest.mark.parametrize("node_size", [1, 2])
def test_plans_honour_node_size(node_size):
    comm = world()
    with mpitree.DecodePlan(2, 4, 2, 16, strategy="hierarchical", node_size=node_size) as plan:
        assert plan.node_size == node_size
        lay = plan._merger._impl.layout
        assert lay.node.Get_size() == min(node_size, comm.size - comm.rank // node_size * node_size)
        assert lay.nodes == -(-comm.size // node_size)
        prob = make_problem(2, [5] * comm.size)
        k, v, _ = prob.shard(comm.rank)
        assert_allclose(plan.decode(prob.q, k, v), prob.reference()[0], atol=2e-5, rtol=0)


# --------------------------------------------------------------------------------------
# resolved facts are agreed: "auto" with the native op on some ranks only
# --------------------------------------------------------------------------------------
AUTO = """
import numpy as np, warnings, mpitree
from mpi4py import MPI
warnings.simplefilter("ignore")
comm = MPI.COMM_WORLD
rng = np.random.default_rng(0)
q = rng.standard_normal((1, 4, 1, 8)).astype(np.float32)
ks = rng.standard_normal((comm.size, 1, 2, 6, 8)).astype(np.float32)
with mpitree.DecodePlan(1, 4, 2, 8) as plan:
    out = plan.decode(q, ks[comm.rank], ks[comm.rank])
    chosen = plan.strategy
ref, _ = mpitree.reference_attention(q, np.concatenate(ks, 2), np.concatenate(ks, 2))
assert np.allclose(out, ref, atol=2e-5)
rows = comm.gather(f"{comm.rank} {mpitree.native_op_available()} {chosen}")
if rows:
    print(*rows, sep=chr(10))
"""


@pytest.mark.timeout(120)
def test_auto_is_resolved_from_agreed_facts():
    """Rank 0 runs without the native op: every rank must resolve "auto" alike."""
    py = [sys.executable, "-c", AUTO]
    cmd = [*mpiexec(1), "env", "MPITREE_NATIVE_OP=0", *py, ":", "-n", "2", *py]
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=env, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = sorted(res.stdout.split("\n")[:-1])
    assert [line.split()[1] for line in lines] == ["False", "True", "True"], lines
    assert {line.split()[2] for line in lines} == {"allgather"}, lines


# --------------------------------------------------------------------------------------
# the library: a stray build of another interpreter is never picked
# --------------------------------------------------------------------------------------
def test_stray_native_builds_are_ignored(tmp_path):
    from mpitree._library import library_path

    real = library_path()
    if real is None:
        pytest.skip("native library not built")
    pkg = tmp_path / "mpitree"
    shutil.copytree(ROOT / "mpitree", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(real, pkg / Path(real).name)
    for stray in ("_native.cpython-39-x86_64-linux-gnu.so", "_native.abi3.so", "_native.so"):
        (pkg / stray).write_bytes(b"not a library")
    code = "import mpitree; print(mpitree.native_op_available(), mpitree._library.library_path())"
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        timeout=60,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[0] == "True" and Path(res.stdout.split()[1]).name == Path(real).name


# --------------------------------------------------------------------------------------
# failures name the lowest failing rank
# --------------------------------------------------------------------------------------
@pytest.mark.parallel(nprocs=[3, 4])
@pytest.mark.parametrize("where", ["agreement", "plan step"])
def test_the_lowest_failing_rank_is_reported(where):
    comm = world()
    q = np.zeros((1, 4, 1, 8), np.float32)
    kv = np.zeros((1, 2, 5, 8), np.float32)
    lens = np.array([9]) if comm.rank in (1, 2) else None
    with pytest.raises(ValueError) as info:
        if where == "agreement":
            mpitree.tree_decode(q, kv, kv, kv_len=lens)
        else:
            with mpitree.DecodePlan(1, 4, 2, 8) as plan:
                plan.decode(q, kv, kv, kv_len=lens)
    if comm.rank not in (1, 2):
        assert isinstance(info.value, mpitree.RankError) and info.value.rank == 1
        assert "kv_len must lie in [0, 5]" in info.value.reason


# --------------------------------------------------------------------------------------
# conventions: +inf lse (flash-attn FA2, vLLM) is the empty state
# --------------------------------------------------------------------------------------
def test_from_lse_maps_plus_inf_to_the_empty_state():
    out = np.array([[1.0, 2.0], [0.0, 0.0], [0.0, 0.0], [3.0, 4.0]])
    lse = np.array([0.5, np.inf, -np.inf, 1.5])
    state = mpitree.State.from_lse(out, lse)
    assert np.isneginf(state.m[1:3]).all() and (state.records[1:3, 1:] == 0).all()
    other = mpitree.State.from_lse(np.array([[5.0, 6.0]] * 4), np.zeros(4))
    merged = mpitree.combine(state, other)
    assert not np.isnan(merged.records).any()
    assert_allclose(merged.output()[1], [5.0, 6.0])


def test_vllm_merge_attn_states_grid():
    """vLLM's merge grid: prefix/suffix states with +inf rows merge to the right output."""
    rng = np.random.default_rng(0)
    for heads, tokens, dim in [(4, 1, 8), (8, 17, 64), (32, 3, 128)]:
        for empty_prefix, empty_suffix in [(0.0, 0.0), (0.3, 0.0), (0.0, 0.3), (0.3, 0.3)]:
            p_out, s_out = (rng.standard_normal((tokens, heads, dim)) for _ in range(2))
            p_lse, s_lse = (rng.standard_normal((tokens, heads)) * 3 for _ in range(2))
            p_lse[rng.random(p_lse.shape) < empty_prefix] = np.inf
            s_lse[rng.random(s_lse.shape) < empty_suffix] = np.inf
            merged = mpitree.combine(
                mpitree.State.from_lse(p_out, p_lse), mpitree.State.from_lse(s_out, s_lse)
            )
            pw = np.where(np.isinf(p_lse), 0, np.exp(np.where(np.isinf(p_lse), 0, p_lse)))
            sw = np.where(np.isinf(s_lse), 0, np.exp(np.where(np.isinf(s_lse), 0, s_lse)))
            total = pw + sw
            ref = np.where(
                (total > 0)[..., None],
                (pw[..., None] * p_out + sw[..., None] * s_out)
                / np.where(total, total, 1)[..., None],
                0,
            )
            assert not np.isnan(merged.output()).any()
            assert_allclose(merged.output(), ref, atol=1e-12, rtol=0)


def test_thread_contract_is_documented():
    doc = textwrap.dedent(mpitree._op.__doc__ or "")
    guide = (ROOT / "docs" / "reliability.md").read_text()
    assert "Thread contract" in doc and "thread" in guide.lower()
