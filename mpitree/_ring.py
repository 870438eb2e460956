"""Ring Attention decode baseline: K/V blocks travel the ring in p - 1 steps."""

import numpy as np
from mpi4py import MPI

from ._local import attend
from ._records import merge_records


def ring_reduce(comm, q, k, v, scale, vis, records, failed):
    """Fill ``records`` with the state of q over every rank's K/V; return a failing rank or None.

    Each rank computes the state of every block as it passes, and merges the p
    block states in rank order, so all ranks get bitwise identical results.
    """
    p, r = comm.Get_size(), comm.Get_rank()
    t = 0 if failed else k.shape[2]
    header = np.array([t, 0 if vis is None or failed else vis.shape[1], failed], dtype=np.int64)
    headers = np.empty((p, 3), dtype=np.int64)
    comm.Allgather(header, headers)
    bad = np.flatnonzero(headers[:, 2])
    if bad.size:
        return int(bad[0])
    b, hkv, _, dim = k.shape
    sq = q.shape[2]
    parts = np.empty((p, *records.shape), dtype=records.dtype)
    attend(q, k, v, scale, vis, parts[r])
    block = (np.ascontiguousarray(k), np.ascontiguousarray(v), vis)
    left, right = (r - 1) % p, (r + 1) % p
    for step in range(1, p):
        src = (r - step) % p
        ts, vheads = int(headers[src, 0]), int(headers[src, 1])
        nk = np.empty((b, hkv, ts, dim), dtype=k.dtype)
        nv = np.empty_like(nk)
        nvis = np.empty((b, vheads, sq, ts), dtype=bool) if vheads else None
        reqs = [
            comm.Irecv([nk, MPI.BYTE], left, 1),
            comm.Irecv([nv, MPI.BYTE], left, 2),
            comm.Isend([block[0], MPI.BYTE], right, 1),
            comm.Isend([block[1], MPI.BYTE], right, 2),
        ]
        if nvis is not None:
            reqs.append(comm.Irecv([nvis, MPI.BYTE], left, 3))
        if block[2] is not None:
            reqs.append(comm.Isend([block[2], MPI.BYTE], right, 3))
        MPI.Request.Waitall(reqs)
        attend(q, nk, nv, scale, nvis, parts[src])
        block = (nk, nv, nvis)
    records[...] = merge_records(parts, axis=0)
    return None
