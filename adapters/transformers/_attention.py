"""The "mpitree" attention and mask functions registered with transformers."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from transformers.masking_utils import and_masks, padding_mask_function, prepare_padding_mask

from mpitree import extend

from ._cache import take_view
from ._prefill import sharded_attention


@dataclass(frozen=True)
class ShardMask:
    """A mask recipe evaluated per rank on the global indices of its own keys.

    transformers builds masks as a function of (batch, head, query index, key
    index); the "mpitree" mask function returns that recipe instead of a
    ``(B, 1, Sq, N)`` tensor, and the attention function evaluates it only at the
    keys this rank stores.
    """

    mask_function: object
    batch_size: int
    use_vmap: bool
    q_offset: int = 0  # global index of the first query, and of the first key, when a
    kv_offset: int = 0  # forward's keys are all here (no ShardedCache: see _unsharded)

    def visible(self, queries, keys):
        """``(B, 1, Sq, T)`` bool: may query ``queries[i]`` see key ``keys[j]``."""
        b = torch.arange(self.batch_size, device=keys.device)[:, None, None, None]
        h = torch.zeros(1, dtype=torch.long, device=keys.device)[None, :, None, None]
        keep = self.mask_function(b, h, queries[None, None, :, None], keys[None, None, None, :])
        return keep.expand(self.batch_size, 1, queries.numel(), keys.numel())


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
    if padding is not None:
        mask_function = and_masks(mask_function, padding_mask_function(padding))
    return ShardMask(mask_function, batch_size, use_vmap, int(q_offset), int(kv_offset))


def _visible(mask, queries, keys, length, batch, heads, sharded=False):
    """Return the ``(B|1, 1|Hq, Sq, T)`` bool mask of ``queries`` over ``keys`` (global indices).

    ``length`` is the global key count a 4-D mask must cover, ``heads`` the query
    heads ``Hq``; ``sharded`` is True under :func:`prefill`. A 4-D mask is checked
    against ``(B, Hq, Sq, length)`` as a whole, whatever keys this rank holds (none
    included): the verdict must not depend on the placement.
    """
    if mask is None:  # transformers' convention: None means causal
        return keys[None, None, None, :] <= queries[None, None, :, None]
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


@dataclass(frozen=True)
class Agreed:
    """What every rank agreed on in a model step's first attention call."""

    signature: dict
    scale: float
    merger: object  # the shared merger for the step's decode layers (None under prefill)
    # visibility per (mask, shard length): every layer of a step shares it
    visible: dict = field(default_factory=dict)


def _signature(query, key, value, scaling, sharding, sharded):
    """Return the per-layer facts every rank must share in a step (``sharding`` None: no cache).

    The step's first layer runs the full checks (:func:`_checked`); a later layer
    is held to them by this signature, which names everything those checks
    establish of query, key and value but the shard length: a layer whose
    signature equals the first's would pass them too. A sharded cache's layers
    mostly repeat one signature: it is kept on the sharding and the same dict
    returned while its inputs stay the same. Never raises (it runs outside the
    guard on the ranks of a layer after the first).
    """
    if sharding is None or sharding.invariant:
        return _new_signature(query, key, value, scaling, sharding, sharded)
    facts = (
        query.shape,
        query.dtype,
        key.dtype,
        value.dtype,
        key.shape[:2] + key.shape[3:],
        value.shape[:2] + value.shape[3:],
        key.shape[2:3] == value.shape[2:3],
        query.device == key.device == value.device,
        scaling,
        sharded,
        sharding.strategy,
        sharding.deterministic,
        sharding.placement,
        sharding.block_size,
    )
    memo = sharding.signature_memo
    if memo is None or memo[0] != facts:
        memo = sharding.signature_memo = (
            facts,
            _new_signature(query, key, value, scaling, sharding, sharded),
        )
    return memo[1]


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
        "dtype": extend.dtype_name(query.dtype),
        # key and value as the checks see them, but their (per-rank) length and device
        "k/v": (
            extend.dtype_name(key.dtype),
            extend.dtype_name(value.dtype),
            tuple(int(s) for s in key.shape[:2] + key.shape[3:]),
            tuple(int(s) for s in value.shape[:2] + value.shape[3:]),
            key.shape[2:3] == value.shape[2:3],
            query.device == key.device == value.device,
        ),
        "scaling": None if scaling is None else float(scaling),
        "strategy": None if sharding is None else sharding.strategy,
        "deterministic": None if sharding is None else sharding.deterministic,
        "placement": None if sharding is None else sharding.placement,
        "block_size": None if sharding is None else sharding.block_size,
        "sharded prefill": sharded,
    }
    if sharding is not None and sharding.invariant:
        extend.invariant_signature(sig)
    return sig


