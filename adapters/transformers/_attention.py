"""The "mpitree" attention and mask functions registered with transformers."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch
from transformers.masking_utils import causal_mask_function, prepare_padding_mask

from mpitree import extend
from mpitree._agreed import with_merge_fields
from mpitree._checks import check_qkv
from mpitree._invariant_step import invariant_pieces, invariant_signature
from mpitree._merger import Merger
from mpitree._namespace import namespace
from mpitree._options import acc_name, dtype_name
from mpitree._registry import needs_kv
from mpitree._step import Attention, KernelSlot
from mpitree._steps import Bound
from mpitree._traffic import hook as phase_hook

from ._cache import View, claim, foreign_shard
from ._prefill import reserve, sharded_attention
from ._static_step import attend as static_attend


@dataclass(frozen=True)
class ShardMask:
    """A mask recipe evaluated per rank on the global indices of its own keys.

    transformers builds masks as a function of (batch, head, query index, key
    index); the "mpitree" mask function returns that recipe instead of a
    ``(B, 1, Sq, N)`` tensor, and the attention function evaluates it only at the
    keys this rank stores. A key is visible where ``mask_function`` and, when
    given, the ``(B, N)`` bool ``padding`` (the 2-D attention mask) allow it.
    """

    mask_function: object
    batch_size: int
    use_vmap: bool
    q_offset: int = 0  # global index of the first query, and of the first key, when a
    kv_offset: int = 0  # forward's keys are all here (no ShardedCache: see _unsharded)
    padding: object = field(default=None, compare=False)  # a tensor: == would not be a bool

    def visible(self, queries, keys):
        """``(B, 1, Sq, T)`` bool: may query ``queries[i]`` see key ``keys[j]``."""
        b = torch.arange(self.batch_size, device=keys.device)[:, None, None, None]
        h = torch.zeros(1, dtype=torch.long, device=keys.device)[None, :, None, None]
        k = keys[None, None, None, :]
        keep = self.mask_function(b, h, queries[None, None, :, None], k)
        if self.padding is not None:  # transformers' and_masks(mask, padding_mask_function)
            keep = keep & self.padding[b, k].to(keep.device)
        return keep.expand(self.batch_size, 1, queries.numel(), keys.numel())

    def causal(self, batch, length):
        """Whether this mask is transformers' causal one over ``batch`` rows and ``length`` keys.

        With padding, only if it covers every key and pads none.
        """
        if self.mask_function is not causal_mask_function or self.batch_size != batch:
            return False
        padding = self.padding
        return padding is None or (padding.shape[-1] >= length and bool(padding.all()))


@dataclass(frozen=True, eq=False)
class CausalPrefill:
    """A sharded prefill's visibility, left unbuilt: causal by its mask's recipe.

    Under transformers' causal mask function (with or without padding), query ``i``
    sees key ``j`` iff ``j <= i`` and the padding allows ``j``: the staircase needs
    no more (:meth:`LayerStep.causal_keys`), and the ``(B, 1, N / p, N)`` bool mask
    (8.6 GB per rank at 128K tokens on 2 ranks) is built only if the general kernel
    runs (:attr:`visibility`).
    """

    mask: object
    queries: object  # (N / p,) int64: this rank's queries
    keys: object  # (N,) int64: every prompt token (all-gathered), in order
    length: int
    rows: tuple  # (B, Hq)
    # not the View: it holds the Step, whose memo holds this (a cycle that kept a built
    # mask alive past the prefill until the garbage collector ran)

    def key_rows(self):
        """``(B|1, N)`` bool: the keys the padding leaves visible to any later query."""
        padding = None if self.mask is None else self.mask.padding
        if padding is None:
            return torch.ones(1, self.keys.numel(), dtype=torch.bool)
        return padding[:, self.keys].to(device="cpu", dtype=torch.bool)

    @cached_property
    def visibility(self):
        """The visibility as :func:`_step_visible` would give it (None: all visible), built once."""
        q, k, n = self.queries, self.keys, self.length
        return _unless_all(_visible(self.mask, q, k, n, *self.rows, True))


def _causal_recipe(mask, view, rows):
    """Return a :class:`CausalPrefill` for a sharded prefill under a causal recipe, else None."""
    if not view.sharded:
        return None
    if mask is None or (type(mask) is ShardMask and mask.mask_function is causal_mask_function):
        if mask is not None and mask.batch_size != rows[0]:
            raise ValueError(f"mask built for batch {mask.batch_size}, inputs have {rows[0]}")
        return CausalPrefill(mask, view.queries, view_keys(view), view.layer.length, rows)
    return None


def view_keys(view):
    """Global indices of the keys a step attends over on this rank, in order.

    The rank's shard; under :func:`prefill`, every prompt token (each layer
    all-gathers the prompt's keys and values, and each rank attends its own queries).
    """
    layer = view.layer
    if view.sharded:
        return torch.arange(layer.length, device=layer.positions.device)
    return layer.positions


def mask_interface(
    batch_size,
    q_length,
    kv_length,
    q_offset=0,
    kv_offset=0,
    mask_function=None,
    attention_mask=None,
    use_vmap=False,
    **kwargs,
):
    """Return the step's :class:`ShardMask` (transformers' ``AttentionMaskInterface`` entry)."""
    if use_vmap:
        raise ValueError(
            "attn_implementation='mpitree' supports index-based mask functions only "
            "(no or_mask_function / and_mask_function overlays)"
        )
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    return ShardMask(mask_function, batch_size, use_vmap, int(q_offset), int(kv_offset), padding)


def _visible(mask, queries, keys, length, batch, heads, sharded=False):
    """Return the ``(B|1, 1|Hq, Sq, T)`` bool mask of ``queries`` over ``keys`` (global indices).

    ``length`` is the global key count a 4-D mask must cover, ``heads`` the query
    heads ``Hq``; ``sharded`` is True under :func:`prefill`. A 4-D mask is checked
    against ``(B, Hq, Sq, length)`` as a whole, whatever keys this rank holds (none
    included): the verdict must not depend on the placement.
    """
    if mask is None:  # transformers' convention: None means causal
        return (keys[None, None, None, :] <= queries[None, None, :, None]).expand(batch, 1, -1, -1)
    if isinstance(mask, ShardMask):
        if mask.batch_size != batch:
            raise ValueError(f"mask built for batch {mask.batch_size}, inputs have {batch}")
        return mask.visible(queries, keys)
    if not isinstance(mask, torch.Tensor) or mask.ndim != 4:
        raise TypeError(f"attention_mask must be a 4-D tensor or None, got {type(mask).__name__}")
    if (
        mask.shape[-1] != length
        or mask.shape[-2] != queries.numel()
        or mask.shape[0] not in (1, batch)
        or mask.shape[1] not in (1, heads)
    ):
        raise ValueError(
            f"a 4-D attention_mask must be (B or 1, Hq or 1, queries, keys) = ({batch} or 1, "
            f"{heads} or 1, {queries.numel()}, {length}), got {tuple(mask.shape)}"
        )
    if sharded:
        raise ValueError("prefill takes a 2-D attention_mask, not a 4-D one")
    local = mask[..., keys]
    if local.dtype == torch.bool:
        return local
    blocked = local <= torch.finfo(local.dtype).min / 2
    if not torch.all(blocked | (local == 0)):
        raise ValueError("additive attention biases are not supported: use 0 / -inf or bool masks")
    return ~blocked


class Recipe:
    """What a step's first layer establishes from its facts alone, kept while they repeat.

    ``facts`` are what :func:`_signature`'s dict and the step's local checks read
    of the layer's inputs and the cache's options (shapes but the shard length,
    dtypes, devices, tensor types, scaling, strategy): the same facts give the
    same signature and, once the checks passed under them, the same verdict,
    options and merge (``checked``: a :class:`extend.Call` template whose payload
    is ``(problem, options)``). They also key the step's agreement, whose
    encoding :func:`extend.agree` then keeps; the cache's length and edits ride in
    it as counts. ``facts`` is None for a recipe that is not kept (no cache,
    invariant mode, a scaling that is not a Python number).
    """

    __slots__ = ("checked", "facts", "signature")

    def __init__(self, facts, signature):
        self.facts, self.signature, self.checked = facts, signature, None


def _recipe(query, key, value, scaling, sharding, sharded):
    """Return the layer's :class:`Recipe`: the cache's last one while its facts repeat.

    Never raises: it runs outside the guard (before a step's agreement, and in a
    layer after the first). Inputs whose facts cannot be read (not tensors) give a
    recipe that names just that; the checks then raise, inside the guard.
    """
    try:
        return _read_recipe(query, key, value, scaling, sharding, sharded)
    except Exception:  # the checks raise it again, inside the guard
        return Recipe(None, {"inputs": "unreadable"})


def _read_recipe(query, key, value, scaling, sharding, sharded):
    """:func:`_recipe`, raising where the inputs' facts cannot be read."""
    if (
        sharding is None
        or sharding.invariant
        or not (scaling is None or type(scaling) is float or type(scaling) is int)
    ):
        return Recipe(None, _new_signature(query, key, value, scaling, sharding, sharded))
    facts = (
        query.shape,
        query.dtype,
        key.dtype,
        value.dtype,
        key.shape[:2] + key.shape[3:],
        value.shape[:2] + value.shape[3:],
        key.shape[2:3] == value.shape[2:3],
        (query.is_cpu and key.is_cpu and value.is_cpu)
        or query.device == key.device == value.device,
        (type(query), type(key), type(value)),
        scaling.hex() if type(scaling) is float else scaling,  # -0.0 is not 0.0
        sharded,
        sharding.strategy,
        sharding.deterministic,
        sharding.placement,
        sharding.block_size,
    )
    memo = sharding.recipe
    if memo is None or memo.facts != facts:
        signature = _new_signature(query, key, value, scaling, sharding, sharded)
        memo = sharding.recipe = Recipe(facts, signature)
    return memo


