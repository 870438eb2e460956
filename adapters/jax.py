"""mpitree for JAX: a tree decode and energy usable in ``jax.jit``, ``jax.vmap`` and ``jax.grad``.

:func:`tree_decode` computes this shard's partial state ``(m, d, n)`` in the
compiled program: for float32, the core's C kernel as an XLA FFI custom call
reading K/V in place (``adapters/_jax_ffi.py``; ``MPITREE_JAX_LOCAL=xla`` when
traced selects XLA instead); for other dtypes, XLA's grouped matmuls (float32
accumulation, no repeated K/V). The merge is a second custom call with an
ordered effect (XLA tokens, as mpi4jax orders its collectives): it runs
mpitree's guarded step on the records in place (the agreement collective, then
the shared merger's one ``MPI_Allreduce`` with the native op), exactly once
per call and in program order on every rank. Its
gradient (``jax.custom_vjp``) needs the merged log-sum-exp, which the forward
keeps, and one more collective: the query's gradient is the sum over every
rank's keys, merged the same guarded way; the keys' and values' gradients stay
local to their shard.

Shape and dtype checks run when the function is traced, on each rank; their
verdict, and the value checks made in the compiled program (``kv_len`` in
range), ride in the agreement when the program runs, so bad input on one rank
raises on every rank. A call whose checks fail while tracing (its inputs traced
or closed over) returns outputs of the shapes and dtype a good call would have,
so the code after it traces and its program reaches the merge; a failed
agreement is settled once (under ``jax.vmap`` or ``jax.grad`` eagerly, the merge
runs while JAX traces, and its error is every rank's). The forward's agreement
says whether a backward merge follows (``jax.grad``): a rank that
differentiates alone makes every rank raise. Eagerly (no tracing) the exception
is the core's: the bad rank's own ``TypeError``/``ValueError``,
:class:`mpitree.RankError` elsewhere. Inside ``jax.jit`` JAX reports the same exception as a
``jax.errors.JaxRuntimeError`` (a ``RuntimeError``) whose message ends with it.

The merge calls run on the thread XLA executes the program on: do not run
other collectives on the same communicator from another thread while a
dispatched step is in flight (``block_until_ready()`` it first).

Under ``jax.vmap`` (the merge call has no batching rule of its own) the
merge is a ``jax.custom_batching.custom_vmap`` function: the mapped axis is
folded into the records' rows, merged by one call, and unfolded, so a
vmapped call is still one agreement and one merge on every rank. The folded
axis sizes are agreed on: a rank that vmaps differently, or not at all, makes
every rank raise. :func:`free_energy` is the sharded log-partition function,
one decode of an augmented problem; its gradient is attention.

Importing this module imports JAX; ``import mpitree`` never does.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import numpy as np

from ._hint import missing

try:
    import jax
    import jax.numpy as jnp
except ImportError as exc:  # pragma: no cover - exercised only without JAX
    raise missing("mpitree.adapters.jax", "jax", exc) from exc

from mpitree import extend
from mpitree._registry import merging_names

from . import _jax_ffi

__all__ = ["free_energy", "tree_decode"]

LOCAL_ENV = "MPITREE_JAX_LOCAL"  # "kernel" (default): the C kernel for float32; "xla": XLA's
FORWARD, FORWARD_GRAD = "forward", "forward, then backward (jax.grad)"  # the forward's phases


@dataclass(frozen=True, eq=False)
class _Step:
    """One call's static facts, fixed when it is traced: what its collectives agree on."""

    comm: object
    problem: object = None  # extend.Problem; None when the local checks failed
    opts: object = None  # extend.Options
    t: int = 0  # this shard's length
    error: Exception | None = None  # the local checks' verdict
    folds: tuple = ()  # the sizes of the vmapped axes folded into the batch
    extra: tuple = ()  # an entry point's own agreed facts: (name, value) pairs

    def call(self, phase, flag):
        """Return the agreement's Call for ``phase``; raise this rank's error."""
        if self.error is not None:
            raise self.error
        if flag & _jax_ffi.FAILED:
            raise _jax_ffi.failure()
        if flag:
            raise ValueError(f"kv_len must lie in [0, {self.t}] (this shard's length)")
        p, o = self.problem, self.opts
        sig = {"phase": phase, "vmap": self.folds, **dict(self.extra)}
        sig.update(p.signature(), **o.signature())
        return extend.Call(sig, key=self.key(phase), merge=(p.rows, p.head_dim, p.acc, o))

    def key(self, phase, flag=0):
        """Return what ``phase``'s agreed call depends on; None where it raises (``flag`` set)."""
        if self.error is not None or flag:
            return None
        keys = self.__dict__.setdefault("_keys", {})  # per phase, made once: the lane's lookup
        key = keys.get(phase)
        if key is None:
            p, o = self.problem, self.opts
            extra = tuple((n, x.hex() if type(x) is float else x) for n, x in self.extra)
            key = keys[phase] = (phase, self.folds, extra, p, o, o.scale.hex())  # signs of zero
        return key

    def folded(self, size):
        """Return this step with a vmapped axis of ``size`` folded into the batch."""
        error, problem = self.error, self.problem
        if error is None and size == 0:
            error = ValueError("jax.vmap over an axis of size 0: there is no row to merge")
        elif error is None:
            problem = dataclasses.replace(problem, batch=problem.batch * size)
        return dataclasses.replace(self, problem=problem, error=error, folds=(*self.folds, size))


