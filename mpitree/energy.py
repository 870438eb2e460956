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

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ._agreed import agree_merger
from ._guard import Call, check_comm, entry_point, flagged_allreduce
from ._local import grouped_keep, quiet, weighted_values
from ._namespace import Array, NumpyLike, is_array, namespace
from ._state import lse_of, output_of
from ._step import prepare_attention

__all__ = ["attention_variance", "free_energy", "tree_energy"]

_HOST = NumpyLike("numpy", np)


def free_energy(
    q: Array,
    k: Array,
    v: Array,
    zeta: Array | None = None,
    *,
    scale: float | None = None,
    causal: bool = False,
    mask: Array | None = None,
    shift: str | float | Array = "max",
) -> Array:
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
        Values of keys that no row sees may be garbage (NaN/Inf): they never reach
        the energy or its gradient.
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
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not is_array(x):
            raise TypeError(f"free_energy takes numpy, torch or JAX arrays; {name} is {type(x)}")
    ns = namespace(q, k, v, zeta, mask)
    b, hq, sq, dim = (int(s) for s in q.shape)
    hkv, n = int(k.shape[1]), int(k.shape[2])
    g = hq // hkv
    scale = 1.0 / dim**0.5 if scale is None else float(scale)
    x = ns.einsum("bhgsd,bhtd->bhgst", q.reshape(b, hkv, g, sq, dim), k) * scale
    if zeta is not None:
        vz = v
        if mask is not None:  # keys no row sees: their values must not reach autodiff
            m5 = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
            seen = ns.max(ns.astype(m5, "int32"), axis=(1, 2)) > 0  # (B|1, N)
            seen = ns.broadcast_to(seen[:, None, :, None], (b, hkv, n, 1))
            vz = ns.where(seen, v, 0)
        x = x + ns.einsum("bhgsd,bhtd->bhgst", zeta.reshape(b, hkv, g, sq, dim), vz)
    x = x.reshape(b, hq, sq, n)
    if causal:
        if sq != n:
            raise ValueError(f"causal energy needs Sq == N, got {sq} and {n}")
        x = ns.where(ns.tril(n, like=x), x, -np.inf)
    if mask is not None:
        x = ns.where(mask, x, -np.inf)
    if isinstance(shift, str):
        if shift != "max":
            raise ValueError(f"shift must be 'max', a number or an array, got {shift!r}")
        c = ns.stop_gradient(ns.max(x, -1, keepdims=True))
        c = ns.where(ns.isneginf(c), 0, c)
    else:
        c = shift if np.isscalar(shift) else shift[..., None]
    total = ns.sum(ns.exp(x - c), -1)
    empty = total == 0  # a NaN sum (a NaN logit) is not empty: it stays NaN, whatever c is
    energy = ns.where(empty, -np.inf, ns.log(ns.where(empty, 1.0, total)))
    return energy + (c if np.isscalar(c) else c[..., 0])


# ----------------------------------------------------------------------------------------
# tree_energy / attention_variance: over MPI ranks
# ----------------------------------------------------------------------------------------


@quiet
def _logits(step, zeta, acc):
    """Local logits ``scale q.k + zeta.v`` (-inf where not visible) and values, grouped.

    Returns x ``(B, Hkv, G*Sq, T)``, v in the accumulation dtype and the visibility
    (or None); GQA without repeating K/V.
    """
    q, k, v = step.q, step.k, step.v
    b, hq, sq, dim = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    kk, vv = k.astype(acc, copy=False), v.astype(acc, copy=False)
    x = q.astype(acc).reshape(b, hkv, g * sq, dim) @ kk.swapaxes(-1, -2)
    x *= acc.type(step.scale)
    keep = grouped_keep(_HOST, step.lens, step.vis, q, k)
    if zeta is not None:  # a hidden key's garbage value reaches only its own column of x
        x += np.asarray(zeta, dtype=acc).reshape(b, hkv, g * sq, dim) @ vv.swapaxes(-1, -2)
    if keep is not None:
        x = np.where(keep, x, acc.type(-np.inf))
    return x, vv, keep


