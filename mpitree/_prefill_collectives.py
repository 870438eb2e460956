"""Sharded prefill's collectives: all-gather ranks' rows, reduce-scatter their states.

Adapters reach :func:`allgather_rows` through :mod:`mpitree.extend`.

Every rank holds a different chunk of the prompt's queries, keys and values.
Either every rank's keys and values are all-gathered and each rank attends its
own queries (what the transformers adapter does), or every rank's queries are:
each rank then computes the partial states of all of them over its own keys,
and one ``MPI_Reduce_scatter_block`` with the native op hands each rank the
merged states of its own queries. Like every merge, the reduce-scatter carries a flag per
destination, so a failure on any rank reaches every rank in the same collective.
Both collectives work in caller-owned buffers, so that a prefill can allocate them
once and reuse them in every layer.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ._guard import raise_failure
from ._op import record_op
from ._state import FLAG_CLEAR, FLAG_FAILED, M, empty_records
from ._traffic import traffic


def allgather_rows(comm, mine, counts, row_size, out=None):
    """All-gather each rank's rows, in rank order (one ``MPI_Allgatherv``).

    Collective over ``comm``; call it only after the agreement, on every rank, with
    agreed ``counts`` and ``row_size``. A rank whose own rows are unusable passes
    zeros of the agreed size and reports its failure in the collective that
    follows (:func:`reduce_scatter_records`, or a
    :func:`~mpitree.extend.flagged_allreduce`), so that every rank raises there.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        The agreed communicator.
    mine : numpy.ndarray or None
        ``(counts[rank], ...)``, C order, float32 or float64: this rank's rows. None
        gathers in place: this rank's rows already sit in ``out`` at its offset
        (``sum(counts[:rank])``).
    counts : list of int
        Rows per rank, the same on every rank.
    row_size : int
        Values per row (the product of ``mine.shape[1:]``).
    out : numpy.ndarray, optional
        ``(sum(counts), ...)``, C order, ``mine``'s dtype: the buffer to gather into
        (required when ``mine`` is None). Default: a new array.

    Returns
    -------
    numpy.ndarray
        ``(sum(counts), ...)``: every rank's rows, rank 0's first (``out`` when given).

    Raises
    ------
    ValueError
        ``mine`` or ``out`` not C-ordered with the size ``counts`` and ``row_size``
        give, or of different dtypes (before any communication).
    """
    if out is None:
        if mine is None:
            raise ValueError("allgather_rows: gathering in place (mine=None) needs out")
        out = np.empty((sum(counts), *mine.shape[1:]), dtype=mine.dtype)
    _check_buffer("out", out, sum(counts) * row_size, out.dtype if mine is None else mine.dtype)
    if mine is not None:
        _check_buffer("mine", mine, counts[comm.Get_rank()] * row_size, out.dtype)
    traffic.add(counts[comm.Get_rank()] * row_size * out.itemsize)
    comm.Allgatherv(MPI.IN_PLACE if mine is None else mine, [out, [c * row_size for c in counts]])
    return out


def scatter_layout(counts):
    """Return the padded layout of :func:`reduce_scatter_records`' send buffer.

    Every rank's blocks get the same number of slots, ``max(counts) + 1``: its own
    blocks first, then empty padding, then one flag slot. Rank ``r``'s ``k``-th
    block sits at slot ``r * per_rank + k``.

    Parameters
    ----------
    counts : list of int
        Query blocks per rank, the same on every rank.

    Returns
    -------
    per_rank : int
        Slots per rank, ``max(counts) + 1``.
    slots : numpy.ndarray
        ``(sum(counts),)`` int64: the slot of every block, in rank-major order.
    """
    per_rank = max(counts) + 1
    slots = [r * per_rank + k for r, c in enumerate(counts) for k in range(c)]
    return per_rank, np.asarray(slots, dtype=np.int64)


def reduce_scatter_records(comm, send, counts, fill, recv=None):
    """Merge every rank's partial states of all ranks' blocks; return this rank's merged blocks.

    One ``MPI_Reduce_scatter_block`` with the (m, d, n) op over the padded layout of
    :func:`scatter_layout`, whose flag slots carry the verdict: whatever ``fill``
    raises on any rank is raised on every rank. Collective over ``comm``; call it
    only after the agreement, with agreed ``counts`` and block shape.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        The agreed communicator.
    send : numpy.ndarray
        ``(p, per_rank, R, D + 2)``, float32 or float64, C order, ``per_rank`` from
        :func:`scatter_layout`: scratch; ``fill`` writes the blocks, this function
        the padding and the flags.
    counts : list of int
        Query blocks per rank, the same on every rank.
    fill : callable
        ``fill(send)`` writes this rank's partial states of every rank's blocks,
        block ``k`` of rank ``r`` at ``send[r, k]``, ``k < counts[r]``; it runs
        inside the guard.
    recv : numpy.ndarray, optional
        ``(per_rank, R, D + 2)``, ``send``'s dtype, C order: where to receive.
        Default: a new array.

    Returns
    -------
    numpy.ndarray
        ``(counts[rank], R, D + 2)``, a view of ``recv``: the merged states of this
        rank's own blocks.

    Raises
    ------
    ValueError
        ``send`` not ``(p, max(counts) + 1, R, D + 2)`` and C-ordered, or ``recv`` not
        its ``send[0]``'s size and dtype (before any communication).
    Exception
        When ``fill`` raised on any rank: that rank raises its own exception, the
        others :class:`~mpitree.RankError`.
    """
    rank, width = comm.Get_rank(), send.shape[-1]
    if send.ndim != 4 or send.shape[:2] != (comm.Get_size(), max(counts) + 1):
        raise ValueError(
            f"reduce_scatter_records: send must be (p, max(counts) + 1, R, D + 2) = "
            f"({comm.Get_size()}, {max(counts) + 1}, R, D + 2), got {send.shape}"
        )
    _check_buffer("send", send, send.size, send.dtype)
    if recv is None:
        recv = np.empty(send.shape[1:], dtype=send.dtype)
    _check_buffer("recv", recv, send.size // len(send), send.dtype)
    error = None
    try:
        fill(send)
    except Exception as exc:  # the verdict rides in the reduce-scatter's flag slots
        error = exc
        empty_records(send)
    for r, c in enumerate(counts):
        empty_records(send[r, c:])  # padding and flag slot: the identity
    send[:, -1, 0, M] = FLAG_FAILED if error is not None else FLAG_CLEAR
    dtype, op = record_op(send.dtype, width)
    traffic.add(send.nbytes)
    comm.Reduce_scatter_block([send, dtype], [recv, dtype], op)
    if recv[-1, 0, M] != FLAG_CLEAR:
        raise_failure(comm, error)
    return recv[: counts[rank]]


def _check_buffer(name, array, size, dtype):
    """Raise ValueError unless ``array`` is a C-ordered numpy array of ``size`` ``dtype`` values.

    Its size and dtype follow from agreed arguments: a wrong one is wrong on every
    rank alike, and MPI would abort on it or fill it with another dtype's bytes.
    """
    if (
        not isinstance(array, np.ndarray)
        or array.size != size
        or array.dtype != dtype
        or not array.flags.c_contiguous
    ):
        got = f"{type(array).__name__} {getattr(array, 'shape', '')} {getattr(array, 'dtype', '')}"
        raise ValueError(f"{name} must be C-ordered {np.dtype(dtype)}, {size} values; got {got}")
