"""A StaticShardedCache's decode step: agreed on host facts, attended on the device.

The step's first layer runs its one agreement over what the host knows without
reading the device (shapes, dtypes, options, the cache's host length and edits,
whether a stream captures): it can run while a CUDA graph captures. Every layer
then runs the Triton kernel over its buffers' whole capacity with the device
``kv_len`` into records made once per layer, and finishes its output into a
buffer made once too. One rank: the records never leave the device (the merge of
one rank is the identity). Several ranks: the records go down into the cache's
own merger in one copy, merge in its MPI collective, and come up in one copy.
"""

from __future__ import annotations

import torch
from transformers.masking_utils import causal_mask_function

from mpitree import extend
from mpitree._namespace import namespace
from mpitree._options import dtype_name
from mpitree._registry import AUTO, host_strategies, needs_kv

from .. import torch as adapter

GRAPH_NEEDS_ONE_RANK = (
    "StaticShardedCache: a CUDA graph cannot hold a decode step over several ranks: its "
    "records merge in an MPI collective on the host (capture at one rank; "
    "docs/frameworks.md, 'CUDA graphs')"
)


def attend(view, query, key, value, mask, scaling):
    """Return the ``(B, 1, Hq, D)`` output of a static decode step's layer (its own buffer).

    The step's first layer agrees on it first (a failure leaves the cache as it
    was, on every rank); a later layer is held to that agreement, inside the merge
    at several ranks.
    """
    layer = view.layer
    agreed = view.step
    if agreed.signature is None:  # the step's first attention call: every rank is here
        try:
            _agree(view, query, key, value, mask, scaling)
        except Exception:
            layer.rollback(view)
            raise
    merger = agreed.merger
    if merger is None:  # one rank: kernels only
        _check(view, query, mask, scaling)
        return _refused(_records(layer, query, agreed.scale)[1], query)
    host = layer.capacity.host

    def local(records):
        _check(view, query, mask, scaling)
        host.copy_(_records(layer, query, agreed.scale)[0])  # the one copy down

    merger.merge(local)
    rec, out, _, _ = layer.work
    rec.copy_(host)  # the one copy up
    adapter._triton().finish_output(rec.transpose(1, 2), out.dtype, out)
    return _refused(out, query)


def _refused(out, query):
    """``out``, tied under grad mode to ``query`` (if it needs grad) by a backward that raises.

    The query alone: K and V are views of the cache's buffers, which autograd does not
    let a Function take once a step wrote them in place.
    """
    if torch.is_grad_enabled():  # never while decoding under no_grad (nor in a graph)
        return namespace(out).refuse_gradient((out,), (query,))[0]
    return out


def _check(view, query, mask, scaling):
    """Raise unless this layer's step is the one agreed (its update, query, mask, scaling)."""
    if view.error is not None:
        raise view.error
    cap = view.layer.capacity
    facts = cap.facts
    if (
        mask is not cap.mask
        or (query.shape, query.dtype, query.device) != facts[0]
        or (scaling.hex() if type(scaling) is float else scaling) != facts[3]
    ):
        raise ValueError(
            "StaticShardedCache: this layer's query, mask or scaling differs from the step's "
            f"first layer's ({tuple(query.shape)} {query.dtype}, scaling {scaling!r})"
        )


def _records(layer, query, scale):
    """Run the kernel into the layer's records (and, at one rank, its output); return the work."""
    kernel = adapter._triton()
    work = layer.work
    if work is None or work[3] is not layer.capacity.facts:  # made once per layer and facts
        work = layer.work = _work(query, layer.capacity.facts)
    rec, out, scratch, _ = work
    keys, values = layer.whole
    lens = layer.counters[1]
    vis = layer.capacity.vis
    kernel.decode_records(query, keys, values, scale, lens, vis, rec, scratch=scratch)
    if layer.capacity.merger is None:
        kernel.finish_output(rec.transpose(1, 2), out.dtype, out)
    return work


def _facts(query, key, value, mask, scaling, sharding):
    """Return the host facts a step is checked under: the same facts, the same verdict."""
    padding = getattr(mask, "padding", None)
    return (
        (query.shape, query.dtype, query.device),
        (type(query), type(key), type(value)),
        (key.shape, key.dtype, key.device, value.shape, value.dtype, value.device),
        scaling.hex() if type(scaling) is float else scaling,
        None if mask is None else (type(mask), getattr(mask, "mask_function", None)),
        None if padding is None else (padding.shape, padding.dtype, padding.device),
        sharding.strategy,
        sharding.deterministic,
        sharding.placement,
        sharding.block_size,
    )