def _signature(query, key, value, scaling, sharding, sharded):
    """Return the per-layer facts every rank must share in a step (``sharding`` None: no cache).

    The step's first layer runs the full checks (:func:`_checked`); a later layer
    is held to them by this signature, which names everything those checks
    establish of query, key and value but the shard length: a layer whose
    signature equals the first's would pass them too. A sharded cache's layers
    mostly repeat one signature: it is kept on the cache's :class:`Recipe` and the
    same dict returned while its inputs stay the same. Never raises.
    """
    return _recipe(query, key, value, scaling, sharding, sharded).signature


def _new_signature(query, key, value, scaling, sharding, sharded):
    """Build :func:`_signature`'s dict."""
    b, hq, sq, d = (int(s) for s in query.shape)
    sig = {
        "cache": "unsharded" if sharding is None else "ShardedCache",
        "batch": b,
        "q_heads": hq,
        "q_len": 0 if sharded else sq,  # prefill: each rank holds its own chunk
        "kv_heads": int(key.shape[1]) if key.ndim > 1 else -1,
        "head_dim": d,
        "dtype": dtype_name(query.dtype),
        # key and value as the checks see them, but their (per-rank) length and device
        "k/v": (
            dtype_name(key.dtype),
            dtype_name(value.dtype),
            tuple(int(s) for s in key.shape[:2] + key.shape[3:]),
            tuple(int(s) for s in value.shape[:2] + value.shape[3:]),
            key.shape[2:3] == value.shape[2:3],
            query.device == key.device == value.device,
        ),
        "scaling": _scaling_fact(scaling),
        "strategy": None if sharding is None else sharding.strategy,
        "deterministic": None if sharding is None else sharding.deterministic,
        "placement": None if sharding is None else sharding.placement,
        "block_size": None if sharding is None else sharding.block_size,
        "sharded prefill": sharded,
    }
    if sharding is not None and sharding.invariant:
        invariant_signature(sig)
    return sig


