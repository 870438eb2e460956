"""One array-namespace dispatch for numpy, CuPy, torch and JAX arrays.

Arrays are recognised by checking the type against a framework that is already
in ``sys.modules`` (the pattern of array-api-compat): if ``torch`` was never
imported, no tensor can exist, so nothing here ever imports a framework. Every
module that handles arrays (the local kernel, masks, the output finish, energy,
spec) asks :func:`namespace` for the operations whose spelling differs between
frameworks, and writes everything else with operators shared by all four.
Torch's device code (its CUDA flash kernel) lives in the torch adapter: the
first torch tensor seen imports it (torch is loaded by then), and it registers
its namespace class with :func:`register` (and its pinned buffer kind with
``mpitree._buffers``).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import numpy as np

from ._library import address
from ._options import dtype_name

Array = Any  # a numpy.ndarray, torch.Tensor, cupy.ndarray or jax.Array (for type hints)


def _torch_module(x):
    """Return torch if ``x`` is a torch tensor, else None."""
    torch = sys.modules.get("torch")
    return torch if torch is not None and isinstance(x, torch.Tensor) else None


def _cupy_module(x):
    """Return cupy if ``x`` is a CuPy array, else None."""
    cupy = sys.modules.get("cupy")
    return cupy if cupy is not None and isinstance(x, cupy.ndarray) else None


def _jax_module(x):
    """Return jax.numpy if ``x`` is a JAX array, else None."""
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(x, getattr(jax, "Array", ())):
        return sys.modules.get("jax.numpy") or __import__("jax.numpy", fromlist=["numpy"])
    return None


class NumpyLike:
    """numpy, CuPy and jax.numpy: one spelling (JAX arrays are immutable: no ``out=``)."""

    def __init__(self, name, xp):
        self.name, self.xp = name, xp

    def __repr__(self):
        return f"<array namespace {self.name}>"

    # dtypes -------------------------------------------------------------------------
    def dtype(self, name):
        """Return the framework's dtype called ``name``."""
        return getattr(self.xp, name)

    def is_integer(self, x):
        """Whether ``x`` holds integers (not bool)."""
        return np.dtype(x.dtype).kind in "iu"

    def is_bool(self, x):
        """Whether ``x`` holds booleans."""
        return np.dtype(x.dtype).kind == "b"

    def astype(self, x, name):
        """``x`` as dtype ``name`` (no copy when it already is)."""
        return x if dtype_name(x.dtype) == name else x.astype(self.dtype(name))

    # creation -----------------------------------------------------------------------
    def asarray(self, x, like=None):
        """``x`` as an array of this namespace."""
        return self.xp.asarray(x)

    def arange(self, n, like=None):
        """``0 .. n-1`` as int64."""
        return self.xp.arange(n, dtype=self.xp.int64)

    def full(self, shape, value, name, like=None):
        """Return a new array filled with ``value``."""
        return self.xp.full(shape, value, dtype=self.dtype(name))

    def eye(self, n, like=None):
        """Return the boolean identity matrix."""
        return self.xp.eye(n, dtype=bool)

    def tril(self, n, like=None):
        """Return the boolean lower-triangular ``(n, n)`` matrix."""
        return self.xp.tril(self.xp.ones((n, n), dtype=bool))

    # shape --------------------------------------------------------------------------
    def mT(self, x):
        """Swap the last two axes."""
        return self.xp.swapaxes(x, -1, -2)

    def broadcast_to(self, x, shape):
        """Broadcast ``x`` to ``shape`` (a view)."""
        return self.xp.broadcast_to(x, shape)

    def concat(self, arrays, axis=-1):
        """Concatenate along ``axis``."""
        return self.xp.concatenate(arrays, axis=axis)

    def contiguous(self, x):
        """``x`` in C order (JAX arrays already are, logically)."""
        return x if self.name == "jax" else self.xp.ascontiguousarray(x)

    # elementwise and reductions -----------------------------------------------------
    def where(self, cond, a, b):
        """Select ``a`` where ``cond`` else ``b``."""
        return self.xp.where(cond, a, b)

    def exp(self, x):
        """Elementwise exp."""
        return self.xp.exp(x)

    def log(self, x):
        """Elementwise natural log."""
        return self.xp.log(x)

    def isneginf(self, x):
        """Elementwise ``x == -inf``."""
        return self.xp.isneginf(x)

    def maximum(self, a, b):
        """Elementwise maximum; NaN wins."""
        return self.xp.maximum(a, b)

    def isfinite(self, x):
        """Elementwise finiteness."""
        return self.xp.isfinite(x)

    def max(self, x, axis, keepdims=False):
        """Maximum along ``axis``."""
        return self.xp.max(x, axis=axis, keepdims=keepdims)

    def sum(self, x, axis):
        """Sum along ``axis``."""
        return self.xp.sum(x, axis=axis)

    def all(self, x, axis=None):
        """Logical AND along ``axis`` (all axes: a Python bool)."""
        out = self.xp.all(x, axis=axis)
        return bool(out) if axis is None else out

    def any(self, x):
        """Whether any element is true (a Python bool)."""
        return bool(self.xp.any(x))

    def cumsum(self, x, axis=-1):
        """Cumulative sum along ``axis``."""
        return self.xp.cumsum(x, axis=axis)

    def last_true(self, x):
        """Index of the last True of a 1-D boolean array, or -1."""
        found = self.xp.flatnonzero(x)
        return int(found[-1]) if found.size else -1

    def cumprod(self, x, axis=-1):
        """Cumulative product along ``axis``."""
        return self.xp.cumprod(x, axis=axis)

    def argmax(self, x, axis=-1):
        """Index of the first maximum along ``axis``, int64."""
        return self.astype(self.xp.argmax(x, axis=axis), "int64")

    def argsort(self, x, axis=-1):
        """Stable argsort along ``axis``."""
        return self.xp.argsort(x, axis=axis, kind="stable")

    def einsum(self, spec, *operands):
        """Einstein summation."""
        return self.xp.einsum(spec, *operands)

    def stop_gradient(self, x):
        """``x`` held constant for differentiation."""
        if self.name == "jax":
            return sys.modules["jax"].lax.stop_gradient(x)
        return x

    # host and device ----------------------------------------------------------------
    def device(self, x):
        """Return a comparable description of where ``x`` lives."""
        if self.name == "cupy":
            return ("cupy", x.device.id)
        if self.name == "jax":
            return ("jax", tuple(sorted(str(d) for d in x.devices())))
        return ("cpu",)

    def on_host(self, x):
        """Whether ``x`` is host memory numpy can share without a copy."""
        return self.name == "numpy"

    def capturing(self, x):
        """Whether work on ``x`` is being captured into a device graph: never here."""
        return False

    def host_layout(self, x):
        """Return (data address, shape, strides in bytes) of a numpy array, or None."""
        if not isinstance(x, np.ndarray):
            return None
        return address(x), x.shape, x.strides

    def to_numpy(self, x):
        """``x`` as a host numpy array (a copy unless it already is one)."""
        if self.name == "cupy":
            return x.get()
        return np.asarray(x)

    def from_numpy(self, a, like=None):
        """Host array ``a`` in this namespace, on ``like``'s device."""
        if self.name == "numpy":
            return a
        return self.xp.asarray(a)

    def refuse_gradient(self, outputs, inputs):
        """Return ``outputs``: numpy and CuPy have no autograd (JAX tracers never get here)."""
        return outputs

    def fused_records(self, q, k, v, scale, lens=None):
        """Return records from a fused attention kernel: none here (numpy, CuPy, JAX)."""
        return None

    def kernel_records(self, q, k, v, scale, lens, vis, out):
        """Write records from a selected device kernel into ``out``: none here (False)."""
        return False

    def kernel_output(self, records, like, out=None, layout="bhsd"):
        """Return ``n / d`` from a selected device kernel: none here (None)."""
        return None

    def host_records(self, records):
        """Return host records as merged (a device kernel may hold them elsewhere): as they are."""
        return records