_MERGES = extend.RecordsMerge(f"{__name__}._host_step")  # the host step's merge and its lane


def _host_lane(step, phase, records, flag, out):
    """:func:`_host_step`'s lane: a recurring merge's bound step in one compiled call, or None."""
    try:
        key = step.key(phase, int(flag))
    except Exception:  # nothing has communicated: the guarded host step decides
        return None
    return None if key is None else _MERGES.lane(step.comm, key, records, out)


@extend.entry_point(lane=_host_lane)
def _host_step(step, phase, records, flag, out):
    """Run one call's collectives on the host: agree on ``step``, merge ``records`` into ``out``.

    ``phase`` "forward" merges ``(B, Hq, Sq, D + 2)`` states; "backward" sums
    the query's gradient, laid out as records whose ``m`` is 0 (the merge's
    weights are then 1). ``out``, of ``records``' shape and dtype, may be
    ``records``. A call that recurs (the same step and phase, records of the
    same shape) runs through :func:`_host_lane` as one compiled call.
    """
    comm, flag = extend.check_comm(step.comm), int(np.asarray(flag))  # freed since traced?
    key = step.key(phase, flag)
    records = np.asarray(records)
    return _MERGES.merge(comm, comm, key, records, lambda: step.call(phase, flag), out)


def _traced(*xs):
    """Whether any of ``xs`` is a tracer (the call is being traced, not run eagerly)."""
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(xs))


def _collective(step, phase, records, flag, context):
    """Run :func:`_host_step` through the ordered merge call (:func:`_jax_ffi.merge`).

    Traced, in the program (see :func:`_merge_in_program`); eagerly, at once,
    after the merges already dispatched (an earlier jitted step's) have run:
    the collectives keep program order on every rank. ``context`` are the
    call's inputs (under ``jax.vmap``: whether it is mapped).
    """
    if _traced(records, flag, context):
        return _merge_in_program(step, phase, records, flag, context)
    return _jax_ffi.merge(functools.partial(_host_step, step, phase), records, flag)


def _merge_in_program(step, phase, records, flag, context):
    """Merge ``records`` through one ordered merge call; under ``jax.vmap``, still one.

    The merge call has no batching rule, and a collective must run once per
    call on every rank whatever the batch: when any of the call's inputs
    (``context``, only looked at by ``jax.vmap``) or its records are mapped, the
    mapped axis is folded into the records' leading axis (the merge is row by
    row; records that do not depend on it, an empty shard's, are broadcast),
    merged by one call whose step agrees on the folded sizes (a rank that
    vmaps differently, or not at all, disagrees: every rank raises), and unfolded.
    """

    @jax.custom_batching.custom_vmap
    def merge(records, flag, context):
        return _jax_ffi.merge(functools.partial(_host_step, step, phase), records, flag)

    @merge.def_vmap
    def _fold(size, batched, records, flag, context):
        if not batched[0]:
            records = jnp.broadcast_to(records, (size, *records.shape))
        if batched[1]:  # every element's flag bits
            flag = jax.lax.reduce(flag, jnp.zeros((), flag.dtype), jax.lax.bitwise_or, (0,))
        rows = records.reshape(-1, *records.shape[2:])
        merged = _merge_in_program(step.folded(size), phase, rows, flag, context)
        return merged.reshape(records.shape), True

    return merge(records, flag, context)


