"""mpitree for torch tensors, on CPU or CUDA.

The core takes torch tensors directly (``mpitree.tree_decode``, ``DecodePlan``):
it recognises them without importing torch and returns results on their device.
This module adds what only torch users need: :func:`local_state` returning the
records as a tensor on the tensors' device, and :func:`cuda_aware`. It also holds
torch's device code, the namespace the core gives every torch tensor and the
``"pinned"`` and ``"device"`` buffer kinds of CUDA tensors' records (the core imports
this module on the first tensor it sees; importing it registers them; the ``"device"``
kind, ``_device_slots.Device``, is what the ``device-node`` strategy merges in).

Local attention: float32 CPU tensors run the compiled kernel on memory shared
with numpy (no copy); bfloat16 CUDA tensors without a mask run torch's fused
flash kernel (records ``[lse, 1, out]``, docs/frameworks.md says when); the
rest run grouped torch matmuls on the tensors' device (float32 accumulation,
float64 for float64; GQA without repeating K/V). CUDA records are staged
through a pinned host buffer for the merge (the :class:`Pinned` buffer kind:
MPI runs user-defined reductions on the host).

``MPITREE_KERNEL=triton`` selects the fused Triton kernel (``_triton_decode``) for
torch tensors on any device instead: float16, bfloat16 and float32 inputs, every
mask, the records written straight into the merge's buffer (CPU tensors, under
Triton's interpreter, ``TRITON_INTERPRET=1``) or staged from the device, and the
output ``n / d`` finished by its own kernel on the device. Triton is imported only then.
What its steps write besides the output lives in a :class:`Workspace` per records
buffer, made once (the key splits' partials; a CUDA step's device twin of the
records): a plan's steps allocate nothing, and a one-rank plan's records never
leave the device, so that a CUDA graph can capture its step.

Importing this module imports torch; ``import mpitree`` never does.
"""

from __future__ import annotations

import ctypes
import os
from collections import OrderedDict

from ._hint import missing

try:
    import torch  # the adapter needs it; the core never imports it
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise missing("mpitree.adapters.torch", "torch", exc) from exc

from mpitree import DecodePlan, _namespace, extend, tree_decode
from mpitree._buffers import BufferKind, alone, alone_at, register_kind
from mpitree._checks import check_masking, check_qkv
from mpitree._library import address
from mpitree._local import state_records
from mpitree._masks import visibility
from mpitree._options import dtype_name

from ._device_slots import Device

__all__ = ["DecodePlan", "cuda_aware", "local_state", "tree_decode"]

