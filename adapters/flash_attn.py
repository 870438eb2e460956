"""mpitree for flash-attn: local attention from ``flash_attn_with_kvcache``, merged by the tree.

Each rank keeps its shard in a flash-attn KV cache (contiguous, or paged with a
``block_table``), computes its partial attention with
``flash_attn_with_kvcache(..., return_softmax_lse=True)``, and the per-row states
are merged across ranks by the core's shared merger (through its public
extension API, :mod:`mpitree.extend`; staged through pinned host memory for CUDA
tensors).

flash-attn's conventions, converted here at the edge:

- ``q`` and the output are ``(B, Sq, H, D)`` (sequence before heads); mpitree's
  states are ``(B, H, Sq, D + 2)``.
- ``softmax_lse`` is ``(B, H, Sq)`` float32, natural log (times ``softmax_scale``
  already applied to the scores).
- A row that sees no key (``cache_seqlens`` 0) gets output 0 and lse ``+inf``
  (``-inf`` on the split-KV path); both become mpitree's empty state.

Importing this module imports torch and flash_attn; ``import mpitree`` never does.
"""

from __future__ import annotations

from ._hint import missing

try:
    import torch
    from flash_attn import flash_attn_with_kvcache
except ImportError as exc:  # pragma: no cover - exercised only without flash-attn
    raise missing("mpitree.adapters.flash_attn", "flash_attn", exc) from exc

from mpitree import extend
from mpitree._namespace import namespace

__all__ = ["local_state", "records_from_lse", "tree_decode"]


def records_from_lse(out, lse):
    """Build mpitree records from flash-attn's ``(out, softmax_lse)``.

    Parameters
    ----------
    out : torch.Tensor
        ``(B, Sq, H, D)`` normalised attention output, any float dtype.
    lse : torch.Tensor
        ``(B, H, Sq)`` natural-log log-sum-exp of the scaled scores; ``+inf`` or
        ``-inf`` where a row saw no key, and also where its score sum was NaN
        (flash-attn's kernel then leaves the row's output unnormalised: NaN).

    Returns
    -------
    torch.Tensor
        ``(B, H, Sq, D + 2)`` float32 records ``[m, d, n]`` with ``m = lse``,
        ``d = 1``, ``n = out``; the empty state ``[-inf, 0, 0]`` for rows without keys;
        every field NaN (poisoned) for a NaN lse, or an infinite lse beside a NaN output.
    """
    n = out.transpose(1, 2).float()
    seen = torch.isfinite(lse)[..., None]
    poisoned = torch.isnan(lse)[..., None] | (~seen & torch.isnan(n).any(-1, keepdim=True))
    m = torch.where(seen, lse[..., None].float(), float("-inf"))
    rec = torch.cat([m, seen.float(), torch.where(seen, n, 0.0)], dim=-1)
    return torch.where(poisoned, float("nan"), rec)


def _check(q, k_cache, v_cache, cache_seqlens, block_table):
    """Validate flash-attn-layout inputs; return the :class:`mpitree.extend.Problem`."""
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(x, torch.Tensor) or x.ndim != 4:
            raise ValueError(f"{name} must be a 4-D torch.Tensor")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"q, k_cache, v_cache dtypes differ: {q.dtype}, {k_cache.dtype}")
    b, sq, hq, d = q.shape
    if k_cache.shape != v_cache.shape or k_cache.shape[-1] != d:
        raise ValueError(
            f"k_cache/v_cache shapes {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not "
            f"match q {tuple(q.shape)} (flash-attn layout: q (B, Sq, Hq, D), cache (B, S, Hkv, D))"
        )
    hkv = k_cache.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"q heads ({hq}) must be a multiple of kv heads ({hkv})")
    if block_table is None and k_cache.shape[0] != b:
        raise ValueError(f"k_cache batch {k_cache.shape[0]} != q batch {b} (no block_table)")
    if block_table is not None and (block_table.ndim != 2 or block_table.shape[0] != b):
        raise ValueError(f"block_table must be (B={b}, max_blocks), got {tuple(block_table.shape)}")
    if isinstance(cache_seqlens, torch.Tensor) and tuple(cache_seqlens.shape) != (b,):
        raise ValueError(f"cache_seqlens must have shape ({b},)")
    return extend.Problem.of(b, hq, hkv, d, sq, q.dtype)