# ----------------------------------------------------------------------------------------
# local checks (trace time: shapes and dtypes only)
# ----------------------------------------------------------------------------------------
def _is_array(x):
    """Whether ``x`` is a JAX array (or tracer) or a numpy array."""
    return isinstance(x, (jax.Array, np.ndarray))


def _check_qkv(q, k, v):
    """Validate q ``(B, Hq, Sq, D)`` and k, v ``(B, Hkv, T, D)``; return (Problem, T)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not _is_array(x):
            raise TypeError(
                f"{name} must be a JAX array, got {type(x).__module__}.{type(x).__name__}"
            )
        if x.ndim != 4:
            raise ValueError(f"{name} must have 4 dimensions, got shape {tuple(x.shape)}")
    dtypes = {x.dtype for x in (q, k, v)}
    if len(dtypes) > 1:
        raise TypeError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    b, hq, sq, d = (int(s) for s in q.shape)
    _, hkv, t, dk = (int(s) for s in k.shape)
    if int(k.shape[0]) != b or dk != d:
        raise ValueError(
            f"k/v must be (B, Hkv, T, D) with q (B, Hq, Sq, D): got k {tuple(k.shape)} for "
            f"q {tuple(q.shape)} (batch or D differ)"
        )
    if min(b, hq, sq, d) == 0:
        raise ValueError(f"q must have no empty dimension, got shape {tuple(q.shape)}")
    if hkv == 0:
        raise ValueError(f"q heads ({hq}) must be a positive multiple of kv heads ({hkv})")
    return extend.Problem.of(b, hq, hkv, d, sq, q.dtype), t


def _int_array(name, x, shape):
    """Check an integer array of an exact shape; return it as a JAX array."""
    if not _is_array(x) or np.dtype(x.dtype).kind not in "iu":
        raise TypeError(f"{name} must be an integer array, got {getattr(x, 'dtype', type(x))}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    return jnp.asarray(x)


def _visibility(problem, t, kv_len, q_pos, k_pos, mask):
    """Check masking arguments; return (lens ``(B,)`` or None, vis ``(B, Hm, Sq, T)`` or None)."""
    b, sq = problem.batch, problem.q_len
    lens = None if kv_len is None else _int_array("kv_len", kv_len, (b,))
    if (q_pos is None) != (k_pos is None):
        raise ValueError("q_pos and k_pos must be given together")
    vis = None
    if q_pos is not None:
        q_pos, k_pos = _int_array("q_pos", q_pos, (b, sq)), _int_array("k_pos", k_pos, (b, t))
        vis = (k_pos[:, None, :] <= q_pos[:, :, None])[:, None]
    if mask is not None:
        if not _is_array(mask) or np.dtype(mask.dtype).kind != "b":
            raise TypeError("mask must be a boolean array (True = attend)")
        full = (b, problem.q_heads, sq, t)
        padded = (1,) * (4 - mask.ndim) + tuple(int(s) for s in mask.shape)
        if mask.ndim > 4 or any(s not in (1, f) for s, f in zip(padded, full, strict=False)):
            raise ValueError(f"mask of shape {tuple(mask.shape)} is not broadcastable to {full}")
        m = jnp.asarray(mask).reshape(padded)
        vis = m if vis is None else vis & m
    if vis is not None:
        vis = jnp.broadcast_to(vis, (b, vis.shape[1], sq, t))
    return lens, vis


# ----------------------------------------------------------------------------------------
# local attention in the traced program
# ----------------------------------------------------------------------------------------
def _grouped_keep(p, t, lens, vis):
    """Visibility in GQA-grouped layout ``(B, Hkv, G*Sq, T)`` (or broadcastable), or None."""
    keep = vis
    if lens is not None:
        inside = (jnp.arange(t, dtype=lens.dtype)[None, :] < lens[:, None])[:, None, None, :]
        keep = inside if keep is None else keep & inside
    if keep is None:
        return None
    g = p.q_heads // p.kv_heads
    grouped = (p.kv_heads, g) if keep.shape[1] > 1 else (1, 1)
    keep = keep.reshape(keep.shape[0], *grouped, keep.shape[2], t)
    full = (p.batch, p.kv_heads, g, p.q_len, t)
    return jnp.broadcast_to(keep, full).reshape(p.batch, p.kv_heads, g * p.q_len, t)


def _grouped(p, x):
    """``(B, Hq, Sq, ...)`` as ``(B, Hkv, G*Sq, ...)``."""
    return x.reshape(p.batch, p.kv_heads, -1, *x.shape[3:])


def _einsum(spec, a, b):
    """``jnp.einsum`` at full precision: a GPU's default for float32 is TF32 (about 1e-3 off)."""
    return jnp.einsum(spec, a, b, precision=jax.lax.Precision.HIGHEST)