class Torch:
    """torch, on the tensors' device: the operations every device shares.

    The torch adapter's subclass (registered with :func:`register`) adds the
    device paths: :meth:`fused_records` (torch's flash kernel on CUDA) and the
    Triton kernel ``MPITREE_KERNEL=triton`` selects (:meth:`kernel_records`,
    :meth:`kernel_output`); :func:`namespace` gives every torch tensor that subclass.
    """

    name = "torch"

    def __init__(self, torch):
        self.t = torch

    def __repr__(self):
        return "<array namespace torch>"

    def dtype(self, name):
        """Return the torch dtype called ``name``."""
        return getattr(self.t, name)

    def is_integer(self, x):
        """Whether ``x`` holds integers (not bool)."""
        return not (x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == self.t.bool)

    def is_bool(self, x):
        """Whether ``x`` holds booleans."""
        return x.dtype == self.t.bool

    def astype(self, x, name):
        """``x`` as dtype ``name`` (no copy when it already is)."""
        return x if dtype_name(x.dtype) == name else x.to(self.dtype(name))

    def asarray(self, x, like=None):
        """``x`` as a tensor on ``like``'s device."""
        return self.t.as_tensor(x, device=None if like is None else like.device)

    def arange(self, n, like=None):
        """``0 .. n-1`` as int64 on ``like``'s device."""
        return self.t.arange(n, device=None if like is None else like.device)

    def full(self, shape, value, name, like=None):
        """Return a new tensor filled with ``value``."""
        device = None if like is None else like.device
        return self.t.full(tuple(shape), value, dtype=self.dtype(name), device=device)

    def eye(self, n, like=None):
        """Return the boolean identity matrix."""
        return self.t.eye(n, dtype=self.t.bool, device=None if like is None else like.device)

    def tril(self, n, like=None):
        """Return the boolean lower-triangular ``(n, n)`` matrix."""
        device = None if like is None else like.device
        return self.t.tril(self.t.ones((n, n), dtype=self.t.bool, device=device))

    def mT(self, x):
        """Swap the last two axes."""
        return x.transpose(-1, -2)

    def broadcast_to(self, x, shape):
        """Broadcast ``x`` to ``shape`` (a view)."""
        return x.expand(*shape)

    def concat(self, arrays, axis=-1):
        """Concatenate along ``axis``."""
        return self.t.cat(arrays, dim=axis)

    def contiguous(self, x):
        """``x`` in C order."""
        return x.contiguous()

    def where(self, cond, a, b):
        """Select ``a`` where ``cond`` else ``b`` (scalars allowed)."""
        return self.t.where(cond, a, b)

    def exp(self, x):
        """Elementwise exp."""
        return self.t.exp(x)

    def log(self, x):
        """Elementwise natural log."""
        return self.t.log(x)

    def isneginf(self, x):
        """Elementwise ``x == -inf``."""
        return self.t.isneginf(x)

    def maximum(self, a, b):
        """Elementwise maximum; NaN wins."""
        return self.t.maximum(a, b)

    def isfinite(self, x):
        """Elementwise finiteness."""
        return self.t.isfinite(x)

    def max(self, x, axis, keepdims=False):
        """Maximum along ``axis``."""
        return self.t.amax(x, dim=axis, keepdim=keepdims)

    def sum(self, x, axis):
        """Sum along ``axis``."""
        return x.sum(dim=axis)

    def all(self, x, axis=None):
        """Logical AND along ``axis`` (all axes: a Python bool)."""
        return bool(x.all()) if axis is None else x.all(dim=axis)

    def any(self, x):
        """Whether any element is true (a Python bool)."""
        return bool(x.any())

    def cumsum(self, x, axis=-1):
        """Cumulative sum along ``axis``."""
        return x.cumsum(dim=axis)

    def last_true(self, x):
        """Index of the last True of a 1-D boolean tensor, or -1."""
        found = x.nonzero()
        return int(found[-1, 0]) if found.numel() else -1

    def cumprod(self, x, axis=-1):
        """Cumulative product along ``axis``."""
        return x.cumprod(dim=axis)

    def argmax(self, x, axis=-1):
        """Index of the first maximum along ``axis``, int64."""
        return x.argmax(dim=axis)

    def argsort(self, x, axis=-1):
        """Stable argsort along ``axis``."""
        return self.t.argsort(x, dim=axis, stable=True)

    def einsum(self, spec, *operands):
        """Einstein summation."""
        return self.t.einsum(spec, *operands)

    def stop_gradient(self, x):
        """``x`` held constant for differentiation."""
        return x.detach()

    def device(self, x):
        """Return a comparable description of where ``x`` lives."""
        return ("torch", str(x.device))

    def on_host(self, x):
        """Whether ``x`` is host memory numpy can share without a copy."""
        return x.device.type == "cpu" and x.dtype != self.t.bfloat16

    def capturing(self, x):
        """Whether the current CUDA stream captures a graph and ``x`` is a CUDA tensor.

        Then nothing may read device values on the host (a synchronisation, which
        capture refuses): checks of values (``kv_len`` in range) are left out of a
        captured step; the Triton kernel clamps lengths to ``[0, T]``, so no key past the
        shard is read.
        """
        return x.device.type == "cuda" and self.t.cuda.is_current_stream_capturing()

    def host_layout(self, x):
        """Return (data address, shape, strides in elements) of a CPU tensor, or None.

        None for a tensor whose memory does not hold its values as they read: on a
        device, or with a lazy negation or conjugation bit.
        """
        if x.device.type != "cpu" or x.is_neg() or x.is_conj():
            return None
        return x.data_ptr(), x.shape, x.stride()

    def to_numpy(self, x):
        """``x`` as a host numpy array (shared with a CPU tensor where possible)."""
        x = x.detach().resolve_neg().resolve_conj()  # a lazily negated view: its values
        if x.device.type != "cpu":
            x = x.cpu()
        if x.dtype == self.t.bfloat16:
            x = x.float()
        return x.numpy()

    def from_numpy(self, a, like=None):
        """Host array ``a`` as a tensor on ``like``'s device."""
        out = self.t.from_numpy(a)
        return out if like is None or like.device.type == "cpu" else out.to(like.device)

    def kernel_records(self, q, k, v, scale, lens, vis, out):
        """Write records from a selected device kernel into host records ``out``; whether it did.

        None selected here (False); the torch adapter's subclass runs the one that
        ``MPITREE_KERNEL`` names.
        """
        return False

    def kernel_output(self, records, like, out=None, layout="bhsd"):
        """Return ``n / d`` of host records from a selected device kernel, or None (none here).

        ``out``, when given, is written in place and returned; ``layout="bshd"``
        asks for ``(B, Sq, Hq, D)`` (see :func:`~mpitree._state.finish`).
        """
        return None

    def host_records(self, records):
        """Return host records as merged: as they are here (a device kernel may hold them)."""
        return records

    def refuse_gradient(self, outputs, inputs):
        """Tie ``outputs`` to the graph of ``inputs`` needing grad, with a backward that raises.

        mpitree's results come from host records through a merge across ranks, with
        no backward. Without this, a backward through them would silently give the
        inputs no gradient from the attention (``q_proj.weight.grad is None``); with
        it, ``backward()`` raises the moment it reaches them. A no-op (and free)
        under ``torch.no_grad()``/``inference_mode()`` or when nothing requires grad.
        """
        if not self.t.is_grad_enabled():
            return outputs
        needing = [x for x in inputs if isinstance(x, self.t.Tensor) and x.requires_grad]
        if not needing:
            return outputs
        return _refused(self.t).apply(len(outputs), *outputs, *needing)[: len(outputs)]