class LayerStep:
    """One layer's local work, run inside the merge's guard: checks, mask, attention.

    ``agreed`` is the layer's model step (:class:`~._cache.Step`), agreed on.
    """

    def __init__(self, view, query, key, value, mask, agreed, signature):
        self.view, self.query, self.key, self.value, self.mask = view, query, key, value, mask
        self.agreed, self.signature, self.att = agreed, signature, None
        self.q_len = int(query.shape[2])

    def check(self):
        """Raise unless this layer matches the step's agreement (and its cache update worked)."""
        if self.view.error is not None:
            raise self.view.error
        if self.signature is not self.agreed.signature and self.signature != self.agreed.signature:
            raise ValueError(
                f"this layer's attention {self.signature} differs from the step's first layer "
                f"{self.agreed.signature}"
            )

    def prepare(self, query=None, key=None, value=None):
        """Check this layer; build its :class:`Attention` (of other tensors, if given).

        A sharded prefill passes this rank's queries and every rank's keys and values.
        """
        self.check()
        query = self.query if query is None else query
        key, value = (self.key, self.value) if key is None else (key, value)
        rows = (int(query.shape[0]), int(query.shape[1]))
        keep = _step_visible(self.agreed.visible, self.mask, self.view, rows)
        ns = namespace(query)
        self.att = Attention(ns, query, key, value, self.agreed.scale, None, keep)
        return self.att

    def causal_keys(self):
        """``(B|1, T)`` bool: the keys a causal recipe leaves visible, or None if not one.

        Not None only for a sharded prefill's unbuilt :class:`CausalPrefill`, whose
        visibility is ``key <= query`` and these keys.
        """
        prepared = self.att.vis if self.att is not None else None
        return prepared.key_rows() if isinstance(prepared, CausalPrefill) else None

    def built(self):
        """Return the prepared Attention with its visibility built (see :class:`CausalPrefill`)."""
        if isinstance(self.att.vis, CausalPrefill):
            self.att.vis = self.att.vis.visibility
        return self.att

    def fill(self, records):
        """Write this shard's state of the layer's queries into host records.

        The call is the ``"local"`` phase of a ``phase_times`` observer (``mpitree._traffic.hook``).
        """
        observer = phase_hook.observer
        if observer is not None and observer.enter("local"):
            return observer.timed("local", self.fill, records)
        self.view.layer.kernel.fill(self.prepare(), records)

    def block(self):
        """Return the shard for the ring baseline."""
        return self.att.block()

    def attend_block(self, *args):
        """Another rank's block, for the ring baseline."""
        self.att.attend_block(*args)


def _view_visible(mask, view, rows):
    """Return the step's visibility over this rank's shard of ``view``'s layer; rows: (B, Hq)."""
    layer = view.layer
    return _visible(mask, view.queries, view_keys(view), layer.length, *rows, view.sharded)


def _step_visible(memo, mask, view, rows):
    """Return ``_view_visible`` (None when all visible), computed once per step and mask.

    Every layer of a step has the same mask object (one per layer type) and the
    same global key indices, so the first layer's visibility serves them all.
    The memo holds the mask, so its ``id`` cannot be reused within the step.
    """
    key = _visible_key(mask, view)
    if key not in memo:
        memo[key] = (mask, _shard_visible(mask, view, rows))
    return memo[key][1]


def _visible_key(mask, view):
    """Return the memo key of a step's visibility: the mask object, the shard's global layout."""
    layer = view.layer
    return (id(mask), view.sharded, int(layer.positions.numel()), layer.length)


def _unless_all(keep):
    """Return ``keep``, or None when every key is visible."""
    return None if keep is not None and bool(keep.all()) else keep


