"""mpitree for torch tensors: ``mpitree.adapters.torch.tree_decode`` on CPU or CUDA.

Local attention runs in torch on the tensors' device (float32 accumulation, or
float64 for float64 inputs; GQA without repeating K/V). The per-row states are
merged by the core's reductions: tensors on the CPU are shared with numpy without
a copy; CUDA tensors are staged through a pinned host buffer (device to host, one
all-reduce, host to device), because MPI runs user-defined reductions on the
host. Whether the MPI library is CUDA-aware is reported by :func:`cuda_aware`.

Importing this module imports torch; ``import mpitree`` never does.
"""

import ctypes
import os

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError("mpitree.adapters.torch needs PyTorch: pip install 'mpitree[torch]'") from exc

from mpitree import State, allreduce_state
from mpitree._plan import checked_call
from mpitree._plan import tree_decode as _numpy_tree_decode
from mpitree._validate import Shapes

__all__ = ["cuda_aware", "local_state", "tree_decode"]

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


def _check(q, k, v, kv_len, q_pos, k_pos, mask):
    """Validate torch inputs; return (B, Hq, Hkv, Sq, D)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(f"{name} must have 4 dimensions, got shape {tuple(x.shape)}")
        if not x.dtype.is_floating_point:
            raise TypeError(f"{name} must be a float tensor, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")
    b, hq, sq, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(
            f"k/v shapes {tuple(k.shape)}, {tuple(v.shape)} do not match q {tuple(q.shape)}"
        )
    hkv, t = k.shape[1], k.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"q heads ({hq}) must be a positive multiple of kv heads ({hkv})")
    if kv_len is not None and (
        tuple(kv_len.shape) != (b,) or int(kv_len.min()) < 0 or int(kv_len.max()) > t
    ):
        raise ValueError(f"kv_len must have shape ({b},) with values in [0, {t}]")
    if (q_pos is None) != (k_pos is None):
        raise ValueError("q_pos and k_pos must be given together")
    if q_pos is not None and (tuple(q_pos.shape) != (b, sq) or tuple(k_pos.shape) != (b, t)):
        raise ValueError(f"q_pos must have shape ({b}, {sq}) and k_pos ({b}, {t})")
    if mask is not None and mask.dtype != torch.bool:
        raise TypeError("mask must be a boolean tensor (True = attend)")
    return b, hq, hkv, sq, d


def _acc(dtype):
    """Accumulation dtype: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def local_state(q, k, v, *, scale=None, kv_len=None, q_pos=None, k_pos=None, mask=None):
    """Compute this shard's (m, d, n) records in torch, on the tensors' device.

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
        inputs), natural-log units.
    """
    _check(q, k, v, kv_len, q_pos, k_pos, mask)
    return _records(q, k, v, scale, kv_len, q_pos, k_pos, mask)


