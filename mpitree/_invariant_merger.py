"""Invariant mode's merger: gather every rank's canonical-tree pieces, finish the tree.

The :class:`~mpitree._merger.Merger` of invariant mode (``merger_for`` hands it
out), not a :class:`~mpitree._strategies.Strategy`: a rank sends a varying number of
records (its pieces, O(log) per run of adjacent blocks), not one fixed set.
Each rank sends ``capacity`` pieces after a 16-byte header (its failure flag
and piece count) in one ``MPI_Allgather``. ``capacity`` is the largest count of
the previous merge, which every rank read from the same headers: in steady
decoding that one collective is all. A rank with more pieces than that sends
the rest in a second collective (an ``MPI_Allgatherv`` whose counts every rank
read from the headers), and the capacity grows to fit.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ._guard import raise_failure
from ._invariant import canonical_root, pack, piece_bytes, unpack
from ._traffic import hook, traffic

_HEADER = 16  # bytes before a rank's pieces: its failure flag and piece count, two int64


class InvariantMerger:
    """Merges canonical-tree pieces of ``rows`` records ``D + 2`` wide across ``comm``, reusably.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        Checked and agreed on by the caller.
    rows, head_dim : int
        Records per piece and ``D``.
    acc : str
        Accumulation dtype name, "float32" or "float64".
    """

    strategy = "invariant"

    def __init__(self, comm, rows, head_dim, acc):
        self.comm, self.rows, self.head_dim, self.acc = comm, rows, head_dim, acc
        self.stride = piece_bytes(rows, head_dim, acc)
        self.capacity = 0
        self._grow(1)

    def _grow(self, capacity):
        """Size the send and receive buffers for ``capacity`` pieces per rank."""
        self.capacity = capacity
        self.send = np.zeros(_HEADER + capacity * self.stride, np.uint8)
        self.recv = np.empty((self.comm.Get_size(), self.send.size), np.uint8)

    def merge(self, local):
        """Run ``local()`` inside the guard, gather every rank's pieces; return the tree's root.

        Parameters
        ----------
        local : callable
            Returns this rank's pieces ``(levels, index, records)`` (see
            :func:`mpitree._invariant.local_pieces`); whatever it raises becomes
            this rank's verdict, carried by the gather's header.

        Returns
        -------
        numpy.ndarray
            ``(rows, D + 2)`` records of the canonical tree's root, the same bits
            on every rank.

        Raises
        ------
        Exception
            On every rank when any rank's local work failed, or two ranks hold
            the same block.

        Notes
        -----
        Under an observer on the phase hook (:data:`~._traffic.hook`), the
        call is its ``"merge"`` phase (its collective counts in it only).
        """
        observer = hook.observer
        if observer is not None and observer.enter("merge"):
            return observer.timed("merge", self.merge, local)
        cap, error = self.capacity, None
        try:
            mine = pack(*local())
            if mine.shape[1] != self.stride:
                raise RuntimeError(f"mpitree internal error: pieces of {mine.shape[1]} bytes")
            sent = mine[:cap].reshape(-1)
            self.send[_HEADER : _HEADER + sent.size] = sent
        except Exception as exc:  # the verdict rides in the header
            error, mine = exc, self.send[:0]
        if self.comm.Get_size() == 1:
            if error is not None:
                raise_failure(self.comm, error)
            return self._root(mine)
        count = len(mine)
        self.send[:_HEADER] = np.array([error is not None, count], np.int64).view(np.uint8)
        traffic.add(self.send.nbytes)
        self.comm.Allgather([self.send, MPI.BYTE], [self.recv, MPI.BYTE])
        headers = np.ascontiguousarray(self.recv[:, :_HEADER]).view(np.int64)
        if headers[:, 0].any():
            raise_failure(self.comm, error)
        counts = headers[:, 1]
        pieces = self.recv[:, _HEADER:].reshape(len(counts), cap, self.stride)
        parts = [pieces[r, : min(int(n), cap)] for r, n in enumerate(counts)]
        extra = np.maximum(counts - cap, 0)
        if extra.any():  # more pieces than last time somewhere: the rest, then grow
            sizes = extra * self.stride
            displs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
            more = np.empty((int(extra.sum()), self.stride), np.uint8)
            traffic.add(max(count - cap, 0) * self.stride)
            self.comm.Allgatherv(
                [np.ascontiguousarray(mine[cap:]), MPI.BYTE],
                [more, sizes.tolist(), displs.tolist(), MPI.BYTE],
            )
            parts.append(more)
        root = self._root(np.concatenate(parts))
        if int(counts.max()) != cap:  # the same on every rank: every rank read every header
            self._grow(max(int(counts.max()), 1))
        return root

    def _root(self, data):
        """Finish the canonical tree from packed pieces ``(k, stride)``."""
        rows, dim, acc = (self.rows,), self.head_dim, self.acc
        return canonical_root(*unpack(data, rows, dim, acc), rows, dim, acc)

    def free(self):
        """Nothing to release (no persistent request); for the merger interface."""

    def __repr__(self):
        return f"InvariantMerger(rows={self.rows}, D={self.head_dim}, {self.acc})"
