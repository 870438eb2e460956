"""The bad-input catalogue: every communicating entry point x bad input on ONE rank.

Each case gives one rank a bad argument (the last rank, or rank 1) and the
others good ones. Every rank must raise a clear Python exception within
seconds: the bad rank its own ``TypeError``/``ValueError``, the others
``mpitree.RankError`` naming it, or ``ValueError: ranks disagree on ...``
everywhere. Never a hang, an ``MPI_Abort`` or a silent wrong answer; and the
communicator must still work afterwards (a correct decode follows each case).

Every function decorated ``@entry_point`` must appear in :data:`CATALOGUE`:
adding an entry point without catalogue cases fails
``test_catalogue_covers_every_entry_point``.
"""

import ast
import importlib
import sys
from pathlib import Path

import mpitree.adapters.transformers as mtt
import numpy as np
import pytest
import torch
import transformers  # noqa: F401
from helpers import make_problem, world
from models import prompt, tiny_llama
from numpy.testing import assert_allclose
from standins import fake_cupy, fake_flash_attn

import mpitree
from mpitree import energy, spec
from mpitree._guard import ENTRY_POINTS

ROOT = Path(__file__).resolve().parent.parent


def bad_rank():
    return world().size - 1


def arrays(b=2, hq=4, hkv=2, sq=1, d=8, t=5, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, hq, sq, d)).astype(dtype)
    k = rng.standard_normal((b, hkv, t, d)).astype(dtype)
    v = rng.standard_normal((b, hkv, t, d)).astype(dtype)
    return q, k, v


def lanes_kept():
    """Whether a one-shot call's lane is kept, or cannot be in this build."""
    from mpitree import _steps
    from mpitree._library import native_lib
    from mpitree._strategies.allreduce import _PERSISTENT_OK

    bound = any(step.compiled is not None for step in _steps.STEPS.values())
    return bound or not (native_lib() and _PERSISTENT_OK)


def pick(bad, good, wrong):
    """``wrong`` on the bad rank when ``bad``, else ``good``."""
    return wrong if bad else good


# --------------------------------------------------------------------------------------
# the core
# --------------------------------------------------------------------------------------
def tree_decode_cases():
    def call(bad, **change):
        q, k, v = arrays()
        kw = dict(q=q, k=k, v=v)
        if bad:
            kw.update(change)
        mpitree.tree_decode(**kw)

    def kept(bad, **change):
        """The bad call on one rank, the others' on the lane kept by two good calls."""
        for _ in range(2):
            call(False)
        assert lanes_kept(), "no lane kept"
        call(bad, **change)

    return {
        "kept lane: q heads": lambda bad: kept(bad, q=arrays(hq=8)[0]),
        "kept lane: kv dtype": lambda bad: kept(bad, k=arrays(dtype=np.float64)[1]),
        "kept lane: K and V lengths differ": lambda bad: kept(bad, k=arrays(t=6)[1]),
        "kept lane: kv_len too long": lambda bad: kept(bad, kv_len=np.array([2, 9])),
        "kept lane: scale NaN": lambda bad: kept(bad, scale=float("nan")),
        "kept lane: strategy differs": lambda bad: kept(bad, strategy="ring"),
        "kept lane: validate NaN": lambda bad: kept(
            bad, v=np.full((2, 2, 5, 8), np.nan, np.float32), validate=True
        ),
        "q heads": lambda bad: call(bad, q=arrays(hq=8)[0]),
        "head dim": lambda bad: call(bad, q=arrays(d=16)[0]),
        "batch": lambda bad: call(bad, q=arrays(b=3)[0]),
        "dtype": lambda bad: call(bad, q=arrays(dtype=np.float64)[0]),
        "kv dtype": lambda bad: call(bad, k=arrays(dtype=np.float64)[1]),
        "ndim": lambda bad: call(bad, k=arrays()[1][0]),
        "heads not a multiple": lambda bad: call(bad, k=arrays(hkv=3)[1], v=arrays(hkv=3)[2]),
        "flash-attn layout": lambda bad: call(
            bad, k=arrays()[1].transpose(0, 2, 1, 3).copy(), v=arrays()[2].transpose(0, 2, 1, 3)
        ),
        "non-contiguous": lambda bad: call(bad, k=np.zeros((2, 2, 5, 16), np.float32)[..., ::2]),
        "mask shape": lambda bad: call(bad, mask=np.ones((2, 3, 1, 5), bool)),
        "mask dtype": lambda bad: call(bad, mask=np.ones((2, 1, 1, 5), np.int8)),
        "kv_len length": lambda bad: call(bad, kv_len=np.array([1, 2, 3])),
        "kv_len dtype": lambda bad: call(bad, kv_len=np.array([1.0, 2.0])),
        "kv_len too long": lambda bad: call(bad, kv_len=np.array([2, 9])),
        "positions shape": lambda bad: call(
            bad, q_pos=np.zeros((2, 1), int), k_pos=np.zeros((2, 4), int)
        ),
        "positions alone": lambda bad: call(bad, q_pos=np.zeros((2, 1), int)),
        "scale -0.0": lambda bad: call(bad, scale=-0.0),
        "scale NaN": lambda bad: call(bad, scale=float("nan")),
        "scale string": lambda bad: call(bad, scale="x"),
        "strategy": lambda bad: call(bad, strategy="tree"),
        "strategy differs": lambda bad: call(bad, strategy="ring"),
        "node size negative": lambda bad: call(bad, node_size=-1),
        "node size 2**63": lambda bad: call(bad, node_size=2**63),
        "deterministic 'no'": lambda bad: call(bad, deterministic="no"),
        "validate q differs": lambda bad: mpitree.tree_decode(
            arrays(seed=world().rank if bad else 0)[0], *arrays()[1:], validate=True
        ),
        "validate NaN": lambda bad: mpitree.tree_decode(
            *arrays()[:2], np.full((2, 2, 5, 8), np.nan if bad else 0, np.float32), validate=True
        ),
        "mixed frameworks": lambda bad: call(bad, k=torch.from_numpy(arrays()[1])),
        "list, not an array": lambda bad: call(bad, q=arrays()[0].tolist()),
        "kv_start without invariant": lambda bad: call(bad, kv_start=0),
        **invariant_cases(plan=False),
        "invariant block size differs": lambda bad: invariant(bad, False, block_size=1),
        "invariant with a strategy": lambda bad: invariant(bad, False, strategy="allreduce"),
        "invariant blocks overlap": lambda bad: invariant(bad, False, kv_start=0),
    }


