"""Attention as the gradient of an energy (the paper's sections 4-5, Algorithms 1 and 2).

For one query row with logits ``s_a = scale * q . k_a`` over the visible keys, the
energy with a source ``zeta`` (a vector of size D) is the log-partition function

    F(zeta) = log sum_a exp(s_a + zeta . v_a)            (natural log)

Its gradient at ``zeta = 0`` is attention, ``dF/dzeta = sum_a softmax(s)_a v_a``, and
its second derivative is the covariance of v under the attention distribution
(the paper's eqs. 11-12). For causal self-attention ``F_tot = sum_i F_i`` with query
``i`` seeing keys ``a <= i``.

- :func:`free_energy`: the per-row energies on one process, for numpy, torch and
  JAX arrays (torch and JAX are imported only when their arrays are passed), so
  ``torch.autograd`` / ``jax.grad`` of ``free_energy(...).sum()`` gives attention.
- :func:`tree_energy`: the energy and its gradient over a KV cache sharded across
  MPI ranks: the paper's Algorithms 1 and 2 as published, or fused into the core's
  single all-reduce.
- :func:`attention_variance`: the covariance of v under the attention weights,
  merged across ranks in the same single all-reduce.
"""

import sys

import numpy as np

from ._local import attend, visibility
from ._plan import allreduce_state, checked_call
from ._state import State

__all__ = ["attention_variance", "free_energy", "tree_energy"]


# ----------------------------------------------------------------------------------------
# free_energy: one process, numpy / torch / JAX
# ----------------------------------------------------------------------------------------


class _Numpy:
    """numpy operations used by the energy (the reference)."""

    @staticmethod
    def einsum(spec, a, b):
        return np.einsum(spec, a, b)

    @staticmethod
    def amax(x, axis):
        return x.max(axis=axis, keepdims=True)

    @staticmethod
    def stop_gradient(x):
        return x

    exp, log, where, isneginf = np.exp, np.log, np.where, np.isneginf

    @staticmethod
    def full_like(x, value):
        return np.full_like(x, value)

    @staticmethod
    def causal(n, like):
        return np.tril(np.ones((n, n), dtype=bool))


class _Torch:
    """torch operations (autograd-friendly: masked entries get zero gradient)."""

    def __init__(self):
        import torch

        self.t = torch

    def einsum(self, spec, a, b):
        return self.t.einsum(spec, a, b)

    def amax(self, x, axis):
        return self.t.amax(x, dim=axis, keepdim=True)

    def stop_gradient(self, x):
        return x.detach()

    def exp(self, x):
        return self.t.exp(x)

    def log(self, x):
        return self.t.log(x)

    def where(self, c, a, b):
        return self.t.where(c, a, b)

    def isneginf(self, x):
        return self.t.isneginf(x)

    def full_like(self, x, value):
        return self.t.full_like(x, value)

    def causal(self, n, like):
        return self.t.tril(self.t.ones((n, n), dtype=self.t.bool, device=like.device))


class _Jax:
    """jax.numpy operations."""

    def __init__(self):
        import jax
        import jax.numpy as jnp

        self.jax, self.np = jax, jnp

    def einsum(self, spec, a, b):
        return self.np.einsum(spec, a, b)

    def amax(self, x, axis):
        return self.np.max(x, axis=axis, keepdims=True)

    def stop_gradient(self, x):
        return self.jax.lax.stop_gradient(x)

    def exp(self, x):
        return self.np.exp(x)

    def log(self, x):
        return self.np.log(x)

    def where(self, c, a, b):
        return self.np.where(c, a, b)

    def isneginf(self, x):
        return self.np.isneginf(x)

    def full_like(self, x, value):
        return self.np.full_like(x, value)

    def causal(self, n, like):
        return self.np.tril(self.np.ones((n, n), dtype=bool))


def _backend(x):
    """Pick operations by the array's type, importing a framework only if its array is here."""
    module = type(x).__module__.split(".")[0]
    if module == "torch" and "torch" in sys.modules:
        return _Torch()
    if module in ("jax", "jaxlib") and "jax" in sys.modules:
        return _Jax()
    if isinstance(x, np.ndarray):
        return _Numpy
    raise TypeError(f"free_energy takes numpy, torch or JAX arrays, got {type(x).__name__}")