NO_GRADIENT = (
    "mpitree's attention has no backward: its output was computed from tensors that "
    "require grad, but gradients do not flow through the merge across ranks. Decode under "
    "torch.no_grad() or torch.inference_mode(); to train, use another attention "
    "implementation (sdpa, eager)"
)
_REFUSED = {}  # the torch module -> its autograd Function (built once)


def _refused(torch):
    """Return the autograd Function whose forward copies its outputs and whose backward raises."""
    if torch not in _REFUSED:

        class Refused(torch.autograd.Function):
            """Forward: copies of the first ``n`` tensors; backward: a clear error."""

            @staticmethod
            def forward(ctx, n, *tensors):
                return tuple(x.clone() for x in tensors[:n])

            @staticmethod
            def backward(ctx, *grads):
                raise RuntimeError(NO_GRADIENT)

        _REFUSED[torch] = Refused
    return _REFUSED[torch]


_NUMPY = NumpyLike("numpy", np)
_TORCH = {}  # the torch module -> its namespace (built once)
_REGISTERED = {}  # framework -> the namespace class its adapter registered


def register(framework, cls):
    """Make ``cls(module)`` the namespace of ``framework``'s arrays (its adapter, on import).

    Parameters
    ----------
    framework : str
        ``"torch"``.
    cls : type
        A subclass of :class:`Torch`, built once with the framework's module.
    """
    _REGISTERED[framework] = cls


