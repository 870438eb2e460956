"""Sharded prefill's collectives: all-gather ranks' query rows, reduce-scatter their states.

Every rank holds a different chunk of the prompt's queries. Each rank computes
the partial states of every rank's queries over its own keys; one
``MPI_Reduce_scatter`` with the native op hands each rank the merged states of
its own queries. Like every merge, the reduce-scatter carries a flag record per
destination, so a failure on any rank reaches every rank in the same collective.
"""

from __future__ import annotations

import numpy as np

from .._guard import raise_failure
from .._op import record_op
from .._state import empty_records
from .._traffic import traffic


def allgather_rows(comm, mine, counts, row_size):
    """All-gather each rank's ``(count, ...)`` float rows into ``(sum(counts), ...)``.

    ``mine`` must have ``counts[rank]`` rows of ``row_size`` values; a rank whose
    own rows are unusable passes zeros of that size and reports its failure in
    :func:`reduce_scatter_records`.
    """
    every = np.empty((sum(counts), *mine.shape[1:]), dtype=mine.dtype)
    traffic.add(mine.nbytes)
    comm.Allgatherv(mine, [every, [c * row_size for c in counts]])
    return every


def reduce_scatter_records(comm, records, counts, rows_per_count, fill):
    """Merge ``records`` of every rank's rows and return this rank's merged block.

    ``fill(records)`` writes this rank's partial states of all ``sum(counts)``
    query blocks, ``(sum(counts) * rows_per_count, D + 2)``; it runs inside the
    guard. Returns ``(counts[rank] * rows_per_count, D + 2)`` merged records.
    """
    width, rank = records.shape[-1], comm.Get_rank()
    error = None
    try:
        fill(records)
    except Exception as exc:  # the verdict rides in the reduce-scatter's flag records
        error = exc
        empty_records(records)
    sizes = [c * rows_per_count for c in counts]
    send = np.empty((sum(sizes) + len(sizes), width), dtype=records.dtype)
    start = 0
    for r, n in enumerate(sizes):
        at = start + r
        send[at : at + n] = records[start : start + n]
        send[at + n, 0] = 1 if error is not None else -np.inf
        send[at + n, 1:] = 0
        start += n
    recv = np.empty((sizes[rank] + 1, width), dtype=records.dtype)
    dtype, op = record_op(records.dtype, width)
    traffic.add(send.nbytes)
    comm.Reduce_scatter([send, dtype], [recv, dtype], [n + 1 for n in sizes], op)
    if not np.isneginf(recv[-1, 0]):
        raise_failure(comm, error)
    return recv[:-1]