def _shard_blocks(memo, layer):
    """Return the global block index of each ``block_size`` keys of ``layer``'s shard, once a step.

    Invariant mode keeps every block whole on one rank, in order: the shard is
    its blocks back to back (only the sequence's last block may be short).
    """
    positions, size = layer.positions, layer.sharding.block_size
    key = ("blocks", int(positions.numel()), layer.length)
    if key not in memo:
        blocks = torch.div(positions[::size], size, rounding_mode="floor")
        whole = torch.arange(positions.numel(), device=positions.device)
        whole = blocks.repeat_interleave(size)[: positions.numel()] * size + whole % size
        if not torch.equal(whole, positions):
            raise ValueError(
                "deterministic='invariant': this rank's cached tokens are not whole blocks of "
                f"block_size={size} (was the shard changed outside the cache?)"
            )
        memo[key] = blocks.cpu()
    return memo[key]


def _invariant_records(step, sharding):
    """Merge one layer over the canonical tree of ``block_size`` leaves: ``(B, Hq, Sq, D + 2)``."""
    acc = acc_name(step.agreed.signature["dtype"])  # agreed: not this layer's own

    def local():
        blocks = _shard_blocks(step.agreed.visible, step.view.layer)
        att = step.prepare()
        return invariant_pieces(att, sharding.block_size, None, blocks, acc)

    return step.agreed.merger.merge(local).reshape(*step.query.shape[:3], -1)


def _local_attention(query, key, value, scale, keep):
    """Return the :class:`Attention` of ``query`` over ``key``/``value`` under ``keep``."""
    keep = _unless_all(keep)
    return Attention(namespace(query), query, key, value, scale, None, keep)


def _checked(query, key, value):
    """Check the attention's tensors; return their :class:`extend.Problem`."""
    ns, problem, _ = check_qkv(query, key, value, names=("query", "key", "value"))
    if ns.name != "torch":
        raise TypeError("attn_implementation='mpitree' runs on torch tensors")
    return problem


def _step_positions(kw, batch, q_len):
    """Return the step's ``(B, Sq)`` position ids from the attention's kwargs, or None."""
    pos = kw.get("position_ids")
    if not isinstance(pos, torch.Tensor) or pos.ndim != 2 or pos.shape[0] not in (1, batch):
        return None
    if pos.shape[1] != q_len:
        return None
    return pos if pos.shape[0] == batch else pos.expand(batch, q_len)


def _positions_code(rows):
    """Return the step's position ids as one agreement count, the same in every process.

    ``rows``: the ``(B, Sq)`` position ids as lists of ints, or None. 0 without
    position ids; a step of one token, its position plus 1 (so that a
    disagreement names the positions); else a code of all of them.
    """
    if rows is None:
        return 0
    values = [x for row in rows for x in row]
    if len(values) == 1 and 0 <= values[0] < (1 << 61):
        return values[0] + 1
    return (hash(tuple(values)) & ((1 << 61) - 1)) | (1 << 61)


def _refeed_error(view, positions):
    """Return the error for a step that feeds tokens the cache already holds."""
    return ValueError(
        f"in no batch row does this step (position ids up to {int(positions.max())}) go past "
        f"the {view.start} tokens the ShardedCache already holds: they would be cached "
        "twice. generate(input_ids, cache=cache) re-runs the whole prompt "
        "when the cache already holds every token of input_ids; the cache must hold a strict "
        "prefix, e.g. mtt.prefill(model, input_ids[:, :-1], cache, attention_mask="
        "mask[:, :-1]) then generate(input_ids, attention_mask=mask, cache=cache), "
        "or append the next token (prefill's logits) to input_ids"
    )


def _scaling_fact(scaling):
    """Return the scaling as a signature holds it: None, a float, or its type's name.

    Never raises: a scaling that is not a number is the checks' to reject, inside the guard.
    """
    if scaling is None:
        return None
    try:
        return float(scaling)
    except Exception:  # whatever float() raises, the checks raise it later
        return type(scaling).__name__


def _agree_step(sharding, view, query, key, value, mask, scaling, recipe, positions):
    """Run the step's one agreement (its first attention call); fill ``view.step`` with it.

    The checks of ``recipe``'s facts run once while they repeat (their verdict is
    theirs alone); what depends on the step (the cache's error, history, length
    and edits, the mask) is checked every step, and the agreement runs every step.
    """

    def prepare():
        if view.error is not None:
            raise view.error
        history = rows = None
        if not view.sharded:
            # the step's one read of its position ids on the host (on a device: a sync)
            rows = None if positions is None else positions.tolist()
            refed, history = sharding.advance(positions, view.start, rows)
            if refed:
                raise _refeed_error(view, positions)
        checked = recipe.checked
        if checked is None:
            checked = _check_step(query, key, value, scaling, sharding, recipe, view.sharded)
        problem, opts = checked.payload
        keep = _first_visible(mask, view, (problem.batch, problem.q_heads))
        payload = (opts, history, keep)
        if view.sharded:  # a sharded prefill gathers keys and values, then attends locally
            # its buffer, allocated here: running out of memory raises on every rank
            reserve(
                sharding.pending, (problem.batch, problem.kv_heads, problem.head_dim), problem.dtype
            )
            return extend.Call(recipe.signature, payload)
        # the cache's global length and edits: a crop or batch operation on one rank only
        # would merge states of different tokens (the layers' own signature stays as it is);
        # the step's positions: other position ids on one rank give other rotary queries
        cache = {
            "cached tokens": view.start,
            "cache edits": sharding.edits,
            "step positions": _positions_code(rows),
        }
        return extend.Call(
            checked.signature,
            payload,
            checked.op,
            key=checked.key,
            merge=checked.merge,
            counts=cache,
        )

    # host tensors need no staging buffer: a plain one (and no look-up of its device)
    like = None if getattr(query, "is_cpu", False) else query
    call, merger = extend.agree_merger(sharding.comm, prepare, like=like)
    opts, history, keep = call.payload
    if not view.sharded:
        sharding.settle(history)
    step = view.step
    step.signature, step.scale, step.merger = recipe.signature, opts.scale, merger
    step.visible[_visible_key(mask, view)] = (mask, keep)  # the first layer's, computed above


