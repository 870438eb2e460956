"""Stand-ins for GPU-only libraries, so their adapters' logic runs on a CPU machine.

The stand-ins are deliberately *not* subclasses of the real types they stand in
for: a ``cupy`` array here is a wrapper around a numpy array that, like a real
CuPy array, is not an ``np.ndarray`` and refuses implicit conversion to one
(``np.asarray(x)`` raises ``TypeError``), so code that would fail on a real GPU
fails here too.
"""

import types

import numpy as np

try:
    import torch
except ImportError:  # the flash-attn stand-in needs torch; the CuPy one does not
    torch = None


class _Device:
    """What ``cupy.ndarray.device`` exposes."""

    id = 0


def _unwrap(x):
    """Numpy arrays inside stand-in arrays (recursively in lists and tuples)."""
    if isinstance(x, FakeCupyArray):
        return x._a
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(y) for y in x)
    return x


def _wrap(x):
    """Stand-in arrays around numpy results (numpy scalars become 0-d arrays)."""
    if isinstance(x, np.ndarray):
        return FakeCupyArray(x)
    if isinstance(x, np.generic):
        return FakeCupyArray(np.asarray(x))
    if isinstance(x, tuple):
        return tuple(_wrap(y) for y in x)
    return x


def _binary(name):
    def op(self, other):
        return _wrap(getattr(self._a, name)(_unwrap(other)))

    op.__name__ = name
    return op


class FakeCupyArray:
    """A device array stand-in: numpy inside, but not a numpy array (as ``cupy.ndarray``)."""

    __array_ufunc__ = None  # numpy operators defer to ours, as they do for CuPy arrays
    __module__ = "cupy"

    def __init__(self, a):
        self._a = np.asarray(a)

    def __array__(self, *args, **kwargs):
        raise TypeError(
            "Implicit conversion to a NumPy array is not allowed. "
            "Please use `.get()` to construct a NumPy array explicitly."
        )

    # attributes
    shape = property(lambda self: self._a.shape)
    ndim = property(lambda self: self._a.ndim)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    strides = property(lambda self: self._a.strides)
    itemsize = property(lambda self: self._a.itemsize)
    T = property(lambda self: FakeCupyArray(self._a.T))
    device = _Device()

    def get(self, out=None):
        """Copy to the host (numpy)."""
        if out is None:
            return self._a.copy()
        out[...] = self._a
        return out

    def __len__(self):
        return len(self._a)

    def __bool__(self):
        return bool(self._a)

    def __int__(self):
        return int(self._a)

    def __float__(self):
        return float(self._a)

    def __index__(self):
        return int(self._a)

    def __repr__(self):
        return f"cupy-stand-in({self._a!r})"

    def __getitem__(self, key):
        return _wrap(self._a[_unwrap(key)])

    def __setitem__(self, key, value):
        if isinstance(value, np.ndarray):
            raise TypeError("Setting a device array from a NumPy array needs cupy.asarray first")
        self._a[_unwrap(key)] = _unwrap(value)

    def __getattr__(self, name):  # methods: reshape, astype, max, sum, any, ...
        if name.startswith("__"):  # no __array_interface__ & co: numpy must not see through
            raise AttributeError(name)
        attr = getattr(self._a, name)
        if not callable(attr):
            return _wrap(attr)
        return lambda *a, **k: _wrap(attr(*_unwrap(a), **{n: _unwrap(v) for n, v in k.items()}))

    def __neg__(self):
        return FakeCupyArray(-self._a)

    def __invert__(self):
        return FakeCupyArray(~self._a)


for _name in (
    "__add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__ "
    "__floordiv__ __mod__ __matmul__ __rmatmul__ __and__ __rand__ __or__ __ror__ __xor__ "
    "__lt__ __le__ __gt__ __ge__ __eq__ __ne__ __pow__ "
    "__iadd__ __isub__ __imul__ __itruediv__ __iand__ __ior__"
).split():
    setattr(FakeCupyArray, _name, _binary(_name.replace("__i", "__", 1)))


