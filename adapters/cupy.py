"""mpitree for CuPy arrays: local attention on the GPU, merged through the host.

The core takes CuPy arrays directly (``mpitree.tree_decode``, ``DecodePlan``):
local attention is the core's namespace-generic kernel run by CuPy (grouped
GQA matmuls on cuBLAS, float32 accumulation; no repeated K/V), the small
per-row states are staged through a (pinned) host buffer for the merge, because
MPI runs user-defined reductions on the host, and results come back on the
device. This module adds :func:`local_state` returning the records on the
device.

Importing this module imports CuPy; ``import mpitree`` never does.
"""

from __future__ import annotations

from ._hint import missing

try:
    import cupy
except ImportError as exc:  # pragma: no cover - exercised only without CuPy
    raise missing("mpitree.adapters.cupy", "cupy", exc) from exc

from mpitree import DecodePlan, extend, tree_decode
from mpitree._checks import check_masking, check_qkv
from mpitree._local import state_records
from mpitree._masks import visibility

__all__ = ["DecodePlan", "local_state", "tree_decode"]


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
    ns, problem, t = check_qkv(q, k, v)
    if not isinstance(q, cupy.ndarray):
        raise TypeError(f"mpitree.adapters.cupy.local_state takes CuPy arrays, got {ns.name}")
    kv_len, q_pos, k_pos, mask = check_masking(ns, problem, t, kv_len, q_pos, k_pos, mask)
    scale = extend.Options.resolve(problem.head_dim, scale=scale).scale
    lens, vis = visibility(ns, problem.batch, problem.q_len, t, kv_len, q_pos, k_pos, mask)
    return state_records(ns, q, k, v, scale, lens, vis, problem.acc)
