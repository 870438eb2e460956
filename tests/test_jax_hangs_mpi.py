"""mpitree.adapters.jax never hangs: every way one rank's call can go wrong raises on every rank.

Each case below hung (or handed another rank's next call a stale error) before:
a failed agreement under an eager ``jax.vmap`` or ``jax.grad`` was followed by a
second one that the other ranks never joined; a call whose checks failed while
tracing returned a ``(1, 3)`` placeholder, so the user's code after it failed to
trace on that rank and its program never reached the merge; a jitted call whose
q, k, v and masks were all closed over ran its failure's agreement at trace time,
alone; and a rank that took ``jax.grad`` alone waited in a backward merge that
the others never ran. Each runs under ``jax.jit`` and eagerly, then a good call
must work on every rank (nothing left waiting, no stale error).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_problem, world
from mpitree.adapters import jax as mj
from numpy.testing import assert_allclose

pytestmark = pytest.mark.timeout(120)  # a hang fails its test (and its leg), not the suite

TOL = 2e-5  # float32 against the float64 reference
GOOD = jax.jit(mj.tree_decode)  # one compilation for every test's closing good call


def setup(seed=1):
    """Return the problem, this rank's float32 (q, k, v) and whether this rank is the bad one."""
    comm = world()
    prob = make_problem(seed, [4] * comm.size, q_heads=4, kv_heads=2)
    k, v, _ = prob.shard(comm.rank)
    return prob, [jnp.asarray(x, jnp.float32) for x in (prob.q, k, v)], comm.rank == comm.size - 1


def outcome(fn, jit):
    """Run ``fn()`` to completion; return its exception as ``(type name, message)``.

    Jitted, the exception is a ``JaxRuntimeError`` whose message's last line is
    mpitree's ``Type: message``; eagerly it is mpitree's own.
    """
    with pytest.raises(Exception) as info:
        jax.block_until_ready(fn())
    if not jit:
        return type(info.value).__name__, str(info.value)
    assert isinstance(info.value, jax.errors.JaxRuntimeError), repr(info.value)
    kind, _, message = str(info.value).strip().splitlines()[-1].partition(": ")
    return kind, message


def assert_every_rank_raises(got, kind, cause):
    """The bad (last) rank raises ``kind: cause``; every other rank a RankError naming it."""
    comm = world()
    if comm.rank == comm.size - 1:
        assert got[0] == kind and got[1].startswith(cause), got
    else:
        bad = comm.size - 1
        assert got[0] == "RankError", got
        assert got[1].startswith(f"mpitree: invalid input on rank {bad}: {kind}: {cause}"), got


def assert_next_calls_work(prob, q, k, v):
    """A jitted and an eager good call after the failure: exact on every rank."""
    ref = prob.reference()[0]
    assert_allclose(np.asarray(GOOD(q, k, v)), ref, atol=TOL, rtol=0)
    assert_allclose(np.asarray(mj.tree_decode(q, k, v)), ref, atol=TOL, rtol=0)


FORMS = ["jit", "eager"]


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("bad", ["q heads", "not vmapped"])
def test_a_failed_agreement_under_vmap_is_settled_once(bad, form):
    """jax.vmap, the last rank's q bad (or that rank not vmapped): every rank raises once.

    Eagerly the vmapped merge runs while JAX traces; its agreement failing was
    followed by a second agreement on the vmapped ranks (the handler of an
    abandoned trace): they hung, or another rank's next call met it and raised a
    stale RankError.
    """
    prob, (q, k, v), is_bad = setup()
    qs = jnp.stack([q, q])
    decode = jax.vmap(mj.tree_decode, in_axes=(0, None, None))
    if is_bad and bad == "q heads":
        qs = qs[:, :, :3]  # 3 query heads over 2 kv heads
    if is_bad and bad == "not vmapped":
        decode, qs = mj.tree_decode, q
    if form == "jit":
        decode = jax.jit(decode)
    got = outcome(lambda: decode(qs, k, v), form == "jit")
    if bad == "q heads":
        assert_every_rank_raises(got, "ValueError", "q heads (3) must be a multiple")
    else:
        assert got[0] == "ValueError", got
        assert got[1].startswith("mpitree: ranks disagree on vmap"), got
    assert_next_calls_work(prob, q, k, v)


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize("form", FORMS)
def test_a_failed_agreement_under_grad_of_vmap_is_settled_once(form):
    """jax.grad of a vmapped decode, the last rank's q bad: every rank raises once.

    Eagerly the forward's merge runs while JAX traces (under grad and vmap), as in
    :func:`test_a_failed_agreement_under_vmap_is_settled_once`.
    """
    prob, (q, k, v), is_bad = setup()
    qs = jnp.stack([q, -q])
    loss = lambda qs: jax.vmap(mj.tree_decode, in_axes=(0, None, None))(qs, k, v).sum()  # noqa: E731
    grad = jax.grad(loss) if form == "eager" else jax.jit(jax.grad(loss))
    if is_bad:
        qs = qs[:, :, :3]
    got = outcome(lambda: grad(qs), form == "jit")
    assert_every_rank_raises(got, "ValueError", "q heads (3) must be a multiple")
    assert_next_calls_work(prob, q, k, v)