def invariant(bad, plan, **change):
    """A deterministic="invariant" step (a plan's or tree_decode's): rank r holds block r of 5."""
    q, k, v = arrays()
    kw = dict(q=q, k=k, v=v, kv_start=5 * world().rank)
    if bad:
        kw.update(change)
    if not plan:
        mpitree.tree_decode(**{"deterministic": "invariant", "block_size": 5, **kw})
        return
    with mpitree.DecodePlan(2, 4, 2, 8, deterministic="invariant", block_size=5) as p:
        p.decode(**kw)


def invariant_cases(plan):
    """Bad placements in deterministic="invariant" mode."""
    return {
        "invariant kv_start unaligned": lambda bad: invariant(bad, plan, kv_start=3),
        "invariant no placement": lambda bad: invariant(bad, plan, kv_start=None),
        "invariant kv_blocks shape": lambda bad: invariant(
            bad, plan, kv_start=None, kv_blocks=np.array([0, 1])
        ),
        "invariant kv_blocks floats": lambda bad: invariant(
            bad, plan, kv_start=None, kv_blocks=np.array([0.0])
        ),
    }


def plan_init_cases():
    def call(bad, **change):
        kw = dict(batch=2, q_heads=4, kv_heads=2, head_dim=8)
        if bad:
            kw.update(change)
        mpitree.DecodePlan(**kw).free()

    return {
        "q heads": lambda bad: call(bad, q_heads=8),
        "zero q_len": lambda bad: call(bad, q_len=0),
        "float size": lambda bad: call(bad, batch=2.0),
        "dtype": lambda bad: call(bad, dtype="int8"),
        "heads not a multiple": lambda bad: call(bad, kv_heads=3),
        "scale NaN": lambda bad: call(bad, scale=float("nan")),
        "strategy": lambda bad: call(bad, strategy="tree"),
        "node size 2**63": lambda bad: call(bad, node_size=2**63),
        "deterministic 'no'": lambda bad: call(bad, deterministic="no"),
        "validate differs": lambda bad: call(bad, validate=True),
        "block size without invariant": lambda bad: call(bad, block_size=8),
        "invariant differs": lambda bad: call(bad, deterministic="invariant"),
        "like not an array": lambda bad: call(bad, like="cuda"),
        "like on one rank only": lambda bad: call(bad, like=torch.zeros(1)),
    }


