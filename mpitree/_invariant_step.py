"""Invariant mode's share of a step: the kernel arithmetic ranks agree on, a shard's pieces."""

from __future__ import annotations

from ._invariant import check_placement, leaf_records, local_pieces
from ._kernel import kernel_arithmetic


def invariant_signature(signature):
    """Invariant mode: add the local kernel's arithmetic, whose bits every rank must share."""
    signature["kernel"] = kernel_arithmetic()
    return signature


def check_arithmetic(agreed):
    """Raise unless this thread's arithmetic is still ``agreed`` (a plan's, at its agreement).

    A plan agrees once: a rank whose floating-point mode changed since (flush-to-zero
    set) would round apart. Called inside the step's guard, so every rank raises.
    """
    now = kernel_arithmetic()
    if now != agreed:
        raise ValueError(
            f"mpitree: this rank's arithmetic is now {now!r}, not the {agreed!r} the plan "
            "agreed on (was the floating-point mode changed, e.g. flush-to-zero?); restore "
            "it or make a new plan"
        )


def invariant_pieces(step, block_size, kv_start, kv_blocks, acc):
    """Invariant mode: this shard's leaf states reduced to its canonical-tree pieces."""
    blocks = check_placement(int(step.k.shape[2]), block_size, kv_start, kv_blocks)
    return local_pieces(blocks, leaf_records(step, block_size, len(blocks), acc))


def _placement_unused(kv_start, kv_blocks, records=None):
    """Raise if a placement is given outside invariant mode (``records``: a merge's, unused)."""
    if kv_start is not None or kv_blocks is not None:
        raise ValueError("kv_start and kv_blocks are only used with deterministic='invariant'")