def reshaped(q, k, v, **kw):
    """The user's code after the call depends on the output's shape (heads into features)."""
    b, hq, sq, d = q.shape
    return mj.tree_decode(q, k, v, **kw).transpose(0, 2, 1, 3).reshape(b, sq, hq * d)


SHAPE_CAUSES = {
    "float kv_len": ("TypeError", "kv_len must be an integer array, got float32"),
    "v heads": ("ValueError", "k and v shapes differ"),
}


def bad_shape_args(bad, q, k, v, is_bad):
    """The call's (q, k, v, kv_len), the last rank's with the ``bad`` flaw."""
    lens = jnp.full((q.shape[0],), k.shape[2], jnp.float32 if is_bad else jnp.int32)
    if bad == "v heads":
        lens = lens.astype(jnp.int32)
        v = jnp.concatenate([v, v], 1) if is_bad else v
    return q, k, v, lens


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("bad", list(SHAPE_CAUSES))
def test_a_failed_trace_returns_the_calls_shapes(bad, form):
    """The last rank's checks fail while tracing, and code after the call reshapes the output:
    that rank's program still traces, reaches the merge and raises the real cause on
    every rank (it raised ``axis 2 is out of bounds`` alone, the others waiting)."""
    prob, (q, k, v), is_bad = setup()
    args = bad_shape_args(bad, q, k, v, is_bad)
    fn = lambda q, k, v, n: reshaped(q, k, v, kv_len=n)  # noqa: E731
    run = jax.jit(fn) if form == "jit" else fn
    got = outcome(lambda: run(*args), form == "jit")
    assert_every_rank_raises(got, *SHAPE_CAUSES[bad])
    assert_next_calls_work(prob, q, k, v)


@pytest.mark.parallel(nprocs=[1])
@pytest.mark.parametrize("bad", ["float kv_len", "v heads", "q not 4-d", "zeta shape"])
def test_a_failed_trace_has_the_shapes_and_dtypes_of_a_good_one(bad):
    """Traced alone (``jax.eval_shape``: no program runs, no collective), a call whose checks
    fail gives outputs of the shapes and dtypes a good call on the same q gives."""
    _, (q, k, v), _ = setup()
    call = lambda q, k, v, n: mj.tree_decode(q, k, v, kv_len=n, return_lse=True)  # noqa: E731
    for dtype in (jnp.float32, jnp.bfloat16):
        q, k, v = (x.astype(dtype) for x in (q, k, v))
        if bad == "zeta shape":
            zeta = jnp.zeros_like(q)
            args = [(q, k, v, z) for z in (zeta, zeta[:, :1])]
            want, got = (jax.eval_shape(mj.free_energy, *a) for a in args)
        elif bad == "q not 4-d":  # the shapes a call on this q would have: q's
            good = bad_shape_args(bad, q, k, v, False)
            got = jax.eval_shape(call, q[0], *good[1:])
            want = (
                jax.ShapeDtypeStruct(q.shape[1:], dtype),
                jax.ShapeDtypeStruct(q.shape[1:3], jnp.float32),
            )
        else:
            args = (bad_shape_args(bad, q, k, v, is_bad) for is_bad in (False, True))
            want, got = (jax.eval_shape(call, *a) for a in args)
        assert got == want, (got, want)


