"""Sharded prefill: each rank runs only its own prompt tokens through the model."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from mpitree import extend

from . import _staircase as staircase


@dataclass(frozen=True)
class Prefill:
    """One sharded prefill step, as every rank sees it."""

    mine: torch.Tensor  # (n_r,) int64: global indices of this rank's prompt tokens
    total: int  # prompt tokens prefilled over all ranks
    queries: torch.Tensor  # (total,) int64: every rank's indices, rank-major
    counts: list  # tokens per rank
    scratch: dict = field(default_factory=dict, compare=False, repr=False)  # see _scratch


def plan(sharding, total):
    """Return the :class:`Prefill` of the first ``total`` tokens under ``sharding``."""
    owners = sharding.owners(0, total, total)
    order = torch.argsort(owners, stable=True)
    counts = torch.bincount(owners, minlength=sharding.size).tolist()
    return Prefill(order[owners[order] == sharding.rank], total, order, counts)


def _scratch(prefill_step, name, shape, dtype):
    """Return the prefill's buffer ``name``, kept for every layer that wants this shape.

    torch allocates it, in 4 KiB pages: numpy asks for transparent huge pages
    for large arrays, and on the VMs we measure on, a first touch of fresh huge
    pages is slow (16K tokens: the query all-gather took 0.87 s into a numpy
    buffer and 0.17 s into a torch one).
    """
    held = prefill_step.scratch.get(name)
    if held is None or held.shape != shape or held.dtype != dtype:
        held = torch.empty(shape, dtype=getattr(torch, np.dtype(dtype).name)).numpy()
        prefill_step.scratch[name] = held
    return held


def reserve(prefill_step, rows, acc):
    """Return the prefill's buffers for query rows ``(B, Hq, D)`` in ``acc``, allocated once.

    Returns ``(queries, slots, send, recv)``: every rank's queries, each query's
    slot in the reduce-scatter's layout, and its two buffers. The step's agreement
    calls it first, in its local checks, so that running out of memory on one rank
    raises on every rank there, not in the query all-gather that follows; every
    layer then finds them (the step's layers share the agreed shapes).
    """
    counts = prefill_step.counts
    every = _scratch(prefill_step, "queries", (prefill_step.total, *rows), acc)
    if "layout" not in prefill_step.scratch:
        per_rank, slots = extend.scatter_layout(counts)
        prefill_step.scratch["layout"] = per_rank, torch.from_numpy(slots)
    per_rank, slots = prefill_step.scratch["layout"]
    block = (rows[0] * rows[1], rows[2] + 2)
    send = _scratch(prefill_step, "send", (len(counts), per_rank, *block), acc)
    recv = _scratch(prefill_step, "recv", (per_rank, *block), acc)
    return every, slots, send, recv


def sharded_attention(query, step):
    """Causal attention for every rank's chunk of queries over every rank's keys.

    Queries are all-gathered (``Allgatherv``, in place); each rank computes the
    partial states of all of them over its own keys, straight into the
    reduce-scatter's send buffer; one ``Reduce_scatter_block`` with the native
    (m, d, n) op hands each rank the merged states of its own queries. A rank whose
    layer does not match the step's agreement sends zeros and reports its failure
    in the reduce-scatter, so every rank raises. Returns ``(B, Sq, Hq, D)``.
    """
    sharding = step.view.layer.sharding
    prefill_step, comm = sharding.pending, sharding.comm
    b, hq, sq, d = (int(s) for s in query.shape)
    agreed = step.agreed.signature
    counts, total = prefill_step.counts, prefill_step.total
    own = counts[sharding.rank]  # sq, or 0 under a stand-in token
    acc = extend.acc_name(agreed["dtype"])  # agreed: not this layer's own (may differ here)
    rows = (agreed["batch"], agreed["q_heads"], agreed["head_dim"])
    every, slots, send, recv = reserve(prefill_step, rows, acc)
    start = sum(counts[: sharding.rank])
    mine = torch.from_numpy(every[start : start + own])
    problem = None  # raised in fill, so that it rides in the reduce-scatter's flag
    try:
        if (b, hq, d) != rows or own > sq:
            raise ValueError(f"prefill: this layer's query {tuple(query.shape)} does not match")
        mine.copy_(query[:, :, :own].permute(2, 0, 1, 3))
    except Exception as exc:
        problem = exc
        mine.zero_()
    extend.allgather_rows(comm, None, counts, int(np.prod(rows)), out=every)

    def fill(out):
        if problem is not None:
            raise problem
        q_all = torch.from_numpy(every).permute(1, 2, 0, 3).to(query.device, query.dtype)
        att = step.prepare()
        att.q = q_all
        keys = step.view.layer.positions
        # the records in their (slot, batch, head) order, seen as (batch, head, slot)
        view = torch.from_numpy(out).view(-1, b, hq, d + 2).permute(1, 2, 0, 3)
        key_ok = None
        if att.k.shape[2] and np.dtype(acc) == np.float32 and staircase.available(q_all):
            key_ok = _key_rows(step, prefill_step, att.vis, keys)
        if key_ok is None:  # windows, per-head masks, float64: the general kernel
            state = np.empty((b, hq, total, d + 2), dtype=acc)
            step.built().fill(state)
            view[:, :, slots] = torch.from_numpy(state)
        else:
            staircase.staircase_records(
                att.q,
                att.k,
                att.v,
                att.scale,
                prefill_step.queries,
                keys,
                key_ok,
                out=view,
                out_rows=slots,
            )

    merged = extend.reduce_scatter_records(comm, send, counts, fill, recv=recv)
    # finish works row by row: the (query, batch, head) records give (Sq, B, Hq, D)
    inputs = (query, step.key, step.value)
    out = extend.finish(merged.reshape(own, b, hq, d + 2), query, inputs=inputs).transpose(0, 1)
    return torch.cat([out, out.new_zeros(b, sq - own, hq, d)], 1) if own < sq else out


def _key_rows(step, prefill_step, vis, keys):
    """Return the staircase's key rows under ``vis``, worked out once per visibility object.

    Layers that share a mask share their visibility (one object per step, an unbuilt
    :class:`~._attention.CausalPrefill` under a causal recipe), so the check runs in
    the first layer only.
    """
    held = prefill_step.scratch.get("key rows")
    if held is None or held[0] is not vis:
        known = step.causal_keys()
        held = vis, staircase.key_rows(vis, prefill_step.queries, keys, known)
        prefill_step.scratch["key rows"] = held
    return held[1]


def _digest(x):
    """Shape and CRC-32 of a tensor's values: ranks must pass the same prompt."""
    host = np.ascontiguousarray(x.detach().cpu().numpy())
    return (tuple(host.shape), str(host.dtype), zlib.crc32(host.view(np.uint8)))


@extend.entry_point
def prefill(model, input_ids, cache, attention_mask=None):
    """Run the whole prompt into an empty ``cache``, sharding its work; return the next logits.

    Afterwards ``cache`` holds every token of ``input_ids``, as after
    ``model(input_ids, cache=cache)``, and the logits are those of the
    last prompt token. Each rank runs the model only on the prompt tokens its
    placement assigns it (with their true positions), so the dense layers' work
    is split ``p`` ways; the causal attention across chunks goes through the
    tree reduction (queries all-gathered, states merged by one
    ``Reduce_scatter``). The last token then runs as an ordinary step on every
    rank, which hands every rank its logits. A cache in
    ``deterministic="invariant"`` mode runs the whole prompt on every rank instead
    (each stores its own tokens): a dense layer's bits for a token can depend on
    how many tokens share its matrix product, so only an unsplit prompt gives
    the same logits for any number of ranks.

    As with any transformers cache, ``generate`` needs input_ids that go past
    what the cache holds. To let ``generate`` produce every token after a prompt
    ``ids``, prefill ``ids[:, :-1]`` (and ``attention_mask[:, :-1]``) and pass
    ``ids`` to ``generate``; to reuse a prefilled prompt for several
    continuations, pass ``generate`` the prompt plus each continuation and a
    ``copy.deepcopy(cache)``. ``generate(ids, cache=cache)`` on a cache
    that already holds all of ``ids`` would feed the prompt a second time: it
    raises ``ValueError`` on every rank and leaves the cache as it was.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A causal LM set to ``attn_implementation="mpitree"``, the same on every rank.
    input_ids : torch.Tensor
        ``(B, N)`` int64 prompt, ``N >= 1``, identical on every rank.
    cache : ShardedCache
        Empty.
    attention_mask : torch.Tensor, optional
        ``(B, N)`` with 0 at (left) padding, as for ``generate``.

    Returns
    -------
    torch.Tensor
        ``(B, V)`` logits after the last prompt token, in the model's dtype,
        identical on every rank.

    Raises
    ------
    ValueError, TypeError
        On every rank, when any rank's arguments are invalid (the cache not empty,
        an empty prompt, shapes that do not match) or ranks pass different prompts.
    """
    from ._cache import ShardedCache

    def prepare():
        impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
        if impl != "mpitree":
            raise ValueError(
                f"prefill needs a model set to attn_implementation='mpitree', not {impl!r}"
            )
        if not isinstance(cache, ShardedCache):
            raise TypeError(f"cache must be a ShardedCache, got {type(cache).__name__}")
        if cache.get_seq_length():
            raise ValueError("prefill needs an empty ShardedCache")
        if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
            raise ValueError(f"input_ids must be a (B, N) tensor, got {input_ids!r:.60}")
        if input_ids.shape[1] < 1:
            raise ValueError("input_ids must hold at least one token")
        if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                f"{tuple(input_ids.shape)}"
            )
        sig = {"input_ids": _digest(input_ids)}
        sig["attention_mask"] = None if attention_mask is None else _digest(attention_mask)
        return extend.Call(sig)

    extend.agree(extend.check_comm(getattr(cache, "comm", None)), prepare)
    batch, total = input_ids.shape[0], input_ids.shape[1] - 1  # all but the last, sharded
    if attention_mask is None:
        positions = torch.arange(total + 1, device=input_ids.device)[None].expand(batch, -1)
    else:  # generate's rule: count real tokens; padding gets position 0
        positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    with torch.no_grad():
        if cache.sharding.invariant:  # same bits for any p: the dense layers see the same rows
            out = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=positions,
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            return out.logits[:, -1]
        if total:
            _sharded_step(model, input_ids, cache, attention_mask, positions, total)
        cache.sharding.history = positions[:, :total].clone()
        out = model(
            input_ids=input_ids[:, total:],
            attention_mask=attention_mask,
            position_ids=positions[:, total:],
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
    return out.logits[:, -1]


def _sharded_step(model, input_ids, cache, attention_mask, positions, total):
    """Run this rank's tokens of the prompt's first ``total`` into ``cache``."""
    step = plan(cache.sharding, total)
    mask = None if attention_mask is None else attention_mask[:, :total]
    # A rank without prompt tokens still joins every layer's collectives: it runs
    # one stand-in token (transformers cannot run an empty sequence) that it
    # neither stores nor sends, and whose output it discards.
    mine = step.mine.to(input_ids.device)
    if not mine.numel():
        mine = torch.zeros(1, dtype=torch.long, device=input_ids.device)
    with cache._prefilling(step):
        model(
            input_ids=input_ids[:, mine],
            attention_mask=mask,
            position_ids=positions[:, mine],
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