def plan_decode_cases():
    def call(bad, strategy="auto", **change):
        q, k, v = arrays()
        kw = dict(q=q, k=k, v=v)
        if bad:
            kw.update(change)
        with mpitree.DecodePlan(2, 4, 2, 8, strategy=strategy) as plan:
            plan.decode(**kw)

    return {
        "batch change": lambda bad: call(bad, q=arrays(b=3)[0]),
        "q heads": lambda bad: call(bad, q=arrays(hq=8)[0]),
        "dtype": lambda bad: call(bad, q=arrays(dtype=np.float64)[0]),
        "mask shape": lambda bad: call(bad, mask=np.ones((2, 3, 1, 5), bool)),
        "kv_len length": lambda bad: call(bad, kv_len=np.array([1])),
        "kv_len too long (ring)": lambda bad: call(bad, "ring", kv_len=np.array([2, 9])),
        "positions shape": lambda bad: call(
            bad, q_pos=np.zeros((2, 2), int), k_pos=np.zeros((2, 5), int)
        ),
        "mixed frameworks (allgather)": lambda bad: call(
            bad, "allgather", k=torch.from_numpy(arrays()[1])
        ),
        "not an array (allreduce3)": lambda bad: call(bad, "allreduce3", v="v"),
        "kv_start without invariant": lambda bad: call(bad, kv_start=0),
        "numpy into a plan for tensors": lambda bad: for_tensors(bad),
        "tensors elsewhere (meta)": lambda bad: for_tensors(bad, "meta"),
        **invariant_cases(plan=True),
    }


def for_tensors(bad, device=None):
    """A step of a plan made with ``like=`` a CPU tensor: numpy arrays, or tensors on
    ``device``, on the bad rank."""
    q, k, v = arrays()
    tensors = [torch.from_numpy(x) for x in (q, k, v)]
    if not bad:
        q, k, v = tensors
    elif device is not None:
        q, k, v = (x.to(device) for x in tensors)
    with mpitree.DecodePlan(2, 4, 2, 8, like=tensors[0]) as plan:
        plan.decode(q, k, v)


def allreduce_state_cases():
    def call(bad, **change):
        kw = dict(state=mpitree.State.empty((3,), 8), strategy="auto")
        if bad:
            kw.update(change)
        mpitree.allreduce_state(**kw)

    def kept(bad, **change):
        """The bad call on one rank, the others' on the lane kept by two good calls."""
        for _ in range(2):
            call(False)
        assert lanes_kept(), "no lane kept"
        call(bad, **change)

    return {
        "kept lane: not a State": lambda bad: kept(bad, state=np.zeros((3, 10))),
        "kept lane: rows": lambda bad: kept(bad, state=mpitree.State.empty((4,), 8)),
        "kept lane: dtype": lambda bad: kept(bad, state=mpitree.State.empty((3,), 8, np.float64)),
        "kept lane: strategy ring": lambda bad: kept(bad, strategy="ring"),
        "not a State": lambda bad: call(bad, state=np.zeros((3, 10))),
        "head dim": lambda bad: call(bad, state=mpitree.State.empty((3,), 6)),
        "rows": lambda bad: call(bad, state=mpitree.State.empty((4,), 8)),
        "dtype": lambda bad: call(bad, state=mpitree.State.empty((3,), 8, np.float64)),
        "strategy ring": lambda bad: call(bad, strategy="ring"),
        "node size": lambda bad: call(bad, node_size="two"),
        "deterministic 'no'": lambda bad: call(bad, deterministic="no"),
        "deterministic invariant": lambda bad: call(bad, deterministic="invariant"),
    }


def energy_cases(fn):
    def call(bad, **change):
        q, k, v = arrays()
        kw = dict(q=q, k=k, v=v)
        if bad:
            kw.update(change)
        fn(**kw)

    cases = {
        "q heads": lambda bad: call(bad, q=arrays(hq=8)[0]),
        "mask shape": lambda bad: call(bad, mask=np.ones((2, 3, 1, 5), bool)),
        "kv_len too long": lambda bad: call(bad, kv_len=np.array([2, 9])),
        "scale NaN": lambda bad: call(bad, scale=float("nan")),
        "torch arrays": lambda bad: call(bad, q=torch.zeros(2, 4, 1, 8)),
    }
    if fn is energy.tree_energy:
        cases["algorithm"] = lambda bad: call(bad, algorithm="magic")
        cases["algorithm differs"] = lambda bad: call(bad, algorithm="paper")
        cases["zeta shape"] = lambda bad: call(bad, zeta=np.zeros((2, 4, 1, 4)))
        cases["zeta only on one rank"] = lambda bad: call(bad, zeta=np.zeros((2, 4, 1, 8)))
    else:
        cases["full 'yes'"] = lambda bad: call(bad, full="yes")
        cases["full differs"] = lambda bad: call(bad, full=True)
    return cases


def verify_attention_cases():
    def call(bad, **change):
        q, k, v = arrays(sq=3)
        kt, vt = arrays(t=3, seed=1)[1:]
        kw = dict(
            q=q, k_context=k, v_context=v, k_tree=kt, v_tree=vt, tree_mask=np.ones((2, 3, 3), bool)
        )
        if bad:
            kw.update(change)
        spec.verify_attention(**kw)

    return {
        "owner -1": lambda bad: call(bad, owner=-1),
        "owner differs": lambda bad: call(bad, owner=0),
        "owner not an int": lambda bad: call(bad, owner=0.5),
        "tree mask shape": lambda bad: call(bad, tree_mask=np.ones((2, 3, 4), bool)),
        "tree mask dtype": lambda bad: call(bad, tree_mask=np.ones((2, 3, 3), int)),
        "k_tree length": lambda bad: call(bad, k_tree=arrays(t=4)[1]),
        "kv_len too long": lambda bad: call(bad, kv_len=np.array([2, 9])),
        "strategy ring": lambda bad: call(bad, strategy="ring"),
        "q heads": lambda bad: call(bad, q=arrays(hq=8, sq=3)[0]),
    }