def fake_cupy():
    """A module named ``cupy`` whose functions run numpy on :class:`FakeCupyArray`s."""
    mod = types.ModuleType("cupy")
    mod.ndarray = FakeCupyArray

    def function(name):
        fn = getattr(np, name)

        def call(*args, **kwargs):
            args = _unwrap(args)
            kwargs = {k: _unwrap(v) for k, v in kwargs.items()}
            return _wrap(fn(*args, **kwargs))

        call.__name__ = name
        return call

    for name in (
        "arange full zeros ones empty eye tril where exp log isneginf isfinite max min sum all "
        "any cumsum cumprod argmax argsort einsum concatenate swapaxes broadcast_to "
        "ascontiguousarray flatnonzero maximum expand_dims matmul"
    ).split():
        setattr(mod, name, function(name))

    def asarray(x, dtype=None):
        if isinstance(x, FakeCupyArray):
            return x if dtype is None else FakeCupyArray(x._a.astype(dtype))
        return FakeCupyArray(np.array(x, dtype=dtype))

    mod.asarray = asarray
    mod.asnumpy = lambda x: x.get() if isinstance(x, FakeCupyArray) else np.asarray(x)
    for name in "float16 float32 float64 int32 int64 bool_ uint8".split():
        setattr(mod, name, getattr(np, name))
    mod.bool = np.bool_
    return mod


def flash_attn_with_kvcache(
    q, k_cache, v_cache, cache_seqlens=None, block_table=None, softmax_scale=None, **kw
):
    """flash-attn's documented semantics in torch (float32), without causal alignment.

    Like the real kernel, keys past ``cache_seqlens`` are never read: they are
    selected out (garbage there never reaches the output), and a row without keys
    gets output 0 and lse ``+inf``; a row whose score sum is NaN also gets lse
    ``+inf``, with its unnormalised output (NaN), as the kernel's
    ``normalize_softmax_lse`` gives.
    """
    assert kw.pop("return_softmax_lse") and not kw.pop("causal") and not kw
    b, _, hq, d = q.shape
    k, v = k_cache, v_cache
    if block_table is not None:  # pages (num_blocks, page, Hkv, D) -> (B, pages * page, Hkv, D)
        k, v = (x[block_table.long()].reshape(b, -1, *x.shape[2:]) for x in (k, v))
    t, g = k.shape[1], hq // k.shape[2]
    lens = torch.full((b,), t) if cache_seqlens is None else torch.as_tensor(cache_seqlens)
    valid = torch.arange(t)[None, :] < lens[:, None]  # (B, T)
    k = torch.where(valid[:, :, None, None], k, 0)  # the kernel never reads past the length
    v = torch.where(valid[:, :, None, None], v, 0)
    qh = q.float().transpose(1, 2)  # (B, Hq, Sq, D)
    kh, vh = (x.float().transpose(1, 2).repeat_interleave(g, 1) for x in (k, v))
    s = qh @ kh.transpose(-1, -2) * (softmax_scale or d**-0.5)
    s = s.masked_fill(~valid[:, None, None, :], -torch.inf)
    m = s.amax(-1, keepdim=True).nan_to_num(neginf=0.0) if t else s.sum(-1, keepdim=True)
    p = torch.exp(s - m)
    total = p.sum(-1, keepdim=True)
    bad = (total == 0) | torch.isnan(total)  # as the kernel: lse +inf, the output not scaled
    out = (p @ vh) * torch.where(bad, 1.0, 1.0 / total)
    lse = torch.where(bad[..., 0], torch.inf, m[..., 0] + torch.log(total[..., 0]))
    return out.transpose(1, 2).to(q.dtype), lse


def fake_flash_attn():
    """A module named ``flash_attn`` exposing :func:`flash_attn_with_kvcache`."""
    mod = types.ModuleType("flash_attn")
    mod.flash_attn_with_kvcache = flash_attn_with_kvcache
    return mod
