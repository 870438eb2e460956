"""ShardedCache: a transformers ``Cache`` whose layers keep one rank's shard of K/V."""

from __future__ import annotations

import copy
import hashlib
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from mpi4py import MPI
from transformers.cache_utils import Cache, CacheLayerMixin

from mpitree import extend
from mpitree._invariant_step import invariant_signature
from mpitree._options import INVARIANT
from mpitree._step import KernelSlot

PLACEMENTS = ("interleave", "last")
_FEW_POSITIONS = 64  # a step of up to this many position ids appends them as ints


class Step:
    """One model step (a forward) over a :class:`ShardedCache`: what its layers share.

    The cache begins a step at an update whose layer index is not above the last
    update's: transformers updates every cached layer once a forward, in
    increasing order, so a forward's first cached layer begins it, whatever its
    index (a model whose layer 0 caches nothing included), and a prefill chunk or
    a speculative verify forward is a step like any other. A step ends when the
    next begins. Its first attention call runs the step's one agreement and fills
    ``signature``, ``scale`` and ``merger``; every later layer is held to them.
    """

    __slots__ = ("fast", "index", "length", "merger", "scale", "signature", "visible")

    def __init__(self, index):
        self.index = index  # the layer index of the step's last update
        self.length = None  # the global length of the step's first updated layer before it
        self.signature = None  # what every rank agreed on (None: no agreement yet)
        self.scale = None
        self.merger = None  # the shared merger for the step's layers (None under prefill)
        # visibility per (mask, shard layout): every layer of a step shares it
        self.visible = {}
        # the step's one-call state (_attention.StepFast) once a layer asked for it;
        # False: no layer runs its one call
        self.fast = None


