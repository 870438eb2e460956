"""Speculative verification of a packed draft tree over the sharded cache."""

import torch

from mpitree import extend

from ._cache import ShardedCache


@extend.entry_point
def verify(model, cache, packed, attention_mask=None):
    """Score a packed draft tree in one forward pass over a :class:`ShardedCache`.

    The tree's tokens (from :func:`mpitree.spec.pack`) follow the cached context;
    each attends the whole (unpadded) context and its own ancestors, through the
    tree reduction. The cache is left as it was.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Set to ``attn_implementation="mpitree"``, the same on every rank.
    cache : ShardedCache
        Holds the context: ``P = cache.get_seq_length()`` tokens.
    packed : mpitree.spec.Packed
        ``(B, L)`` tree of torch tensors. Its ``position_ids``, if set (``pack``
        with the context's padding mask), are used; otherwise ``P + depth``.
    attention_mask : torch.Tensor, optional
        ``(B, P)`` context padding mask (0 at padding), as for ``generate``.

    Returns
    -------
    torch.Tensor
        ``(B, L, V)`` logits of every tree node; :func:`mpitree.spec.unpack` maps
        them back to the beam's ``(B, M, C, V)``.
    """

    def prepare():
        if not isinstance(cache, ShardedCache):
            raise TypeError(f"cache must be a ShardedCache, got {type(cache).__name__}")
        tokens = getattr(packed, "tokens", None)
        if not isinstance(tokens, torch.Tensor) or tokens.ndim != 2:
            raise TypeError("packed must be mpitree.spec.pack(...) of torch tensors")
        b, length = (int(s) for s in tokens.shape)
        context = cache.get_seq_length()
        if attention_mask is not None and tuple(attention_mask.shape) != (b, context):
            raise ValueError(
                f"attention_mask must have shape ({b}, {context}), "
                f"got {tuple(attention_mask.shape)}"
            )
        if tuple(packed.mask.shape) != (b, length, length):
            raise ValueError(f"packed.mask must be ({b}, {length}, {length})")
        return extend.Call({"tree": (b, length), "context": context})

    extend.agree(extend.check_comm(getattr(cache, "comm", None)), prepare)
    tokens = packed.tokens
    b = tokens.shape[0]
    context = cache.get_seq_length()
    seen = torch.ones(b, context, dtype=torch.bool, device=tokens.device)
    if attention_mask is not None:
        seen = attention_mask.to(device=tokens.device, dtype=torch.bool)
    rows = packed.valid[:, :, None] & seen[:, None, :]  # padding slots see no context
    mask = torch.cat([rows, packed.mask.to(torch.bool)], dim=-1)[:, None]  # (B, 1, L, P + L)
    positions = packed.position_ids
    if positions is None:
        positions = (context + packed.position_offsets) * packed.valid
    try:
        with torch.no_grad():
            return model(
                input_ids=tokens,
                attention_mask=mask,
                position_ids=positions,
                cache=cache,
                use_cache=True,
            ).logits
    finally:
        if cache.get_seq_length() > context:
            cache.crop(context - cache.get_seq_length())
