"""Buffer kinds: where a merger's records live (host, pinned or device memory), registered by name.

A :class:`~mpitree._merger.Merger` holds its ``(rows + 1, D + 2)`` record buffer
in one kind, the one :func:`kind_for` picks from its strategy's declared
``buffers`` and the call's arrays. A kind is one small class: which arrays it
serves (:meth:`BufferKind.serves`), how it allocates the buffer once
(:meth:`BufferKind.allocate`), whether MPI and the native op read it in place
(``host_memory``) or through a host mirror that :meth:`BufferKind.to_host`
fills, and the merged records as host memory for the output
(:meth:`BufferKind.output`). The core registers ``"host"`` (and CuPy's
``"pinned"``); an adapter registers its own kinds when it is imported (the torch
adapter: ``"pinned"`` for CUDA tensors). docs/strategies.md, "Buffer kinds".

A one-rank :class:`~mpitree.DecodePlan` marks its host records as merged by that
rank alone (:func:`merged_alone`): a device kernel may then keep them on the device
(docs/frameworks.md, "A step without allocation, and CUDA graphs").
"""

from __future__ import annotations

import sys
import weakref

import numpy as np

from ._library import address
from ._registry import BUFFERS

#: kind name -> the kind classes registered under it, the latest first (an adapter's own
#: kind goes before the core's). Filled by :func:`register_kind`.
KINDS: dict = {name: [] for name in BUFFERS}
#: the order a merger tries its strategy's kinds in: the memory nearest the arrays first
PREFERENCE = ("device", "pinned", "host")


def register_kind(cls):
    """Add a buffer kind class under its ``name`` (a class decorator; returns ``cls``).

    A class of the same module and name registered before (its module imported
    again) is replaced.

    Raises
    ------
    ValueError
        A name that is not one of ``"host"``, ``"pinned"`` or ``"device"``, or
        flags that are not True or False.
    """
    if cls.name not in BUFFERS:
        raise ValueError(f"a buffer kind's name is one of {BUFFERS}, got {cls.name!r}")
    if type(cls.host_memory) is not bool or type(cls.cuda_aware) is not bool:
        raise ValueError(f"buffer kind {cls.__name__}: host_memory and cuda_aware are bools")
    same = (cls.__module__, cls.__qualname__)
    kinds = [k for k in KINDS[cls.name] if (k.__module__, k.__qualname__) != same]
    KINDS[cls.name][:] = [cls, *kinds]
    return cls


class BufferKind:
    """One kind of memory a merger's record buffer lives in, allocated once per merger.

    Parameters
    ----------
    shape : tuple of int
        ``(rows + 1, D + 2)``: the records, then the failure flag record.
    dtype : str
        ``"float32"`` or ``"float64"``.
    like : array or None
        An array of the call (its framework and device); None for host records.

    Attributes
    ----------
    name : str
        ``"host"``, ``"pinned"`` or ``"device"``: what a strategy's ``buffers`` names.
    host_memory : bool
        MPI, the native op and a compiled step read :attr:`buf` in place (then
        :attr:`host` is :attr:`buf`); else they read the host mirror :attr:`host`.
    cuda_aware : bool
        :attr:`buf` is device memory a CUDA-aware MPI may take directly.
    arrays : str
        The arrays it serves, in words, for the error where no kind serves a call
        (e.g. ``"CUDA tensors where Triton is installed"``); "" names the class.
    buf : array
        The record buffer, of the kind's framework (numpy for host memory).
    host : numpy.ndarray
        The buffer in host memory: :attr:`buf` itself, or its mirror.
    """

    name = ""
    host_memory = True
    cuda_aware = False
    arrays = ""

    def __init__(self, shape, dtype, like=None):
        self.buf = self.allocate(shape, dtype, like)
        self.host = self.buf if self.host_memory else np.empty(shape, np.dtype(dtype))

    @classmethod
    def serves(cls, like):
        """Whether this kind can hold the records of a call over arrays like ``like``."""
        return False

    def allocate(self, shape, dtype, like):
        """Return a new ``shape`` buffer of ``dtype`` (called once, by the constructor)."""
        raise TypeError(f"buffer kind {type(self).__name__} allocates nothing")

    def address(self):
        """Return the address of :attr:`host` (what MPI and a compiled step are handed)."""
        return address(self.host)

    def to_host(self):
        """Copy :attr:`buf` into :attr:`host` where they differ; return :attr:`host`."""
        return self.host

    def output(self, rows):
        """Return the first ``rows`` merged records as host memory, for the output."""
        return self.to_host()[:rows]