class LayerStep:
    """One layer's local work, run inside the merge's guard: checks, mask, attention."""

    def __init__(self, view, query, key, value, mask, agreed, signature):
        self.view, self.query, self.key, self.value, self.mask = view, query, key, value, mask
        self.agreed, self.signature, self.att = agreed, signature, None
        self.q_len = int(query.shape[2])

    def prepare(self):
        """Check this layer against the step's agreement; build its :class:`Attention`."""
        if self.view.error is not None:
            raise self.view.error
        if self.signature is not self.agreed.signature and self.signature != self.agreed.signature:
            raise ValueError(
                f"this layer's attention {self.signature} differs from the step's first layer "
                f"{self.agreed.signature}"
            )
        rows = (int(self.query.shape[0]), int(self.query.shape[1]))
        keep = _step_visible(self.agreed.visible, self.mask, self.view, rows)
        ns = extend.namespace(self.query)
        self.att = extend.Attention(
            ns, self.query, self.key, self.value, self.agreed.scale, None, keep
        )
        return self.att

    def fill(self, records):
        """Write this shard's state of the layer's queries into host records."""
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
    return _visible(mask, view.queries, layer.positions, layer.length, *rows, view.sharded)


def _step_visible(memo, mask, view, rows):
    """Return ``_view_visible`` (None when all visible), computed once per step and mask.

    Every layer of a step has the same mask object (one per layer type) and the
    same global key indices, so the first layer's visibility serves them all.
    The memo holds the mask, so its ``id`` cannot be reused within the step.
    """
    key = _visible_key(mask, view)
    if key not in memo:
        memo[key] = (mask, _unless_all(_view_visible(mask, view, rows)))
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
    acc = extend.acc_name(step.agreed.signature["dtype"])  # agreed: not this layer's own

    def local():
        blocks = _shard_blocks(step.agreed.visible, step.view.layer)
        att = step.prepare()
        return extend.invariant_pieces(att, sharding.block_size, None, blocks, acc)

    return step.agreed.merger.merge(local).reshape(*step.query.shape[:3], -1)


def _local_attention(query, key, value, scale, keep):
    """Return the :class:`extend.Attention` of ``query`` over ``key``/``value`` under ``keep``."""
    keep = _unless_all(keep)
    return extend.Attention(extend.namespace(query), query, key, value, scale, None, keep)


def _checked(query, key, value):
    """Check the attention's tensors; return their :class:`extend.Problem`."""
    ns, problem, _ = extend.check_qkv(query, key, value, names=("query", "key", "value"))
    if ns.name != "torch":
        raise TypeError("attn_implementation='mpitree' runs on torch tensors")
    return problem


def _step_positions(kw, batch, q_len):
    """Return the step's ``(B, Sq)`` position ids from the attention's kwargs, or None."""
    pos = kw.get("position_ids")
    if not isinstance(pos, torch.Tensor) or pos.ndim != 2 or pos.shape[0] not in (1, batch):
        return None
    return pos.expand(batch, q_len) if pos.shape[1] == q_len else None


