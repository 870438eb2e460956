"""StaticShardedCache: a ShardedCache of fixed capacity whose decode step a CUDA graph can hold."""

from __future__ import annotations

import copy
import operator

import torch

from mpitree._options import INVARIANT

from .. import torch as adapter
from ._cache import ShardedCache, ShardedLayer, View


class Capacity:
    """What a static cache's layers share: the capacity, the placement's tables, the merge.

    ``size`` global tokens at most (``max_cache_len``). The tables map a global token
    index to where this rank writes it (its slot in the shard, or the scratch slot
    past the shard's capacity when another rank owns it) and whether it is this
    rank's (1 or 0), as int64 tensors on the cache's device: a decode step looks
    its token up there at the device's length, never on the host.
    """

    __slots__ = ("facts", "host", "mask", "merger", "opts", "signature", "size", "tables", "vis")

    def __init__(self, size):
        self.size = size
        self.tables = None  # (key, slot, mine, local capacity, mine on the host, held)
        # the facts the last checked step had, its options and signature
        self.facts = self.opts = self.signature = None
        self.merger = self.host = None  # the cache's own merger (p > 1), its records as a tensor
        self.mask = None  # the step's mask (its first layer's): later layers are held to it
        self.vis = None  # (B, 1, 1, T) bool over the shard for the step, or None

    def __deepcopy__(self, memo):
        """Copy the size and tables; a copied cache makes its own merger at its next step."""
        twin = Capacity(self.size)
        twin.tables = copy.deepcopy(self.tables, memo)
        return twin

    def table(self, sharding, prompt, device):
        """Return the tables of a cache whose first step had ``prompt`` tokens.

        ``(slot, mine, local capacity, mine on the host, held)``; ``held`` is the
        global index each slot of the shard holds (0 in the scratch slot), the same
        at any length: a rank stores its tokens in global order.
        """
        key = (prompt, device)
        if self.tables is None or self.tables[0] != key:
            mine = sharding.owners(0, self.size, prompt) == sharding.rank
            local = int(mine.sum())
            slot = torch.full((self.size,), local, dtype=torch.long)
            slot[mine] = torch.arange(local)
            held = torch.cat([mine.nonzero()[:, 0], torch.zeros(1, dtype=torch.long)])
            on = (slot.to(device), mine.long().to(device), local, mine, held.to(device))
            self.tables = (key, *on)
        return self.tables[1:]


