"""Sharded prefill's collectives: all-gather ranks' query rows, reduce-scatter their states.

Adapters reach them through :mod:`mpitree.extend`.

Every rank holds a different chunk of the prompt's queries. Each rank computes
the partial states of every rank's queries over its own keys; one
``MPI_Reduce_scatter`` with the native op hands each rank the merged states of
its own queries. Like every merge, the reduce-scatter carries a flag record per
destination, so a failure on any rank reaches every rank in the same collective.
"""

from __future__ import annotations

import numpy as np

from ._guard import raise_failure
from ._op import record_op
from ._state import empty_records
from ._traffic import traffic


def allgather_rows(comm, mine, counts, row_size):
    """All-gather each rank's rows, in rank order (one ``MPI_Allgatherv``).

    Collective over ``comm``; call it only after the agreement, on every rank, with
    agreed ``counts`` and ``row_size``. A rank whose own rows are unusable passes
    zeros of the agreed size and reports its failure in
    :func:`reduce_scatter_records`, so that every rank raises there.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        The agreed communicator.
    mine : numpy.ndarray
        ``(counts[rank], ...)``, C order, float32 or float64: this rank's rows.
    counts : list of int
        Rows per rank, the same on every rank.
    row_size : int
        Values per row (the product of ``mine.shape[1:]``).

    Returns
    -------
    numpy.ndarray
        ``(sum(counts), ...)``, ``mine``'s dtype: every rank's rows, rank 0's first.
    """
    every = np.empty((sum(counts), *mine.shape[1:]), dtype=mine.dtype)
    traffic.add(mine.nbytes)
    comm.Allgatherv(mine, [every, [c * row_size for c in counts]])
    return every


def reduce_scatter_records(comm, records, counts, rows_per_count, fill):
    """Merge every rank's partial states of all ranks' rows; return this rank's merged block.

    One ``MPI_Reduce_scatter`` with the (m, d, n) op, carrying a flag record per
    destination: whatever ``fill`` raises on any rank is raised on every rank.
    Collective over ``comm``; call it only after the agreement, with agreed
    ``counts`` and ``rows_per_count``.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        The agreed communicator.
    records : numpy.ndarray
        ``(sum(counts) * rows_per_count, D + 2)``, float32 or float64, C order:
        scratch that ``fill`` writes.
    counts : list of int
        Query blocks per rank, the same on every rank.
    rows_per_count : int
        Records per query block.
    fill : callable
        ``fill(records)`` writes this rank's partial states of every rank's query
        blocks, rank 0's first; it runs inside the guard.

    Returns
    -------
    numpy.ndarray
        ``(counts[rank] * rows_per_count, D + 2)``, ``records``' dtype: the merged
        states of this rank's own blocks.

    Raises
    ------
    Exception
        When ``fill`` raised on any rank: that rank raises its own exception, the
        others :class:`~mpitree.extend.RankError`.
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