# --------------------------------------------------------------------------------------
# adapters
# --------------------------------------------------------------------------------------
def flash_attn_module():
    sys.modules.setdefault("flash_attn", fake_flash_attn())
    return importlib.import_module("mpitree.adapters.flash_attn")


def flash_attn_cases():
    def call(bad, **change):
        q, k, v = (torch.from_numpy(x).transpose(1, 2) for x in arrays())
        kw = dict(q=q, k_cache=k, v_cache=v, cache_seqlens=torch.tensor([5, 3], dtype=torch.int32))
        if bad:
            kw.update(change)
        flash_attn_module().tree_decode(**kw)

    return {
        "cache_seqlens shape": lambda bad: call(bad, cache_seqlens=torch.tensor([5])),
        "block_table shape": lambda bad: call(
            bad, block_table=torch.zeros(3, 1, dtype=torch.int32)
        ),
        "strategy ring": lambda bad: call(bad, strategy="ring"),
        "dtype": lambda bad: call(bad, q=torch.zeros(2, 1, 4, 8, dtype=torch.float64)),
        "mpitree layout": lambda bad: call(bad, q=torch.zeros(2, 4, 1, 8)),
        "scale NaN": lambda bad: call(bad, softmax_scale=float("nan")),
    }


def jax_cases():
    """mpitree.adapters.jax.tree_decode, eagerly (inside jax.jit: tests/test_jax_mpi.py)."""
    import jax.numpy as jnp

    def call(bad, **change):
        q, k, v = (jnp.asarray(x) for x in arrays())
        kw = dict(q=q, k=k, v=v)
        if bad:
            kw.update(change)
        importlib.import_module("mpitree.adapters.jax").tree_decode(**kw)

    return {
        "q heads": lambda bad: call(bad, q=jnp.asarray(arrays(hq=8)[0])),
        "dtype": lambda bad: call(bad, q=jnp.asarray(arrays()[0], jnp.float16)),
        "kv heads not a multiple": lambda bad: call(
            bad, k=jnp.asarray(arrays(hkv=3)[1]), v=jnp.asarray(arrays(hkv=3)[2])
        ),
        "kv_len too long": lambda bad: call(bad, kv_len=jnp.array([2, 9])),
        "kv_len floats": lambda bad: call(bad, kv_len=jnp.array([2.0, 3.0])),
        "positions alone": lambda bad: call(bad, q_pos=jnp.zeros((2, 1), int)),
        "mask shape": lambda bad: call(bad, mask=jnp.ones((2, 3, 1, 5), bool)),
        "strategy ring": lambda bad: call(bad, strategy="ring"),
        "scale differs": lambda bad: call(bad, scale=0.5),
        "list, not an array": lambda bad: call(bad, q=arrays()[0].tolist()),
        "torch tensor": lambda bad: call(bad, k=torch.from_numpy(arrays()[1])),
    }


_MODEL = {}


def model():
    if "llama" not in _MODEL:
        _MODEL["llama"] = tiny_llama()
    m = _MODEL["llama"]
    m.set_attn_implementation("mpitree")
    return m


def cache_init_cases():
    def call(bad, **change):
        kw = dict(block_size=4)
        if bad:
            kw.update(change)
        mtt.ShardedCache(**kw)

    return {
        "world size": lambda bad: call(bad, world_size=99),
        "placement": lambda bad: call(bad, placement="everywhere"),
        "placement differs": lambda bad: call(bad, placement="last"),
        "block size": lambda bad: call(bad, block_size=0),
        "block size bool": lambda bad: call(bad, block_size=True),
        "strategy": lambda bad: call(bad, strategy="gossip"),
        "deterministic 'no'": lambda bad: call(bad, deterministic="no"),
        "invariant on one rank": lambda bad: call(bad, deterministic="invariant"),
        "invariant with strategy": lambda bad: call(
            bad, deterministic="invariant", strategy="ring"
        ),
        "static: capacity differs": lambda bad: static(bad, max_cache_len=31),
        "static: capacity 0": lambda bad: static(bad, max_cache_len=0),
        "static: capacity a float": lambda bad: static(bad, max_cache_len=32.0),
        "static: capacity a bool": lambda bad: static(bad, max_cache_len=True),
        "static: invariant on one rank": lambda bad: static(bad, deterministic="invariant"),
    }