def _check_step(query, key, value, scaling, sharding, recipe, sharded):
    """Run the checks of ``recipe``'s facts; return its ``checked`` template (kept if kept)."""
    problem = _checked(query, key, value)
    opts = extend.Options.resolve(
        problem.head_dim,
        sharding.strategy,
        scaling,
        sharding.deterministic,
        node_size=0,  # the real nodes: a ShardedCache takes no node size
        block_size=sharding.block_size if sharding.invariant else None,
        invariant=True,
    )
    payload = (problem, opts)
    if sharded:
        checked = extend.Call(recipe.signature, payload)
    else:
        merge = (problem.rows, problem.head_dim, problem.acc, opts)
        key = None if recipe.facts is None else ("ShardedCache step", recipe.facts)
        # the options and sizes the merger depends on, agreed in the template once
        checked = with_merge_fields(extend.Call(recipe.signature, payload, key=key, merge=merge))
    if recipe.facts is not None:
        recipe.checked = checked
    return checked


def _first_visible(mask, view, rows):
    """Return the step's visibility over this rank's shard (None: all visible); rows: (B, Hq).

    A decode step under the causal mask with no padding sees every key: its one
    query is the newest token and every cached key (``positions``) lies before
    the layer's length. A sharded prefill under a causal recipe leaves it unbuilt
    (:class:`CausalPrefill`). Any other step or mask evaluates the mask over the shard.
    """
    length = view.layer.length
    if (
        not view.sharded
        and view.start == length - 1  # one new token: queries = [start]
        and (mask is None or (type(mask) is ShardMask and mask.causal(rows[0], length)))
    ):
        return None
    return _shard_visible(mask, view, rows)


def _shard_visible(mask, view, rows):
    """Return the visibility over the shard: unbuilt under a prefill's causal recipe, or None."""
    return _causal_recipe(mask, view, rows) or _unless_all(_view_visible(mask, view, rows))


class StepFast:
    """What a step's layers share on the one-call path: the mask, the shard and its visibility.

    It also holds the step's outputs, allocated together for the cache's layers
    when the first layer needs one (one allocation a step instead of one a layer):
    ``outs`` pairs each ``(B, Sq, Hq, D)`` float32 tensor with its address.
    """

    __slots__ = ("length", "mask", "out_shape", "outs", "t", "vis", "vis_heads")

    def __init__(self, mask, t, length, vis, vis_heads):
        self.mask, self.t, self.length, self.vis, self.vis_heads = mask, t, length, vis, vis_heads
        self.out_shape, self.outs = None, []

    def output(self, shape, layers):
        """Return a fresh float32 ``shape`` tensor and its address (make ``layers`` at first)."""
        if self.outs and shape == self.out_shape:
            return self.outs.pop()
        if self.out_shape is None:  # the step's first: one block for every layer's output
            self.out_shape = shape
            block = torch.empty((max(layers, 1), *shape), dtype=torch.float32)
            size, base = math.prod(shape) * 4, block.data_ptr()  # float32: 4 bytes
            self.outs = [(x, base + i * size) for i, x in enumerate(block.unbind(0))]
            return self.outs.pop()
        out = torch.empty(shape, dtype=torch.float32)
        return out, out.data_ptr()


def _step_fast(agreed, view, mask, query):
    """Return the step's :class:`StepFast` from the visibility its agreement computed, or False.

    Only reads the memo that the guarded checks filled (never computes, so never
    raises). The kernel reads the visibility as ``(B, Hm, Sq, T)`` bytes: a mask
    that is not that, C-contiguous, takes the checked path.
    """
    layer = view.layer
    memo = agreed.visible.get(_visible_key(mask, view))
    if memo is None or view.sharded or not isinstance(agreed.merger, Merger):
        return False
    keep, t = memo[1], int(layer.positions.numel())
    if keep is None:
        return StepFast(mask, t, layer.length, 0, 0)
    b, hq, sq = (int(s) for s in query.shape[:3])
    if (
        sq != 1  # the checked path splits many rows into blocks by the visible keys
        or keep.dtype != torch.bool
        or keep.device.type != "cpu"
        or tuple(keep.shape) not in ((b, 1, sq, t), (b, hq, sq, t))
        or not keep.is_contiguous()
    ):
        return False
    return StepFast(mask, t, layer.length, keep.data_ptr(), int(keep.shape[1]))