class StaticShardedLayer(ShardedLayer):
    """One layer's shard in buffers of fixed capacity, written at a device index.

    ``buffers``: keys and values ``(B, Hkv, C + 1, D)`` and the global index each
    slot holds ``(C + 1,)`` (fixed by the placement), where ``C`` is the rank's share
    of ``max_cache_len`` and slot ``C`` the scratch slot, written by a decode step
    whose token another rank owns and never attended. ``counters``: int64 tensors on
    the device, the global length ``(1,)``, this rank's length per batch row ``(B,)``
    (the attention's ``kv_len``), the step's slot and share ``(1,)``, all written in
    place, and a 1 ``(1,)``. ``length`` and ``local`` are their host twins, kept by
    eager steps (a CUDA graph's replays advance the device's alone).
    """

    def __init__(self, sharding, capacity):
        super().__init__(sharding)
        self.capacity = capacity
        self.local = 0
        self.buffers = self.counters = self.whole = self.tables = None
        self.work = None  # the attention's (records, output, scratch, facts): _static_step

    def lazy_initialization(self, key_states, value_states):
        """Allocate the buffers at full capacity for the first step's ``prompt``."""
        super().lazy_initialization(key_states, value_states)
        self.prompt = int(key_states.shape[2])
        cap = self.capacity
        slot, mine, local, _, held = cap.table(self.sharding, self.prompt, self.device)
        b, h = key_states.shape[:2]
        keys = key_states.new_zeros(b, h, local + 1, key_states.shape[3])
        values = value_states.new_zeros(b, h, local + 1, value_states.shape[3])
        self.buffers = (keys, values, held)
        self.whole = (keys.narrow(2, 0, local), values.narrow(2, 0, local))
        zeros = (1, b, 1, 1, 1)
        self.counters = tuple(torch.zeros(n, dtype=torch.long, device=self.device) for n in zeros)
        self.counters[4].fill_(1)  # one: a step adds it (a Python 1 would be a new tensor)
        self.tables = (slot, mine)
        self._narrow()

    def _narrow(self):
        """Make ``keys``, ``values`` and ``positions`` the views of the ``local`` tokens held."""
        keys, values, positions = self.buffers
        n = self.local
        self.keys, self.values = keys.narrow(2, 0, n), values.narrow(2, 0, n)
        self.positions = positions.narrow(0, 0, n)

    def _update(self, key_states, value_states):
        """Store the step's tokens this rank owns; return the step's :class:`View`."""
        if self.sharding.pending is not None:
            raise ValueError(
                "StaticShardedCache: prefill() does not fill it; run the prompt through the "
                "model (its first forward stores the prompt)"
            )
        new, start = int(key_states.shape[2]), self.length
        size = self.capacity.size
        if start + new > size:
            raise ValueError(
                f"StaticShardedCache: {start} cached tokens and {new} new ones exceed its "
                f"max_cache_len={size}; make the cache with a larger max_cache_len"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values, _ = self.buffers
        for x, buf in ((key_states, keys), (value_states, values)):
            if x.shape[:2] != buf.shape[:2] or x.shape[3] != buf.shape[3] or x.dtype != buf.dtype:
                raise ValueError(
                    f"StaticShardedCache: the states {tuple(x.shape)} {x.dtype} do not fit its "
                    f"buffers {tuple(buf.shape)} {buf.dtype} (batch, heads, head_dim and dtype "
                    "are fixed at the first step); call cache.reset() or use a new cache"
                )
        if new == 1 and start and _on_device(key_states):
            return self._step(key_states, value_states, start)
        owned = self.sharding.mine(start, start + new, self.prompt)
        if owned.numel():
            take = (owned - start).to(self.device)
            n = owned.numel()
            keys.narrow(2, self.local, n).copy_(key_states.index_select(2, take))
            values.narrow(2, self.local, n).copy_(value_states.index_select(2, take))
            self.local += n
        self.length = start + new
        length, lens = self.counters[:2]
        length.fill_(self.length)
        lens.fill_(self.local)
        self._narrow()
        queries = torch.arange(start, start + new, device=self.device)
        return View(self.keys, self, queries, False, start)

    def _step(self, key_states, value_states, start):
        """Write a decode step's token at the slot the device's length gives; no host read.

        Its :class:`View` has no query indices (``queries`` None): the attention runs
        :func:`._static_step.attend`, over the whole capacity with the device ``kv_len``.
        """
        keys, values, positions = self.buffers
        length, lens, slot, share, one = self.counters
        at, mine = self.tables
        torch.index_select(at, 0, length, out=slot)
        keys.index_copy_(2, slot, key_states)
        values.index_copy_(2, slot, value_states)
        torch.index_select(mine, 0, length, out=share)
        lens.add_(share)
        length.add_(one)
        self.keys, self.values = self.whole
        if not (key_states.is_cuda and torch.cuda.is_current_stream_capturing()):
            # the host twins, for eager steps; a captured step runs nothing until replayed
            sharding = self.sharding
            if sharding.owner(start, self.prompt) == sharding.rank:
                self.local += 1
                self.positions = positions.narrow(0, 0, self.local)
            self.length = start + 1
        return View(self.keys, self, None, False, start)

    def _keep_first(self):
        """After a crop (:meth:`ShardedLayer.crop`): the counters go back to :attr:`length`."""
        self.local = int(self.capacity.tables[4][: self.length].sum())
        length, lens = self.counters[:2]
        length.fill_(self.length)
        lens.fill_(self.local)
        self._narrow()

    def reset(self):
        """Forget every token and the buffers (the next first step allocates them again)."""
        super().reset()
        self.local = 0
        self.buffers = self.counters = self.whole = self.tables = self.work = None

    def reorder_cache(self, beam_idx):
        """Reorder the batch rows of the buffers in place (beam search)."""
        if self.is_initialized:
            for buf in self.buffers[:2]:
                buf.copy_(buf.index_select(0, beam_idx.to(buf.device)))

    def batch_repeat_interleave(self, repeats):
        """Refused: the buffers' batch is fixed."""
        raise ValueError("StaticShardedCache: its batch is fixed (no batch_repeat_interleave)")

    def batch_select_indices(self, indices):
        """Refused: the buffers' batch is fixed."""
        raise ValueError("StaticShardedCache: its batch is fixed (no batch_select_indices)")

    def get_mask_sizes(self, query_length):
        """Return the mask's size: the whole capacity (fixed shapes step after step), offset 0."""
        return self.capacity.size, 0

    def get_max_length(self):
        """``max_cache_len``."""
        return self.capacity.size

    def get_max_cache_shape(self):
        """``max_cache_len``."""
        return self.capacity.size


def _on_device(x):
    """Whether a decode step of ``x`` runs on the device: the Triton kernel takes its dtype."""
    return adapter._triton() is not None and str(x.dtype).split(".")[-1] in adapter._TRITON_DTYPES


class StaticShardedCache(ShardedCache):
    """A :class:`ShardedCache` of fixed capacity, as transformers' ``StaticCache``.

    Each layer's shard lives in buffers allocated once at its first step, for
    ``max_cache_len`` global tokens (this rank's share of them, plus one scratch
    slot), never grown. With ``MPITREE_KERNEL=triton`` a decode step (one new token
    after the first step) writes its K/V at an index the device computes from its
    own length (:class:`StaticShardedLayer`), and attends over the whole capacity
    with a device ``kv_len`` through the Triton kernel: no host read, no allocation,
    and at one rank nothing else but kernels, so that a ``torch.cuda.CUDAGraph``
    can capture the model's decode forward and replay it token after token
    (docs/frameworks.md, "CUDA graphs"). Other steps (the prompt, several tokens,
    no Triton kernel) take :class:`ShardedCache`'s path over the tokens held.

    Parameters
    ----------
    config : transformers.PretrainedConfig, optional
        As for :class:`ShardedCache`.
    max_cache_len : int
        Global tokens the cache holds at most (all ranks together); a step past it
        raises on every rank. Agreed by every rank at construction.
    **kwargs
        ``comm``, ``placement``, ``block_size``, ``strategy``, ``deterministic``
        (not ``"invariant"``) and ``world_size``, as for :class:`ShardedCache`.
        The strategy must merge records (not ``"ring"``).

    Raises
    ------
    ValueError
        On every rank, when any rank's ``max_cache_len`` is not a positive int, or
        the ranks' differ, or ``deterministic="invariant"`` (and as
        :class:`ShardedCache` raises).

    Notes
    -----
    Its batch is fixed: ``reorder_cache`` works in place, ``batch_repeat_interleave``
    and ``batch_select_indices`` raise; :func:`prefill` does not fill it.
    A decode step's agreement holds every rank to its shapes, options and host
    length, not to its position ids (which it never reads).
    """

    def __init__(self, config=None, *, max_cache_len, **kwargs):
        self._size = max_cache_len  # checked and agreed in ShardedCache's one agreement
        super().__init__(config, **kwargs)
        self.capacity = Capacity(self._size)
        self.layers = [StaticShardedLayer(self.sharding, self.capacity) for _ in self.layers]

    def _agreed(self, opts):
        """``max_cache_len`` and the options, checked in the construction's one agreement."""
        size = self._size
        try:
            size = None if isinstance(size, bool) else operator.index(size)
        except TypeError:
            size = None
        if size is None or size < 1:
            raise ValueError(f"max_cache_len must be a positive int, got {self._size!r}")
        self._size = size
        if opts.deterministic == INVARIANT:
            raise ValueError("StaticShardedCache does not take deterministic='invariant'")
        return {"max_cache_len": size}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Store this rank's share of the new K/V for ``layer_idx`` (see :class:`ShardedCache`)."""
        while len(self.layers) <= layer_idx:
            self.layers.append(StaticShardedLayer(self.sharding, self.capacity))
            self.sharding.layers = len(self.layers)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @property
    def max_cache_len(self):
        """Global tokens the cache holds at most."""
        return self.capacity.size