def _records(q, k, v, scale, kv_len, q_pos, k_pos, mask):
    """Local attention state of validated inputs."""
    b, hq, sq, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    g = hq // hkv
    acc = _acc(q.dtype)
    scale = 1.0 / d**0.5 if scale is None else float(scale)
    qs = q.to(acc).reshape(b, hkv, g * sq, d) * scale
    s = qs @ k.to(acc).transpose(-1, -2)  # (B, Hkv, G*Sq, T): no repeated K/V
    keep = None
    if kv_len is not None:
        keep = (torch.arange(t, device=q.device) < kv_len[:, None])[:, None, None, None, :]
    if q_pos is not None:
        causal = (k_pos[:, None, :] <= q_pos[:, :, None])[:, None, None]
        keep = causal if keep is None else keep & causal
    if mask is not None:
        m5 = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
        m5 = m5.reshape(m5.shape[0], hkv, g, sq, t) if m5.shape[1] > 1 else m5[:, :, None]
        keep = m5 if keep is None else keep & m5
    if keep is not None:
        s = s.reshape(b, hkv, g, sq, t).masked_fill(~keep, float("-inf")).reshape(b, hkv, g * sq, t)
    m = s.amax(-1) if t else torch.full(s.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    shift = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    p = torch.exp(s - shift[..., None])
    rec = torch.cat([m[..., None], p.sum(-1)[..., None], p @ v.to(acc)], dim=-1)
    return rec.reshape(b, hq, sq, d + 2)


def _merge(records, comm, strategy, deterministic):
    """Merge device records across ranks through the core (host staging for CUDA)."""
    if records.device.type == "cpu":
        merged = allreduce_state(
            State(records.numpy()), comm, strategy, check=False, deterministic=deterministic
        )
        return torch.from_numpy(merged.records)
    host = torch.empty(records.shape, dtype=records.dtype, pin_memory=True)
    host.copy_(records)  # synchronous: the producing stream has finished
    merged = allreduce_state(
        State(host.numpy()), comm, strategy, check=False, deterministic=deterministic
    )
    return torch.from_numpy(merged.records).to(records.device, non_blocking=False)


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
    """:func:`mpitree.tree_decode` for torch tensors on CPU or CUDA.

    Same arguments, as tensors on one device (``kv_len``, positions and mask too).

    Returns
    -------
    out : torch.Tensor
        ``(B, Hq, Sq, D)`` in q's dtype and device; 0 for rows that see no key.
    lse : torch.Tensor
        ``(B, Hq, Sq)`` float32, natural log, on q's device (with ``return_lse``).
    """

    def inspect():
        return Shapes(*_check(q, k, v, kv_len, q_pos, k_pos, mask), q.dtype)

    comm, _, scale, _ = checked_call(
        comm,
        q,
        k,
        v,
        scale=scale,
        kv_len=kv_len,
        q_pos=q_pos,
        k_pos=k_pos,
        mask=mask,
        strategy=strategy,
        deterministic=deterministic,
        inspect=inspect,
    )
    return _decode_checked(
        q, k, v, comm, scale, kv_len, q_pos, k_pos, mask, strategy, deterministic, return_lse
    )


def _decode_checked(
    q, k, v, comm, scale, kv_len, q_pos, k_pos, mask, strategy, deterministic, return_lse
):
    """Run :func:`tree_decode` on inputs every rank has validated and agreed on."""
    if strategy == "ring":  # the baseline moves K/V: hand numpy (host) copies to the core
        host = [None if x is None else x.detach().cpu() for x in (q, k, v)]
        acc = _acc(q.dtype)
        arrays = [x.to(acc).numpy() for x in host]
        extra = {
            name: None if x is None else x.detach().cpu().numpy()
            for name, x in (("kv_len", kv_len), ("q_pos", q_pos), ("k_pos", k_pos), ("mask", mask))
        }
        out, lse = _numpy_tree_decode(
            *arrays, comm, scale=scale, strategy="ring", return_lse=True, **extra
        )
        out = torch.from_numpy(out).to(device=q.device, dtype=q.dtype)
        lse = torch.from_numpy(lse).to(q.device)
        return (out, lse) if return_lse else out
    records = _merge(
        _records(q, k, v, scale, kv_len, q_pos, k_pos, mask), comm, strategy, deterministic
    )
    return _finish(records, q, return_lse)


def _finish(records, q, return_lse):
    """Turn merged ``(B, Hq, Sq, D + 2)`` records into q's dtype and device (and the lse)."""
    n, den = records[..., 2:], records[..., 1:2]
    out = torch.where(
        den != 0, n / torch.where(den != 0, den, torch.ones_like(den)), torch.zeros_like(n)
    )
    out = out.to(q.device, q.dtype)
    if not return_lse:
        return out
    lse = torch.where(
        den[..., 0] != 0,
        records[..., 0] + torch.log(den[..., 0]),
        torch.full_like(den[..., 0], float("-inf")),
    )
    return out, lse.to(device=q.device, dtype=torch.float32)