def static(bad, **change):
    """A StaticShardedCache (its construction is ShardedCache's), ``change`` on the bad rank."""
    kw = dict(block_size=4, max_cache_len=32)
    if bad:
        kw.update(change)
    mtt.StaticShardedCache(**kw)


def filled_cache(batch=2, length=9, **options):
    m = model()
    ids, _ = prompt(length, False, batch)
    cache = mtt.ShardedCache(m.config, block_size=4, **options)
    with torch.no_grad():
        m(ids, cache=cache)
    return m, ids, cache


def attention_cases():
    def step(bad, batch=None, tokens=1, mask=None, everywhere=False, **options):
        m, ids, cache = filled_cache(**options)
        nxt = ids[:, :tokens]
        if bad or everywhere:
            if batch is not None:
                nxt = ids[:batch, :tokens]
        kwargs = {}
        if mask is not None:
            good = torch.ones(2, 1, tokens, ids.shape[1] + tokens, dtype=torch.bool)
            kwargs["attention_mask"] = mask if bad else good
        with torch.no_grad():
            m(nxt, cache=cache, **kwargs)

    return {
        "batch change on one rank": lambda bad: step(bad, batch=1),
        "batch change on every rank": lambda bad: step(bad, batch=1, everywhere=True),
        "step length differs": lambda bad: step(bad, tokens=2 if bad else 1),
        "4-D mask shape": lambda bad: step(bad, mask=torch.ones(2, 1, 1, 3, dtype=torch.bool)),
        "4-D mask additive bias": lambda bad: step(bad, mask=torch.full((2, 1, 1, 10), 0.5)),
        # Hkv heads (neither 1 nor Hq): refused whatever keys the bad rank holds
        "4-D mask with Hkv heads": lambda bad: step(bad, mask=torch.ones(2, 2, 1, 10).bool()),
        "4-D mask with Hkv heads, no keys on the bad rank": lambda bad: step(
            bad, mask=torch.ones(2, 2, 1, 3).bool(), length=2
        ),
        "invariant: 4-D mask with Hkv heads": lambda bad: step(
            bad, mask=torch.ones(2, 2, 1, 10).bool(), deterministic="invariant"
        ),
        "strategy set on one rank": lambda bad: strategy_changed(bad),
        "beam search after prefill": lambda bad: beams_after_prefill(bad),
        "no ShardedCache on one rank": lambda bad: without_cache(bad),
        "prompt fed again": lambda bad: refed(bad),
        "invariant: batch change on one rank": lambda bad: step(
            bad, batch=1, deterministic="invariant"
        ),
        "invariant: step length differs": lambda bad: step(
            bad, tokens=2 if bad else 1, deterministic="invariant"
        ),
        "invariant: shard not whole blocks": lambda bad: torn_blocks(bad),
        "later layer: key dtype": lambda bad: later_layer(bad, lambda k, v: (k.double(), v)),
        "later layer: value head dim": lambda bad: later_layer(bad, lambda k, v: (k, v[..., :8])),
        "later layer: value heads": lambda bad: later_layer(bad, lambda k, v: (k, v[:, :1])),
        # a bound later layer runs in the entry point's lane, before the guard
        "bound later layer: scaling an array": lambda bad: bound_later_layer(
            bad, scaling=np.array([0.25, 0.25])
        ),
        "bound later layer: dropout a tensor": lambda bad: bound_later_layer(
            bad, dropout=torch.tensor([0.0, 0.0])
        ),
        "bound later layer: attention sinks": lambda bad: bound_later_layer(
            bad, s_aux=torch.zeros(4)
        ),
        "bound later layer: an unknown argument": lambda bad: bound_later_layer(
            bad, attention_bias=torch.zeros(4)
        ),
        "bound later layer: query a numpy array": lambda bad: bound_later_layer(
            bad, query=lambda q: q.numpy()
        ),
        "bound later layer: query float64": lambda bad: bound_later_layer(
            bad, query=lambda q: q.double()
        ),
        "bound later layer: a dropout whose type's == raises": lambda bad: bound_later_layer(
            bad, dropout=Unequal()
        ),
        "bound later layer: a dropout whose truth value raises": lambda bad: bound_later_layer(
            bad, dropout=Untrue()
        ),
    }


class _RaisingEq(type):
    """A metaclass whose ``==`` raises: ``type(x) in (int, float)`` calls it."""

    def __eq__(cls, other):
        raise RuntimeError("this type's == raises")

    __hash__ = type.__hash__


class Unequal(metaclass=_RaisingEq):
    """An argument whose type compares by raising."""


class Untrue(float):
    """A float 0 whose truth value raises (``dropout`` is tested with ``or dropout``)."""

    def __bool__(self):
        raise RuntimeError("this float's truth value raises")