def _torch_namespace(torch):
    """Return torch's namespace: the adapter's class, the adapter imported the first time."""
    if "torch" not in _REGISTERED:
        importlib.import_module("mpitree.adapters.torch")  # registers its class on import
    return _REGISTERED["torch"](torch)


def namespace(*arrays):
    """Return the namespace of ``arrays`` (``None`` entries are skipped).

    Parameters
    ----------
    *arrays : array or None
        numpy, CuPy, torch or JAX arrays; Python scalars and lists count as numpy.

    Returns
    -------
    NumpyLike or Torch
        The operations for these arrays.

    Raises
    ------
    TypeError
        When the arrays belong to different frameworks.
    """
    found = None
    for x in arrays:
        if x is None:
            continue
        ns = _namespace_of(x)
        if found is None:
            found = ns
        elif ns.name != found.name:
            raise TypeError(
                f"arrays from different frameworks: {found.name} and {ns.name} "
                f"({type(x).__module__}.{type(x).__name__})"
            )
    return found or _NUMPY


def _namespace_of(x):
    """Return the namespace of one array."""
    if isinstance(x, np.ndarray) or np.isscalar(x) or isinstance(x, (list, tuple)):
        return _NUMPY
    torch = _torch_module(x)
    if torch is not None:
        ns = _TORCH.get(torch)
        if ns is None:
            ns = _TORCH[torch] = _torch_namespace(torch)
        return ns
    cupy = _cupy_module(x)
    if cupy is not None:
        return NumpyLike("cupy", cupy)
    jnp = _jax_module(x)
    if jnp is not None:
        return NumpyLike("jax", jnp)
    raise TypeError(
        f"expected a numpy, CuPy, torch or JAX array, got {type(x).__module__}.{type(x).__name__}"
    )


def is_array(x):
    """Whether ``x`` is an array of a supported framework (not a list or scalar)."""
    if isinstance(x, np.ndarray):
        return True
    return any(f(x) is not None for f in (_torch_module, _cupy_module, _jax_module))