def _scores(p, scale, q, k, keep):
    """Scaled logits ``(B, Hkv, G*Sq, T)`` in the accumulation dtype; -inf where not visible."""
    s = _einsum("bhrd,bhtd->bhrt", _grouped(p, q.astype(p.acc)) * scale, k.astype(p.acc))
    return s if keep is None else jnp.where(keep, s, -jnp.inf)


def _dot(probs, v):
    """``probs @ v`` for ``(B, Hkv, R, T)`` and ``(B, Hkv, T, D)``."""
    return _einsum("bhrt,bhtd->bhrd", probs, v)


def _weighted(probs, v, keep):
    """``probs @ v``: values of excluded keys (NaN/Inf in unused slots) contribute nothing.

    A visible key's non-finite value enters as plain arithmetic gives it, in its own
    column only: counted by matmuls of indicators (``0 * inf`` and NaN give NaN).
    """
    if keep is None:
        return _dot(probs, v)
    finite = jnp.isfinite(v)
    clean = _dot(probs, jnp.where(finite, v, 0))

    def poisoned():
        seen = keep & jnp.ones(probs.shape, bool)
        nan = _dot(seen.astype(v.dtype), jnp.isnan(v).astype(v.dtype))
        nan += _dot((seen & (probs == 0)).astype(v.dtype), jnp.isinf(v).astype(v.dtype))
        big = (seen & (probs != 0)).astype(v.dtype)
        inf = jnp.where(_dot(big, (v == jnp.inf).astype(v.dtype)) > 0, jnp.inf, 0)
        inf += jnp.where(_dot(big, (v == -jnp.inf).astype(v.dtype)) > 0, -jnp.inf, 0)
        return clean + inf.astype(v.dtype) + jnp.where(nan > 0, jnp.nan, 0).astype(v.dtype)

    sees_bad = jnp.any(keep & ~jnp.all(finite, axis=-1)[:, :, None, :])
    return jax.lax.cond(sees_bad, poisoned, lambda: clean)


def _local_records(p, scale, t, q, k, v, keep):
    """Return this shard's ``(B, Hq, Sq, D + 2)`` records ``[m, d, n]`` (accumulation dtype)."""
    if t == 0:
        empty = jnp.full((*p.row_shape, 1), -jnp.inf, p.acc)
        return jnp.concatenate([empty, jnp.zeros((*p.row_shape, p.head_dim + 1), p.acc)], -1)
    s = _scores(p, scale, q, k, keep)
    m = jnp.max(s, axis=-1)
    probs = jnp.exp(s - jnp.where(jnp.isneginf(m), 0, m)[..., None])
    n = _weighted(probs, v.astype(p.acc), keep)
    rec = jnp.concatenate([m[..., None], jnp.sum(probs, axis=-1)[..., None], n], -1)
    return rec.reshape(*p.row_shape, p.head_dim + 2)


def _kernel_applies(t, q):
    """Whether the forward's local state runs in the C kernel (float32, keys, not switched off).

    Only on the CPU (the kernel is a host call): an array's own devices, or for a
    traced value JAX's default backend. On an accelerator XLA computes the state.
    """
    if t == 0 or q.dtype != jnp.float32 or os.environ.get(LOCAL_ENV, "kernel") == "xla":
        return False
    if isinstance(q, jax.core.Tracer):
        return jax.default_backend() == "cpu"
    return all(d.platform == "cpu" for d in q.devices())