def later_layer(bad, change):
    """One model step by hand: the bad rank's second layer gets other key/value tensors.

    The step's first layer runs the full checks; a later layer must be held to them
    (before, only the query's shape and dtype were compared: a value of another head
    dim was read by the kernel with the query's).
    """
    torch.manual_seed(0)
    cache = mtt.ShardedCache(model().config, block_size=4)
    q = torch.randn(2, 4, 1, 16)
    for layer in range(2):
        k, v = torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16)
        if bad and layer == 1:
            k, v = change(k, v)
        keys, values = cache.update(k, v, layer)
        with torch.no_grad():
            mtt.attention_interface(None, q, keys, values, None)


def bound_later_layer(bad, query=None, **kw):
    """Steps by hand over two layers, bound to their one compiled call from the second
    step on; in the last, the bad rank's second layer gets other arguments.

    That layer would run in the entry point's lane, before the guard: whatever it is
    given, the lane must decline without raising, so the guard reports it.
    """
    torch.manual_seed(0)
    cache = mtt.ShardedCache(model().config, block_size=1)  # every rank holds keys
    q = torch.randn(2, 4, 1, 16)
    steps = world().size + 2
    for step in range(steps):
        for layer in range(2):
            k, v = torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16)
            keys, values = cache.update(k, v, layer)
            odd = bad and step == steps - 1 and layer == 1
            args = (query(q) if odd and query is not None else q, keys, values, None)
            with torch.no_grad():
                mtt.attention_interface(None, *args, **(kw if odd else {}))


def torn_blocks(bad):
    m, ids, cache = filled_cache(deterministic="invariant")
    if bad:  # every layer: the step's first one is where the blocks are read
        for layer in cache.layers:
            layer.positions = layer.positions + 1
    with torch.no_grad():
        m(ids[:, :1], cache=cache)


def strategy_changed(bad):
    m, ids, cache = filled_cache()
    if bad:
        cache.strategy = "ring"
    with torch.no_grad():
        m(ids[:, :1], cache=cache)


def without_cache(bad):
    m, ids, cache = filled_cache()
    with torch.no_grad():
        m(ids[:, :1], cache=None if bad else cache, use_cache=not bad)


def refed(bad):
    m, ids, cache = filled_cache()
    with torch.no_grad():  # positions 0..8 again, as generate(ids) on this cache would feed
        m(ids, cache=cache, position_ids=torch.arange(9)[None] if bad else None)


def beams_after_prefill(bad):
    m = model()
    ids, _ = prompt(9, False)
    cache = mtt.ShardedCache(m.config, block_size=4)
    mtt.prefill(m, ids[:, :-1], cache)
    with torch.no_grad():
        m.generate(ids, cache=cache, max_new_tokens=2, num_beams=2 if bad else 1, do_sample=False)


def prefill_cases():
    def call(bad, ids=None, mask=None, dirty=False):
        m = model()
        good, _ = prompt(9, False)
        cache = mtt.ShardedCache(m.config, block_size=4)
        if bad and dirty:
            with torch.no_grad():
                m(good[:, :2], cache=cache)
        mtt.prefill(
            m, ids if bad and ids is not None else good, cache, attention_mask=mask if bad else None
        )

    return {
        "prompt differs": lambda bad: call(bad, ids=prompt(9, False)[0] + 1),
        "prompt length differs": lambda bad: call(bad, ids=prompt(10, False)[0]),
        "mask shape": lambda bad: call(bad, mask=torch.ones(2, 3)),
        "cache not empty": lambda bad: call(bad, dirty=True),
        "empty prompt": lambda bad: call(bad, ids=prompt(9, False)[0][:, :0]),
        "not a cache": lambda bad: not_a_cache(bad),
    }


def not_a_cache(bad):
    cache = mtt.ShardedCache(model().config, block_size=4)
    mtt.prefill(model(), prompt(9, False)[0], None if bad else cache)


def verify_cases():
    def call(bad, change):
        m, _, cache = filled_cache()
        beam = torch.from_numpy(np.random.default_rng(3).integers(1, 4, (2, 3, 2)))
        packed = spec.pack(beam)
        kw = dict(attention_mask=None)
        if bad:
            packed, kw = change(packed, kw)
        mtt.verify(m, cache, packed, **kw)

    def short_mask(packed, kw):
        packed.mask = packed.mask[:, :-1]
        return packed, kw

    def bad_padding(packed, kw):
        return packed, dict(attention_mask=torch.ones(2, 3))

    def numpy_tree(packed, kw):
        return spec.pack(np.ones((2, 3, 2), np.int64)), kw

    return {
        "tree mask shape": lambda bad: call(bad, short_mask),
        "attention mask shape": lambda bad: call(bad, bad_padding),
        "numpy tree": lambda bad: call(bad, numpy_tree),
    }


