"""One rank's local attention step: checked arguments, the Attention it computes, a bound kernel."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np

from ._checks import check_finite, check_masking, check_qkv
from ._kernel import Prepared
from ._library import address
from ._local import attend, block_rows
from ._masks import visibility
from ._namespace import NumpyLike
from ._options import Options, dtype_name, resolve_scale

_HOST = NumpyLike("numpy", np)


def checksum(ns, x):
    """Return a cheap CRC-32 of an array's values, to check every rank holds the same ``q``."""
    return zlib.crc32(np.ascontiguousarray(ns.to_numpy(x)).view(np.uint8))


@dataclass
class Attention:
    """One rank's validated share of an attention step: what a merger asks it to compute."""

    ns: object
    q: object
    k: object
    v: object
    scale: float
    lens: object = None
    vis: object = None

    @property
    def q_len(self):
        """``Sq``."""
        return int(self.q.shape[2])

    def fill(self, records):
        """Write this shard's state into host records ``(rows, D + 2)``."""
        attend(
            self.ns, self.q, self.k, self.v, self.scale, self.lens, self.vis, self._rows(records)
        )

    def _rows(self, records):
        """Return records viewed as ``(B, Hq, Sq, D + 2)``."""
        return records.reshape(*(int(s) for s in self.q.shape[:3]), records.shape[-1])

    def block(self):
        """Return the shard as contiguous host arrays for the ring: k, v, int64 lengths, vis."""
        k, v = (np.ascontiguousarray(self.ns.to_numpy(x)) for x in (self.k, self.v))
        t = k.shape[2]
        if self.lens is None:
            lens = np.full(k.shape[0], t, np.int64)
        else:
            lens = np.ascontiguousarray(self.ns.to_numpy(self.lens), dtype=np.int64)
        vis = None if self.vis is None else np.ascontiguousarray(self.ns.to_numpy(self.vis))
        return k, v, lens, vis

    def attend_block(self, k, v, lens, vis, out):
        """Write the state of q over another rank's block into ``out`` records."""
        q = np.ascontiguousarray(self.ns.to_numpy(self.q)).astype(k.dtype, copy=False)
        attend(_HOST, q, k, v, self.scale, lens, vis, self._rows(out))


_FEW = 32  # up to this many lengths, Python's min and max of a list beat numpy's


def _lengths_fit(kv_len, lens, t):
    """Copy a bound step's ``kv_len`` (an integer array) into the int64 ``lens``.

    Returns whether every length lies in ``[0, t]``; where not, ``lens`` holds
    garbage and the caller's full checks decide. Unsigned lengths of ``2**63`` or
    more wrap to negative int64 in the copy, and fail too.
    """
    if len(lens) <= _FEW:
        values = kv_len.tolist()
        if min(values) < 0 or max(values) > t:
            return False
        lens[:] = values
        return True
    lens[:] = kv_len
    return lens.min() >= 0 and lens.max() <= t