def _finish(records):
    """Return (output ``n / d``, 0 for empty rows; lse, -inf for empty rows) of merged records."""
    m, d, n = records[..., 0], records[..., 1], records[..., 2:]
    seen = d != 0
    out = n / jnp.where(seen, d, 1)[..., None]
    return out, jnp.where(seen, m + jnp.log(jnp.where(seen, d, 1)), -jnp.inf)


# ----------------------------------------------------------------------------------------
# the differentiable decode
# ----------------------------------------------------------------------------------------
def _forward(step, q, k, v, aux, phase):
    """Return the merged output ``(B, Hq, Sq, D)`` and lse ``(B, Hq, Sq)`` (accumulation dtype).

    ``phase`` (:data:`FORWARD` or :data:`FORWARD_GRAD`) is agreed on: a rank whose
    call is differentiated runs a backward merge after it, and one whose call is
    not must not pair its next collective with that merge.
    """
    lens, vis, flag = aux
    p, scale = step.problem, step.opts.scale

    def local():
        if _kernel_applies(step.t, q):  # in range: a bad kv_len raises at the agreement
            inside = None if lens is None else jnp.clip(lens, 0, step.t).astype(jnp.int32)
            records, failed = _jax_ffi.records(q, k, v, scale, inside, vis)
            return records, flag | failed, ()  # a kernel error rides in the agreement
        keep = _grouped_keep(p, step.t, lens, vis)
        return _local_records(p, scale, step.t, q, k, v, keep), flag, ()

    def placeholder():
        return jnp.zeros((*p.row_shape, p.head_dim + 2), p.acc), jnp.zeros((), jnp.int32), ()

    step, records, flag, _ = _local_part(step, local, placeholder)
    return _finish(_collective(step, phase, records, flag, (q, k, v, aux)))


def _local_part(step, local, placeholder):
    """Return ``(step, records, flag, extra)`` of ``local()``; its error rides along.

    Eagerly the local part runs at once and is waited for (on an accelerator too:
    an out-of-memory there, say); traced, it is traced (a trace may fail on one
    rank only: its own dtype promotion, its empty shard's path). Either way an
    error in it becomes the step's verdict, with ``placeholder()``'s records, flag
    and extra (of the shapes ``local()``'s would have, so a traced program goes on
    to the merge), and the merge that follows raises it on every rank instead of
    leaving the others waiting there.
    """
    tracing = _jax_ffi.tracing()
    try:
        part = local()
        return (step, *(part if tracing else jax.block_until_ready(part)))
    except Exception as exc:  # the merge raises it on every rank
        return (dataclasses.replace(step, error=exc), *placeholder())


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _decode(step, q, k, v, aux):
    """Return the decode as JAX sees it: (output in q's dtype, lse in the accumulation dtype)."""
    out, lse = _forward(step, q, k, v, aux, FORWARD)
    return out.astype(q.dtype), lse


def _decode_fwd(step, q, k, v, aux):
    """Forward rule: keep the merged output and lse (the backward's global facts)."""
    out, lse = _forward(step, q, k, v, aux, FORWARD_GRAD)
    return (out.astype(q.dtype), lse), (q, k, v, aux, out, lse)


