"""mpitree for torch tensors, on CPU or CUDA.

The core takes torch tensors directly (``mpitree.tree_decode``, ``DecodePlan``):
it recognises them without importing torch and returns results on their device.
This module adds what only torch users need: :func:`local_state` returning the
records as a tensor on the tensors' device, and :func:`cuda_aware`.

Local attention: float32 CPU tensors run the compiled kernel on memory shared
with numpy (no copy); bfloat16 CUDA tensors without a mask run torch's fused
flash kernel (records ``[lse, 1, out]``, docs/frameworks.md says when); the
rest run grouped torch matmuls on the tensors' device (float32 accumulation,
float64 for float64; GQA without repeating K/V). CUDA records are staged
through a pinned host buffer for the merge (MPI runs user-defined reductions
on the host).

Importing this module imports torch; ``import mpitree`` never does.
"""

from __future__ import annotations

import ctypes
import os

from ._hint import missing

try:
    import torch  # noqa: F401  (the adapter needs it; the core never imports it)
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise missing("mpitree.adapters.torch", "torch", exc) from exc

from mpitree import DecodePlan, extend, tree_decode

__all__ = ["DecodePlan", "cuda_aware", "local_state", "tree_decode"]

_CUDA_AWARE_ENV = "MPITREE_CUDA_AWARE"


def cuda_aware():
    """Return whether the loaded MPI library accepts CUDA device buffers.

    ``MPITREE_CUDA_AWARE=0/1`` overrides; otherwise ``MPIX_Query_cuda_support()``
    from the MPI library mpi4py loaded (MPICH and Open MPI provide it; the PyPI
    wheels answer 0). Without that symbol: False.
    """
    env = os.environ.get(_CUDA_AWARE_ENV)
    if env in ("0", "1"):
        return env == "1"
    from mpi4py import MPI

    try:
        query = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
    except AttributeError:
        return False
    query.restype = ctypes.c_int
    return bool(query())


def local_state(q, k, v, *, scale=None, kv_len=None, q_pos=None, k_pos=None, mask=None):
    """Compute this shard's (m, d, n) records in torch, on the tensors' device (no communication).

    Parameters
    ----------
    q : torch.Tensor
        ``(B, Hq, Sq, D)``, float16/bfloat16/float32/float64.
    k, v : torch.Tensor
        ``(B, Hkv, T, D)``, same dtype and device; ``T`` may be 0.
    scale, kv_len, q_pos, k_pos, mask
        As in :func:`mpitree.tree_decode`, as tensors on the same device.

    Returns
    -------
    torch.Tensor
        ``(B, Hq, Sq, D + 2)`` records ``[m, d, n]``, float32 (float64 for float64
        inputs), natural-log units. Excluded keys contribute exactly nothing. From
        the fused CUDA kernel they are ``[lse, 1, out]``: the same state (``n / d``
        and ``m + log d`` agree), though ``m`` is then not the row's max score.
    """
    ns, problem, t = extend.check_qkv(q, k, v)
    if ns.name != "torch":
        raise TypeError(f"mpitree.adapters.torch.local_state takes torch tensors, got {ns.name}")
    kv_len, q_pos, k_pos, mask = extend.check_masking(ns, problem, t, kv_len, q_pos, k_pos, mask)
    scale = extend.Options.resolve(problem.head_dim, scale=scale).scale
    lens, vis = extend.visibility(ns, problem.batch, problem.q_len, t, kv_len, q_pos, k_pos, mask)
    return extend.state_records(ns, q, k, v, scale, lens, vis, problem.acc)