class LayerFast:
    """A layer's bound one-call step (:class:`~mpitree._steps.Bound`) and what it was checked for.

    Made after the layer's checked step succeeded; it stays valid while its K/V
    are views of the same cache buffers (the layer drops it when they change),
    its step's signature is the very dict it was checked under, and the query
    has the same shape and strides.
    """

    __slots__ = (
        "bound",
        "fused",
        "merger",
        "out_shape",
        "q_shape",
        "q_stride",
        "rows",
        "scaling",
        "signature",
        "vis",
    )

    def __init__(self, bound, signature, merger, scaling, query):
        self.bound, self.signature, self.merger, self.scaling = bound, signature, merger, scaling
        self.q_shape, self.q_stride = query.shape, query.stride()
        b, hq, sq, d = query.shape
        self.out_shape = (b, sq, hq, d)
        self.rows = (b, hq, sq) if sq > 1 else None  # rows that may be a prompt as T grows
        self.vis = 0  # the visibility address the bound call holds
        self.fused = merger.bind_layer(bound)  # kernel, merge and output in one call

    def __deepcopy__(self, memo):
        """Return None: a copied cache has other buffers, so its layer starts unbound."""
        return None


def _bind(view, query, key, value, scaling, signature, agreed):
    """Return the :class:`LayerFast` of a layer whose checked step just succeeded, or None."""
    layer, merger = view.layer, agreed.merger
    buffers = getattr(layer, "_buffers", None)
    if (
        buffers is None
        or key is not buffers[3]
        or value is not buffers[4]
        or view.sharded
        or signature is not agreed.signature
        or not isinstance(merger, Merger)
        or needs_kv(merger.strategy)  # it asks for the shard itself, not filled records
        or torch.is_grad_enabled()
        or not all(x.dtype == torch.float32 and x.device.type == "cpu" for x in (query, key, value))
        or any(x.is_neg() for x in (query, key, value))
        or not query.is_contiguous()
        or query.shape[2] > 16
        or (key.stride(3) != 1 and key.shape[3] > 1)
        or (value.stride(3) != 1 and value.shape[3] > 1)
    ):
        return None
    records = merger.records
    b, hq, sq, d = (int(s) for s in query.shape)
    if (
        records.dtype != np.float32
        or not records.flags.c_contiguous
        or records.shape != (b * hq * sq, d + 2)
    ):
        return None
    k, v = buffers[0], buffers[1]
    bound = Bound.layer(
        (b, hq, sq, d),
        int(k.shape[1]),
        (k.data_ptr(), k.stride()[:3]),
        (v.data_ptr(), v.stride()[:3]),
        records,
        agreed.scale,
        keep=(k, v, merger),
    )
    return None if bound is None else LayerFast(bound, signature, merger, scaling, query)


def _rebind(view, query, key, value, scaling, signature, agreed):
    """After a layer's checked step: bind its one-call step unless its binding still fits."""
    fast = view.layer.fast
    if (
        fast is None
        or fast.signature is not agreed.signature
        or fast.merger is not agreed.merger
        or fast.scaling != scaling
        or fast.q_shape != query.shape
        or fast.q_stride != query.stride()
    ):
        view.layer.fast = _bind(view, query, key, value, scaling, signature, agreed)


def _bound_step(view, query, key, value, mask, scaling, lane=False):
    """Run the layer's bound step (:class:`LayerFast`) if this call repeats what it was bound for.

    It does when the step's signature is the dict the layer was checked under, K/V
    are its buffers, the query has the same shape and strides, the mask and the
    shard are the step's (:class:`StepFast`, ``view.step.fast``). Everything a
    later layer's signature holds it to then holds, so it runs the bound kernel,
    the merge (whose flag carries no failure: nothing here raises) and the
    output: in one compiled call where the merge is one persistent all-reduce
    (``LayerFast.fused``), else the kernel inside the merge, then the output.

    Returns the ``(B, Sq, Hq, D)`` float32 output, or None (nothing ran). With
    ``lane`` (:func:`_one_call`, outside the guard) it runs only the one compiled
    call. Never raises before the merge,
    whatever the arguments (a query that is not exactly a ``torch.Tensor``, or a
    scaling other than the bound float or None, takes the checked path).
    """
    layer, agreed = view.layer, view.step
    fast, step = layer.fast, agreed.fast
    if (
        fast is None
        or not step
        or fast.signature is not agreed.signature
        or fast.merger is not agreed.merger
        or mask is not step.mask
        or view.error is not None
        or (lane and not fast.fused)
    ):
        return None
    buffers = layer._buffers
    if (
        key is not buffers[3]
        or value is not buffers[4]
        or type(query) is not torch.Tensor
        or layer.length != step.length
        or key.shape[2] != step.t
        or (fast.rows is not None and KernelSlot.prompt(*fast.rows, step.t))
        or query.shape != fast.q_shape
        or query.stride() != fast.q_stride
        or query.dtype != torch.float32
        or not query.is_cpu
        or query.is_neg()
        or (scaling is not fast.scaling and (type(scaling) is not float or scaling != fast.scaling))
        or torch.is_grad_enabled()
    ):
        return None
    if lane:  # the call takes a view-less update's view, as the guarded call does
        layer.sharding.unclaimed = None
    bound = fast.bound
    call = bound.struct
    call.q, call.t = query.data_ptr(), step.t
    if fast.vis != step.vis:  # usually 0 (every key visible) step after step
        call.vis, call.vis_heads, fast.vis = step.vis, step.vis_heads, step.vis
    out, address = step.output(fast.out_shape, layer.sharding.layers)
    if fast.fused:
        fast.merger.merge_layer(bound, address)
    else:
        fast.merger.merge(bound)
        bound.finish(address)
    return out