def local_state(q, k_cache, v_cache, *, cache_seqlens=None, block_table=None, softmax_scale=None):
    """Compute this rank's ``(B, Hq, Sq, D + 2)`` float32 records with flash-attn.

    Parameters
    ----------
    q : torch.Tensor
        ``(B, Sq, Hq, D)`` float16/bfloat16 on a CUDA device.
    k_cache, v_cache : torch.Tensor
        ``(B, S, Hkv, D)``, or ``(num_blocks, page_size, Hkv, D)`` with ``block_table``.
    cache_seqlens : int or torch.Tensor, optional
        ``(B,)`` int32 valid keys per row of this rank's shard (0 allowed); keys
        past it are never read.
    block_table : torch.Tensor, optional
        ``(B, max_blocks)`` int32 page indices (paged KV cache).
    softmax_scale : float, optional
        Default ``D ** -0.5``.

    Every query sees every valid cached key of the shard (no causal alignment,
    which would be relative to each shard's end): append the step's new tokens to
    their owning rank's cache first.

    Returns
    -------
    torch.Tensor
        ``(B, Hq, Sq, D + 2)`` float32 records ``[m, d, n]`` (see :func:`records_from_lse`).
    """
    problem = _check(q, k_cache, v_cache, cache_seqlens, block_table)
    scale = extend.Options.resolve(problem.head_dim, scale=softmax_scale).scale
    return _records(q, k_cache, v_cache, cache_seqlens, block_table, scale)


def _records(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale):
    """Call flash-attn on validated inputs and convert its output to records."""
    if block_table is None and k_cache.shape[1] == 0:  # an empty shard: no kernel call
        b, sq, hq, d = q.shape
        empty = torch.zeros(b, hq, sq, d + 2, dtype=torch.float32, device=q.device)
        empty[..., 0] = float("-inf")
        return empty
    out, lse = flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        cache_seqlens=cache_seqlens,
        block_table=block_table,
        softmax_scale=softmax_scale,
        causal=False,
        return_softmax_lse=True,
    )
    return records_from_lse(out, lse)


@extend.entry_point
def tree_decode(
    q,
    k_cache,
    v_cache,
    comm=None,
    *,
    cache_seqlens=None,
    block_table=None,
    softmax_scale=None,
    strategy="auto",
    return_lse=False,
    deterministic=False,
):
    """Exact attention of ``q`` over every rank's flash-attn KV cache shard.

    Parameters are those of :func:`local_state`, plus ``comm``, ``strategy``
    (any of :data:`mpitree.STRATEGIES` but ``"ring"``, which needs K/V blocks
    rather than a paged cache), ``return_lse`` and ``deterministic`` as in
    :func:`mpitree.tree_decode`.

    Returns
    -------
    out : torch.Tensor
        ``(B, Sq, Hq, D)`` in q's dtype and device (flash-attn's layout); 0 for rows
        that see no key on any rank.
    lse : torch.Tensor
        ``(B, Hq, Sq)`` float32, natural log (with ``return_lse``).
    """
    comm = extend.check_comm(comm)

    def prepare():
        problem = _check(q, k_cache, v_cache, cache_seqlens, block_table)
        opts = extend.Options.resolve(
            problem.head_dim, strategy, softmax_scale, deterministic=deterministic
        )
        if opts.needs_kv:
            raise ValueError(f"the flash-attn adapter cannot run strategy={opts.strategy!r}")
        sig = {**problem.signature(), **opts.signature()}
        merge = (problem.rows, problem.head_dim, "float32", opts)
        return extend.Call(sig, (problem, opts), merge=merge)

    call, merger = extend.agree_merger(comm, prepare, like=q)
    problem, opts = call.payload

    def fill(records):
        rec = _records(q, k_cache, v_cache, cache_seqlens, block_table, opts.scale)
        records[...] = namespace(rec).to_numpy(rec).reshape(records.shape)

    records = merger.merge(fill).reshape(*problem.row_shape, -1)
    like = q.transpose(1, 2)
    result = extend.finish(records, like, return_lse, inputs=(q, k_cache, v_cache))
    if return_lse:
        return result[0].transpose(1, 2).contiguous(), result[1]
    return result.transpose(1, 2).contiguous()
