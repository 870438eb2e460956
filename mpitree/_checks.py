"""Local checks of attention arguments, for any array namespace (no communication)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._namespace import is_array, namespace
from ._options import FLOAT_NAMES, acc_name, dtype_name


@dataclass(frozen=True)
class Problem:
    """The decode problem's shape and dtype, identical on every rank (``T`` excepted)."""

    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    head_dim: int
    dtype: str  # "float16", "bfloat16", "float32" or "float64"

    @classmethod
    def of(cls, batch, q_heads, kv_heads, head_dim, q_len=1, dtype="float32"):
        """Validate sizes given as integers (as :class:`mpitree.DecodePlan` takes them)."""
        sizes = dict(batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim)
        sizes["q_len"] = q_len
        for name, value in sizes.items():
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if not 0 < value < 1 << 31:
                raise ValueError(f"{name} must be a positive int, got {value}")
        if isinstance(dtype, str):
            name = dtype
        elif isinstance(dtype, type):
            name = np.dtype(dtype).name
        else:
            name = dtype_name(dtype)
        if name not in FLOAT_NAMES:
            raise TypeError(f"dtype must be one of {FLOAT_NAMES}, got {dtype!r}")
        if q_heads % kv_heads:
            raise ValueError(f"q heads ({q_heads}) must be a multiple of kv heads ({kv_heads})")
        return cls(int(batch), int(q_heads), int(kv_heads), int(q_len), int(head_dim), name)

    @property
    def rows(self):
        """Number of (batch, head, query) rows."""
        return self.batch * self.q_heads * self.q_len

    @property
    def acc(self):
        """Accumulation dtype name: float64 for float64 inputs, float32 otherwise."""
        return acc_name(self.dtype)

    @property
    def row_shape(self):
        """``(B, Hq, Sq)``."""
        return (self.batch, self.q_heads, self.q_len)

    def signature(self):
        """Return the fields every rank must agree on."""
        return {
            "batch": self.batch,
            "q_heads": self.q_heads,
            "kv_heads": self.kv_heads,
            "q_len": self.q_len,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
        }


def _shape(x):
    """Return the shape of an array as a tuple of ints."""
    return tuple(int(s) for s in x.shape)