class Drafted:
    """Prompt lookup's drafts, changed by ``change(beam, depth)`` on the bad rank."""

    def __init__(self, bad, change):
        self.bad, self.change = bad, change

    def propose(self, tokens, attention_mask, depth):
        beam = mtt.PromptLookup().propose(tokens, attention_mask, depth)
        return self.change(beam, depth) if self.bad and self.change else beam


class Streaming:
    """A streamer that raises on the bad rank at its ``fail``-th put, or at ``end``."""

    def __init__(self, bad, fail):
        self.fail, self.puts = fail if bad else None, 0

    def put(self, ids):
        self.puts += 1
        if self.puts == self.fail:
            raise RuntimeError("the streamer's terminal went away")

    def end(self):
        if self.fail == "end":
            raise RuntimeError("the streamer's terminal went away")


class Decoding:
    """A tokenizer: token t is "<t>"; on the bad rank it raises, or decodes to nothing."""

    def __init__(self, bad, how):
        self.how = how if bad else None

    def decode(self, ids):
        if self.how == "raises":
            raise RuntimeError("the tokenizer's vocabulary file is gone")
        return "" if self.how == "differs" else "".join(f"<{int(t)}>" for t in ids)


def generate_cases():
    def call(bad, change=None, cache=True, new=4, sample=None, cost="auto", ends=None, every=None):
        """``ends``: more arguments on the bad rank; ``every(bad)``: on every rank."""
        m = model()
        ids, _ = prompt(9, False)
        sharded = mtt.ShardedCache(m.config, block_size=4)
        sampling = {} if sample is None else dict(do_sample=True, seed=0)
        kw = dict(every(bad) if every else {}, **(ends if bad and ends else {}))
        mtt.generate(
            m,
            kw.pop("input_ids", ids),
            sharded if cache or not bad else None,
            drafter=Drafted(bad, change),
            max_new_tokens=new if bad else 4,
            node_cost=cost if bad else "auto",
            **{**sampling, **(sample if bad and sample else {})},
            **kw,
        )

    def raises(beam, depth):
        raise RuntimeError("the draft model ran out of memory")

    def streams(fail):  # a streamer on every rank
        return lambda bad: dict(streamer=Streaming(bad, fail))

    def stops(how):  # stop strings on every rank: "<" ends each row at once, unless decoded apart
        return lambda bad: dict(eos_token_id=[], stop_strings="<", tokenizer=Decoding(bad, how))

    ids = prompt(9, False)[0]
    holes = torch.ones_like(ids)
    holes[1, 0] = 0  # the same shape, other values

    return {
        "draft out of vocabulary": lambda bad: call(bad, lambda beam, depth: beam + 10**6),
        "empty draft": lambda bad: call(bad, lambda beam, depth: beam[:, :, :0]),
        "draft deeper than what is left": lambda bad: call(
            bad, lambda beam, depth: torch.ones(2, 1, depth + 1, dtype=torch.long)
        ),
        "drafts differ": lambda bad: call(bad, lambda beam, depth: (beam + 1) % 97),
        "drafter raises": lambda bad: call(bad, raises),
        "not a ShardedCache": lambda bad: call(bad, cache=False),
        "max_new_tokens 0": lambda bad: call(bad, new=0),
        "node_cost negative": lambda bad: call(bad, cost=-0.1),
        "node_cost a string": lambda bad: call(bad, cost="fast"),
        "node_costs differ": lambda bad: call(bad, cost=0.15),
        "eos_token_ids differ": lambda bad: call(bad, ends=dict(eos_token_id=5)),
        "stop_strings without a tokenizer": lambda bad: call(bad, ends=dict(stop_strings=["."])),
        "prompt values differ": lambda bad: call(bad, ends=dict(input_ids=(ids + 1) % 97)),
        "attention_mask values differ": lambda bad: call(bad, ends=dict(attention_mask=holes)),
        "streamer put raises": lambda bad: call(bad, every=streams(3)),
        "streamer end raises": lambda bad: call(bad, every=streams("end")),
        "tokenizer raises": lambda bad: call(bad, every=stops("raises")),
        "tokenizers decode differently": lambda bad: call(bad, every=stops("differs")),
        "negative temperature": lambda bad: call(bad, sample=dict(temperature=-1.0)),
        "top_p 0": lambda bad: call(bad, sample=dict(top_p=0.0)),
        "top_k negative": lambda bad: call(bad, sample=dict(top_k=-3)),
        "seed out of range": lambda bad: call(bad, sample=dict(seed=-1)),
        "seeds differ": lambda bad: call(bad, sample=dict(seed=1)),
        "greedy on one rank": lambda bad: call(bad, sample=dict(do_sample=False)),
    }


