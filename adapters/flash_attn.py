"""mpitree for flash-attn: local attention from ``flash_attn_with_kvcache``, merged by the tree.

Each rank keeps its shard in a flash-attn KV cache (contiguous, or paged with a
``block_table``), computes its partial attention with
``flash_attn_with_kvcache(..., return_softmax_lse=True)``, and the per-row states
are merged across ranks by the core's reduction (through
:mod:`mpitree.adapters.torch`: host-staged for CUDA tensors).

flash-attn's conventions, converted here at the edge:

- ``q`` and the output are ``(B, Sq, H, D)`` (sequence before heads); mpitree's
  states are ``(B, H, Sq, D + 2)``.
- ``softmax_lse`` is ``(B, H, Sq)`` float32, natural log (times ``softmax_scale``
  already applied to the scores).
- A row that sees no key (``cache_seqlens`` 0) gets output 0 and lse ``+inf``
  (``-inf`` on the split-KV path); both become mpitree's empty state.

Importing this module imports torch and flash_attn; ``import mpitree`` never does.
"""

try:
    import torch
    from flash_attn import flash_attn_with_kvcache
except ImportError as exc:  # pragma: no cover - exercised only without flash-attn
    raise ImportError(
        "mpitree.adapters.flash_attn needs torch and flash-attn: pip install 'mpitree[flash-attn]'"
    ) from exc

from mpitree._plan import checked_call
from mpitree._validate import Shapes

from . import torch as mt

__all__ = ["local_state", "records_from_lse", "tree_decode"]


def records_from_lse(out, lse):
    """Build mpitree records from flash-attn's ``(out, softmax_lse)``.

    Parameters
    ----------
    out : torch.Tensor
        ``(B, Sq, H, D)`` normalised attention output, any float dtype.
    lse : torch.Tensor
        ``(B, H, Sq)`` natural-log log-sum-exp of the scaled scores; ``+inf`` or
        ``-inf`` where a row saw no key.

    Returns
    -------
    torch.Tensor
        ``(B, H, Sq, D + 2)`` float32 records ``[m, d, n]`` with ``m = lse``,
        ``d = 1``, ``n = out``; the empty state ``[-inf, 0, 0]`` for rows without keys.
    """
    seen = torch.isfinite(lse)[..., None]
    m = torch.where(
        seen, lse[..., None].float(), torch.full_like(seen, float("-inf"), dtype=torch.float32)
    )
    n = torch.where(seen, out.transpose(1, 2).float(), torch.zeros((), device=out.device))
    return torch.cat([m, seen.float(), n], dim=-1)


def _check(q, k_cache, v_cache, cache_seqlens, block_table):
    """Validate flash-attn-layout inputs; return (B, Hq, Hkv, Sq, D)."""
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(x, torch.Tensor) or x.ndim != 4:
            raise ValueError(f"{name} must be a 4-D torch.Tensor")
    b, sq, hq, d = q.shape
    if k_cache.shape != v_cache.shape or k_cache.shape[-1] != d:
        raise ValueError(
            f"k_cache/v_cache shapes {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not "
            f"match q {tuple(q.shape)}"
        )
    hkv = k_cache.shape[2]
    if hq % hkv:
        raise ValueError(f"q heads ({hq}) must be a multiple of kv heads ({hkv})")
    if block_table is None and k_cache.shape[0] != b:
        raise ValueError(f"k_cache batch {k_cache.shape[0]} != q batch {b} (no block_table)")
    if block_table is not None and (block_table.ndim != 2 or block_table.shape[0] != b):
        raise ValueError(f"block_table must be (B={b}, max_blocks), got {tuple(block_table.shape)}")
    if isinstance(cache_seqlens, torch.Tensor) and tuple(cache_seqlens.shape) != (b,):
        raise ValueError(f"cache_seqlens must have shape ({b},)")
    return b, hq, hkv, sq, d


def local_state(q, k_cache, v_cache, *, cache_seqlens=None, block_table=None, softmax_scale=None):
    """Compute this rank's ``(B, Hq, Sq, D + 2)`` float32 records with flash-attn.

    Parameters
    ----------
    q : torch.Tensor
        ``(B, Sq, Hq, D)`` float16/bfloat16 on a CUDA device.
    k_cache, v_cache : torch.Tensor
        ``(B, S, Hkv, D)``, or ``(num_blocks, page_size, Hkv, D)`` with ``block_table``.
    cache_seqlens : int or torch.Tensor, optional
        ``(B,)`` int32 valid keys per row of this rank's shard (0 allowed).
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
    _check(q, k_cache, v_cache, cache_seqlens, block_table)
    return _records(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale)


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

    def inspect():
        if strategy == "ring":
            raise ValueError("the flash-attn adapter cannot run strategy='ring'")
        b, hq, hkv, sq, d = _check(q, k_cache, v_cache, cache_seqlens, block_table)
        return Shapes(b, hq, hkv, sq, d, q.dtype)

    comm, _, scale, _ = checked_call(
        comm,
        q,
        k_cache,
        v_cache,
        scale=softmax_scale,
        kv_len=None,
        q_pos=None,
        k_pos=None,
        mask=None,
        strategy=strategy,
        deterministic=deterministic,
        inspect=inspect,
    )
    records = _records(q, k_cache, v_cache, cache_seqlens, block_table, scale)
    merged = mt._merge(records, comm, strategy, deterministic)
    result = mt._finish(merged, q, return_lse)
    if return_lse:
        return result[0].transpose(1, 2).contiguous(), result[1]
    return result.transpose(1, 2).contiguous()
