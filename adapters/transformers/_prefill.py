"""Sharded prefill: each rank runs only its own prompt tokens through the model."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np
import torch
from mpi4py import MPI

from mpitree import extend
from mpitree._options import acc_name, dtype_name

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


def reserve(prefill_step, rows, dtype):
    """Return the prefill's all-gather buffer for key rows ``(B, Hkv, D)`` of ``dtype``, made once.

    Returns ``(N, 2, B, Hkv, D)``: every rank's keys and values, rank-major (the
    order of ``prefill_step.queries``), in their own dtype (a name): float16 and
    bfloat16 as int16 bits (:func:`_keys_values` reads them back), which numpy and
    MPI move unchanged, so a 2-byte model hands the link half the bytes of float32.
    The step's agreement calls it first, in its local checks, so that running out
    of memory on one rank raises on every rank there, not in the all-gather that
    follows; every layer then finds it (the step's layers share the agreed shapes).
    """
    carrier = "int16" if dtype in _TWO_BYTES else dtype
    return _scratch(prefill_step, "keys and values", (prefill_step.total, 2, *rows), carrier)


_TWO_BYTES = ("float16", "bfloat16")


def _keys_values(rows, dtype):
    """Return gathered rows of :func:`reserve`'s buffer as a tensor of ``dtype`` (shared)."""
    held = torch.from_numpy(rows)
    return held.view(getattr(torch, dtype)) if dtype in _TWO_BYTES else held


def sharded_attention(query, step):
    """Causal attention for this rank's chunk of queries over every rank's keys.

    One ``Allgatherv`` (in place) hands every rank every rank's keys and values;
    each rank then attends its own queries over all of them, locally and exactly,
    and one flag all-reduce carries every rank's verdict. Under GQA the keys and
    values are fewer bytes than the queries and partial states that the merge
    would move (Llama-3.1-8B: a quarter; half of the queries alone), and they need
    no merge. A rank whose layer does not match the step's agreement sends zeros
    and reports its failure in the flag, so every rank raises. Returns
    ``(B, Sq, Hq, D)``.
    """
    sharding = step.view.layer.sharding
    prefill_step, comm = sharding.pending, sharding.comm
    b, hq, sq, d = (int(s) for s in query.shape)
    agreed = step.agreed.signature
    counts = prefill_step.counts
    own = counts[sharding.rank]  # sq, or 0 under a stand-in token
    dtype = agreed["dtype"]  # agreed: not this layer's own (may differ here)
    rows = (agreed["batch"], agreed["kv_heads"], agreed["head_dim"])
    every = reserve(prefill_step, rows, dtype)
    start = sum(counts[: sharding.rank])
    mine = _keys_values(every[start : start + own], dtype)
    problem = out = None
    try:
        step.check()
        key, value = step.key, step.value
        if own > sq or tuple(key.shape) != (*rows[:2], own, rows[2]) or key.shape != value.shape:
            raise ValueError(f"prefill: this layer's keys {tuple(key.shape)} do not match")
        if not torch.equal(step.view.layer.positions.cpu(), prefill_step.mine):
            raise ValueError("prefill: this rank's cached tokens are not the ones it prefills")
        mine[:, 0].copy_(key.permute(2, 0, 1, 3))
        mine[:, 1].copy_(value.permute(2, 0, 1, 3))
    except Exception as exc:  # its verdict rides in the flag below
        problem = exc
        mine.zero_()
    extend.allgather_rows(comm, None, counts, every[0].size, out=every)
    if problem is None:
        try:
            out = _attend(query[:, :, :own], step, prefill_step, _keys_values(every, dtype))
        except Exception as exc:
            problem = exc
    extend.flagged_allreduce(comm, np.zeros(0, np.float32), MPI.MAX, problem)
    return torch.cat([out, out.new_zeros(b, sq - own, hq, d)], 1) if own < sq else out


def _attend(query, step, prefill_step, gathered):
    """Return ``(B, Sq, Hq, D)``: ``query`` (this rank's) over every gathered key, exactly.

    ``gathered`` is :func:`reserve`'s buffer as a tensor of the keys' dtype.
    """
    b, hq, own, d = (int(s) for s in query.shape)
    if not own:
        return query.new_zeros(b, 0, hq, d)
    order = prefill_step.scratch.get("order")
    if order is None:  # rank-major to global order
        order = prefill_step.scratch["order"] = torch.argsort(prefill_step.queries)
    # (B, Hkv, N, D), contiguous, keys in global order (one copy each, in their own dtype:
    # the staircase widens them to float32 itself, the general kernel takes them as they are)
    k, v = (gathered[:, i].permute(1, 2, 0, 3).index_select(2, order) for i in (0, 1))
    att = step.prepare(query, k, v)
    acc = acc_name(dtype_name(k.dtype))
    records = torch.empty((b, hq, own, d + 2), dtype=getattr(torch, acc)).numpy()  # 4 KiB pages
    keys = torch.arange(k.shape[2])
    known = None
    if acc == "float32" and staircase.available(query):
        known = _key_rows(step, prefill_step, keys)
    if known is not None:
        out = torch.from_numpy(records)
        # interleaved, c of this rank's queries span about c * p positions, and so does a
        # chunk's band: CHUNK // p keeps it at about CHUNK keys (8K on 2 ranks, one
        # thread: 2.98-2.99 s at 192 queries a chunk, 3.07-3.16 s at 384)
        chunk = max(1, staircase.CHUNK // len(prefill_step.counts))
        mine = prefill_step.mine
        staircase.staircase_records(query, k, v, att.scale, mine, keys, known, out=out, chunk=chunk)
    else:  # windows, per-head masks, float64: the general kernel
        att = step.built()
        att.k, att.v = (x.to(query.device, step.key.dtype) for x in (k, v))
        att.fill(records)
    inputs = (step.query, step.key, step.value)
    return extend.finish(records, query, layout="bshd", inputs=inputs)


def _key_rows(step, prefill_step, keys):
    """Return the staircase's ``(B|1, N)`` key rows of the step's visibility, or None.

    The causal recipe gives them with no mask built. A built mask (a window, which
    may be causal over a short prompt) is checked once per visibility object: the
    step's layers share it, so the check runs in the first layer only.
    """
    known = step.causal_keys()
    if known is not None:
        return known
    vis = step.built().vis
    held = prefill_step.scratch.get("key rows")
    if held is None or held[0] is not vis:
        held = vis, staircase.key_rows(vis, prefill_step.mine, keys)
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
    is split ``p`` ways; in each layer, every rank's keys and values are
    all-gathered and each rank attends its own queries over them. The last
    token then runs as an ordinary step on every
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
    Exception
        On every rank, when a layer fails on any rank (that rank raises its own
        exception, the others :class:`~mpitree.RankError`); the cache is then
        left empty. A failure on one rank outside attention (its dense layers) leaves
        the other ranks waiting in the next layer's collective.
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
    try:
        with torch.no_grad():
            return _run(model, input_ids, cache, attention_mask, positions, total)
    except Exception:  # raised on every rank (a flag or a step's guard): leave the cache empty
        cache.reset()
        raise


def _run(model, input_ids, cache, attention_mask, positions, total):
    """Run the prompt into ``cache``; return the logits after its last token."""
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
