"""The "mpitree" attention and mask functions registered with transformers."""

from dataclasses import dataclass

import torch
from transformers.masking_utils import and_masks, padding_mask_function, prepare_padding_mask

from mpitree._plan import checked_call
from mpitree._validate import Shapes, resolve_scale

from .. import torch as mt
from ._prefill import sharded_attention

# Score elements per block of query rows when the local attention is chunked, so
# a long prompt never materialises its whole (queries x keys) score matrix.
_BLOCK_SCORES = 1 << 24


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


def local_records(q, k, v, scale, keep):
    """Local ``(B, Hq, Sq, D + 2)`` records, in blocks of query rows.

    Each block only reads the keys up to the last one any of its rows can see, so
    causal prompts cost about half of the full product.
    """
    b, hq, sq, _ = q.shape
    t = k.shape[2]
    step = max(1, _BLOCK_SCORES // max(1, b * hq * t))
    parts = []
    for i in range(0, max(sq, 1), step):
        rows = keep[..., i : i + step, :] if keep is not None and keep.shape[-2] > 1 else keep
        stop = t
        if rows is not None and t:
            seen = rows.reshape(-1, t).any(0).nonzero()
            stop = int(seen[-1, 0]) + 1 if seen.numel() else 0
            rows = rows[..., :stop]
        parts.append(
            mt._records(
                q[:, :, i : i + step], k[:, :, :stop], v[:, :, :stop], scale, None, None, None, rows
            )
        )
    return torch.cat(parts, 2) if len(parts) > 1 else parts[0]


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
    """
    view = getattr(key, "mpitree_view", None)
    if view is None:
        raise TypeError(
            "attn_implementation='mpitree' needs past_key_values=ShardedCache(...) "
            "(from mpitree.adapters.transformers) and use_cache=True"
        )
    if dropout:
        raise ValueError("attn_implementation='mpitree' is for inference: dropout must be 0")
    if kw.get("softcap") is not None:
        raise ValueError("attn_implementation='mpitree' does not support softcap")
    if kw.get("sliding_window") is not None and attention_mask is None:
        # a window is honoured through the mask, which transformers builds with it
        raise ValueError("attn_implementation='mpitree' needs a mask for sliding_window")
    sharding = view.layer.sharding
    keep = None

    def inspect():
        nonlocal keep
        shapes = Shapes(*mt._check(query, key, value, None, None, None, None), query.dtype)
        keep = _visible(attention_mask, view, shapes.batch)
        if keep is not None and bool(keep.all()):
            keep = None
        if view.sharded:  # ranks hold different chunks of queries: agree on the total
            shapes = Shapes(
                shapes.batch, shapes.q_heads, shapes.kv_heads, 0, shapes.head_dim, shapes.dtype
            )
        return shapes

    # One agreement per model step: the first layer's. Later layers with the same
    # signature reuse it, so a decode step pays local attention and one merge per
    # layer, plus one small collective per step.
    signature = (
        tuple(query.shape),
        tuple(key.shape[:2]),
        query.dtype,
        scaling,
        sharding.strategy,
        view.sharded,
    )
    if signature == sharding.agreed:
        inspect()
        comm, scale = sharding.comm, resolve_scale(scaling, query.shape[-1])
    else:
        comm, _, scale, _ = checked_call(
            sharding.comm,
            query,
            key,
            value,
            scale=scaling,
            kv_len=None,
            q_pos=None,
            k_pos=None,
            mask=None,
            strategy=sharding.strategy,
            deterministic=sharding.deterministic,
            inspect=inspect,
        )
        sharding.agreed = signature
    if view.sharded:
        out = sharded_attention(query, key, value, scale, keep, view, local_records)
    elif sharding.strategy == "ring":
        out = mt._decode_checked(
            query, key, value, comm, scale, None, None, None, keep, "ring", False, False
        )
    else:
        records = mt._merge(
            local_records(query, key, value, scale, keep),
            comm,
            sharding.strategy,
            sharding.deterministic,
        )
        out = mt._finish(records, query, False)
    return out.transpose(1, 2).contiguous(), None