class KernelSlot:
    """The compiled kernel bound to a recurring layout: a plan, a recurring call, a layer.

    A decode loop attends with the same shapes, strides, dtype and scale step
    after step (only the shard length ``T`` grows): the slot holds the kernel's
    bound arguments (:class:`Prepared`) so that such a step pays the kernel call
    alone, and gives :meth:`Attention.fill`'s records bitwise. It runs a step
    bound only where :func:`attend` would run its rows as one block
    (:meth:`takes`; a prompt over many keys runs in blocks of rows, whose bits
    differ), over host float32 inputs with no positions (lengths and a mask
    as the kernel reads it: only through :meth:`step` and :meth:`load`, which
    range-check the lengths).

    Two ways in: :meth:`fill` takes a checked :class:`Attention` (numpy, or CPU
    torch tensors shared without a copy) and binds on a new layout by itself (a
    cache layer's checked step); :meth:`bind` after a checked numpy step, then :meth:`step` for
    the later steps with its layout (a plan), or :meth:`run_unheld` for those
    whose layout the caller found unchanged (a recurring one-shot call).
    """

    __slots__ = ("_call", "_key", "_layout", "_out", "_prepared", "_rows", "_size")

    def __init__(self):
        self._key, self._prepared, self._size, self._out = None, None, 0, (None, 0)
        self._rows = (0, 0, 0)  # the bound query's (B, Hq, Sq)
        self._layout = None  # the :func:`_layout` that :meth:`step` runs (None: none)
        self._call = None  # a compiled step's struct kept pointed at the bound kernel

    @staticmethod
    def prompt(b, hq, sq, t):
        """Whether ``sq`` query rows over ``t`` keys are a prompt, which no bound kernel runs.

        :func:`attend` runs a prompt's rows in blocks whose scores fit its budget,
        and a kernel over fewer rows can round differently: a bound kernel runs
        only what :func:`attend` runs as one block (the one rule of what a prompt is).
        """
        return sq > 1 and sq > block_rows(b, hq, t)

    def takes(self, k, v):
        """Whether a step of the bound layout over ``k``, ``v`` runs bound (not a prompt)."""
        t = k.shape[2]
        b, hq, sq = self._rows
        return v.shape[2] == t and (sq == 1 or not self.prompt(b, hq, sq, t))

    def bind(self, att, kv_len=None, mask=None):
        """Bind to a checked step over numpy arrays (its ``kv_len``, mask); return if it can run.

        :meth:`step` then runs the later steps with the same :func:`_layout`. A
        prompt binds nothing: the bound kernel would not run it, nor the steps after
        it over as many keys or more (a step over fewer binds again).
        """
        self._key, self._layout = None, None
        self._rows = tuple(int(s) for s in att.q.shape[:3])
        if self.prompt(*self._rows, int(att.k.shape[2])):
            self._prepared = None
            return False
        self._prepared = Prepared.of(att.q, att.k, att.v, att.scale)
        if self._prepared is not None:
            self._layout = _layout(att.q, att.k, att.v, kv_len, mask)
        if self._layout is not None and self._call is not None:
            self._aim(self._call)
        return self._layout is not None

    def unbind(self):
        """Run no step bound until the next :meth:`bind`."""
        self._layout = None

    def ready(self, q, k, v, kv_len, mask=None, fitted=False):
        """Whether a step may run bound; where it may, its ``kv_len`` is in the slot's lengths.

        Equal layouts pass the same checks but those that can change within a
        layout: K, V and the mask agree on ``T``, the step is not a prompt
        (:meth:`takes`), ``kv_len`` is in range (copied into the slot's int64
        lengths, which the bound kernel reads while the bound layout has
        lengths). False where one fails (or the layout differs): the caller's
        full checks then decide. ``fitted``: the caller found the arrays'
        :func:`_layout` equal to the bound one (a one-shot step's memo key is the
        layout its slot bound), which is then not computed again.
        """
        layout = self._layout
        if layout is None or (not fitted and _layout(q, k, v, kv_len, mask) != layout):
            return False
        t = k.shape[2]
        if v.shape[2] != t or (mask is not None and mask.shape[3] != t):
            return False
        b, hq, sq = self._rows
        if sq != 1 and self.prompt(b, hq, sq, t):  # :meth:`takes`, inline
            return False
        return kv_len is None or _lengths_fit(kv_len, self._prepared.lens, t)

    def step(self, q, k, v, kv_len, records, mask=None):
        """Run a step with the bound :func:`_layout` where :meth:`ready`; return whether it ran.

        The arrays are held until the next step (a plan's cache usually repeats them).
        """
        if not self.ready(q, k, v, kv_len, mask):
            return False
        lens = None if kv_len is None else self._prepared.lens
        self._prepared.run(q, k, v, lens, records, mask)
        return True

    def run_unheld(self, q, k, v, records, mask=None):
        """Run the bound kernel after :meth:`ready`, holding none of the step's arrays afterwards.

        Its lengths are the slot's (those :meth:`ready` copied in) where the bound
        layout has lengths.
        """
        if records is not self._out[0]:  # a merger hands the same buffer every call
            self._out = (records, address(records))
        lens = None if self._layout[-1] is None else self._prepared.lens
        self._prepared.run_raw(
            address(q), address(k), address(v), k.shape[2], self._out[1], lens, mask
        )

    def load(self, q, k, v, kv_len, call, mask=None, fitted=False):
        """Set a compiled step's arrays for a step with the bound layout.

        As :meth:`step`, for the struct :meth:`point` keeps aimed at the bound
        kernel: where the step may run bound (its layout, ``kv_len``'s dtype and
        shape and the mask's ``(B, Hm, Sq)`` included, is the bound one, K, V and
        the mask agree on ``T``, not a prompt, every ``kv_len`` in ``[0, T]``),
        it copies ``kv_len`` into the slot's int64 lengths (which ``call.lens``
        points at while the bound layout has lengths), sets ``call``'s ``q``,
        ``k``, ``v``, ``t`` and visibility (the mask, or none), and returns
        True; otherwise False, ``call`` untouched (the caller's checked path
        decides). Checks nothing else (``fitted``: as :meth:`ready` takes it).
        """
        if not self.ready(q, k, v, kv_len, mask, fitted):
            return False
        call.q, call.k, call.v, call.t = address(q), address(k), address(v), k.shape[2]
        if mask is not None:  # a layout without one: its NULL is set when it is bound
            call.vis, call.vis_heads = address(mask), mask.shape[1]
        return True

    def point(self, call):
        """Keep a compiled step's struct (a ``StepArgs``) aimed at the bound kernel.

        Its kernel arguments, scratch and lengths (the slot's int64 buffer where
        the bound layout has ``kv_len``, else NULL) are the bound kernel's now
        (where one is bound) and again whenever :meth:`bind` binds another layout.
        """
        self._call = call
        if self._prepared is not None:
            self._aim(call)

    def _aim(self, call):
        """Copy the bound kernel's arguments and scratch address into ``call``.

        ``call.lens`` points at the slot's int64 lengths where the bound layout has
        ``kv_len`` (:meth:`load` fills them each step), else is NULL; ``call.vis``
        is NULL until :meth:`load` points it at a step's mask.
        """
        prepared, layout = self._prepared, self._layout
        call.args, call.scratch = prepared.args, address(prepared.scratch)
        call.lens = None if layout is None or layout[-1] is None else address(prepared.lens)
        call.vis, call.vis_heads = None, 0

    def fill(self, att, records):
        """Write ``att``'s state into host records ``(rows, D + 2)``, as :meth:`Attention.fill`."""
        ns = att.ns
        if (
            att.lens is not None
            or att.vis is not None
            or records.dtype != np.float32
            or not records.flags.c_contiguous
            or not ns.on_host(att.q)
            or dtype_name(att.k.dtype) != "float32"
        ):
            att.fill(records)
            return
        layouts = [ns.host_layout(x) for x in (att.q, att.k, att.v)]
        if None in layouts:
            att.fill(records)
            return
        (qp, qs, qst), (kp, ks, kst), (vp, _, vst) = layouts
        key = (ns.name, att.q.dtype, att.v.dtype, qs, qst, ks[:2], kst, vst, att.scale)
        if key != self._key:
            arrays = (ns.to_numpy(x) for x in (att.q, att.k, att.v))
            self._key, self._prepared = key, Prepared.of(*arrays, att.scale)
            self._size = math.prod(qs[:3]) * (qs[3] + 2)
            self._rows = tuple(qs[:3])
        if self._prepared is None or records.size != self._size or not self.takes(att.k, att.v):
            att.fill(records)
            return
        if records is not self._out[0]:  # a merger hands the same buffer every step
            self._out = (records, address(records))
        self._prepared.run_raw(qp, kp, vp, ks[2], self._out[1])

    def __deepcopy__(self, memo):
        """Return an unbound slot: bound arguments hold raw pointers."""
        return KernelSlot()


