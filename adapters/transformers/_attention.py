"""The "mpitree" attention and mask functions registered with transformers."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.masking_utils import and_masks, padding_mask_function, prepare_padding_mask

from mpitree import extend

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
    return ShardMask(mask_function, batch_size, use_vmap)


def _visible(mask, view, batch):
    """Return the step's ``(B|1, 1|H, Sq, T)`` bool mask over this rank's keys."""
    keys = view.layer.positions
    if mask is None:  # transformers' convention: None means causal
        return keys[None, None, None, :] <= view.queries[None, None, :, None]
    if isinstance(mask, ShardMask):
        if mask.batch_size != batch:
            raise ValueError(f"mask built for batch {mask.batch_size}, inputs have {batch}")
        return mask.visible(view.queries, keys)
    if not isinstance(mask, torch.Tensor) or mask.ndim != 4:
        raise TypeError(f"attention_mask must be a 4-D tensor or None, got {type(mask).__name__}")
    if mask.shape[-1] != view.layer.length or mask.shape[-2] != view.queries.numel():
        raise ValueError(
            f"a 4-D attention_mask must cover (queries, keys) = ({view.queries.numel()}, "
            f"{view.layer.length}), got {tuple(mask.shape)}"
        )
    if view.sharded:
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


def _signature(query, key, scaling, sharding, sharded):
    """Return the per-layer facts every rank must share within a step."""
    b, hq, sq, d = (int(s) for s in query.shape)
    return {
        "batch": b,
        "q_heads": hq,
        "q_len": 0 if sharded else sq,  # prefill: each rank holds its own chunk
        "kv_heads": int(key.shape[1]),
        "head_dim": d,
        "dtype": extend.dtype_name(query.dtype),
        "scaling": None if scaling is None else float(scaling),
        "strategy": sharding.strategy,
        "deterministic": sharding.deterministic,
        "sharded prefill": sharded,
    }


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
        if self.signature != self.agreed.signature:
            raise ValueError(
                f"this layer's attention {self.signature} differs from the step's first layer "
                f"{self.agreed.signature}"
            )
        ns = extend.namespace(self.query)
        keep = _visible(self.mask, self.view, int(self.query.shape[0]))
        if keep is not None and bool(keep.all()):
            keep = None
        self.att = extend.Attention(
            ns, self.query, self.key, self.value, self.agreed.scale, None, keep
        )
        return self.att

    def fill(self, records):
        """Write this shard's state of the layer's queries into host records."""
        self.prepare().fill(records)

    def block(self):
        """Return the shard for the ring baseline."""
        return self.att.block()

    def attend_block(self, *args):
        """Another rank's block, for the ring baseline."""
        self.att.attend_block(*args)


def _agree_step(sharding, view, query, key, value, mask, scaling, signature):
    """Run the step's one agreement (first attention call): checks, signature, merger."""

    def prepare():
        if view.error is not None:
            raise view.error
        ns, problem, _ = extend.check_qkv(query, key, value, names=("query", "key", "value"))
        if ns.name != "torch":
            raise TypeError("attn_implementation='mpitree' runs on torch tensors")
        _visible(mask, view, problem.batch)
        opts = extend.Options.resolve(
            problem.head_dim, sharding.strategy, scaling, sharding.deterministic
        )
        width = problem.head_dim + 2
        op = extend.op_needed(opts.strategy, opts.deterministic, problem.acc, problem.head_dim)
        return extend.Call(
            signature, (problem, opts), op=(problem.acc, width) if view.sharded else op
        )

    call = extend.agree(sharding.comm, prepare)
    problem, opts = call.payload
    merger = None
    if not view.sharded:
        chosen = extend.resolve(opts.strategy, sharding.comm, call.native, 0, opts.deterministic)
        merger = extend.merger_for(
            sharding.comm, problem.rows, problem.head_dim, problem.acc, chosen, like=query
        )
    return Agreed(signature, opts.scale, merger)


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
        :class:`ShardedCache` (GQA handled without repeating K/V).
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
    inside its merge, so a rank that diverges mid-step raises on every rank.
    """
    view = getattr(key, "mpitree_view", None)
    if view is None:
        raise TypeError(
            "attn_implementation='mpitree' needs past_key_values=ShardedCache(...) "
            "(from mpitree.adapters.transformers) and use_cache=True"
        )
    if dropout:
        view.error = view.error or ValueError(
            "attn_implementation='mpitree' is for inference: dropout must be 0"
        )
    if kw.get("softcap") is not None:
        view.error = view.error or ValueError("attn_implementation='mpitree' has no softcap")
    if kw.get("sliding_window") is not None and attention_mask is None:
        # a window is honoured through the mask, which transformers builds with it
        view.error = view.error or ValueError(
            "attn_implementation='mpitree' needs a mask for sliding_window"
        )
    sharding = view.layer.sharding
    signature = _signature(query, key, scaling, sharding, view.sharded)
    if sharding.agreed is None:  # the step's first attention call: every rank is here
        sharding.agreed = _agree_step(
            sharding, view, query, key, value, attention_mask, scaling, signature
        )
    step = LayerStep(view, query, key, value, attention_mask, sharding.agreed, signature)
    if view.sharded:
        out = sharded_attention(query, step)
    else:
        records = sharding.agreed.merger.merge(step)
        out = extend.finish(records.reshape(*query.shape[:3], -1), query)
    return out.transpose(1, 2).contiguous(), None