_CUDA_AWARE_ENV = "MPITREE_CUDA_AWARE"
_KERNEL_ENV = "MPITREE_KERNEL"
_KERNELS = ("", "triton")  # the values MPITREE_KERNEL may take ("": the default kernels)
_TRITON_DTYPES = ("float16", "bfloat16", "float32")


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
        With ``MPITREE_KERNEL=triton``, float16/bfloat16/float32 inputs' records
        come from the Triton kernel.
    """
    ns, problem, t = check_qkv(q, k, v)
    if ns.name != "torch":
        raise TypeError(f"mpitree.adapters.torch.local_state takes torch tensors, got {ns.name}")
    kv_len, q_pos, k_pos, mask = check_masking(ns, problem, t, kv_len, q_pos, k_pos, mask)
    scale = extend.Options.resolve(problem.head_dim, scale=scale).scale
    lens, vis = visibility(ns, problem.batch, problem.q_len, t, kv_len, q_pos, k_pos, mask)
    kernel = _triton()
    if kernel is not None and problem.acc == "float32":  # MPITREE_KERNEL=triton
        shape = (*problem.row_shape, problem.head_dim + 2)
        out = torch.empty(shape, dtype=torch.float32, device=q.device)
        kernel.decode_records(q.detach(), k.detach(), v.detach(), scale, lens, vis, out)
        return out
    return state_records(ns, q, k, v, scale, lens, vis, problem.acc)


class CudaTorch(_namespace.Torch):
    """torch's array namespace with its CUDA paths, which the core gives every torch tensor.

    Adds to the core's device-independent operations torch's fused flash kernel
    for bfloat16 CUDA tensors (:meth:`fused_records`).
    """

    def fused_records(self, q, k, v, scale, lens=None):
        """Return float32 records of q over k, v from torch's fused flash kernel, or None.

        For bfloat16 CUDA tensors (NVIDIA, compute capability 8.0 or later, torch 2.2
        or later, flash attention enabled) with a head dimension of a multiple of 8 up
        to 256, 16-byte aligned rows and no gradient to track; None elsewhere, and
        for good on a device where the kernel refused a call. float16 is left to the
        matmuls: the kernel rounds the softmax weights to float16 before P @ V, and
        the small weights of a long flat tail fall in float16's subnormals (over 2e-3
        off at 128K keys).

        The GQA group is folded into the query rows, so K and V are read once. With
        ``lens`` (int ``(B,)``, in ``[0, T]``) each batch row is one call over its
        first ``lens[b]`` keys (one call for all when every row sees every key):
        what lies past them is never read. The kernel accumulates in float32 and
        gives its output rounded to q's dtype and a float32 natural-log lse: the
        records are ``[lse, 1, out]``, the same state as ``[m, d, n]`` (``n / d`` and
        ``m + log d`` agree), and a row with no key is the empty state. A result
        with a NaN or infinity in it (non-finite inputs; a row whose every score is
        -inf, to which the kernel gives lse +inf) is dropped: None, so that the
        caller's matmuls give the pattern :func:`reference_attention` gives.
        """
        if not self._flash_applies(q, k, v):
            return None
        host = None if lens is None else lens.tolist()
        try:
            if host is None or all(n == k.shape[2] for n in host):
                out, lse = self._flash(q, k, v, scale)
            else:
                parts = [
                    self._flash(q[i : i + 1], k[i : i + 1, :, :n], v[i : i + 1, :, :n], scale)
                    for i, n in enumerate(host)
                ]
                out, lse = (self.t.cat(x, 0) for x in zip(*parts, strict=True))
        except self.t.cuda.OutOfMemoryError:
            raise  # the guard raises it on every rank; the kernel itself is fine
        except RuntimeError:  # refused before launch (a build or device without the kernel)
            _FLASH[q.device] = False
            return None
        t = self.t
        if not bool(t.isfinite(out).all() & (lse < float("inf")).all()):
            return None  # a non-finite input met: the matmul path gives its exact pattern
        seen = lse != -float("inf")
        return t.cat([lse, seen.float(), t.where(seen, out.float(), 0)], -1)

    def _flash_applies(self, q, k, v):
        """Whether :meth:`fused_records` may call the kernel on these tensors."""
        t = self.t
        if q.device.type != "cuda" or q.dtype != t.bfloat16 or not _flash_capable(t, q.device):
            return False
        d = int(q.shape[3])
        if d % 8 or d > 256 or (t.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))):
            return False
        return all(  # 16-byte aligned rows: the kernel loads 16 bytes at a time
            x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and not any(s % 8 for s in x.stride()[:-1])
            for x in (q, k, v)
        )

    def _flash(self, q, k, v, scale):
        """Return (out ``(B, Hq, Sq, D)`` in q's dtype, lse ``(B, Hq, Sq, 1)`` float32)."""
        t = self.t
        b, hq, sq, d = (int(s) for s in q.shape)
        hkv, keys = int(k.shape[1]), int(k.shape[2])
        if keys == 0:
            lse = t.full((b, hq, sq, 1), -float("inf"), dtype=t.float32, device=q.device)
            return t.zeros_like(q), lse
        folded = q.reshape(b, hkv, hq // hkv * sq, d)
        flash = t.ops.aten._scaled_dot_product_flash_attention
        out, lse = flash(folded, k, v, scale=scale)[:2]
        return out.reshape(b, hq, sq, d), lse.reshape(b, hq, sq, 1)

    def on_host(self, x):
        """:meth:`Torch.on_host`, and no kernel selected by ``MPITREE_KERNEL``.

        What the compiled host kernel asks before it reads a tensor: False keeps it
        (and a bound ``KernelSlot``) off the tensors, and the step runs
        :meth:`kernel_records`.
        """
        return super().on_host(x) and _triton() is None

    def kernel_records(self, q, k, v, scale, lens, vis, out):
        """Write the Triton kernel's records into records ``out`` where it is selected.

        Returns False (nothing written) unless ``MPITREE_KERNEL=triton``, and for
        inputs it does not take (float64; records other than float32). ``out`` is
        host memory (numpy: CPU tensors share it) or a tensor on the inputs' device
        (a merger's buffer of a device kind), written in place. A CUDA step's
        records go into the host buffer's device twin (:class:`Workspace`), then
        down in one copy; a one-rank plan's stay there (``_buffers.alone``: the
        merge is the identity, the output is finished from the twin). The key
        splits' partials live in the workspace too: nothing is allocated per step.

        Raises
        ------
        RuntimeError
            While a CUDA graph captures a step whose records must go down to the
            host for an MPI merge: a graph cannot hold it (one rank only).
        """
        kernel = _triton()
        if kernel is None or dtype_name(q.dtype) not in _TRITON_DTYPES:
            return False
        if dtype_name(out.dtype) != "float32":
            return False
        t = self.t
        q, k, v = (x.detach() for x in (q, k, v))
        if isinstance(out, t.Tensor):
            work = workspace(out.data_ptr(), out.shape, out.device)
            kernel.decode_records(q, k, v, scale, lens, vis, out, scratch=work.scratch)
            return True
        work = workspace(address(out), out.shape, q.device)
        if shares_host(q.device):
            records = t.from_numpy(out)
            kernel.decode_records(q, k, v, scale, lens, vis, records, scratch=work.scratch)
            return True
        kernel.decode_records(q, k, v, scale, lens, vis, work.twin(), scratch=work.scratch)
        work.fresh = alone(out)
        if not work.fresh:  # the merge reads the host records: one device-to-host copy
            if q.device.type == "cuda" and t.cuda.is_current_stream_capturing():
                raise RuntimeError(GRAPH_NEEDS_ONE_RANK)
            t.from_numpy(out).copy_(work.rec)
        return True

    def kernel_output(self, records, like, out=None, layout="bhsd"):
        """Return ``n / d`` of float32 host records from the Triton kernel, on ``like``'s device.

        None (the host finishes) unless ``MPITREE_KERNEL=triton``, and for records
        other than float32 or an output dtype the kernel does not write. A CUDA
        step's records come from the host buffer's device twin: as the kernel left
        them (one rank: no copy), or the merged host records copied up into it.
        ``out``, when given, is written in place and returned. ``layout="bshd"``
        (records ``(B, Hq, Sq, D + 2)``, the output ``(B, Sq, Hq, D)`` as
        transformers' attention returns it) is finished on the device only: CPU
        tensors' records are finished by the host's compiled pass (None here).
        """
        kernel = _triton()
        if kernel is None or records.dtype != "float32":
            return None
        if dtype_name(like.dtype) not in _TRITON_DTYPES:
            return None
        if shares_host(like.device):
            if layout == "bshd":
                return None
            return kernel.finish_output(self.t.from_numpy(records), like.dtype, out)
        work = workspace(address(records), records.shape, like.device)
        if work.fresh:
            work.fresh = False  # consumed: a later step writes it again
        else:
            work.twin().copy_(self.t.from_numpy(records))  # one host-to-device copy
        rec = work.rec if layout == "bhsd" else work.rec.transpose(1, 2)  # Sq = 1: no copy
        return kernel.finish_output(rec, like.dtype, out)

    def host_records(self, records):
        """Return host records as merged: a one-rank plan's left on the device copied down first."""
        if self.t.is_tensor(records):
            return records
        work = _WORK.get((address(records), records.shape)) if records.size else None
        if work is not None and work.fresh:
            self.t.from_numpy(records).copy_(work.rec)
            work.fresh = False
        return records


def shares_host(device):
    """Whether tensors on ``device`` share host records without a copy (CPU: no device twin)."""
    return device.type == "cpu"


GRAPH_NEEDS_ONE_RANK = (
    "mpitree: a CUDA graph cannot hold this step: its records go through the host for the "
    "MPI merge across ranks (a graph holds a DecodePlan step with one rank only; "
    "docs/frameworks.md, 'CUDA graphs')"
)


class Workspace:
    """The device memory one records buffer's steps reuse: the kernel's scratch, a device twin.

    Made once per records buffer (:func:`workspace`), so that a plan's steps
    allocate nothing: the key splits' partial records (``scratch``, by shape) and,
    for CUDA tensors' host records, their device twin ``rec``, made on first use.

    Parameters
    ----------
    shape : tuple of int
        The records' ``(B, Hq, Sq, D + 2)``.
    device : torch.device
        Where the inputs live (``where``).

    Attributes
    ----------
    scratch : dict
        shape -> float32 tensor, for ``_triton_decode.decode_records``.
    rec : torch.Tensor or None
        The device twin of host records.
    fresh : bool
        The twin holds the records and the host buffer does not (a one-rank plan's
        step, until :meth:`CudaTorch.kernel_output` or :meth:`CudaTorch.host_records`
        takes them).
    """

    __slots__ = ("fresh", "rec", "scratch", "shape", "where")

    def __init__(self, shape, device):
        self.shape, self.where = tuple(shape), device
        self.scratch, self.rec, self.fresh = {}, None, False

    def twin(self):
        """Return the device twin ``rec``, made on first use."""
        if self.rec is None:
            self.rec = torch.empty(self.shape, dtype=torch.float32, device=self.where)
        return self.rec


_WORK = OrderedDict()  # (address, shape) -> Workspace, the most recently used last
_WORK_SIZE = 16


def workspace(addr, shape, device):
    """Return the :class:`Workspace` of the records at ``addr``, of ``shape``, on ``device``.

    Kept for the last :data:`_WORK_SIZE` buffers (a plan or a shared merger hands
    the same buffer step after step), and for as long as a one-rank plan's records
    live (``_buffers.alone``): a CUDA graph captured over its step holds the
    workspace's memory. A buffer that takes a dead one's address reuses its
    workspace safely: it is scratch, and each step sets the twin's freshness.
    """
    key = (addr, tuple(shape))
    work = _WORK.get(key)
    if work is None or work.where != device:
        if len(_WORK) >= _WORK_SIZE:
            _evict()
        work = _WORK[key] = Workspace(shape, device)
    else:
        _WORK.move_to_end(key)
    return work


def _evict():
    """Drop the least recently used workspace but a live one-rank plan's, if there is one."""
    for key in _WORK:
        if not alone_at(key[0]):
            del _WORK[key]
            return


class Pinned(BufferKind):
    """Page-locked host memory for CUDA tensors' records: a merger's ``"pinned"`` buffer kind.

    MPI and the native op read it in place; copies between it and the device run
    at full speed (and may run asynchronously).
    """

    name = "pinned"

    @classmethod
    def serves(cls, like):
        """CUDA tensors."""
        return isinstance(like, torch.Tensor) and like.device.type == "cuda"

    def allocate(self, shape, dtype, like):
        """Return a numpy array over torch's page-locked host memory."""
        return torch.empty(tuple(shape), dtype=getattr(torch, dtype), pin_memory=True).numpy()


def _triton():
    """Return the Triton kernel's module if ``MPITREE_KERNEL=triton`` selects it, else None.

    Read on every call (a test or a user may set it between calls); the module, and
    triton with it, is imported the first time it is selected.

    Raises
    ------
    ValueError
        For a value of ``MPITREE_KERNEL`` other than ``triton`` or empty.
    ImportError
        Where triton is not installed, naming what to install.
    """
    name = os.environ.get(_KERNEL_ENV, "")
    if name == "":
        return None
    if name not in _KERNELS:
        raise ValueError(f"{_KERNEL_ENV} must be 'triton' or unset, got {name!r}")
    from . import _triton_decode

    return _triton_decode


_FLASH = {}  # a CUDA device -> whether torch's flash kernel runs there (looked up once)


def _flash_capable(torch, device):
    """Whether torch's flash kernel may run on ``device``.

    NVIDIA only (ROCm's flash kernel has given wrong values for non-contiguous V),
    compute capability 8.0 or later, torch 2.2 or later (2.1's older kernel pads its
    lse and takes D <= 128), and flash attention not switched off
    (``torch.backends.cuda.enable_flash_sdp(False)``).
    """
    if device not in _FLASH:
        version = tuple(int(x) for x in torch.__version__.split(".")[:2])
        _FLASH[device] = (
            torch.version.hip is None
            and version >= (2, 2)
            and torch.cuda.get_device_capability(device)[0] >= 8
        )
    return _FLASH[device] and torch.backends.cuda.flash_sdp_enabled()


_namespace.register("torch", CudaTorch)
register_kind(Pinned)
register_kind(Device)