def _fast_attention(view, query, key, value, mask, scaling):
    """Under the guard: :func:`_bound_step`, the step's first call computing ``view.step.fast``.

    That is what the step's layers share, from the visibility its agreement
    computed. Never raises before the merge.
    """
    agreed = view.step
    if agreed.fast is None and view.layer.fast is not None:
        agreed.fast = _step_fast(agreed, view, mask, query)
    return _bound_step(view, query, key, value, mask, scaling)


def _one_call(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling=None,
    dropout=0.0,
    *,
    mpitree_shard=None,
    **kw,
):
    """:func:`attention_interface`'s lane: a later decode layer's one compiled call, or None.

    It runs where the step's agreement already ran (in its first layer), the
    layer's bound step applies (:func:`_bound_step`) and its merge is one
    compiled call, which asks ``MPI_Finalized`` before any other MPI call (where
    the merger was freed since, :meth:`Merger.merge_layer` checks MPI
    first). Otherwise it returns None, and the guarded call runs instead: so
    do arguments that :func:`_unsupported` might refuse (a dropout other than
    an int or float 0, a keyword outside ``_PASS``, a sliding window without a
    mask), arguments whose comparisons raise, and a call without its update's
    view. It checks the ``mpitree_shard`` view itself, as :func:`~._cache.claim`
    does: this runs in every later layer, where each Python call costs about a
    microsecond; without one it looks up a view-less update's (``claim``).
    """
    view = claim(key, take=False) if mpitree_shard is None else mpitree_shard
    # a keyword name (a str subclass) whose == raises only against some names gets past
    # binding and raises in the set test: the guarded call says why
    try:
        if (
            type(view) is not View
            or view.keys is not key
            or (type(dropout) is not float and type(dropout) is not int)  # no __eq__ runs
            or dropout
            or not kw.keys() <= _PASS
            or (attention_mask is None and kw.get("sliding_window") is not None)
        ):
            return None
    except Exception:
        return None
    out = _bound_step(view, query, key, value, attention_mask, scaling, lane=True)
    return None if out is None else (out, None)


@extend.entry_point(lane=_one_call)
def attention_interface(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling=None,
    dropout=0.0,
    *,
    mpitree_shard=None,
    **kw,
):
    """Attend over every rank's shard (transformers' ``AttentionInterface`` entry).

    Parameters
    ----------
    module : torch.nn.Module
        The attention module (unused beyond transformers' calling convention).
    query : torch.Tensor
        ``(B, Hq, Sq, D)``, identical on every rank (except under :func:`prefill`).
    key, value : torch.Tensor
        ``(B, Hkv, T_local, D)``: this rank's shard, as returned by
        :class:`ShardedCache` (GQA handled without repeating K/V). Without a
        ShardedCache (``use_cache=False``, or transformers' own cache), the
        forward's whole ``(B, Hkv, T, D)``, the same on every rank: attended
        locally, exactly, with no merge.
    attention_mask : ShardMask, torch.Tensor or None
        From the "mpitree" mask function, a 4-D bool or 0/-inf float mask over
        the global sequence, or None (causal).
    scaling : float, optional
        Score scale; default ``D ** -0.5``.
    dropout : float
        Must be 0 (inference only).
    mpitree_shard : optional
        The view of this rank's shard that :class:`ShardedCache`'s update put in
        the layer's attention keywords (transformers passes them to the cache
        update, then to the attention): never given by hand. Without it, the
        shard's view is the one the cache's last update in this thread left,
        when that update returned ``key`` (a model that gives its cache update
        no attention keywords, or ``cache.update`` then this function called
        directly); K/V of a ShardedCache attended otherwise raise on every rank.
    **kw
        transformers' extra arguments. ``softcap``, ``s_aux`` (attention sinks)
        and ``position_bias`` must be None; a ``sliding_window``, or
        ``is_causal=False``, is applied through the mask transformers builds for
        it; ``position_ids`` give the step's positions; flags such as
        ``use_cache`` and flash kernels' packed-sequence lengths change nothing.
        Any other argument must be None: ``ValueError`` names it otherwise.

    Returns
    -------
    out : torch.Tensor
        ``(B, Sq, Hq, D)`` in query's dtype: exact attention over every rank's keys.
    weights : None

    Notes
    -----
    A model step (one forward pass) costs one agreement collective, in its first
    attention call, and one merge per layer. Every later layer's checks run
    inside its merge, so a rank that diverges mid-step raises on every rank; a
    step that fails its agreement leaves the cache as it was. Without a
    ShardedCache, each call is local attention followed by one agreement over
    mpitree's default communicator, so every rank must run the forward (a rank
    with a ShardedCache while another has none raises on every rank).
    """
    view = claim(key, mpitree_shard)
    error = _unsupported(attention_mask, dropout, kw)
    if view is None:
        error = error or foreign_shard(key, mpitree_shard)
        out = _unsharded(query, key, value, attention_mask, scaling, error)
        return out.transpose(1, 2).contiguous(), None
    view.error = view.error or error
    if view.queries is None:  # a StaticShardedCache's decode step: on the device
        return static_attend(view, query, key, value, attention_mask, scaling), None
    sharding = view.layer.sharding
    signature = None
    agreed = view.step
    if agreed.signature is None:  # the step's first attention call: every rank is here
        recipe = _recipe(query, key, value, scaling, sharding, view.sharded)
        signature = recipe.signature
        positions = _step_positions(kw, int(query.shape[0]), int(query.shape[2]))
        try:
            _agree_step(
                sharding, view, query, key, value, attention_mask, scaling, recipe, positions
            )
        except Exception:
            view.layer.rollback(view)  # a failed step leaves the cache as it was
            raise
    out = _fast_attention(view, query, key, value, attention_mask, scaling)
    if out is not None:
        return out, None
    if signature is None:
        signature = _signature(query, key, value, scaling, sharding, view.sharded)
    step = LayerStep(view, query, key, value, attention_mask, agreed, signature)
    if view.sharded:
        return sharded_attention(query, step).contiguous(), None
    if sharding.invariant:
        records = _invariant_records(step, sharding)
    else:
        records = agreed.merger.merge(step).reshape(*query.shape[:3], -1)
        _rebind(view, query, key, value, scaling, signature, agreed)
    return extend.finish(records, query, layout="bshd", inputs=(query, key, value)), None


