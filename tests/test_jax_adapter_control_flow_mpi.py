"""mpitree.adapters.jax: several merges in one jitted program, in loops and branches, failing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_problem, world
from mpitree.adapters import _jax_ffi
from mpitree.adapters import jax as mj
from numpy.testing import assert_allclose

import mpitree

SIZES = [5, 0, 7, 3]  # ragged, an empty shard from p = 2
TOL = 2e-5  # float32 against the float64 reference


def shards(seed):
    """Return one problem's (q, this rank's k, v) as float32 JAX arrays, and the reference."""
    prob = make_problem(seed, SIZES[: world().size], q_heads=4, kv_heads=2)
    k, v, _ = prob.shard(world().rank)
    return [jnp.asarray(x, jnp.float32) for x in (prob.q, k, v)], prob


def reference(prob, q):
    """float64 attention of ``q`` over the problem's concatenated K/V."""
    return mpitree.reference_attention(np.asarray(q, np.float64), prob.k, prob.v)[0]


def programs():
    """Jitted programs holding several merges (over problems of one shape, different data)."""
    decode = mj.tree_decode

    def two(q1, k1, v1, q2, k2, v2):
        return jnp.stack([decode(q1, k1, v1), decode(q2, k2, v2)])

    def scan(q1, k1, v1, q2, k2, v2):
        def body(carry, q):
            return carry + 1, decode(q, k1, v1)

        return jax.lax.scan(body, 0, jnp.stack([q1, q2, -q1]))[1]

    def fori(q1, k1, v1, q2, k2, v2):
        qs = jnp.stack([q1, q2, -q2])

        def body(i, acc):
            return acc.at[i].set(decode(qs[i], k2, v2))

        return jax.lax.fori_loop(0, jnp.int32(3), body, jnp.zeros_like(qs))

    def cond(q1, k1, v1, q2, k2, v2):
        def pick(pred):  # True: the first problem
            branches = (lambda: decode(q1, k1, v1), lambda: decode(q2, k2, v2))
            return jax.lax.cond(pred, *branches)

        return jnp.stack([pick(jnp.bool_(True)), pick(q1.sum() > 1e9)])

    return {"two": two, "scan": scan, "fori": fori, "cond": cond}


def expected(form, prob1, prob2):
    """The stacked references of :func:`programs`' ``form``."""
    q1, q2 = prob1.q, prob2.q
    return {
        "two": [reference(prob1, q1), reference(prob2, q2)],
        "scan": [reference(prob1, q) for q in (q1, q2, -q1)],
        "fori": [reference(prob2, q) for q in (q1, q2, -q2)],
        "cond": [reference(prob1, q1), reference(prob2, q2)],
    }[form]


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("form", ["two", "scan", "fori", "cond"])
def test_merges_in_one_program_keep_their_order(form):
    """Two decodes, and decodes under scan, fori_loop and cond: each merge pairs with its own.

    The problems have one shape and different data, so a merge that met another
    call's merge on some rank (out of order, skipped or repeated) gives wrong values.
    """
    args1, prob1 = shards(1)
    args2, prob2 = shards(2)
    step = jax.jit(programs()[form])
    for _ in range(2):  # the second call runs the compiled program again
        got = np.asarray(step(*args1, *args2), np.float64)
        assert_allclose(got, np.stack(expected(form, prob1, prob2)), atol=TOL, rtol=0)


@pytest.mark.parallel(nprocs=[2, 3])
def test_failure_inside_scan_raises_on_every_rank_then_steps_work():
    """A bad kv_len at the 3rd of 4 scanned merges, on the last rank only: every rank raises.

    Then the same compiled loop with good lengths, a plain jitted step and an
    eager call all work on every rank (no rank is left in a merge, no error sticks).
    """
    comm = world()
    (q, k, v), prob = shards(3)
    t = int(k.shape[2])
    lens = np.full((4, q.shape[0]), t, np.int32)
    if comm.rank == comm.size - 1:
        lens[2, 0] = t + 1
    loop = jax.jit(
        lambda q, k, v, lens: jax.lax.scan(
            lambda c, n: (c, mj.tree_decode(q, k, v, kv_len=n)), 0, lens
        )[1]
    )
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        loop(q, k, v, jnp.asarray(lens)).block_until_ready()
    last = str(info.value).strip().splitlines()[-1]
    if comm.rank == comm.size - 1:
        assert last == f"ValueError: kv_len must lie in [0, {t}] (this shard's length)", last
    else:
        assert last.startswith(f"RankError: mpitree: invalid input on rank {comm.size - 1}"), last
    ref = reference(prob, prob.q)
    good = np.asarray(loop(q, k, v, jnp.full(lens.shape, t, jnp.int32)), np.float64)
    assert_allclose(good, np.stack([ref] * 4), atol=TOL, rtol=0)
    assert_allclose(np.asarray(jax.jit(mj.tree_decode)(q, k, v)), ref, atol=TOL, rtol=0)
    assert_allclose(np.asarray(mj.tree_decode(q, k, v)), ref, atol=TOL, rtol=0)


@pytest.mark.parallel(nprocs=[1, 2, 3])
def test_merges_keep_their_place_among_ordered_callbacks():
    """A user's ordered io_callback between two decodes runs between their merges.

    The merges share JAX's ordered-callback token chain: a callback making its
    own collective (here an all-reduce on the same communicator) between two
    merges in program order runs there on every rank. On a separate chain it
    ran after both merges (order ['merge', 'merge', 'user']).
    """
    from jax.experimental import io_callback

    comm = world()
    (q, k, v), prob = shards(4)
    seen = []
    hosts = _jax_ffi._hosts  # the lowered merges' host steps, by key

    def user(x):
        seen.append("user")
        return np.asarray(comm.allreduce(float(np.asarray(x).sum())), np.float32)

    def program(q, k, v):
        first = mj.tree_decode(q, k, v)
        total = io_callback(user, jax.ShapeDtypeStruct((), jnp.float32), first, ordered=True)
        return first, total, mj.tree_decode(q + total * 0, k, v)

    compiled = jax.jit(program).lower(q, k, v).compile()
    merges = hosts[-2:]  # the program's two merges, just lowered: note when each runs
    hosts[-2:] = [lambda r, f, o, h=h: (seen.append("merge"), h(r, f, o))[1] for h in merges]
    try:
        first, total, second = jax.block_until_ready(compiled(q, k, v))
    finally:
        hosts[-2:] = merges
    assert seen == ["merge", "user", "merge"], seen
    assert_allclose(float(total), comm.size * float(np.asarray(first).sum()), rtol=1e-5)
    ref = reference(prob, prob.q)
    assert_allclose(np.asarray(first), ref, atol=TOL, rtol=0)
    assert_allclose(np.asarray(second), ref, atol=TOL, rtol=0)
