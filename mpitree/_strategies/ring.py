"""``ring``: the Ring Attention baseline; K/V blocks travel the ring in p - 1 steps."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .._state import merge_records
from .._traffic import traffic
from . import Strategy, flagged, register, set_flag


@register
class Ring(Strategy):
    """Every rank sees every block as it passes and merges the p block states in rank order.

    Needs a ``local`` step with ``q_len``, ``block()`` (this rank's host K/V,
    contiguous, with int64 ``(B,)`` lengths and its visibility or None) and
    ``attend_block(k, v, lens, vis, out)``. Each block travels with
    its ragged lengths (int64 ``(B,)``) and, if it has one, its visibility array.
    Results are bitwise identical on all ranks.
    """

    name = "ring"
    order = 4
    summary = "the Ring Attention baseline: K/V blocks travel the ring in p - 1 steps"
    needs_kv = True
    reproducible = True

    def reduce(self, local, failed):
        """Header all-gather (flags included), p - 1 block exchanges, one final flag all-reduce."""
        comm, buf = self.comm, self.host
        p, r = comm.Get_size(), comm.Get_rank()
        set_flag(buf, failed)
        if p == 1:
            return flagged(buf)
        error = None
        try:
            k, v, lens, vis = local.block() if not failed else (None, None, None, None)
        except Exception as exc:  # this rank cannot offer its block: flag it in the header
            error, failed = exc, True
            set_flag(buf, True)
        t = 0 if failed else k.shape[2]
        header = np.array([t, 0 if failed or vis is None else vis.shape[1], failed], np.int64)
        headers = np.empty((p, 3), dtype=np.int64)
        traffic.add(header.nbytes)
        comm.Allgather(header, headers)
        if headers[:, 2].any():
            self.error = error
            return True
        rows = buf[:-1]
        parts = np.empty((p, *rows.shape), dtype=rows.dtype)
        parts[r] = rows
        b, hkv, _, dim = k.shape
        block = (k, v, lens, vis)
        left, right = (r - 1) % p, (r + 1) % p
        for step in range(1, p):
            src = (r - step) % p
            ts, vheads = int(headers[src, 0]), int(headers[src, 1])
            new = (
                np.empty((b, hkv, ts, dim), dtype=k.dtype),
                np.empty((b, hkv, ts, dim), dtype=k.dtype),
                np.empty(b, dtype=np.int64),
                np.empty((b, vheads, local.q_len, ts), dtype=bool) if vheads else None,
            )
            reqs = []
            for tag, (out_buf, in_buf) in enumerate(zip(block, new, strict=False)):
                if in_buf is not None:
                    reqs.append(comm.Irecv([in_buf, MPI.BYTE], left, tag))
                if out_buf is not None:
                    traffic.add(out_buf.nbytes)
                    reqs.append(comm.Isend([out_buf, MPI.BYTE], right, tag))
            MPI.Request.Waitall(reqs)
            if error is None:
                try:
                    local.attend_block(*new, parts[src])
                except Exception as exc:  # keep forwarding blocks; report at the end
                    error = exc
            block = new
        flag = np.array([1 if error is not None else 0], dtype=np.int64)
        traffic.add(flag.nbytes)
        comm.Allreduce(MPI.IN_PLACE, flag, op=MPI.MAX)
        if flag[0]:
            self.error = error
            return True
        rows[...] = merge_records(parts, axis=0)
        return False