def free_energy(q, k, v, zeta=None, *, scale=None, causal=False, mask=None, shift="max"):
    """Per-row energies ``F = log sum_a exp(scale q.k_a + zeta.v_a)`` (natural log).

    Parameters
    ----------
    q : array
        ``(B, Hq, Sq, D)``: numpy, torch or JAX, any float dtype (computed in it).
    k, v : array
        ``(B, Hkv, N, D)``, same type; ``Hq % Hkv == 0`` (GQA without repeating K/V).
    zeta : array, optional
        ``(B, Hq, Sq, D)``: the source, one vector per row; default 0.
    scale : float, optional
        Logit scale, default ``1/sqrt(D)``.
    causal : bool, optional
        Causal self-attention: ``Sq == N`` and query ``i`` sees keys ``a <= i``;
        summing the result gives the paper's ``F_tot``.
    mask : array of bool, optional
        Broadcastable to ``(B, Hq, Sq, N)``; True = attend. Combines with ``causal``.
    shift : {"max"} or float or array, optional
        The safe-softmax shift ``c`` in ``F = c + log sum exp(x - c)`` (appendix 11):
        ``"max"`` (default) uses the row max, held constant for differentiation;
        a number or an array broadcastable to ``(B, Hq, Sq)`` uses that. ``F`` does
        not depend on it (up to rounding, and overflow for a poor shift).

    Returns
    -------
    array
        ``(B, Hq, Sq)``, same type and dtype as q; ``-inf`` for rows that see no key.
        Its gradient with respect to ``zeta`` is the attention output.
    """
    ops = _backend(q)
    b, hq, sq, dim = q.shape
    hkv, n = k.shape[1], k.shape[2]
    g = hq // hkv
    scale = 1.0 / dim**0.5 if scale is None else float(scale)
    x = ops.einsum("bhgsd,bhtd->bhgst", q.reshape(b, hkv, g, sq, dim), k) * scale
    if zeta is not None:
        x = x + ops.einsum("bhgsd,bhtd->bhgst", zeta.reshape(b, hkv, g, sq, dim), v)
    x = x.reshape(b, hq, sq, n)
    neg = ops.full_like(x, -float("inf"))
    if causal:
        if sq != n:
            raise ValueError(f"causal energy needs Sq == N, got {sq} and {n}")
        x = ops.where(ops.causal(n, x), x, neg)
    if mask is not None:
        x = ops.where(mask, x, neg)
    if isinstance(shift, str):
        if shift != "max":
            raise ValueError(f"shift must be 'max', a number or an array, got {shift!r}")
        c = ops.stop_gradient(ops.amax(x, -1))
        c = ops.where(ops.isneginf(c), ops.full_like(c, 0.0), c)
    else:
        c = shift if np.isscalar(shift) else shift[..., None]
    total = ops.exp(x - c).sum(-1)
    seen = total > 0
    safe = ops.where(seen, total, ops.full_like(total, 1.0))
    energy = ops.where(seen, ops.log(safe), ops.full_like(total, -float("inf")))
    return energy + (c if np.isscalar(c) else c[..., 0])


# ----------------------------------------------------------------------------------------
# tree_energy / attention_variance: over MPI ranks
# ----------------------------------------------------------------------------------------


def _logits(q, k, v, zeta, scale, lens, vis, acc):
    """Local logits ``scale q.k + zeta.v``, -inf where not visible, grouped by kv head.

    Returns x of shape (B, Hkv, G, Sq, T) and v in the accumulation dtype; GQA
    without repeating K/V.
    """
    b, hq, sq, dim = q.shape
    hkv, t = k.shape[1], k.shape[2]
    g = hq // hkv
    kk, vv = k.astype(acc, copy=False), v.astype(acc, copy=False)
    x = np.einsum("bhgsd,bhtd->bhgst", q.astype(acc).reshape(b, hkv, g, sq, dim), kk)
    x *= acc.type(scale)
    if zeta is not None:
        z5 = np.asarray(zeta, dtype=acc).reshape(b, hkv, g, sq, dim)
        x += np.einsum("bhgsd,bhtd->bhgst", z5, vv)
    keep = np.ones((1, 1, 1, 1, t), dtype=bool)
    if lens is not None:
        keep = keep & (np.arange(t) < lens[:, None])[:, None, None, None, :]
    if vis is not None:
        keep = keep & (vis.reshape(b, hkv, g, sq, t) if vis.shape[1] > 1 else vis[:, :, None])
    return np.where(keep, x, acc.type(-np.inf)), vv