def local_attention(q, k, v, kv_len, q_pos, k_pos, mask, scale):
    """Check one rank's attention arguments; return its (Problem, Attention)."""
    ns, problem, t = check_qkv(q, k, v)
    kv_len, q_pos, k_pos, mask = check_masking(ns, problem, t, kv_len, q_pos, k_pos, mask)
    scale = resolve_scale(scale, problem.head_dim)
    lens, vis = visibility(ns, problem.batch, problem.q_len, t, kv_len, q_pos, k_pos, mask)
    return problem, Attention(ns, q, k, v, scale, lens, vis)


def validated(step, signature):
    """Validate mode: check q, k, v are finite; add q's checksum to the signature."""
    check_finite(step.ns, {"q": step.q, "k": step.k, "v": step.v})
    signature["q (checksum)"] = checksum(step.ns, step.q)
    return signature


def prepare_attention(q, k, v, kv_len, q_pos, k_pos, mask, options):
    """Local checks of one attention call; return (Problem, Options, Attention, signature).

    As :func:`local_attention`, its options resolved (:meth:`Options.resolve`) too.
    """
    ns, problem, t = check_qkv(q, k, v)
    kv_len, q_pos, k_pos, mask = check_masking(ns, problem, t, kv_len, q_pos, k_pos, mask)
    options = Options.resolve(problem.head_dim, **options)
    lens, vis = visibility(ns, problem.batch, problem.q_len, t, kv_len, q_pos, k_pos, mask)
    step = Attention(ns, q, k, v, options.scale, lens, vis)
    signature = {**problem.signature(), **options.signature()}
    if options.validate:
        validated(step, signature)
    return problem, options, step, signature