CATALOGUE = {
    "mpitree._oneshot.tree_decode": tree_decode_cases,
    "mpitree._decode_plan.DecodePlan.__init__": plan_init_cases,
    "mpitree._decode_plan.DecodePlan.decode": plan_decode_cases,
    "mpitree._oneshot.allreduce_state": allreduce_state_cases,
    "mpitree.energy.tree_energy": lambda: energy_cases(energy.tree_energy),
    "mpitree.energy.attention_variance": lambda: energy_cases(energy.attention_variance),
    "mpitree.spec.verify_attention": verify_attention_cases,
    "mpitree.adapters.flash_attn.tree_decode": flash_attn_cases,
    "mpitree.adapters.jax._host_step": jax_cases,
    "mpitree.adapters.transformers._cache.ShardedCache.__init__": cache_init_cases,
    "mpitree.adapters.transformers._attention.attention_interface": attention_cases,
    "mpitree.adapters.transformers._prefill.prefill": prefill_cases,
    "mpitree.adapters.transformers._spec.verify": verify_cases,
    "mpitree.adapters.transformers._generate.generate": generate_cases,
}
# Every communicating entry point of every module; the torch and CuPy adapters
# re-export the core's (their own functions do not communicate); the JAX adapter's
# collectives run in its host step, called when a (jitted) tree_decode runs.
ADAPTERS = ["torch", "cupy", "flash_attn", "transformers", "jax"]
CASES = [(entry, case) for entry, make in CATALOGUE.items() for case in make()]


def import_every_adapter(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", sys.modules.get("cupy") or fake_cupy())
    flash_attn_module()
    for name in ADAPTERS:
        importlib.import_module(f"mpitree.adapters.{name}")


def test_catalogue_covers_every_entry_point(monkeypatch):
    import_every_adapter(monkeypatch)
    missing = sorted(set(ENTRY_POINTS) - set(CATALOGUE))
    assert not missing, f"entry points without bad-input cases in the catalogue: {missing}"
    stale = sorted(set(CATALOGUE) - set(ENTRY_POINTS))
    assert not stale, f"catalogue entries that are not entry points: {stale}"
    assert all(len(make()) >= 3 for make in CATALOGUE.values())


# Modules allowed to call MPI: the guard, the strategies and invariant mode's merger
# (data collectives behind the merger; adapters/_device_slots.py is the device-node
# strategy's torch half, built and run by that strategy only), sharded prefill's
# collectives (each carrying the failure flags), the node split, the private
# communicator, and the command line.
MPI_MODULES = {
    "_guard.py", "_topology.py", "_runtime.py", "_merger.py", "_invariant_merger.py",
    "_prefill_collectives.py", "_device_slots.py",
}  # fmt: skip
MPI_CALLS = {
    "Allreduce", "Allgather", "Allgatherv", "Bcast", "Reduce", "Reduce_scatter", "Barrier",
    "Isend", "Irecv", "Send", "Recv", "Allreduce_init", "Split", "Split_type", "Dup",
    "allgather", "allreduce", "bcast", "gather", "Start",
}  # fmt: skip


def test_only_the_guarded_modules_call_mpi():
    """Static check: no module outside the guard and the strategies calls MPI itself."""
    offenders = []
    for path in [*(ROOT / "mpitree").rglob("*.py"), *(ROOT / "adapters").rglob("*.py")]:
        rel = path.relative_to(ROOT)
        if path.name in MPI_MODULES or rel.parts[1] in ("_strategies", "cli"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr in MPI_CALLS:
                    offenders.append(f"{rel}:{node.lineno} .{node.func.attr}(...)")
    assert not offenders, offenders


def check_comm_still_works():
    """After a failed call, a correct collective on the same communicator is exact."""
    comm = world()
    prob = make_problem(11, [3 + r for r in range(comm.size)])
    k, v, _ = prob.shard(comm.rank)
    out = mpitree.tree_decode(prob.q, k, v)
    assert_allclose(out, prob.reference()[0], atol=2e-5, rtol=0)


@pytest.mark.timeout(60)
@pytest.mark.parallel(nprocs=[2, 3])
@pytest.mark.parametrize("entry, case", CASES, ids=[f"{e.split('.')[-1]}-{c}" for e, c in CASES])
def test_bad_input_on_one_rank_raises_on_every_rank(entry, case, monkeypatch):
    import_every_adapter(monkeypatch)
    rank = world().rank
    with pytest.raises(Exception) as info:
        CATALOGUE[entry]()[case](rank == bad_rank())
    err = info.value
    assert isinstance(err, (TypeError, ValueError, RuntimeError)), repr(err)
    assert not isinstance(err, mpitree_mpi_exception()), repr(err)
    message = str(err)
    if isinstance(err, mpitree.RankError):
        assert err.rank == bad_rank() and err.reason, message
    assert message and len(message) < 2000
    check_comm_still_works()


def mpitree_mpi_exception():
    from mpi4py import MPI

    return MPI.Exception