def _decode_bwd(step, residuals, cotangents):
    """Backward rule: dK, dV from this shard; dq summed over every rank's keys.

    With ``P = exp(S - L)`` (``L`` the merged lse) and ``O`` the merged output:
    ``dV = P^T dO``, ``dS = P * (dO V^T - rowsum(dO * O) + dL)``,
    ``dK = scale dS^T q`` and ``dq = scale sum_ranks dS K``.
    """
    q, k, v, aux, out, lse = residuals
    lens, vis, flag = aux
    p, scale = step.problem, step.opts.scale
    dout, dlse = cotangents

    def local():
        keep = _grouped_keep(p, step.t, lens, vis)
        do = _grouped(p, dout.astype(p.acc))
        if step.t == 0:
            dq_local = jnp.zeros_like(do)
            dk, dv = jnp.zeros_like(k), jnp.zeros_like(v)
        else:
            big_l = _grouped(p, lse)[..., None]
            s = _scores(p, scale, q, k, keep)
            probs = jnp.where(jnp.isneginf(big_l), 0, jnp.exp(s - big_l))
            vv, kk = v.astype(p.acc), k.astype(p.acc)
            if keep is not None:  # unused slots may hold NaN/Inf: they get, and give, nothing
                vv, kk = (jnp.where(jnp.isfinite(x), x, 0) for x in (vv, kk))
            delta = jnp.sum(do * _grouped(p, out), axis=-1, keepdims=True)
            dlse_rows = _grouped(p, dlse.astype(p.acc))[..., None]
            ds = probs * (_einsum("bhrd,bhtd->bhrt", do, vv) - delta + dlse_rows)
            if keep is not None:
                ds = jnp.where(keep, ds, 0)
            qg = _grouped(p, q.astype(p.acc))
            dv = _einsum("bhrt,bhrd->bhtd", probs, do).astype(v.dtype)
            dk = (scale * _einsum("bhrt,bhrd->bhtd", ds, qg)).astype(k.dtype)
            dq_local = scale * _dot(ds, kk)
        zeros = jnp.zeros((*dq_local.shape[:-1], 2), p.acc)  # m = 0, d = 0: the merge sums n
        rows = jnp.concatenate([zeros, dq_local], -1).reshape(*p.row_shape, -1)
        return rows, flag, (dk, dv)

    def placeholder():
        rows = jnp.zeros((*p.row_shape, p.head_dim + 2), p.acc)
        return rows, jnp.zeros((), jnp.int32), (jnp.zeros_like(k), jnp.zeros_like(v))

    step, rows, flag, (dk, dv) = _local_part(step, local, placeholder)
    summed = _collective(step, "backward", rows, flag, (q, k, v, aux, dout, dlse))
    dq = summed[..., 2:].reshape(q.shape).astype(q.dtype)
    return dq, dk, dv, (None, None, None)


_decode.defvjp(_decode_fwd, _decode_bwd)


def _failed(step, q):
    """Fail on every rank: one agreement carries ``step.error`` and raises everywhere.

    Eagerly the agreement runs at once and raises. Traced (``jax.jit``, and a
    closed-over ``q``, ``k``, ``v`` too), the program enters it in its place in the
    order of collectives and raises when it runs; the outputs, never produced, are
    shaped as a call on ``q`` would shape them (the output in q's dtype, the lse),
    so the code after the call traces and the program reaches the merge.
    """
    shape, dtype = (1, 1, 1, 1), jnp.dtype(jnp.float32)
    if _is_array(q) and q.ndim > 0:
        shape = tuple(int(s) for s in q.shape)
        if jnp.issubdtype(q.dtype, jnp.floating):  # numpy float64 without x64: float32
            dtype = jax.dtypes.canonicalize_dtype(q.dtype)
    acc = jnp.float64 if dtype == jnp.float64 else jnp.float32
    records = jnp.zeros((*shape[:-1], shape[-1] + 2), acc)
    flag = jnp.zeros((), jnp.int32)
    out, lse = _finish(_collective(step, FORWARD, records, flag, ()))
    return out.astype(dtype), lse


def _attend(comm, inputs, prepare, masking, strategy):
    """Run one guarded decode: (output in q's dtype, lse in the accumulation dtype).

    ``prepare(*inputs)`` runs the entry point's own checks and returns the
    ``(q, k, v, scale)`` to decode and its own facts the ranks agree on
    (``(name, value)`` pairs). Any exception in the local checks rides in the
    agreement, on every rank. While JAX traces (whether or not the inputs are
    traced), so does an exception that abandons the decode's trace on this rank,
    unless the decode's merge already ran (eagerly under ``jax.vmap`` or
    ``jax.grad``): then every rank settled it, and a second agreement would wait
    for ranks that never join it.
    """
    try:
        q, k, v, scale, extra = prepare(*inputs)
        problem, t = _check_qkv(q, k, v)
        lens, vis = _visibility(problem, t, **masking)
        opts = extend.Options.resolve(problem.head_dim, strategy, scale)
        if opts.needs_kv:
            raise ValueError(
                f"strategy {opts.strategy!r} moves K/V between ranks; the JAX adapter merges "
                f"states: use one of {merging_names()}"
            )
    except Exception as exc:  # the verdict rides in the agreement, on every rank
        return _failed(_Step(comm, error=exc), inputs[0])
    step = _Step(comm, problem, opts, t, extra=extra)
    flag = jnp.zeros((), jnp.int32)
    if lens is not None:
        flag = jnp.any((lens < 0) | (lens > t)).astype(jnp.int32)
    if not _jax_ffi.tracing():
        return _decode(step, q, k, v, (lens, vis, flag))
    ran = _jax_ffi.merges_run()
    try:  # a trace abandoned on one rank (say, its dtype promotion) must not strand the others
        return _decode(step, q, k, v, (lens, vis, flag))
    except Exception as exc:
        if _jax_ffi.merges_run() != ran:  # its merge ran: settled on every rank already
            raise
        return _failed(_Step(comm, error=exc), q)  # its verdict rides in the agreement