def _refeed_error(view, positions):
    """Return the error for a step that feeds tokens the cache already holds."""
    return ValueError(
        f"in no batch row does this step (position ids up to {int(positions.max())}) go past "
        f"the {view.start} tokens the ShardedCache already holds: they would be cached "
        "twice. generate(input_ids, past_key_values=cache) re-runs the whole prompt "
        "when the cache already holds every token of input_ids; the cache must hold a strict "
        "prefix, e.g. mtt.prefill(model, input_ids[:, :-1], cache, attention_mask="
        "mask[:, :-1]) then generate(input_ids, attention_mask=mask, past_key_values=cache), "
        "or append the next token (prefill's logits) to input_ids"
    )


def _agree_step(sharding, view, query, key, value, mask, scaling, signature, positions):
    """Run the step's one agreement (first attention call): checks, signature, merger."""

    def prepare():
        if view.error is not None:
            raise view.error
        history = None
        if not view.sharded:
            if sharding.refed(positions, view.start):
                raise _refeed_error(view, positions)
            history = sharding.extended(positions, view.start)
        problem = _checked(query, key, value)
        keep = _unless_all(_view_visible(mask, view, (problem.batch, problem.q_heads)))
        opts = extend.Options.resolve(
            problem.head_dim,
            sharding.strategy,
            scaling,
            sharding.deterministic,
            block_size=sharding.block_size if sharding.invariant else None,
            invariant=True,
        )
        width = problem.head_dim + 2
        op = extend.op_needed(opts.strategy, opts.deterministic, problem.acc, problem.head_dim)
        return extend.Call(
            signature,
            (problem, opts, history, keep),
            op=(problem.acc, width) if view.sharded else op,
        )

    call = extend.agree(sharding.comm, prepare)
    problem, opts, history, keep = call.payload
    merger = None
    if not view.sharded:
        sharding.history = history
    if sharding.invariant and not view.sharded:
        merger = extend.merger_for(
            sharding.comm, problem.rows, problem.head_dim, problem.acc, extend.INVARIANT
        )
    elif not view.sharded:
        chosen = extend.resolve(opts.strategy, sharding.comm, call.native, 0, opts.deterministic)
        merger = extend.merger_for(
            sharding.comm, problem.rows, problem.head_dim, problem.acc, chosen, like=query
        )
    agreed = Agreed(signature, opts.scale, merger)
    agreed.visible[_visible_key(mask, view)] = (mask, keep)  # the first layer's, computed above
    return agreed


@extend.entry_point
def attention_interface(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
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
    **kw
        transformers' extra arguments. ``softcap`` must be None; a
        ``sliding_window`` is applied through the mask transformers builds for it.

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
    view = take_view(key)
    error = _unsupported(attention_mask, dropout, kw)
    if view is None:
        out = _unsharded(query, key, value, attention_mask, scaling, error)
        return out.transpose(1, 2).contiguous(), None
    view.error = view.error or error
    sharding = view.layer.sharding
    signature = _signature(query, key, value, scaling, sharding, view.sharded)
    if sharding.agreed is None:  # the step's first attention call: every rank is here
        positions = _step_positions(kw, int(query.shape[0]), int(query.shape[2]))
        try:
            sharding.agreed = _agree_step(
                sharding, view, query, key, value, attention_mask, scaling, signature, positions
            )
        except Exception:
            view.layer.rollback(view)  # a failed step leaves the cache as it was
            raise
    step = LayerStep(view, query, key, value, attention_mask, sharding.agreed, signature)
    if view.sharded:
        return sharded_attention(query, step).transpose(1, 2).contiguous(), None
    if sharding.invariant:
        records = _invariant_records(step, sharding)
    else:
        records = sharding.agreed.merger.merge(step).reshape(*query.shape[:3], -1)
    return extend.finish(records, query, layout="bshd", inputs=(query, key, value)), None


def _unsupported(mask, dropout, kw):
    """Return the error for what the "mpitree" attention does not do, or None."""
    if dropout:
        return ValueError("attn_implementation='mpitree' is for inference: dropout must be 0")
    if kw.get("softcap") is not None:
        return ValueError("attn_implementation='mpitree' has no softcap")
    if kw.get("sliding_window") is not None and mask is None:
        # a window is honoured through the mask, which transformers builds with it
        return ValueError("attn_implementation='mpitree' needs a mask for sliding_window")
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
