"""Sharded prefill: each rank runs only its own prompt tokens through the model."""

from dataclasses import dataclass

import numpy as np
import torch

from mpitree._op import record_op

from .. import torch as mt


@dataclass(frozen=True)
class Prefill:
    """One sharded prefill step, as every rank sees it."""

    mine: torch.Tensor  # (n_r,) int64: global indices of this rank's prompt tokens
    total: int  # prompt tokens prefilled over all ranks
    queries: torch.Tensor  # (total,) int64: every rank's indices, rank-major
    counts: list  # tokens per rank


def plan(sharding, total):
    """Return the :class:`Prefill` of the first ``total`` tokens under ``sharding``."""
    owners = sharding.owners(0, total, total)
    order = torch.argsort(owners, stable=True)
    counts = torch.bincount(owners, minlength=sharding.size).tolist()
    return Prefill(order[owners[order] == sharding.rank], total, order, counts)


def sharded_attention(query, key, value, scale, keep, view, local_records):
    """Causal attention for every rank's chunk of queries over every rank's keys.

    Queries are all-gathered (``Allgatherv``); each rank computes the partial
    states of all of them over its own keys; one ``Reduce_scatter`` with the
    native (m, d, n) op hands each rank the merged states of its own queries.
    """
    step = view.layer.sharding.pending
    comm = view.layer.sharding.comm
    b, hq, sq, d = query.shape
    own = step.counts[view.layer.sharding.rank]  # sq, or 0 under a stand-in token
    acc = mt._acc(query.dtype)
    np_acc = np.float64 if acc == torch.float64 else np.float32
    mine = query[:, :, :own].permute(2, 0, 1, 3).to(device="cpu", dtype=acc).contiguous()
    every = torch.empty((step.total, b, hq, d), dtype=acc)
    row = b * hq * d
    comm.Allgatherv(mine.numpy(), [every.numpy(), [c * row for c in step.counts]])
    q_all = every.permute(1, 2, 0, 3).to(query.device)
    rec = local_records(q_all, key, value, scale, keep)
    send = rec.permute(2, 0, 1, 3).to("cpu").contiguous().numpy()
    recv = np.empty((own, b, hq, d + 2), dtype=np_acc)
    dtype, op = record_op(np_acc, d)
    comm.Reduce_scatter([send, dtype], [recv, dtype], [c * b * hq for c in step.counts], op)
    merged = torch.from_numpy(recv).permute(1, 2, 0, 3).to(query.device)
    out = mt._finish(merged, query, False)
    return torch.cat([out, out.new_zeros(b, hq, sq - own, d)], 2) if own < sq else out


def prefill(model, input_ids, cache, attention_mask=None):
    """Prefill ``cache`` with all but the last prompt token, sharded over the ranks.

    Each rank runs the model only on the prompt tokens its placement assigns it
    (with their true positions), so the dense layers' work is split ``p`` ways;
    the causal attention across chunks goes through the tree reduction
    (queries all-gathered, states merged by one ``Reduce_scatter``). Then call
    ``model.generate(input_ids, attention_mask=..., past_key_values=cache)``: it
    runs the last prompt token as an ordinary step and generates from there.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A causal LM set to ``attn_implementation="mpitree"``, the same on every rank.
    input_ids : torch.Tensor
        ``(B, N)`` int64 prompt, identical on every rank; ``N >= 2`` to prefill anything.
    cache : ShardedCache
        Empty.
    attention_mask : torch.Tensor, optional
        ``(B, N)`` with 0 at (left) padding, as for ``generate``.

    Raises
    ------
    ValueError
        When the cache is not empty or the shapes do not match (on every rank, as
        every rank sees the same arguments).
    """
    from ._cache import ShardedCache

    impl = getattr(model.config, "_attn_implementation", None)
    if impl != "mpitree":
        raise ValueError(
            f"prefill needs a model set to attn_implementation='mpitree', not {impl!r}"
        )
    if not isinstance(cache, ShardedCache):
        raise TypeError(f"cache must be a ShardedCache, got {type(cache).__name__}")
    if cache.get_seq_length():
        raise ValueError("prefill needs an empty ShardedCache")
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be (B, N), got shape {tuple(input_ids.shape)}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
            f"{tuple(input_ids.shape)}"
        )
    total = input_ids.shape[1] - 1
    if total < 1:
        return
    step = plan(cache.sharding, total)
    if attention_mask is None:
        positions = torch.arange(total, device=input_ids.device)[None]
        mask = None
    else:  # generate's rule: count real tokens; padding gets position 0
        mask = attention_mask[:, :total]
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    # A rank without prompt tokens still joins every layer's collectives: it runs
    # one stand-in token (transformers cannot run an empty sequence) that it
    # neither stores nor sends, and whose output it discards.
    mine = step.mine.to(input_ids.device)
    if not mine.numel():
        mine = torch.zeros(1, dtype=torch.long, device=input_ids.device)
    with torch.no_grad(), cache._prefilling(step):
        model(
            input_ids=input_ids[:, mine],
            attention_mask=mask,
            position_ids=positions[:, mine],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