def _as_jax(*xs):
    """Return numpy arrays as JAX arrays; anything else unchanged (the checks judge it)."""
    return tuple(jnp.asarray(x) if isinstance(x, np.ndarray) else x for x in xs)


def tree_decode(
    q,
    k,
    v,
    comm=None,
    *,
    scale=None,
    kv_len=None,
    q_pos=None,
    k_pos=None,
    mask=None,
    strategy="auto",
    return_lse=False,
):
    """Exact attention over a KV cache sharded along the sequence, inside or outside ``jax.jit``.

    Collective over ``comm``: every rank passes the same ``q`` and its own shard
    of keys and values, and every rank receives the attention output over all
    shards, as one process would compute it. Differentiable with ``jax.grad``
    (``q``, ``k``, ``v``): ``dq`` is summed over every rank's keys, ``dk`` and
    ``dv`` are this shard's.

    Parameters
    ----------
    q : jax.Array
        ``(B, Hq, Sq, D)``, float16/bfloat16/float32/float64, identical on every rank.
    k, v : jax.Array
        ``(B, Hkv, T, D)``, same dtype: this rank's shard; ``T`` may differ between
        ranks and may be 0. ``Hq % Hkv == 0`` (GQA: query head ``h`` uses kv head
        ``h // (Hq // Hkv)``; K/V are never repeated).
    comm : mpi4py.MPI.Intracomm, optional
        Default: mpitree's private duplicate of ``COMM_WORLD``.
    scale : float, optional
        Logit scale, default ``1/sqrt(D)``. A Python number (it is agreed on).
    kv_len : jax.Array, optional
        int ``(B,)``: valid keys per batch row in this shard (keys at index
        ``>= kv_len[b]`` are ignored); traced, so a decode loop over a
        preallocated cache does not recompile as it fills.
    q_pos, k_pos : jax.Array, optional
        int ``(B, Sq)`` and ``(B, T)``: key j is visible to query i iff
        ``k_pos[b, j] <= q_pos[b, i]``. Give both or neither.
    mask : jax.Array, optional
        bool, broadcastable to ``(B, Hq or 1, Sq, T)``; True = attend.
    strategy : {"auto", "allreduce", "allreduce3", "allgather", "hierarchical"}, optional
        As in :func:`mpitree.tree_decode` (``"ring"`` moves K/V and is not offered).
    return_lse : bool, optional
        Also return the log-sum-exp.

    Returns
    -------
    out : jax.Array
        ``(B, Hq, Sq, D)`` in q's dtype; 0 for rows that see no key on any rank.
    lse : jax.Array
        ``(B, Hq, Sq)``, float32, natural log; -inf for rows that see no key.
        Only with ``return_lse=True``.

    Raises
    ------
    Exception
        On every rank, when any rank's input is invalid or ranks disagree: eagerly
        the core's exceptions; inside ``jax.jit`` a ``jax.errors.JaxRuntimeError``
        that ends with them.

    Notes
    -----
    Two collectives a call (the agreement and the merge), two more for the
    backward. Accumulation is float32 (float64 for float64 inputs). Keys
    excluded by ``kv_len``, positions or the mask contribute exactly nothing,
    whatever their values, to the output and to every gradient.

    Examples
    --------
    >>> step = jax.jit(lambda q, k, v, n: tree_decode(q, k, v, kv_len=n))  # doctest: +SKIP
    >>> batched = jax.jit(jax.vmap(lambda q, k, v: tree_decode(q, k, v)))  # doctest: +SKIP
    """
    comm = extend.check_comm(comm)

    def prepare(q, k, v):
        if not isinstance(return_lse, bool):
            raise TypeError(f"return_lse must be True or False, got {return_lse!r}")
        return (*_as_jax(q, k, v), scale, ())

    masking = dict(kv_len=kv_len, q_pos=q_pos, k_pos=k_pos, mask=mask)
    out, lse = _attend(comm, (q, k, v), prepare, masking, strategy)
    return (out, lse.astype(jnp.float32)) if return_lse is True else out


