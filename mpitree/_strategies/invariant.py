"""``deterministic="invariant"``: all-gather every rank's canonical-tree pieces, finish the tree.

Not a :class:`~mpitree._strategies.Strategy`: the number of records a rank sends
varies (its pieces, O(log) per run of adjacent blocks), so it needs no merger.
Two collectives, like the ring: a header all-gather carrying every rank's
failure flag and piece count, then one ``MPI_Allgatherv`` of the pieces.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .._guard import raise_failure
from .._invariant import canonical_root, pack, piece_bytes, unpack
from .._traffic import traffic


def invariant_merge(comm, local, row_shape, head_dim, acc):
    """Run ``local()`` inside the guard, gather every rank's pieces, return the tree's root.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        Agreed on by the caller.
    local : callable
        Returns this rank's pieces ``(levels, index, records)`` (see
        :func:`mpitree._invariant.local_pieces`); whatever it raises becomes this
        rank's verdict, carried by the header all-gather.
    row_shape : tuple of int
        ``(B, Hq, Sq)``.
    head_dim : int
        ``D``.
    acc : str
        Accumulation dtype name.

    Returns
    -------
    numpy.ndarray
        ``(*row_shape, D + 2)`` records of the canonical tree's root, the same
        bits on every rank.
    """
    stride = piece_bytes(int(np.prod(row_shape)), head_dim, acc)
    error, mine = None, np.empty((0, stride), np.uint8)
    try:
        mine = pack(*local())
    except Exception as exc:  # the verdict rides in the header all-gather
        error = exc
    size = comm.Get_size()
    if size == 1:
        if error is not None:
            raise_failure(comm, error)
        return canonical_root(*unpack(mine, row_shape, head_dim, acc), row_shape, head_dim, acc)
    header = np.array([error is not None, len(mine)], np.int64)
    headers = np.empty((size, 2), np.int64)
    traffic.add(header.nbytes)
    comm.Allgather(header, headers)
    if headers[:, 0].any():
        raise_failure(comm, error)
    counts = headers[:, 1] * stride
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
    every = np.empty((int(headers[:, 1].sum()), stride), np.uint8)
    traffic.add(mine.nbytes)
    comm.Allgatherv([mine, MPI.BYTE], [every, counts.tolist(), displs.tolist(), MPI.BYTE])
    return canonical_root(*unpack(every, row_shape, head_dim, acc), row_shape, head_dim, acc)
