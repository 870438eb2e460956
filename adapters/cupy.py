"""mpitree for CuPy arrays: local attention and on-device merges on the GPU.

Local attention is the core's reference kernel run by CuPy (grouped GQA matmuls
on cuBLAS, float32 accumulation; no repeated K/V). Across ranks the small states
are staged through host memory (MPI runs user-defined reductions on the host):

- ``allreduce``, ``allreduce3``, ``hierarchical``: device to host, the core's
  reduction, host to device;
- ``allgather``: every rank's records are gathered to the host, copied to the
  device in one transfer, and merged there, in rank order, by the same vectorised
  merge the core uses (CuPy kernels).

Importing this module imports CuPy; ``import mpitree`` never does.
"""

try:
    import cupy
except ImportError as exc:  # pragma: no cover - exercised only without CuPy
    raise ImportError("mpitree.adapters.cupy needs CuPy: pip install 'mpitree[cupy]'") from exc

import numpy as np

from mpitree import State, allreduce_state
from mpitree._local import _attend_numpy, visibility
from mpitree._plan import checked_call
from mpitree._records import merge_records
from mpitree._reduce import resolve_strategy

__all__ = ["local_state", "tree_decode"]


def _records(q, k, v, shapes, scale, kv_len, q_pos, k_pos, mask):
    """Compute this shard's ``(B, Hq, Sq, D + 2)`` records on the device."""
    out = cupy.empty(
        (shapes.batch, shapes.q_heads, shapes.q_len, shapes.head_dim + 2),
        dtype=shapes.acc_dtype,
    )
    lens, vis = visibility(shapes, k.shape[2], kv_len, q_pos, k_pos, mask)
    _attend_numpy(q, k, v, scale, lens, vis, out)
    return out


def local_state(q, k, v, *, scale=None, kv_len=None, q_pos=None, k_pos=None, mask=None):
    """Compute this shard's partial attention state on the GPU (no communication).

    Parameters are those of :func:`mpitree.local_state`, as CuPy arrays on one
    device.

    Returns
    -------
    cupy.ndarray
        ``(B, Hq, Sq, D + 2)`` records ``[m, d, n]``, float64 for float64 inputs,
        else float32, natural-log units.
    """
    _, shapes, scale, _ = _checked(None, q, k, v, scale, kv_len, q_pos, k_pos, mask, None)
    return _records(q, k, v, shapes, scale, kv_len, q_pos, k_pos, mask)


def _checked(comm, q, k, v, scale, kv_len, q_pos, k_pos, mask, strategy):
    """Validate CuPy inputs; agree across ``comm`` unless ``strategy`` is None (local)."""

    def extra():
        for name, x in (("q", q), ("k", k), ("v", v)):
            if not isinstance(x, cupy.ndarray):
                raise TypeError(f"{name} must be a cupy.ndarray, got {type(x).__name__}")
        if strategy == "ring":
            raise ValueError("mpitree.adapters.cupy cannot run strategy='ring'")

    if strategy is None:
        from mpi4py import MPI

        comm = MPI.COMM_SELF
    return checked_call(
        comm,
        q,
        k,
        v,
        scale=scale,
        kv_len=kv_len,
        q_pos=q_pos,
        k_pos=k_pos,
        mask=mask,
        strategy=strategy or "allreduce",
        extra=extra,
    )


def _merge(records, comm, strategy, deterministic):
    """Merge device records across ranks: on the device for allgather, else on the host."""
    if comm.Get_size() > 1 and resolve_strategy(strategy, comm, 0, deterministic) == "allgather":
        host = cupy.asnumpy(records)
        gathered = np.empty((comm.Get_size(), *host.shape), dtype=host.dtype)
        comm.Allgather(host, gathered)
        return merge_records(cupy.asarray(gathered), axis=0)
    merged = allreduce_state(State(cupy.asnumpy(records)), comm, strategy, check=False)
    return cupy.asarray(merged.records)


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
    deterministic=False,
):
    """:func:`mpitree.tree_decode` for CuPy arrays: same arguments, results on the device.

    ``ring`` is refused (it moves K/V; use the numpy path for the baseline).

    Returns
    -------
    out : cupy.ndarray
        ``(B, Hq, Sq, D)`` in q's dtype; 0 for rows that see no key.
    lse : cupy.ndarray
        ``(B, Hq, Sq)`` float32, natural log (with ``return_lse``).
    """
    comm, shapes, scale, _ = _checked(comm, q, k, v, scale, kv_len, q_pos, k_pos, mask, strategy)
    records = _records(q, k, v, shapes, scale, kv_len, q_pos, k_pos, mask)
    if deterministic and strategy != "allgather":
        strategy = "allgather"  # rank-ordered, like the core's deterministic mode
    merged = _merge(records, comm, strategy, deterministic)
    den = merged[..., 1:2]
    seen = den != 0
    out = cupy.where(seen, merged[..., 2:] / cupy.where(seen, den, 1), 0).astype(q.dtype)
    if not return_lse:
        return out
    logd = cupy.log(cupy.where(seen, den, 1)[..., 0])
    lse = cupy.where(seen[..., 0], merged[..., 0] + logd, -np.inf)
    return out, lse.astype(np.float32)