CLOSED = [("nan scale", "jit"), ("nan scale", "eager"), ("traced scale", "jit")]
CLOSED += [("unknown strategy", "jit"), ("unknown strategy", "eager"), ("ring", "jit")]
CLOSED += [("ring", "eager")]  # a traced scale has no eager form
CLOSED_CAUSES = {
    "nan scale": ("ValueError", "scale must be finite, got nan"),
    "traced scale": ("TypeError", "scale must be a real number, got JitTracer"),
    "unknown strategy": ("ValueError", "strategy must be one of"),
    "ring": ("ValueError", "strategy 'ring' moves K/V between ranks"),
}


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize("bad, form", CLOSED, ids=[f"{b}-{f}" for b, f in CLOSED])
def test_a_call_with_no_traced_input_meets_the_others_in_the_merge(bad, form):
    """``jax.jit(lambda x: x + tree_decode(q, k, k, ...))``: q, k, v closed over, a bad
    argument on the last rank. That rank raised while tracing, alone, and the others
    waited in its merge; now its program enters the merge, which raises everywhere."""
    prob, (q, k, v), is_bad = setup()
    options = {}
    if is_bad:
        options = {
            "nan scale": dict(scale=float("nan")),
            "unknown strategy": dict(strategy="bogus"),
            "ring": dict(strategy="ring"),
        }.get(bad, {})
    scale = 1 / np.sqrt(q.shape[-1])
    if bad == "traced scale":
        fn = jax.jit(lambda x, s: x + mj.tree_decode(q, k, v, scale=s if is_bad else scale))
        got = outcome(lambda: fn(jnp.float32(1), jnp.float32(scale)), True)
    else:
        fn = lambda x: x + mj.tree_decode(q, k, v, **options)  # noqa: E731
        got = outcome(lambda: (jax.jit(fn) if form == "jit" else fn)(jnp.float32(1)), form == "jit")
    assert_every_rank_raises(got, *CLOSED_CAUSES[bad])
    assert_next_calls_work(prob, q, k, v)


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize("form", FORMS)
def test_grad_on_one_rank_alone_raises_on_every_rank(form):
    """Rank 0 takes jax.grad of a decode, the others run its forward: the forward's agreement
    says a backward merge follows on rank 0 only, so every rank raises (all hung: rank 0
    in the backward merge that the others never run)."""
    prob, (q, k, v), _ = setup()
    forward = lambda q: mj.tree_decode(q, k, v).sum()  # noqa: E731
    fn = jax.grad(forward) if world().rank == 0 else forward
    run = jax.jit(fn) if form == "jit" else fn
    got = outcome(lambda: run(q), form == "jit")
    assert got[0] == "ValueError", got
    assert got[1].startswith("mpitree: ranks disagree on phase"), got
    assert "'forward, then backward (jax.grad)'" in got[1] and "'forward'" in got[1], got
    assert_next_calls_work(prob, q, k, v)
    grads = jax.grad(forward)(q)  # every rank differentiating: works
    assert grads.shape == q.shape and np.isfinite(np.asarray(grads)).all()


@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize("form", FORMS)
def test_a_backward_that_fails_on_one_rank_raises_on_every_rank(form, monkeypatch):
    """jax.grad, the last rank's backward local part raising (jitted: while it is traced):
    that rank's program still reaches the backward merge, which raises on every rank.
    Jitted, the trace failed on that rank alone and the others waited in the merge."""
    prob, (q, k, v), is_bad = setup()
    if is_bad:  # float32: the forward runs the C kernel, the backward XLA's scores

        def fail(*args):
            raise MemoryError("no room")

        monkeypatch.setattr(mj, "_scores", fail)
    loss = lambda q: mj.tree_decode(q, k, v).sum()  # noqa: E731
    grad = jax.jit(jax.grad(loss)) if form == "jit" else jax.grad(loss)
    got = outcome(lambda: grad(q), form == "jit")
    monkeypatch.undo()
    assert_every_rank_raises(got, "MemoryError", "no room")
    assert_next_calls_work(prob, q, k, v)