# transformers' attention keyword arguments that change nothing here (its TransformersKwargs and
# FlashAttentionKwargs): flags about the model's outputs, a loss's item count, and
# packed-sequence metadata for flash or state-space kernels, which the mask already carries
# (eager attention ignores them too); position_ids are read for the step's positions, a
# sliding window comes through the mask
_PASS = frozenset(
    {
        "position_ids", "use_cache", "cache_position", "output_attentions",
        "output_hidden_states", "output_router_logits", "num_items_in_batch",
        "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx",
        "sliding_window",
    }
)  # fmt: skip


def _causal(value):
    """Whether an ``is_causal`` argument asks for causal attention (never raises)."""
    try:
        return value is None or bool(value)
    except Exception:  # a tensor of many values: not a flag that says causal
        return False


def _unsupported(mask, dropout, kw):
    """Return the error for what the "mpitree" attention does not do, or None (never raises).

    Any keyword argument but those of ``_PASS`` that is set is refused, never ignored
    (GPT-OSS's attention sinks, ``s_aux``, once were: the output was silently wrong).
    An argument whose own comparison or truth value raises is refused with that error.
    """
    try:
        return _refused(mask, dropout, kw)
    except Exception as exc:  # this runs before the agreement: its verdict must ride in it
        return ValueError(f"attn_implementation='mpitree' could not check its arguments: {exc!r}")


def _refused(mask, dropout, kw):
    """:func:`_unsupported`'s checks, which may raise where an argument's own methods do."""
    if not isinstance(dropout, (int, float)) or dropout:
        return ValueError("attn_implementation='mpitree' is for inference: dropout must be 0")
    if kw.get("sliding_window") is not None and mask is None:
        # a window is honoured through the mask, which transformers builds with it
        return ValueError("attn_implementation='mpitree' needs a mask for sliding_window")
    if kw.keys() <= _PASS:
        return None
    if mask is None and not _causal(kw.get("is_causal")):
        return ValueError(
            "attn_implementation='mpitree' needs a mask for attention that is not causal "
            "(is_causal is false)"
        )
    for name, value in kw.items():
        if name in _PASS or name == "is_causal" or value is None:
            continue
        if name == "softcap":
            return ValueError("attn_implementation='mpitree' has no softcap")
        if name == "s_aux":  # gpt-oss: a per-head logit in every softmax's denominator
            return ValueError("attn_implementation='mpitree' has no attention sinks (s_aux)")
        if name == "position_bias":
            return ValueError("attn_implementation='mpitree' has no position bias (position_bias)")
        return ValueError(
            f"attn_implementation='mpitree' does not know the attention argument {name!r}, "
            "which is not None: it would be ignored, and the output could be wrong"
        )
    return None


def _unsharded(query, key, value, mask, scaling, error):
    """Attend over K/V that every rank holds whole: ``use_cache=False``, or not a ShardedCache.

    Every rank runs the same forward, so each has all of its keys and local
    attention is exact with no merge. It still joins one agreement (over
    mpitree's default communicator), which carries its verdict: a rank whose
    model runs with a :class:`ShardedCache` while another's does not raises on
    every rank instead of waiting in a merge. All local work runs before it, so
    nothing can fail on some ranks only afterwards.
    """

    def prepare():
        if error is not None:
            raise error
        problem = _checked(query, key, value)
        b, hq, sq, d = (int(s) for s in query.shape)
        t = int(key.shape[2])
        q0, k0 = (mask.q_offset, mask.kv_offset) if isinstance(mask, ShardMask) else (t - sq, 0)
        queries = torch.arange(q0, q0 + sq, device=query.device)
        keys = torch.arange(k0, k0 + t, device=query.device)
        keep = _visible(mask, queries, keys, t, problem.batch, problem.q_heads)
        scale = extend.Options.resolve(d, scale=scaling).scale
        records = np.empty((b, hq, sq, d + 2), dtype=problem.acc)
        _local_attention(query, key, value, scale, keep).fill(records)
        signature = _signature(query, key, value, scaling, None, False)
        return extend.Call(signature, extend.finish(records, query, inputs=(query, key, value)))

    return extend.agree(extend.check_comm(None), prepare).payload
