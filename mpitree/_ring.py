"""Ring Attention decode baseline: K/V blocks travel the ring in p - 1 steps."""

import numpy as np
from mpi4py import MPI

from ._local import attend
from ._records import merge_records
from ._traffic import traffic


def ring_reduce(comm, q, k, v, scale, lens, vis, records, failed):
    """Fill ``records`` with the state of q over every rank's K/V; return a failing rank or None.

    Each block travels with its ragged lengths (int64 ``(B,)``) and, if it has one,
    its visibility array. Every rank computes the state of every block as it
    passes and merges the p block states in rank order, so all ranks get bitwise
    identical results.
    """
    p, r = comm.Get_size(), comm.Get_rank()
    t = 0 if failed else k.shape[2]
    header = np.array([t, 0 if vis is None or failed else vis.shape[1], failed], dtype=np.int64)
    headers = np.empty((p, 3), dtype=np.int64)
    traffic.add(header.nbytes)
    comm.Allgather(header, headers)
    bad = np.flatnonzero(headers[:, 2])
    if bad.size:
        return int(bad[0])
    b, hkv, _, dim = k.shape
    sq = q.shape[2]
    parts = np.empty((p, *records.shape), dtype=records.dtype)
    own_lens = np.full(b, t, dtype=np.int64) if lens is None else lens
    attend(q, k, v, scale, own_lens, vis, parts[r])
    block = (np.ascontiguousarray(k), np.ascontiguousarray(v), own_lens, vis)
    left, right = (r - 1) % p, (r + 1) % p
    for step in range(1, p):
        src = (r - step) % p
        ts, vheads = int(headers[src, 0]), int(headers[src, 1])
        new = (
            np.empty((b, hkv, ts, dim), dtype=k.dtype),
            np.empty((b, hkv, ts, dim), k.dtype),
            np.empty(b, dtype=np.int64),
            np.empty((b, vheads, sq, ts), dtype=bool) if vheads else None,
        )
        reqs = []
        for tag, (out_buf, in_buf) in enumerate(zip(block, new)):
            if in_buf is not None:
                reqs.append(comm.Irecv([in_buf, MPI.BYTE], left, tag))
            if out_buf is not None:
                traffic.add(out_buf.nbytes)
                reqs.append(comm.Isend([out_buf, MPI.BYTE], right, tag))
        MPI.Request.Waitall(reqs)
        attend(q, *new[:2], scale, new[2], new[3], parts[src])
        block = new
    records[...] = merge_records(parts, axis=0)
    return None