def _checked(query, key, value, mask, scaling, sharding):
    """Check a static decode step's tensors and mask; return its options and signature."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor) or x.ndim != 4:
            raise TypeError(f"StaticShardedCache: {name} must be a 4-D torch tensor")
    b, hq, sq, d = (int(s) for s in query.shape)
    hkv = int(key.shape[1])
    if sq != 1 or hkv == 0 or hq % hkv or tuple(key.shape[::3]) != (b, d):
        raise ValueError(
            f"StaticShardedCache: a decode step attends one query (B, Hq, 1, D) over keys "
            f"(B, Hkv, T, D) with Hq % Hkv == 0; got {tuple(query.shape)}, {tuple(key.shape)}"
        )
    if value.shape != key.shape or not query.dtype == key.dtype == value.dtype:
        raise ValueError("StaticShardedCache: query, key and value must share dtype and shapes")
    if not query.device == key.device == value.device:
        raise ValueError("StaticShardedCache: query, key and value must be on one device")
    if mask is not None and getattr(mask, "mask_function", None) is not causal_mask_function:
        raise ValueError(
            "StaticShardedCache attends causally only (no sliding window, no 4-D mask): "
            f"got {type(mask).__name__}"
        )
    padding = getattr(mask, "padding", None)
    if padding is not None and (
        padding.dtype != torch.bool or padding.ndim != 2 or padding.shape[0] != b
    ):
        raise ValueError(f"StaticShardedCache: a padding mask must be (B, T) bool, got {padding}")
    if mask is not None and mask.batch_size != b:
        raise ValueError(f"mask built for batch {mask.batch_size}, inputs have {b}")
    opts = extend.Options.resolve(
        d, sharding.strategy, scaling, sharding.deterministic, node_size=0
    )
    if needs_kv(opts.strategy):
        raise ValueError(
            f"StaticShardedCache merges records: strategy {opts.strategy!r} is not supported"
        )
    if opts.strategy != AUTO and opts.strategy not in host_strategies():
        raise ValueError(
            f"StaticShardedCache merges its records from host memory: strategy "
            f"{opts.strategy!r} merges device buffers only"
        )
    signature = {
        "cache": "StaticShardedCache",
        "batch": b,
        "q_heads": hq,
        "kv_heads": hkv,
        "head_dim": d,
        "dtype": dtype_name(query.dtype),
        "padding": padding is not None,
        "scaling": None if scaling is None else float(scaling),
        "strategy": sharding.strategy,
        "deterministic": sharding.deterministic,
        "placement": sharding.placement,
        "block_size": sharding.block_size,
    }
    return opts, signature


def _agree(view, query, key, value, mask, scaling):
    """Run the step's one agreement on host facts; make the merger and work it needs."""
    layer = view.layer
    sharding, cap = layer.sharding, layer.capacity
    ranks = sharding.size
    capturing = query.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    state = {}

    def prepare():
        if view.error is not None:
            raise view.error
        if capturing and ranks > 1:
            raise RuntimeError(GRAPH_NEEDS_ONE_RANK)
        facts = _facts(query, key, value, mask, scaling, sharding)
        if facts != cap.facts:
            state["checked"] = facts, *_checked(query, key, value, mask, scaling, sharding)
        opts, signature = state["checked"][1:] if state else (cap.opts, cap.signature)
        padding = getattr(mask, "padding", None)
        if padding is not None and padding.shape[-1] < cap.size:  # gathered over the capacity
            raise ValueError(
                f"StaticShardedCache: the padding mask covers {padding.shape[-1]} keys, not "
                f"its max_cache_len={cap.size}"
            )
        merge = None
        fresh = ranks > 1 and (bool(state) or cap.merger is None)
        if fresh:
            b, hq, _, d = (int(s) for s in query.shape)
            merge = (b * hq, d, "float32", opts)
        counts = {"cached tokens": view.start, "cache edits": sharding.edits}
        signature = {**signature, "new merger": bool(fresh)}
        code = ("StaticShardedCache step", facts, fresh)
        return extend.Call(signature, opts, merge=merge, key=code, counts=counts)

    like = None if query.is_cpu or ranks == 1 else query  # CUDA records merge from pinned memory
    call, merger = extend.agree_merger(sharding.comm, prepare, like=like, owned=True)
    if state:  # checked anew: keep the verdict for the same facts
        cap.facts, cap.opts, cap.signature = state["checked"]
    if merger is not None:  # this rank's records, as the kernel's records are shaped
        cap.merger, cap.host = merger, torch.from_numpy(merger.records).view(*query.shape[:3], -1)
    cap.mask = mask
    padding = getattr(mask, "padding", None)
    if padding is None:
        cap.vis = None
    else:  # the keys the padding hides, over the shard's whole capacity (its first layer's)
        cap.vis = _visibility(layer, padding, cap)
    step = view.step
    step.signature, step.scale, step.merger = call.signature, call.payload.scale, cap.merger


def _visibility(layer, padding, cap):
    """Write ``(B, 1, 1, T)`` bool: which of the shard's slots the padding leaves visible."""
    positions = layer.buffers[2].narrow(0, 0, layer.whole[0].shape[2])
    vis = cap.vis
    b, t = int(padding.shape[0]), int(positions.shape[0])
    if vis is None or vis.shape != (b, 1, 1, t) or vis.device != padding.device:
        vis = torch.empty(b, t, dtype=torch.bool, device=padding.device).view(b, 1, 1, t)
    torch.index_select(padding, 1, positions, out=vis.view(b, t))
    return vis


def _work(query, facts):
    """Return a layer's ``(records, output, kernel scratch, facts)`` for ``query``'s shape."""
    b, hq, sq, d = (int(s) for s in query.shape)
    rec = torch.empty((b, hq, sq, d + 2), dtype=torch.float32, device=query.device)
    out = torch.empty((b, sq, hq, d), dtype=query.dtype, device=query.device)
    return rec, out, {}, facts