def _rows(a, hq):
    """(B, Hkv, G, Sq, ...) -> (B, Hq, Sq, ...)."""
    return a.reshape(a.shape[0], hq, *a.shape[3:])


def _prepare(q, k, v, comm, zeta, scale, kv_len, q_pos, k_pos, mask):
    """Validate and agree across ranks; return what the local pass needs."""

    def zeta_shape():
        if zeta is not None and np.shape(zeta) != np.shape(q):
            raise ValueError(f"zeta must have q's shape {np.shape(q)}, got {np.shape(zeta)}")

    comm, shapes, scale, _ = checked_call(
        comm,
        q,
        k,
        v,
        scale=scale,
        kv_len=kv_len,
        q_pos=q_pos,
        k_pos=k_pos,
        mask=mask,
        extra=zeta_shape,
    )
    lens, vis = visibility(shapes, k.shape[2], kv_len, q_pos, k_pos, mask)
    acc = np.dtype(np.float64 if q.dtype == np.float64 else np.float32)
    return comm, shapes, scale, lens, vis, acc


def tree_energy(
    q,
    k,
    v,
    comm=None,
    *,
    zeta=None,
    scale=None,
    kv_len=None,
    q_pos=None,
    k_pos=None,
    mask=None,
    algorithm="fused",
):
    """Compute the energy and its gradient (attention) over a KV cache sharded across ranks.

    Collective over ``comm``.

    Parameters
    ----------
    q, k, v, comm, scale, kv_len, q_pos, k_pos, mask
        As in :func:`mpitree.tree_decode`: q ``(B, Hq, Sq, D)`` identical on every
        rank, k and v ``(B, Hkv, T, D)`` this rank's shard, float16/32/64.
    zeta : numpy.ndarray, optional
        ``(B, Hq, Sq, D)``, the source; default 0.
    algorithm : {"fused", "paper"}, optional
        ``"paper"``: Algorithms 1 and 2 as published: local logits
        ``x = q.k + zeta.v``, ``Allreduce(MAX)`` of the row max ``m``,
        ``Allreduce(SUM)`` of ``sum exp(x - m)``, ``F = m + log(sum)``; then the
        gradient from the saved ``F``: ``Allreduce(SUM)`` of ``sum exp(x - F) v``
        (three collectives: 1 + 1 + D numbers per row). ``"fused"`` (default):
        the same quantities from the core's (m, d, n) state of the logits ``x``,
        merged in one native all-reduce of ``D + 2`` numbers per row.

    Returns
    -------
    energy : numpy.ndarray
        ``(B, Hq, Sq)``, float64 for float64 inputs else float32, natural log;
        -inf for rows that see no key.
    grad : numpy.ndarray
        ``(B, Hq, Sq, D)``, same dtype: ``dF/dzeta``, the attention output at
        ``zeta = 0``; 0 for rows that see no key.
    """
    comm, shapes, scale, lens, vis, acc = _prepare(
        q, k, v, comm, zeta, scale, kv_len, q_pos, k_pos, mask
    )
    if algorithm == "fused" and zeta is None:  # the logits are q.k: the core's own kernel
        state = State(np.empty((*q.shape[:3], shapes.head_dim + 2), dtype=acc))
        attend(q, k, v, scale, lens, vis, state.records)
        state = allreduce_state(state, comm, "allreduce", check=False)
        return state.lse(dtype=acc), state.output()
    x, vv = _logits(q, k, v, zeta, scale, lens, vis, acc)
    hq = shapes.q_heads
    if algorithm == "paper":
        from mpi4py import MPI

        m = x.max(axis=-1, initial=-np.inf)  # Algorithm 1: tree-reduce the max,
        comm.Allreduce(MPI.IN_PLACE, m, op=MPI.MAX)
        shift = np.where(np.isneginf(m), 0, m)[..., None]
        total = np.exp(x - shift).sum(axis=-1)  # ... then the sum of exp(x - max)
        comm.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
        seen = total > 0
        energy = np.where(seen, np.log(np.where(seen, total, 1)) + shift[..., 0], -np.inf)
        f = np.where(seen, energy, 0)[..., None]  # Algorithm 2: from the saved energy,
        grad = np.einsum("bhgst,bhtd->bhgsd", np.exp(x - f), vv)  # one sum-reduction
        comm.Allreduce(MPI.IN_PLACE, grad, op=MPI.SUM)
        return _rows(energy, hq).astype(acc), _rows(grad, hq).astype(acc)
    if algorithm != "fused":
        raise ValueError(f"algorithm must be 'fused' or 'paper', got {algorithm!r}")
    state = allreduce_state(_state_of(x, vv, acc, hq), comm, "allreduce", check=False)
    return state.lse(dtype=acc), state.output()