@quiet
def _records_of(x, vv, keep, hq, moments=None):
    """Return the (m, d, n [, second moments]) records of grouped logits x over values vv."""
    m = x.max(axis=-1, initial=-np.inf)
    w = np.exp(x - np.where(np.isneginf(m), 0, m)[..., None])
    parts = [m[..., None], w.sum(axis=-1)[..., None], weighted_values(_HOST, w, vv, keep)]
    if moments == "diag":
        parts.append(weighted_values(_HOST, w, vv * vv, keep))
    elif moments == "full":
        dim = vv.shape[-1]
        outer = (vv[..., :, None] * vv[..., None, :]).reshape(*vv.shape[:-1], dim * dim)
        parts.append(weighted_values(_HOST, w, outer, keep))
    rec = np.concatenate(parts, axis=-1)
    b, _, rows, width = rec.shape
    return rec.reshape(b, hq, rows * x.shape[1] // hq, width)


def _prepare(q, k, v, zeta, scale, kv_len, q_pos, k_pos, mask, extra=None):
    """Local checks shared by the distributed energy functions."""
    masking = dict(kv_len=kv_len, q_pos=q_pos, k_pos=k_pos, mask=mask)
    options = dict(strategy="allreduce", scale=scale)
    problem, opts, step, sig = prepare_attention(q, k, v, **masking, options=options)
    if step.ns.name != "numpy":
        raise TypeError(f"the distributed energy takes numpy arrays, got {step.ns.name}")
    if zeta is not None and (not isinstance(zeta, np.ndarray) or zeta.shape != q.shape):
        raise ValueError(f"zeta must be a numpy array of q's shape {q.shape}")
    sig.update(extra or {}, zeta=zeta is not None)
    return problem, opts, step, sig


def _merge(problem, opts, width):
    """Return ``Call.merge`` for ``(B, Hq, Sq, width)`` records: one native all-reduce."""
    return (problem.rows, width - 2, problem.acc, opts)


@entry_point
def tree_energy(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    comm: MPI.Intracomm | None = None,
    *,
    zeta: np.ndarray | None = None,
    scale: float | None = None,
    kv_len: np.ndarray | None = None,
    q_pos: np.ndarray | None = None,
    k_pos: np.ndarray | None = None,
    mask: np.ndarray | None = None,
    algorithm: str = "fused",
) -> tuple[np.ndarray, np.ndarray]:
    """Compute the energy and its gradient (attention) over a KV cache sharded across ranks.

    Collective over ``comm``.

    Parameters
    ----------
    q, k, v, comm, scale, kv_len, q_pos, k_pos, mask
        As in :func:`mpitree.tree_decode`: q ``(B, Hq, Sq, D)`` identical on every
        rank, k and v ``(B, Hkv, T, D)`` this rank's shard, numpy float16/32/64.
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
    comm = check_comm(comm)

    def prepare():
        if algorithm not in ("fused", "paper"):
            raise ValueError(f"algorithm must be 'fused' or 'paper', got {algorithm!r}")
        problem, opts, step, sig = _prepare(
            q, k, v, zeta, scale, kv_len, q_pos, k_pos, mask, {"algorithm": algorithm}
        )
        merge = _merge(problem, opts, problem.head_dim + 2) if algorithm == "fused" else None
        return Call(sig, (problem, step), merge=merge)

    call, merger = agree_merger(comm, prepare)
    problem, step = call.payload
    acc = np.dtype(problem.acc)
    if algorithm == "paper":
        return _paper(comm, step, zeta, acc, problem.q_heads)

    def fill(records):
        rows = records.reshape(*problem.row_shape, -1)
        if zeta is None:  # the logits are q.k: the core's own kernel
            step.fill(records)
        else:
            x, vv, keep = _logits(step, zeta, acc)
            rows[...] = _records_of(x, vv, keep, problem.q_heads)

    merged = merger.merge(fill).reshape(*problem.row_shape, -1)
    return lse_of(merged, dtype=acc), output_of(merged)


@quiet
def _paper(comm, step, zeta, acc, hq):
    """Algorithms 1 and 2: MAX of m, SUM of the partition sum, then SUM of the gradient."""
    error = x = vv = keep = None
    b, sq = step.q.shape[0], step.q.shape[2]
    m = np.full((b, step.k.shape[1], hq // step.k.shape[1] * sq), -np.inf, dtype=acc)
    try:
        x, vv, keep = _logits(step, zeta, acc)
        m = x.max(axis=-1, initial=-np.inf)  # Algorithm 1: tree-reduce the max,
    except Exception as exc:  # the verdict rides in the first collective
        error = exc
    m = flagged_allreduce(comm, m, MPI.MAX, error)
    shift = np.where(np.isneginf(m), 0, m)[..., None]
    total = flagged_allreduce(comm, np.exp(x - shift).sum(axis=-1), MPI.SUM, None)
    empty = total == 0  # ... then the sum of exp(x - max) (NaN stays NaN: not empty)
    energy = np.where(empty, -np.inf, np.log(np.where(empty, 1, total)) + shift[..., 0])
    f = np.where(empty, 0, energy)[..., None]  # Algorithm 2: from the saved energy,
    grad = flagged_allreduce(comm, weighted_values(_HOST, np.exp(x - f), vv, keep), MPI.SUM, None)
    return energy.reshape(b, hq, sq).astype(acc), grad.reshape(b, hq, sq, -1).astype(acc)


@entry_point
def attention_variance(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    comm: MPI.Intracomm | None = None,
    *,
    scale: float | None = None,
    kv_len: np.ndarray | None = None,
    q_pos: np.ndarray | None = None,
    k_pos: np.ndarray | None = None,
    mask: np.ndarray | None = None,
    full: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
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
        rank, k and v ``(B, Hkv, T, D)`` this rank's shard, numpy float16/32/64.
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
    comm = check_comm(comm)

    def prepare():
        if not isinstance(full, (bool, np.bool_)):
            raise TypeError(f"full must be True or False, got {full!r}")
        problem, opts, step, sig = _prepare(
            q, k, v, None, scale, kv_len, q_pos, k_pos, mask, {"full": bool(full)}
        )
        dim = problem.head_dim
        width = dim + 2 + (dim * dim if full else dim)
        return Call(sig, (problem, step, width), merge=_merge(problem, opts, width))

    call, merger = agree_merger(comm, prepare)
    problem, step, width = call.payload
    acc, dim = np.dtype(problem.acc), problem.head_dim

    def fill(records):
        x, vv, keep = _logits(step, None, acc)
        moments = "full" if full else "diag"
        records.reshape(*problem.row_shape, width)[...] = _records_of(
            x, vv, keep, problem.q_heads, moments
        )

    moments = output_of(merger.merge(fill).reshape(*problem.row_shape, width))  # E[v], E[v v]
    mean, second = moments[..., :dim], moments[..., dim:]
    if full:
        second = second.reshape(*second.shape[:-1], dim, dim)
        var = second - mean[..., :, None] * mean[..., None, :]
    else:
        var = second - mean * mean
    return mean, var