@dataclass
class Sharding:
    """Which rank stores which global token, shared by all layers of one cache."""

    comm: MPI.Intracomm
    placement: str
    block_size: int
    strategy: str
    deterministic: bool | str
    rank: int = field(init=False)
    size: int = field(init=False)
    # the :class:`~._prefill.Prefill` step while :func:`prefill` runs this rank's chunk
    pending: object = None
    # the current model step (see :meth:`begin`)
    step: Step = field(init=False)
    # the position history (see :attr:`history`) as a tensor, before the rows appended since
    whole_history: torch.Tensor | None = None
    # per row, the position ids short steps appended since (ints; None: none)
    appended: list | None = None
    # per row, the largest position id of the history (ints; None: not known)
    top: list | None = None
    # while :meth:`ShardedCache._capturing` runs: every layer's incoming (keys, values), in order
    captured: list | None = None
    # the last attention call's :class:`~._attention.Recipe`: layers and steps reuse its
    # signature dict and, once checked, its verdict, options and merge while its facts repeat
    recipe: object = None
    # device -> (index, tensor [index]) of the last decode step's token there: every layer's
    token_memo: dict = field(default_factory=dict)
    # device -> int64 0, 1, 2, ... there: each step's ``[index]`` is a view of it (no
    # allocation, no host-to-device copy a step, on every device a split model's layers use)
    token_range: dict = field(default_factory=dict)
    # (View, thread id) of the last update given no attention keywords to carry its view,
    # until an attention call in that thread claims it (see :func:`claim`)
    unclaimed: tuple | None = None
    # the step of the last update that handed its view on in the attention keywords, until
    # the next update: mpitree's attention agrees on that step (Step.signature) before it,
    # another attention never does (see ShardedCache.update)
    handed: Step | None = None
    # that step went unattended and a new one began (a forward that failed between an update
    # and its attention, or a one-layer model under another attention): every update raises
    # it inside mpitree's guard (View.error) until the cache is reset
    unattended: bool = False
    # the model's config given to ShardedCache (None if none): its attention implementation
    config: object = None
    layers: int = 0  # the cache's layer count: a step's outputs are allocated together
    # a digest of the cache's batch operations and crops since it was made or reset, with
    # their arguments: agreed at each step, so a rank that ran one alone raises on every rank
    edits: int = 0

    def __post_init__(self):
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.step = Step(-1)

    def __deepcopy__(self, memo):
        """Copy the state and share the communicator (MPI communicators are never copied)."""
        twin = copy.copy(self)
        twin.pending = twin.captured = twin.unclaimed = twin.handed = None
        twin.token_memo, twin.token_range = {}, dict(self.token_range)  # the ranges: read only
        twin.step = Step(-1)
        twin.history = copy.deepcopy(self.history, memo)
        return twin

    @property
    def history(self):
        """``(B, length)`` int64: the model's position id of every cached token, per batch row.

        The same on every rank; None when unknown (e.g. a model that passes no
        position_ids to attention).
        """
        if self.appended is not None:  # the rows short steps appended, joined on first read
            whole = self.whole_history
            more = torch.tensor(self.appended, dtype=whole.dtype, device=whole.device)
            self.whole_history, self.appended = torch.cat([whole, more], 1), None
        return self.whole_history

    @history.setter
    def history(self, value):
        self.whole_history, self.appended, self.top = value, None, None

    def begin(self, layer_idx):
        """Return the :class:`Step` of an update of ``layer_idx``: a new one unless it increases."""
        step = self.step
        if layer_idx <= step.index:
            step = self.step = Step(layer_idx)
        step.index = layer_idx
        return step

    def token(self, idx, device):
        """Return the int64 tensor ``[idx]`` on ``device``, one for every layer of a decode step.

        A view of :attr:`token_range`'s tensor for ``device``, made with room to
        grow (by half when outgrown): a step neither allocates it nor copies it to
        the device, on each device of a model split over several.
        """
        memo = self.token_memo.get(device)
        if memo is None or memo[0] != idx:
            tokens = self.token_range.get(device)
            if tokens is None or idx >= tokens.shape[0]:
                tokens = torch.arange(max(idx + idx // 2, 256), device=device)
                self.token_range[device] = tokens
            memo = self.token_memo[device] = (idx, tokens[idx : idx + 1])
        return memo[1]

    def advance(self, positions, before, values=None):
        """Return whether a step at ``positions`` ``(B, Sq)`` re-feeds tokens, and its history.

        Re-fed: in every row, no new position goes past the ``before`` cached
        ones, so the step feeds tokens the cache already holds (``generate``
        re-runs a prompt that the cache holds entirely), which would store them
        twice. The history is what :meth:`settle` makes the cache's once the step
        is agreed: None (unknown), a tensor, or for a step of a few tokens its
        rows as ints, to append, with the history's per-row maximum after it.
        ``values``: ``positions.tolist()`` if the caller read them already (the
        step's one read of its positions on the host).
        """
        if positions is None or (before and self.whole_history is None):
            return False, None
        if before == 0:
            return False, positions.clone()
        rows, count = len(positions), self.whole_history.shape[1]
        if self.appended:
            count += len(self.appended[0])
        if (rows, count) != (self.whole_history.shape[0], before):
            return False, None
        top = self.top
        if top is None:
            top = self.top = self.history.amax(-1).tolist()
        new = positions.tolist() if values is None else values
        high = [max(row) for row in new]
        if rows and rows * positions.shape[1] <= _FEW_POSITIONS:
            after = (new, [max(n, h) for n, h in zip(high, top, strict=True)])
        else:
            after = torch.cat([self.history, positions.to(self.whole_history.device)], 1)
        return all(n <= h for n, h in zip(high, top, strict=True)), after

    def settle(self, after):
        """Make a step's history (from :meth:`advance`) the cache's, once the step is agreed."""
        if type(after) is not tuple:
            self.history = after
            return
        rows, self.top = after
        if self.appended is None:
            self.appended = rows
        else:
            for kept, row in zip(self.appended, rows, strict=True):
                kept += row

    def follow_rows(self, select):
        """Apply a batch operation ``select`` (reorder, repeat, select) to the per-row history."""
        if self.history is not None:
            self.history = select(self.history)

    def edited(self, *what):
        """Fold one crop or batch operation (integers: its kind and arguments) into ``edits``."""
        data = b"".join(int(x).to_bytes(8, "little", signed=True) for x in (self.edits, *what))
        self.edits = int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little")

    @property
    def invariant(self):
        """Whether this cache runs ``deterministic="invariant"`` (block-aligned placement)."""
        return self.deterministic == INVARIANT

    def owners(self, start, stop, prompt):
        """Owning rank of global tokens ``start..stop-1``; ``prompt`` tokens came first."""
        idx = torch.arange(start, stop)
        if self.placement == "interleave":
            return (idx // self.block_size) % self.size
        # "last": the prompt in contiguous, even chunks; every later token on the last rank.
        # Invariant mode cuts whole blocks: a block's tokens stay together, on its owner.
        if self.invariant:
            idx, prompt = idx // self.block_size, -(-prompt // self.block_size)
        chunk = torch.div(idx * self.size, max(prompt, 1), rounding_mode="floor")
        return torch.where(idx < prompt, chunk, torch.full_like(idx, self.size - 1))

    def owner(self, idx, prompt):
        """Owning rank of global token ``idx`` (an int): :meth:`owners` for one token."""
        if self.placement == "interleave":
            return (idx // self.block_size) % self.size
        if self.invariant:
            idx, prompt = idx // self.block_size, -(-prompt // self.block_size)
        return idx * self.size // max(prompt, 1) if idx < prompt else self.size - 1

    def mine(self, start, stop, prompt):
        """Global indices in ``start..stop-1`` this rank stores (int64, ascending)."""
        idx = torch.arange(start, stop)
        return idx[self.owners(start, stop, prompt) == self.rank]


@dataclass
class View:
    """What the attention function needs about one layer's step (see :func:`claim`)."""

    keys: torch.Tensor  # the very tensor the layer's update returned
    layer: ShardedLayer
    queries: torch.Tensor  # (Sq,) int64 global indices of the queries this rank attends for
    sharded: bool  # True under :func:`prefill`: queries are this rank's, keys every rank's
    start: int  # the layer's global length before this step
    step: Step | None = None  # the model step the update belongs to
    error: Exception | None = None  # the cache update failed on this rank: raised in the guard


#: The attention keyword that carries a layer's :class:`View` from its cache update to its
#: attention call. transformers passes a layer's attention keyword arguments to the cache
#: update (``cache.update(k, v, layer_idx, kwargs=kwargs)``) and then the same dict to the
#: attention (``attention_interface(..., **kwargs)``): :meth:`ShardedLayer.update` puts the
#: view there, so the keys and their view reach attention as arguments.
SHARD = "mpitree_shard"
# Weak references to every ShardedLayer of the process, copies and unpickled ones included
# (foreign_shard, claim). A plain set: adding, a dead reference's discard and copying are each
# one C call, so a layer collected in another thread never changes it mid-copy (a WeakSet's
# own removal callback did, on Python 3.10)
_LAYERS = set()


def _layers():
    """Return the process's live :class:`ShardedLayer` objects (a snapshot)."""
    return [layer for layer in (ref() for ref in _LAYERS.copy()) if layer is not None]


def claim(key, shard=None, take=True):
    """Return the :class:`View` of the update that returned ``key``, or None.

    ``shard`` is the attention's :data:`SHARD` argument: the view its update put
    in transformers' attention keywords, taken when its keys are ``key``. Without
    one (a direct ``update`` then attention call, or a model that gives its update
    no attention keywords), the view is the one the cache's last update in this
    thread left, if that update returned ``key``; ``take`` takes it (a second call
    over the same K/V gets none; the one-call lane takes it only once it runs).
    Never raises; :func:`foreign_shard` says why a call got no view.
    """
    if shard is not None:
        return shard if type(shard) is View and shard.keys is key else None
    thread = threading.get_ident()
    for layer in _layers():
        sharding = getattr(layer, "sharding", None)
        left = getattr(sharding, "unclaimed", None)
        if left is not None and left[0].keys is key and left[1] == thread:
            if take:
                sharding.unclaimed = None
            return left[0]
    return None


def foreign_shard(key, shard=None):
    """Return the error of an attention call that :func:`claim` found no view for, or None.

    With a ``shard`` argument, its keys were not ``key``: the model changed the
    K/V between its cache update and its attention call. Without one, an error
    if ``key`` is a :class:`ShardedLayer`'s shard: one layer's K/V reused by
    another layer's attention (KV sharing, e.g. Gemma3n), attended after another
    layer's update, or in another thread than a view-less update's. Each rank
    holds only its shard of them, so attending them locally would be silently
    wrong. Every layer of the process is looked at (only where attention is not
    over a ShardedCache step); None for K/V of no ShardedCache.
    """
    if shard is not None:
        return ValueError(
            f"ShardedCache: the attention's {SHARD} argument is not the view of the cache "
            "update that returned its keys (did the model change the keys between its cache "
            "update and its attention call?)"
        )
    if not _LAYERS or key.device.type == "meta":
        return None
    storage = key.untyped_storage().data_ptr()
    if not storage:  # no memory (no keys): nothing of a shard
        return None
    for layer in _layers():
        keys = getattr(layer, "keys", None)  # read once: reset() in another thread clears it
        if (
            isinstance(keys, torch.Tensor)
            and keys.device == key.device
            and keys.untyped_storage().data_ptr() == storage
        ):
            return ValueError(
                "ShardedCache: an attention call got a cache layer's K/V other than the "
                "ones its own cache update just returned (one layer's K/V shared with "
                "later layers, as Gemma3n's KV sharing does, attended after another "
                "layer's update, or in another thread); each rank holds only its "
                "shard of them: not supported"
            )
    return None


def _unattended():
    """Return the error of an update after one whose view no mpitree attention call took."""
    return ValueError(
        "ShardedCache: the model attended a cache layer's shard without mpitree's attention "
        "(its attention is another, e.g. attn_implementation='sdpa' or 'eager'), so each "
        "rank attended only the keys it holds: wrong results. Set the model's attention to "
        "mpitree's (model.set_attn_implementation('mpitree'), or "
        "attn_implementation='mpitree'), then cache.reset() (or a new cache). A forward that "
        "failed between a cache update and its attention leaves the cache so too: reset it"
    )


def _other_attention(config):
    """Whether ``config`` (a model's, or None) names an attention other than mpitree's."""
    name = getattr(config, "_attn_implementation", None)
    return isinstance(name, str) and name != "mpitree"


def _prefix_of(x, buffer):
    """Whether ``x`` is ``buffer[:, :, :n]`` for some n (not another view, e.g. of fewer rows)."""
    return (
        x.data_ptr() == buffer.data_ptr()
        and x.stride() == buffer.stride()
        and x.shape[:2] == buffer.shape[:2]
        and x.shape[3] == buffer.shape[3]
    )


def _in_buffers(layer, buffers):
    """Whether ``layer``'s keys, values and positions are prefixes of its append buffers.

    Usually they are the very views the last append left (checked by identity first).
    """
    if layer.keys is buffers[3] and layer.values is buffers[4] and layer.positions is buffers[5]:
        return True
    return (
        _prefix_of(layer.keys, buffers[0])
        and _prefix_of(layer.values, buffers[1])
        and layer.positions.data_ptr() == buffers[2].data_ptr()
    )


class ShardedLayer(CacheLayerMixin):
    """One layer's shard: keys/values ``(B, Hkv, T_local, D)`` and their global indices."""

    is_sliding = False
    is_croppable = True

    def __new__(cls, *args, **kwargs):
        """Register the layer for :func:`foreign_shard` (copies and unpickling come here too)."""
        layer = super().__new__(cls)
        _LAYERS.add(weakref.ref(layer, _LAYERS.discard))
        return layer

    def __init__(self, sharding):
        super().__init__()
        self.sharding = sharding
        self.length = 0  # global tokens seen by this layer, on all ranks together
        self.prompt = 0  # tokens of the first step ("last" placement splits them evenly)
        self.positions = torch.empty(0, dtype=torch.long)
        self.kernel = KernelSlot()  # this layer's bound kernel arguments, step to step
        # the attention's one-call decode step over this layer's buffers (None: unbound); see
        # _attention._bound_step. Dropped whenever the buffers are replaced.
        self.fast = None

    def lazy_initialization(self, key_states, value_states):
        """Create empty shards with the states' batch, heads, dim, dtype and device."""
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states[:, :, :0].clone()
        self.values = value_states[:, :, :0].clone()
        self.positions = self.positions.to(self.device)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, kwargs=None, **ignored):
        """Store the new tokens this rank owns; return the shard; hand its :class:`View` on.

        The view goes into ``kwargs``, the layer's attention keywords as transformers
        passes them (``kwargs=kwargs``), under :data:`SHARD`; without them, to the
        cache for the next attention call in this thread (see :func:`claim`).

        Never raises: a failure (a batch size that changed, a bad prefill step) is
        handed to the attention function with the step's :class:`View` and raised
        inside mpitree's guard, so that every rank raises it, not only the ranks
        that own the new tokens.
        """
        try:
            if self.sharding.unattended:
                raise _unattended()
            self._join_step()
            view = self._update(key_states, value_states)
        except Exception as exc:  # a sharded prefill keeps its path: the layer flag carries it
            empty = torch.empty(0, dtype=torch.long)
            sharded = self.sharding.pending is not None
            view = View(key_states[:, :, :0], self, empty, sharded, self.length, error=exc)
            keys, values = view.keys, value_states[:, :, :0]
        else:
            keys, values = view.keys, self.values
        view.step = self.sharding.step
        if type(kwargs) is dict:
            kwargs[SHARD] = view
            self.sharding.unclaimed = None  # the last update's view is this one, in hand
            self.sharding.handed = view.step
        else:
            self.sharding.unclaimed = (view, threading.get_ident())
        return keys, values

    def _join_step(self):
        """Join the cache's model step; raise if this layer's length is not the step's."""
        step = self.sharding.step
        if step.length is None:
            step.length = self.length
        elif self.length != step.length:
            raise ValueError(
                f"ShardedCache: this layer holds {self.length} tokens, the step's first layer "
                f"{step.length}: a forward that failed midway left some layers a step ahead; "
                "reset the cache (cache.reset()) and prefill it again"
            )

    def _update(self, key_states, value_states):
        """:meth:`update`, raising on failure; return the step's :class:`View`."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.keys.shape[0] or key_states.shape[1] != self.keys.shape[1]:
            raise ValueError(
                f"ShardedCache: the batch or kv heads changed from {tuple(self.keys.shape[:2])} "
                f"to {tuple(key_states.shape[:2])}; to run generate(num_beams=n or "
                "num_return_sequences=n) from a filled cache, expand it first with "
                "cache.batch_repeat_interleave(n); otherwise call cache.reset() or use a new cache"
            )
        new = key_states.shape[-2]
        start = self.length
        step = self.sharding.pending
        if step is not None:  # sharded prefill: every incoming token is this rank's
            if self.length or new != max(step.mine.numel(), 1):  # 1: a stand-in token
                raise ValueError(f"prefill: got {new} new tokens, expected {step.mine.numel()}")
            stop, self.prompt = step.total, step.total
            queries = owned = step.mine  # each rank attends its own queries
            take = None
        elif new == 1 and start:  # a decode step: one token, one owner, no index tensors
            queries = self.sharding.token(start, self.device)
            if self.sharding.owner(start, self.prompt) == self.sharding.rank:
                self._append(key_states, value_states, queries)
            self.length = start + 1
            return View(self.keys, self, queries, False, start)
        else:
            stop = self.length + new
            if self.length == 0:
                self.prompt = stop
            queries = torch.arange(self.length, stop)
            keep = self.sharding.owners(self.length, stop, self.prompt) == self.sharding.rank
            owned = queries[keep]
            take = keep.nonzero()[:, 0].to(self.device)
        if owned.numel():
            k = key_states if take is None else key_states.index_select(2, take)
            v = value_states if take is None else value_states.index_select(2, take)
            self._append(k, v, owned.to(self.device))
        self.length = stop
        return View(self.keys, self, queries.to(self.device), step is not None, start)

    def _append(self, k, v, owned):
        """Append ``k``/``v`` and their global indices ``owned`` in place, into spare room.

        ``keys``/``values``/``positions`` are views of buffers with spare room.

        A decode step then copies one token, not the whole shard (``torch.cat``
        reallocates and copies it, with fresh pages, every step: at 8K keys per
        rank that was 62 of a 122 ms Llama-8B-shaped step). Capacity grows by half
        when full. Whatever replaces ``keys`` elsewhere (batch operations) is not a
        view of the buffer any more, and the next append starts a new one from it.
        ``crop`` keeps a view, so tensors returned before a crop may see later
        appends in the cropped-off range (transformers holds none across steps).
        """
        n, extra = self.keys.shape[2], k.shape[2]
        buffers = getattr(self, "_buffers", None)
        if buffers is None or n + extra > buffers[0].shape[2] or not _in_buffers(self, buffers):
            room = max(n + extra, n + n // 2, 256)
            keys, values = (
                x.new_empty(*x.shape[:2], room, x.shape[3]) for x in (self.keys, self.values)
            )
            buffers = (keys, values, self.positions.new_empty(room))
            self.fast = None  # bound to the old buffers
            for x, buf in zip((self.keys, self.values, self.positions), buffers, strict=True):
                buf.narrow(-2 if x.dim() > 1 else 0, 0, n).copy_(x)
        kb, vb, pb = buffers[:3]
        kb.narrow(2, n, extra).copy_(k)
        vb.narrow(2, n, extra).copy_(v)
        pb.narrow(0, n, extra).copy_(owned)
        self.keys, self.values = kb.narrow(2, 0, n + extra), vb.narrow(2, 0, n + extra)
        self.positions = pb.narrow(0, 0, n + extra)
        self._buffers = (kb, vb, pb, self.keys, self.values, self.positions)

    def rollback(self, view):
        """Drop the tokens the step of ``view`` stored (its agreement failed on some rank).

        mpitree's attention took the step's view (it failed agreeing on it): the next
        update does not hold the step against it (:meth:`ShardedCache.update`).
        """
        self.crop(min(view.start - self.length, 0))
        self.sharding.handed = None

    def get_mask_sizes(self, query_length):
        """Global key count and offset the step's mask must cover."""
        step = self.sharding.pending
        return (step.total if step is not None else self.length + query_length), 0

    def get_seq_length(self):
        """Global number of cached tokens (all ranks' shards together)."""
        return self.length

    def get_max_length(self):
        """No maximum: shards grow dynamically."""
        return -1

    def crop(self, tokens_to_remove):
        """Drop the last ``-tokens_to_remove`` global tokens (negative, as transformers passes)."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of tokens to remove")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self.length = max(self.length + tokens_to_remove, 0)
        self._keep_first()

    def _keep_first(self):
        """Keep the shard's tokens among the first :attr:`length` global ones (after a crop)."""
        keep = self.positions < self.length
        count = int(keep.sum())
        if bool(keep[:count].all()):  # the usual case (positions ascend): views, no copy
            buffers = getattr(self, "_buffers", None)
            whole = buffers is not None and self.keys is buffers[3] and self.values is buffers[4]
            self.keys, self.values = self.keys[:, :, :count], self.values[:, :, :count]
            self.positions = self.positions[:count]
            if whole and self.positions.data_ptr() == buffers[2].data_ptr():
                # still prefixes of the append buffers: a bound decode step stays bound
                self._buffers = (*buffers[:3], self.keys, self.values, self.positions)
        else:
            self.keys, self.values = self.keys[:, :, keep], self.values[:, :, keep]
            self.positions = self.positions[keep]

    def reset(self):
        """Forget every token."""
        self.keys = self.values = self._buffers = self.fast = None
        self.is_initialized = False
        self.length = self.prompt = 0
        self.positions = torch.empty(0, dtype=torch.long)

    def batch_repeat_interleave(self, repeats):
        """Repeat each batch row of this shard ``repeats`` times, next to it (beam expansion)."""
        self.fast = None
        if self.is_initialized:  # an empty shard too: its batch must follow the other ranks'
            self.keys = self.keys.repeat_interleave(repeats, dim=0)
            self.values = self.values.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices):
        """Keep the batch rows ``indices`` of this rank's shard, in that order."""
        self.fast = None
        if self.is_initialized:
            self.keys, self.values = self.keys[indices, ...], self.values[indices, ...]

    def reorder_cache(self, beam_idx):
        """Reorder the batch rows of this rank's shard as ``beam_idx`` says (beam search)."""
        self.fast = None
        if self.is_initialized:
            self.keys = self.keys.index_select(0, beam_idx.to(self.keys.device))
            self.values = self.values.index_select(0, beam_idx.to(self.values.device))


class ShardedCache(Cache):
    """A transformers ``Cache`` holding this rank's shard of every layer's K/V.

    Use with ``attn_implementation="mpitree"`` (see :mod:`mpitree.adapters.transformers`):
    every rank runs the same model on the same inputs; each stores only the tokens
    its placement assigns it, and attention merges the ranks' partial states with
    the tree reduction. Under another attention (``"sdpa"``), which would attend each
    rank's own shard only, the next :meth:`update` raises on every rank.
    ``get_seq_length`` reports the global length, so masks, positions and ``generate``
    see the whole sequence.

    Parameters
    ----------
    config : transformers.PretrainedConfig, optional
        The model's config; sizes the layer list up front (otherwise grown lazily).
    comm : mpi4py.MPI.Intracomm, optional
        Defaults to :func:`mpitree.default_comm`.
    placement : {"interleave", "last"}
        ``"interleave"`` (default): blocks of ``block_size`` tokens round-robin
        over ranks, balanced at every length. ``"last"``: the first step (the
        prompt) in contiguous even chunks, every later token on the last rank, as
        in the tree attention paper's code; unbalanced as generation goes on.
    block_size : int, optional
        Tokens per block: the unit ``"interleave"`` deals out (default 64) and,
        with ``deterministic="invariant"``, the leaf block of the canonical merge
        tree (default 1024), which both placements then keep whole on one rank.
    strategy : str
        The merge strategy (one of :data:`mpitree.STRATEGIES`) for every step.
    deterministic : bool or "invariant"
        As in :func:`mpitree.tree_decode`. ``"invariant"``: every attention
        output, hence the logits, is the same bits for any number of ranks and
        either placement (see the README's "Invariant mode"); :func:`prefill`
        then runs the whole prompt on every rank instead of sharding it.
    world_size : int, optional
        The number of ranks this cache is meant for; checked against ``comm``.

    Raises
    ------
    ValueError, TypeError
        On every rank, when any rank's arguments are invalid or differ from the
        others' (one small collective at construction).

    Notes
    -----
    Like ``DynamicCache``, it has ``crop``, ``reorder_cache`` (beam search),
    ``batch_repeat_interleave`` and ``batch_select_indices``: each rank applies them
    to its own shard, with no communication, so every rank must call them alike
    (a rank that does not raises on every rank at the next step). The cache also
    keeps, on every rank, each row's position ids, which follow the rows; a step
    whose positions go past the cached ones in no row (``generate(ids)`` on a cache
    that already holds all of ``ids`` re-runs the whole prompt) raises on every
    rank and leaves the cache as it was.

    ``copy.deepcopy(cache)`` copies the shards and shares the communicator, so a
    prefilled prompt can be reused, as with ``DynamicCache``. Its keys and values are
    plain tensors that pickle and save like ``DynamicCache``'s; see :meth:`crop` for
    the one difference in how they alias.
    """

    @extend.entry_point
    def __init__(
        self,
        config=None,
        *,
        comm=None,
        placement="interleave",
        block_size=None,
        strategy="auto",
        deterministic=False,
        world_size=None,
    ):
        comm = extend.check_comm(comm)

        def prepare():
            if placement not in PLACEMENTS:
                raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
            if block_size is not None and (
                isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1
            ):
                raise ValueError(f"block_size must be a positive int, got {block_size!r}")
            if world_size is not None and world_size != comm.Get_size():
                raise ValueError(
                    f"this ShardedCache was made for world_size={world_size}, but the "
                    f"communicator has {comm.Get_size()} ranks"
                )
            invariant = isinstance(deterministic, str) and deterministic == INVARIANT
            opts = extend.Options.resolve(
                1,
                strategy,
                deterministic=deterministic,
                block_size=block_size if invariant else None,
                invariant=True,
            )
            size = opts.block_size or block_size or 64
            sig = {"placement": placement, "block_size": size}
            sig.update(strategy=opts.strategy, deterministic=opts.deterministic)
            sig.update(self._agreed(opts))
            if invariant:
                invariant_signature(sig)
            return extend.Call(sig, (opts, size))

        opts, size = extend.agree(comm, prepare).payload
        layers = int(getattr(config, "num_hidden_layers", 0) or 0) if config is not None else 0
        self.sharding = Sharding(comm, placement, size, opts.strategy, opts.deterministic)
        super().__init__(layers=[ShardedLayer(self.sharding) for _ in range(layers)])
        self.sharding.layers = layers
        self.sharding.config = config

    def _agreed(self, opts):
        """Check what a subclass adds to the construction's one agreement; return its fields.

        Runs inside the agreement's local phase (an exception is this rank's verdict);
        ``opts`` are the cache's resolved options. None here.
        """
        return {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Store this rank's share of the new K/V for ``layer_idx``; return the shard.

        Raises
        ------
        ValueError
            When the last update handed its shard's view on in the attention keywords
            (as transformers' models pass them: ``kwargs=kwargs``) and no mpitree
            attention call has agreed on that update's step since: the model's
            attention is not mpitree's (``"sdpa"``, ``"eager"``), which attends each
            rank's own shard only. Raised before this update stores anything, with
            no communication, where every rank knows it alike: the update is that
            forward's next layer, or the model's config (given to the cache) names
            another attention. Otherwise (the last forward stopped between an update
            and its attention, e.g. a reset on one rank only) every update carries
            the error into mpitree's attention, whose agreement raises it on every
            rank, until :meth:`reset`.
        """
        sharding = self.sharding
        handed = sharding.handed
        if handed is not None and handed.signature is None:
            if layer_idx > handed.index and handed is sharding.step:
                raise _unattended()  # this forward's last layer: every rank is here alike
            if _other_attention(sharding.config):
                raise _unattended()  # the model's config says so: every rank's alike
            # else a rank's state alone (a reset on one rank) may say so: the guard decides
            sharding.unattended, sharding.handed = True, None
        sharding.begin(layer_idx)  # a new model step unless layer_idx increases
        if self.sharding.captured is not None:
            self.sharding.captured.append((key_states, value_states))
        while len(self.layers) <= layer_idx:
            self.layers.append(ShardedLayer(self.sharding))
            self.sharding.layers = len(self.layers)
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def crop(self, tokens_to_remove):
        """Drop the last ``-tokens_to_remove`` global tokens of every layer (negative count).

        Unlike ``DynamicCache``'s, the shards stay views of buffers that later tokens
        are appended into: a key or value tensor taken before the crop sees them in
        the cropped-off range (``clone()`` what you keep across a crop).
        """
        super().crop(tokens_to_remove)
        self.sharding.edited(1, self.get_seq_length())
        self.sharding.follow_rows(lambda history: history[:, : self.get_seq_length()])

    def reset(self):
        """Forget every token of every layer, and the last step (its visibility memo)."""
        super().reset()
        self.sharding.history = None
        self.sharding.edits = 0
        self.sharding.step = Step(-1)
        self.sharding.handed = None
        self.sharding.unattended = False

    def reorder_cache(self, beam_idx):
        """Reorder the batch rows of every layer's shard as ``beam_idx`` says (beam search)."""
        super().reorder_cache(beam_idx)
        self.sharding.edited(2, *beam_idx.tolist())
        self.sharding.follow_rows(lambda history: history[beam_idx.to(history.device)])

    def batch_repeat_interleave(self, repeats):
        """Repeat each batch row ``repeats`` times, next to it (before ``num_beams=repeats``)."""
        super().batch_repeat_interleave(repeats)
        self.sharding.edited(3, repeats)
        self.sharding.follow_rows(lambda history: history.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices):
        """Keep the batch rows ``indices``, in that order."""
        super().batch_select_indices(indices)
        if isinstance(indices, slice):
            ends = (indices.start, indices.stop, indices.step)
            self.sharding.edited(5, *(-(2**62) if x is None else x for x in ends))
        else:
            rows = torch.as_tensor(indices)
            if rows.dtype == torch.bool:  # a mask keeps rows, as their indices do
                rows = rows.nonzero()[:, 0]
            self.sharding.edited(4, *rows.reshape(-1).tolist())
        self.sharding.follow_rows(lambda history: history[indices, ...])

    @property
    def comm(self):
        """The communicator the shards are spread over."""
        return self.sharding.comm

    @property
    def block_size(self):
        """Tokens per placement block: ``"interleave"`` deals blocks of them round-robin."""
        return self.sharding.block_size

    @property
    def strategy(self):
        """The merge strategy of the next steps; settable (every rank must set the same)."""
        return self.sharding.strategy

    @strategy.setter
    def strategy(self, value):
        sharding = self.sharding
        invariant = (
            {"block_size": sharding.block_size, "invariant": True} if sharding.invariant else {}
        )
        opts = extend.Options.resolve(1, value, deterministic=sharding.deterministic, **invariant)
        sharding.strategy = opts.strategy

    def local_length(self, layer_idx=0):
        """Return how many tokens this rank stores for ``layer_idx``."""
        if layer_idx >= len(self.layers):
            return 0
        return int(self.layers[layer_idx].positions.numel())

    @contextmanager
    def _capturing(self):
        """While active, record every layer's incoming ``(keys, values)`` (all tokens, in order)."""
        self.sharding.captured = []
        try:
            yield self.sharding.captured
        finally:
            self.sharding.captured = None

    def _commit(self, keys, values, positions):
        """Append tokens after the cached ones; each layer's K/V go to the ranks that own them.

        ``keys``/``values``: one ``(B, Hkv, n, D)`` tensor per layer, identical on every
        rank; ``positions``: ``(B, n)`` int64 position ids. No communication.
        """
        before = self.get_seq_length()
        for layer, k, v in zip(self.layers, keys, values, strict=True):
            layer._update(k, v)
        self.sharding.settle(self.sharding.advance(positions, before)[1])

    @contextmanager
    def _prefilling(self, step):
        """While active, every layer's update stores this rank's chunk of ``step``."""
        self.sharding.pending = step
        try:
            yield
        finally:
            self.sharding.pending = None
