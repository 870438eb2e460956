"""An adapter of your own, written from ``mpitree.extend`` alone: exact, guarded, recurring.

    .venv/bin/mpiexec -n 3 .venv/bin/python examples/extend_adapter.py

The adapter brings its own local attention (plain numpy here; your fused kernel in
practice) over a cache laid out ``(B, T, Hkv, D)`` ("bthd"), writes this rank's
``(m, d, n)`` records, and merges them through mpitree's guarded path: every
local check inside ``prepare()``, one agreement collective, then the merge. From
its second call on, a call of the same layout is one compiled call
(:class:`mpitree.extend.RecordsMerge`'s lane). Bad input on one rank raises on
every rank. Rank 0 checks each output against one process over the whole cache.
"""

import math

import numpy as np
from mpi4py import MPI

import mpitree
from mpitree import extend

_MERGES = extend.RecordsMerge(f"{__name__}.bthd_decode")  # the entry point's qualified name


def local_records(q, k, v):
    """This shard's float32 records ``(B, Hq, 1, D + 2)``, ``[m, d, n]`` per row.

    ``q`` ``(B, Hq, D)``; ``k``, ``v`` ``(B, T, Hkv, D)``; an empty shard gives the
    empty state (``m = -inf``, ``d = n = 0``), the merge's identity.
    """
    b, hq, dim = q.shape
    t, hkv = k.shape[1], k.shape[2]
    records = np.zeros((b, hq, 1, dim + 2), np.float32)
    records[..., 0] = -np.inf
    if t:
        grouped = q.reshape(b, hkv, hq // hkv, dim).astype(np.float64)
        scores = np.einsum("bhgd,bthd->bhgt", grouped, k) / math.sqrt(dim)
        m = scores.max(-1, keepdims=True)
        p = np.exp(scores - m)
        records[..., 0] = m.reshape(b, hq, 1)
        records[..., 1] = p.sum(-1).reshape(b, hq, 1)
        records[..., 2:] = np.einsum("bhgt,bthd->bhgd", p, v).reshape(b, hq, 1, dim)
    return records


def _checked(q, k, v, strategy):
    """Every local check: return the call's key (the shapes, dtypes and options).

    The key determines the agreed call for any shard length (``T`` may change
    from call to call; K's and V's must match).
    """
    arrays = (q, k, v)
    if not all(isinstance(x, np.ndarray) and x.dtype == np.float32 for x in arrays):
        raise TypeError("q, k and v must be float32 numpy arrays")
    if q.ndim != 3 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(
            f"q must be (B, Hq, D), k and v (B, T, Hkv, D) alike: {q.shape}, {k.shape}, {v.shape}"
        )
    (b, hq, dim), (kb, _, hkv, kdim) = q.shape, k.shape
    problem = extend.Problem.of(b, hq, hkv, dim)  # validates the sizes and GQA's grouping
    if (kb, kdim) != (b, dim):
        raise ValueError(f"k's batch and head_dim {kb, kdim} differ from q's {b, dim}")
    return problem, extend.Options.resolve(dim, strategy)


def _output(merged, q):
    """The ``(B, Hq, D)`` output of merged records (0 for a row that saw no key)."""
    return extend.finish(merged, q)[:, :, 0]


def _lane(q, k, v, comm=None, *, strategy="auto"):
    """The recurring call's compiled step; None (nothing has communicated): the guard runs.

    Where it returns None (a layout's first two calls, or a call it declines), the
    guarded call computes the records again: cheap beside a fused kernel's step.
    """
    try:
        problem, opts = _checked(q, k, v, strategy)
        records = local_records(q, k, v)
    except Exception:
        return None
    merged = _MERGES.lane(comm, (problem, opts), records)
    return None if merged is None else _output(merged, q)


@extend.entry_point(lane=_lane)
def bthd_decode(q, k, v, comm=None, *, strategy="auto"):
    """Exact decode attention of ``q`` ``(B, Hq, D)`` over a "bthd" cache sharded by rank.

    Returns the float32 output ``(B, Hq, D)``, the same on every rank.
    """
    comm_arg, comm = comm, extend.check_comm(comm)
    checked = records = error = None
    try:  # the checks and the local work: an error rides in the agreement, every rank raises
        checked = _checked(q, k, v, strategy)
        records = local_records(q, k, v)
    except Exception as exc:
        error = exc

    def prepare():
        if error is not None:
            raise error
        problem, opts = checked
        merge = (problem.rows, problem.head_dim, problem.acc, opts)
        signature = {**problem.signature(), **opts.signature()}  # every rank's alike
        return extend.Call(signature, key=checked, merge=merge)

    key = checked if error is None else None  # a failed call is not remembered
    return _output(_MERGES.merge(comm_arg, comm, key, records, prepare), q)


if __name__ == "__main__":
    comm = MPI.COMM_WORLD
    rank, p = comm.Get_rank(), comm.Get_size()
    B, Hq, Hkv, D = 2, 8, 2, 64
    rng = np.random.default_rng(0)  # the same on every rank: each can rebuild the whole cache
    k_all = rng.standard_normal((B, 40 * p, Hkv, D), dtype=np.float32)
    v_all = rng.standard_normal((B, 40 * p, Hkv, D), dtype=np.float32)
    worst = 0.0
    for step in range(4):
        sizes = [(7 * r + 3 * step) % 29 + 1 for r in range(p)]  # uneven shards, growing
        sizes[-1] = 0 if p > 2 else sizes[-1]  # and an empty one
        lo = sum(sizes[:rank])
        k, v = k_all[:, lo : lo + sizes[rank]], v_all[:, lo : lo + sizes[rank]]
        q = rng.standard_normal((B, Hq, D), dtype=np.float32)
        out = bthd_decode(q, k, v)
        n = sum(sizes)
        ref, _ = mpitree.reference_attention(
            q[:, :, None], k_all[:, :n].transpose(0, 2, 1, 3), v_all[:, :n].transpose(0, 2, 1, 3)
        )
        worst = max(worst, float(np.abs(out - ref[:, :, 0]).max()))
    caught = "nothing"
    try:  # bad input on the last rank only: every rank raises
        bthd_decode(q[:, :3] if rank == p - 1 else q, k, v)
    except (ValueError, mpitree.RankError) as exc:
        caught = type(exc).__name__
    if rank == 0:
        print(f"{p} ranks: max |out - ref| = {worst:.2e} over 4 steps; bad input: {caught}")