def _layout(q, k, v, kv_len, mask=None):
    """Return what a validated step's checks depend on but T; None if not all numpy.

    Two steps with equal layouts pass the same checks (shapes, dtypes, strides, the
    kind of ``kv_len``, a mask's ``(B, Hm, Sq)``) as long as K, V and the mask have
    the same length: a plan re-validates only when the layout changes. A mask has a
    layout only as the kernel reads it (:func:`_mask_layout`); the last entry is
    ``kv_len``'s.
    """
    if type(q) is not np.ndarray or type(k) is not np.ndarray or type(v) is not np.ndarray:
        return None
    lens = vis = None
    if kv_len is not None:
        if type(kv_len) is not np.ndarray:
            return None
        lens = (kv_len.dtype, kv_len.shape)
    if mask is not None:
        vis = _mask_layout(mask, q.shape)
        if vis is None:
            return None
    ks, vs = k.shape, v.shape
    return (
        q.dtype, k.dtype, v.dtype, q.shape, q.strides, ks[:2], ks[3:], vs[:2], vs[3:],
        k.strides, v.strides, vis, lens,
    )  # fmt: skip


def _mask_layout(mask, shape):
    """Return a mask's ``(B, Hm, Sq)`` where the kernel reads it as it is; else None.

    That is a bool numpy array ``(B, Hm, Sq, T)``, C-contiguous, with q's ``B`` and
    ``Sq`` (``shape``: q's) and ``Hm`` 1 or q's ``Hq``: the visibility
    :func:`~._masks.visibility` makes of it is the mask itself, so a bound step
    pointing the kernel at it computes the checked step's records bit for bit. A
    mask the checks broadcast (a size-1 ``B`` or ``Sq``) is None: the kernel would
    read past it.
    """
    if type(mask) is not np.ndarray or mask.dtype != np.bool_ or mask.ndim != 4:
        return None
    b, hm, sq, _ = mask.shape
    if b != shape[0] or sq != shape[2] or hm not in (1, shape[1]):
        return None
    return mask.shape[:3] if mask.flags.c_contiguous else None
