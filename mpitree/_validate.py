"""Local input checks, and the one small collective that makes every rank agree."""

import math
import zlib
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

STRATEGIES = ("auto", "allreduce", "allreduce3", "allgather", "ring", "hierarchical")
_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
# dtype names in the agreement signature: numpy's and the adapters' (torch.bfloat16 ...)
_DTYPE_NAMES = ("float16", "float32", "float64", "bfloat16")


def dtype_name(dtype):
    """Return the plain name of a numpy or framework float dtype ("float32", "bfloat16")."""
    return str(dtype).rsplit(".", 1)[-1]


@dataclass(frozen=True)
class Shapes:
    """The decode problem's shape, identical on every rank (T excepted)."""

    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    head_dim: int
    dtype: np.dtype

    @property
    def rows(self):
        """Number of (batch, head, query) rows."""
        return self.batch * self.q_heads * self.q_len

    @property
    def acc_dtype(self):
        """Accumulation dtype: float64 for float64 inputs, float32 otherwise."""
        return np.dtype(np.float64 if dtype_name(self.dtype) == "float64" else np.float32)


def _array(name, x, ndim):
    """Check that ``x`` is a numpy array of rank ``ndim`` with a unit-stride last axis."""
    if not isinstance(x, np.ndarray):
        raise TypeError(
            f"{name} must be a numpy.ndarray, got {type(x).__name__} "
            "(torch/CuPy tensors go through mpitree.adapters)"
        )
    if x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {x.shape}")
    if x.size and x.shape[-1] > 1 and x.strides[-1] != x.itemsize:
        raise ValueError(f"{name} must be contiguous in its last dimension (strides {x.strides})")


def check_shapes(q, k, v):
    """Validate q, k, v and return their :class:`Shapes`."""
    _array("q", q, 4)
    _array("k", k, 4)
    _array("v", v, 4)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype not in _FLOATS:
            raise TypeError(f"{name} must be float16, float32 or float64, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {k.shape} vs {v.shape}")
    b, hq, sq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k/v shape {k.shape} does not match q shape {q.shape} in batch or D")
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"q heads ({hq}) must be a positive multiple of kv heads ({hkv})")
    if min(b, hq, sq, d) == 0:
        raise ValueError(f"q must have no empty dimension, got shape {q.shape}")
    return Shapes(b, hq, hkv, sq, d, q.dtype)


def resolve_scale(scale, head_dim):
    """Return the softmax scale as a Python float (default 1/sqrt(D))."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    try:
        scale = float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"scale must be a real number, got {scale!r}") from None
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def _int_array(name, x, shape):
    """Check an integer array of an exact shape."""
    if not isinstance(x, np.ndarray) or x.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer numpy array, got {type(x).__name__}")
    if x.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {x.shape}")


def check_masking(shapes, t, kv_len, q_pos, k_pos, mask):
    """Validate kv_len, q_pos, k_pos and mask for a shard of ``t`` keys."""
    b, sq = shapes.batch, shapes.q_len
    if kv_len is not None:
        _int_array("kv_len", kv_len, (b,))
        if kv_len.size and (kv_len.min() < 0 or kv_len.max() > t):
            raise ValueError(f"kv_len must lie in [0, {t}] (this shard's length), got {kv_len}")
    if (q_pos is None) != (k_pos is None):
        raise ValueError("q_pos and k_pos must be given together")
    if q_pos is not None:
        _int_array("q_pos", q_pos, (b, sq))
        _int_array("k_pos", k_pos, (b, t))
    if mask is not None:
        if not isinstance(mask, np.ndarray) or mask.dtype != np.bool_:
            raise TypeError("mask must be a boolean numpy array (True = attend)")
        full = (b, shapes.q_heads, sq, t)
        padded = (1,) * (4 - mask.ndim) + mask.shape
        if mask.ndim > 4 or any(s not in (1, f) for s, f in zip(padded, full)):
            raise ValueError(f"mask of shape {mask.shape} is not broadcastable to {full}")


def check_strategy(strategy):
    """Validate a strategy name."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")


def check_comm(comm):
    """Validate that ``comm`` is a usable intracommunicator."""
    if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
        raise TypeError(f"comm must be an mpi4py intracommunicator, got {comm!r}")


_FIELDS = (
    "batch",
    "q_heads",
    "kv_heads",
    "q_len",
    "head_dim",
    "dtype",
    "strategy",
    "scale",
    "node size",
    "deterministic",
    "q (checksum)",
)


def check_finite(q, k, v):
    """Raise if q, k or v holds NaN or Inf (validate mode: reads K/V once more)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.size and not np.isfinite(x).all():
            raise ValueError(f"{name} contains NaN or Inf")


def checksum(q):
    """Return a cheap checksum (CRC-32) of q's bytes, to check every rank has the same q."""
    return zlib.crc32(np.ascontiguousarray(q).view(np.uint8))


def agree(
    comm,
    error,
    shapes=None,
    strategy="auto",
    scale=0.0,
    *,
    node_size=0,
    deterministic=False,
    q_sum=0,
):
    """Make every rank agree on the problem in one small collective, or raise on all.

    ``error`` is this rank's local validation exception (or None). Raises on every
    rank when any rank failed locally or when the fields in ``_FIELDS`` differ.
    """
    size = comm.Get_size()
    if shapes is None or error is not None:  # a failed rank's fields may be unresolved
        sig = [0] * len(_FIELDS)
    else:
        sig = [
            shapes.batch,
            shapes.q_heads,
            shapes.kv_heads,
            shapes.q_len,
            shapes.head_dim,
            _DTYPE_NAMES.index(dtype_name(shapes.dtype)),
            STRATEGIES.index(strategy),
            int(np.float64(scale).view(np.int64)),
            node_size,
            int(deterministic),
            q_sum,
        ]
    bad = comm.Get_rank() if error is not None else size
    buf = np.array([bad, *sig, *(-s for s in sig)], dtype=np.int64)
    if size > 1:
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MIN)
    if error is not None:
        raise error
    if buf[0] < size:
        raise ValueError(f"mpitree: invalid input on rank {buf[0]} (see that rank's error)")
    n = len(_FIELDS)
    lo, hi = buf[1 : 1 + n], -buf[1 + n :]
    differ = [f for f, a, b in zip(_FIELDS, lo, hi) if a != b]
    if differ:
        raise ValueError(f"mpitree: ranks disagree on {', '.join(differ)}; they must match")