@register_kind
class Host(BufferKind):
    """Plain host memory (numpy): every call's records can be staged here."""

    name = "host"
    arrays = "every call's arrays"

    @classmethod
    def serves(cls, like):
        """Any call: numpy arrays in place, others staged through the host."""
        return True

    def allocate(self, shape, dtype, like):
        """Return a numpy array."""
        return np.empty(shape, np.dtype(dtype))


@register_kind
class CupyPinned(BufferKind):
    """Page-locked host memory for CuPy arrays' records (``cupyx.empty_pinned``)."""

    name = "pinned"
    arrays = "CuPy arrays"

    @classmethod
    def serves(cls, like):
        """CuPy arrays, where ``cupyx.empty_pinned`` exists (CuPy is never imported here)."""
        cupy = sys.modules.get("cupy")
        return (
            cupy is not None
            and isinstance(like, cupy.ndarray)
            and hasattr(sys.modules.get("cupyx"), "empty_pinned")
        )

    def allocate(self, shape, dtype, like):
        """Return a numpy array over pinned memory."""
        return sys.modules["cupyx"].empty_pinned(shape, dtype=np.dtype(dtype))


#: address -> a weak reference to host records whose merge is the identity (a one-rank
#: plan's), filled by :func:`merged_alone`
_ALONE: dict = {}


def merged_alone(records):
    """Mark host records as merged by one rank alone: no merge reads or writes them (local).

    A one-rank :class:`~mpitree.DecodePlan` marks its merger's records: a device
    kernel (the torch adapter's Triton path) may then keep a step's records on the
    device and finish its output there, never staging them through the host. The
    mark lasts while ``records`` lives.
    """
    if records.size == 0:
        return
    key = address(records)

    def gone(ref, key=key):
        if _ALONE.get(key) is ref:
            del _ALONE[key]

    _ALONE[key] = weakref.ref(records, gone)


def alone(records):
    """Whether host ``records`` (or a view at their address) are marked by :func:`merged_alone`."""
    return alone_at(address(records))


def alone_at(addr):
    """Whether the host records at address ``addr`` are marked by :func:`merged_alone`."""
    ref = _ALONE.get(addr)
    return ref is not None and ref() is not None


def kind_for(buffers, like):
    """Return the kind class a merger over ``buffers`` uses for ``like``'s records, or None.

    Of the kinds registered under the names in ``buffers``, the first in
    :data:`PREFERENCE` order (the latest registered first within a name) that
    serves ``like``. It depends only on what ranks agree on (the strategy, the
    arrays' framework and device type) and on the kinds registered: a call
    agrees on the chosen kind's name, so that ranks never build different mergers.
    """
    for name in PREFERENCE:
        if name in buffers:
            for cls in KINDS[name]:
                if cls.serves(like):
                    return cls
    return None


def unserved(strategy, buffers, like, dtype=None):
    """Say that no kind of a strategy's ``buffers`` serves a call: what it got, what they serve.

    Parameters
    ----------
    strategy : str
        The strategy's name.
    buffers : tuple of str
        Its declared buffer kinds' names.
    like : array or None
        The call's array (its framework, dtype and device); None for host records.
    dtype : dtype or str, optional
        For a call given a dtype and no arrays (a :class:`~mpitree.DecodePlan`
        without ``like=`` a device array, whose records live in host memory): that
        dtype, as the caller gave it.
    """
    names = " or ".join(buffers)
    kinds = [cls for name in buffers for cls in KINDS[name]]
    if kinds:
        accepts = f"{names} kinds registered serve {'; '.join(dict.fromkeys(map(_serves, kinds)))}"
    else:
        accepts = (
            f"no {names} kind is registered (an adapter registers its kinds when it is "
            "imported, e.g. mpitree.adapters.torch)"
        )
    return (
        f"strategy {strategy!r} merges in {names} buffers, and no buffer kind registered under "
        f"those names serves {_described(like, dtype)}; {accepts}"
    )


def _serves(cls):
    """Name the arrays a kind class serves: its ``arrays``, else the class itself."""
    return cls.arrays or f"what {cls.__module__}.{cls.__qualname__} serves"


def _described(like, dtype):
    """Name what a call's records stand for: the arrays' framework, dtype and device."""
    if like is not None:
        kind, where = type(like), getattr(like, "device", "host")
        return f"{kind.__module__}.{kind.__name__} of {getattr(like, 'dtype', '?')} on {where}"
    if dtype is None:
        return "numpy arrays (host records)"
    if isinstance(dtype, type):
        dtype = f"{dtype.__module__}.{dtype.__qualname__}"
    return (
        f"a DecodePlan of dtype {dtype!s}: a plan is made from a dtype, so without like= (an "
        "array of its steps' framework and device) its records live in host memory"
    )