def free_energy(
    q,
    k,
    v,
    zeta=None,
    comm=None,
    *,
    scale=None,
    kv_len=None,
    q_pos=None,
    k_pos=None,
    mask=None,
    strategy="auto",
):
    """Per-row energies over a KV cache sharded along the sequence; ``jax.grad`` gives attention.

    The sharded form of :func:`mpitree.energy.free_energy`:
    ``F = log sum_a exp(scale q.k_a + zeta.v_a)`` (natural log) over the
    visible keys of every rank, on every rank, inside or outside ``jax.jit``
    and ``jax.vmap``. Its gradient with respect to ``zeta`` is the attention
    output (the paper's "attention is the gradient of the energy", across
    ranks); with respect to ``q`` it is ``scale`` times the attention-weighted
    mean of the keys. Collective over ``comm``.

    Parameters
    ----------
    q : jax.Array
        ``(B, Hq, Sq, D)``, float16/bfloat16/float32/float64, identical on every rank.
    k, v : jax.Array
        ``(B, Hkv, T, D)``, same dtype: this rank's shard (``T`` may differ between
        ranks and may be 0); ``Hq % Hkv == 0``.
    zeta : jax.Array, optional
        ``(B, Hq, Sq, D)``, q's dtype: the source, identical on every rank; default 0.
    comm, kv_len, q_pos, k_pos, mask, strategy
        As in :func:`tree_decode`.
    scale : float, optional
        Logit scale, default ``1/sqrt(D)``. A Python number (it is agreed on).

    Returns
    -------
    jax.Array
        ``(B, Hq, Sq)`` in q's dtype; ``-inf`` for rows that see no key.

    Raises
    ------
    Exception
        On every rank, as :func:`tree_decode` raises.

    Notes
    -----
    One decode of the augmented problem ``q' = [scale q, zeta]``,
    ``k' = v' = [k, v]`` (head size ``2D``, scale 1, the agreement also holding
    ``scale``): its log-sum-exp is ``F``, and its backward gives every gradient
    (``dq`` and ``dzeta`` summed over every rank's keys). Keys that no row sees
    contribute nothing, whatever their values.

    Examples
    --------
    >>> attention = jax.grad(lambda z: free_energy(q, k, v, z).sum())(zeros)  # doctest: +SKIP
    """
    comm = extend.check_comm(comm)

    def prepare(q, k, v, zeta):
        q, k, v, zeta = _as_jax(q, k, v, zeta)
        problem, _ = _check_qkv(q, k, v)
        if zeta is None:
            zeta = jnp.zeros(q.shape, q.dtype)
        elif not _is_array(zeta) or zeta.shape != q.shape or zeta.dtype != q.dtype:
            got = f"{zeta.dtype} {tuple(zeta.shape)}" if _is_array(zeta) else type(zeta).__name__
            raise ValueError(f"zeta must be an array of q's shape and dtype, got {got}")
        s = extend.Options.resolve(problem.head_dim, "allreduce", scale).scale
        keys = jnp.concatenate([k, v], -1)
        augmented = jnp.concatenate([q * jnp.asarray(s, q.dtype), zeta], -1)
        return augmented, keys, keys, 1.0, (("energy scale", s),)

    masking = dict(kv_len=kv_len, q_pos=q_pos, k_pos=k_pos, mask=mask)
    _, lse = _attend(comm, (q, k, v, zeta), prepare, masking, strategy)
    return lse.astype(q.dtype) if _is_array(q) else lse