def _state_of(x, vv, acc, hq, moments=None):
    """Build the (m, d, n [, second moments]) records of grouped logits x over values vv."""
    m = x.max(axis=-1, initial=-np.inf)
    w = np.exp(x - np.where(np.isneginf(m), 0, m)[..., None])
    parts = [m[..., None], w.sum(axis=-1)[..., None], np.einsum("bhgst,bhtd->bhgsd", w, vv)]
    if moments == "diag":
        parts.append(np.einsum("bhgst,bhtd->bhgsd", w, vv * vv))
    elif moments == "full":
        outer = np.einsum("bhgst,bhtd,bhte->bhgsde", w, vv, vv)
        parts.append(outer.reshape(*outer.shape[:4], -1))
    return State(_rows(np.concatenate(parts, axis=-1), hq).astype(acc))


def attention_variance(
    q, k, v, comm=None, *, scale=None, kv_len=None, q_pos=None, k_pos=None, mask=None, full=False
):
    """Compute attention and the covariance of v under its weights, in one all-reduce.

    The second cumulant ``d2F/dzeta2`` at ``zeta = 0`` (the paper's eqs. 11-12):
    ``E[v v^T] - E[v] E[v]^T`` under ``softmax(q.k)``. Each rank adds the second
    moment ``sum w v v`` to its (m, d, n) state; every field after ``m`` rescales
    by the same factor, so the core's native combine merges the longer records
    unchanged (a record of width ``D + 2 + D``, or ``D + 2 + D*D`` with ``full``).

    Parameters
    ----------
    q, k, v, comm, scale, kv_len, q_pos, k_pos, mask
        As in :func:`mpitree.tree_decode`: q ``(B, Hq, Sq, D)`` identical on every
        rank, k and v ``(B, Hkv, T, D)`` this rank's shard, float16/32/64.
    full : bool, optional
        Return the full ``D x D`` covariance instead of its diagonal.

    Returns
    -------
    out : numpy.ndarray
        ``(B, Hq, Sq, D)``: attention output (0 for rows that see no key).
    var : numpy.ndarray
        ``(B, Hq, Sq, D)`` variances, or ``(B, Hq, Sq, D, D)`` covariances with
        ``full``; 0 for rows that see no key. float64 for float64 inputs, else
        float32.
    """
    comm, shapes, scale, lens, vis, acc = _prepare(
        q, k, v, comm, None, scale, kv_len, q_pos, k_pos, mask
    )
    x, vv = _logits(q, k, v, None, scale, lens, vis, acc)
    state = _state_of(x, vv, acc, shapes.q_heads, "full" if full else "diag")
    merged = allreduce_state(state, comm, "allreduce", check=False)
    dim = shapes.head_dim
    moments = merged.output()  # every field after m divided by d: E[v], E[v v]
    mean, second = moments[..., :dim], moments[..., dim:]
    if full:
        second = second.reshape(*second.shape[:-1], dim, dim)
        var = second - mean[..., :, None] * mean[..., None, :]
    else:
        var = second - mean * mean
    return mean, var