def check_qkv(q, k, v, *, names=("q", "k", "v")):
    """Validate q ``(B, Hq, Sq, D)`` and k, v ``(B, Hkv, T, D)``; return (namespace, Problem, T)."""
    for name, x in zip(names, (q, k, v), strict=False):
        if not is_array(x):
            raise TypeError(
                f"{name} must be a numpy, torch, CuPy or JAX array, got {type(x).__name__}"
            )
    ns = namespace(q, k, v)
    for name, x in zip(names, (q, k, v), strict=False):
        if x.ndim != 4:
            raise ValueError(f"{name} must have 4 dimensions, got shape {_shape(x)}")
        if ns.name == "numpy" and x.size and x.shape[-1] > 1 and x.strides[-1] != x.itemsize:
            raise ValueError(
                f"{name} must be contiguous in its last dimension (strides {x.strides})"
            )
        if dtype_name(x.dtype) not in FLOAT_NAMES:
            raise TypeError(
                f"{name} must be a float array ({', '.join(FLOAT_NAMES)}), got {x.dtype}"
            )
    if not (dtype_name(q.dtype) == dtype_name(k.dtype) == dtype_name(v.dtype)):
        raise TypeError(f"{', '.join(names)} dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    devices = {ns.device(x) for x in (q, k, v)}
    if len(devices) > 1:
        raise ValueError(f"{', '.join(names)} are on different devices: {sorted(devices)}")
    qs, ks = tuple(int(s) for s in q.shape), _shape(k)
    if ks != _shape(v):
        raise ValueError(f"{names[1]} and {names[2]} shapes differ: {ks} vs {_shape(v)}")
    b, hq, sq, d = qs
    if min(qs) == 0:
        raise ValueError(f"{names[0]} must have no empty dimension, got shape {qs}")
    layout = f"{names[1]}/{names[2]} must be (B, Hkv, T, D) with q (B, Hq, Sq, D)"
    if ks[0] != b or ks[3] != d:
        raise ValueError(f"{layout}: got {names[1]} {ks} for q {qs} (batch or D differ)")
    hkv = ks[1]
    if hkv == 0 or hq % hkv:
        hint = ""
        if ks[2] and hq % ks[2] == 0:
            hint = " (is it in flash-attn's (B, T, Hkv, D) layout? transpose(1, 2) it)"
        raise ValueError(
            f"q heads ({hq}) must be a positive multiple of kv heads ({hkv}); {layout}{hint}"
        )
    return ns, Problem(b, hq, hkv, sq, d, dtype_name(q.dtype)), ks[2]


def _int_array(ns, name, x, shape):
    """Check an integer array of an exact shape in namespace ``ns`` (or numpy)."""
    if not is_array(x):
        raise TypeError(f"{name} must be an integer array, got {type(x).__name__}")
    xs = namespace(x)
    if xs.name not in (ns.name, "numpy"):
        raise TypeError(f"{name} is a {xs.name} array but q, k, v are {ns.name} arrays")
    if not xs.is_integer(x):
        raise TypeError(f"{name} must hold integers, got dtype {x.dtype}")
    if _shape(x) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {_shape(x)}")
    return ns.asarray(x) if xs.name != ns.name else x


def check_masking(ns, problem, t, kv_len=None, q_pos=None, k_pos=None, mask=None):
    """Validate kv_len, positions and mask for a shard of ``t`` keys; return them in ``ns``."""
    b, sq = problem.batch, problem.q_len
    if (q_pos is None) != (k_pos is None):
        raise ValueError("q_pos and k_pos must be given together")
    given = (("kv_len", kv_len, (b,)), ("q_pos", q_pos, (b, sq)), ("k_pos", k_pos, (b, t)))
    kv_len, q_pos, k_pos = (x if x is None else _int_array(ns, n, x, s) for n, x, s in given)
    values = kv_len is not None and b and not ns.capturing(kv_len)  # read on the host
    if values and (int(kv_len.min()) < 0 or int(kv_len.max()) > t):
        raise ValueError(f"kv_len must lie in [0, {t}] (this shard's length), got {kv_len}")
    if mask is not None:
        if not is_array(mask) or not namespace(mask).is_bool(mask):
            raise TypeError("mask must be a boolean array (True = attend)")
        if namespace(mask).name not in (ns.name, "numpy"):
            raise TypeError(f"mask is a {namespace(mask).name} array, q is {ns.name}")
        mask = ns.asarray(mask) if namespace(mask).name != ns.name else mask
        full = (b, problem.q_heads, sq, t)
        padded = (1,) * (4 - mask.ndim) + _shape(mask)
        if mask.ndim > 4 or any(s not in (1, f) for s, f in zip(padded, full, strict=False)):
            raise ValueError(f"mask of shape {_shape(mask)} is not broadcastable to {full}")
        if padded[1] not in (1, problem.q_heads):
            raise ValueError(f"mask heads must be 1 or Hq={problem.q_heads}, got {padded[1]}")
    return kv_len, q_pos, k_pos, mask


def check_finite(ns, arrays):
    """Raise if any named array holds NaN or Inf (validate mode: reads it once more)."""
    for name, x in arrays.items():
        if not ns.all(ns.isfinite(x)):
            raise ValueError(f"{name} contains NaN or Inf")


def lane_output(out, shape):
    """Return the float32 array of ``shape`` a lane writes its result into, or None.

    ``out`` itself where it is a writeable C-order float32 numpy array of
    ``shape``; a new one where ``out`` is None; None otherwise (the guarded path
    then checks it with :func:`output_error` and says what is wrong).
    """
    if out is None:
        return np.empty(shape, np.float32)
    if (
        type(out) is np.ndarray
        and out.dtype == np.float32
        and out.shape == shape
        and out.flags.c_contiguous
        and out.flags.writeable
    ):
        return out
    return None


def output_error(out, like, shape):
    """Return the exception an ``out=`` array for a result like ``like`` of ``shape`` calls for.

    None where ``out`` can take it: an array of ``like``'s framework (not JAX, whose
    arrays are immutable), dtype and device, of exactly ``shape``. Never raises:
    a caller refuses the step inside its merge's guard with what it returns.
    """
    try:
        if not is_array(out) or namespace(out).name != namespace(like).name:
            return TypeError(f"out must be an array of q's framework, got {type(out).__name__}")
        ns = namespace(out)
        if ns.name == "jax":
            return TypeError("out cannot be a JAX array (JAX arrays are immutable)")
        if ns.name == "numpy" and not out.flags.writeable:
            return ValueError("out is read-only")
        if _shape(out) != tuple(shape):
            return ValueError(f"out has shape {_shape(out)}, the result {tuple(shape)}")
        if dtype_name(out.dtype) != dtype_name(like.dtype):
            return TypeError(f"out is {dtype_name(out.dtype)}, q is {dtype_name(like.dtype)}")
        if ns.device(out) != ns.device(like):
            return ValueError(f"out is on {ns.device(out)[-1]}, q on {ns.device(like)[-1]}")
    except Exception as exc:  # a verdict, never raised here
        return exc
    return None
