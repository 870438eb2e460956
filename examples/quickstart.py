"""Exact decode attention over a KV cache sharded across MPI ranks.

    .venv/bin/mpiexec -n 4 .venv/bin/python examples/quickstart.py

Every rank holds a different slice of the sequence (uneven, one may be empty) and
the same query; every rank gets the attention output over the whole sequence.
Rank 0 checks it against one process computing over the concatenated cache.
"""

import numpy as np
from mpi4py import MPI

import mpitree

comm = MPI.COMM_WORLD
rank, p = comm.Get_rank(), comm.Get_size()
B, Hq, Hkv, D = 1, 32, 8, 128  # Llama-3.1-8B attention: GQA with 4 query heads per kv head
sizes = [1000 + 700 * r for r in range(p)]  # uneven shards
sizes[-1] = 0 if p > 2 else sizes[-1]  # ...and an empty one

rng = np.random.default_rng(0)  # same seed everywhere: every rank can rebuild the whole cache
q = rng.standard_normal((B, Hq, 1, D), dtype=np.float32)
k_all = rng.standard_normal((B, Hkv, sum(sizes), D), dtype=np.float32)
v_all = rng.standard_normal((B, Hkv, sum(sizes), D), dtype=np.float32)
lo = sum(sizes[:rank])
k, v = k_all[:, :, lo : lo + sizes[rank]], v_all[:, :, lo : lo + sizes[rank]]

# One call: local attention on this shard, then one MPI_Allreduce of (m, d, n) states.
out, lse = mpitree.tree_decode(q, k, v, return_lse=True)

# A decode loop reuses a plan: validated once, buffers and MPI request preallocated.
with mpitree.DecodePlan(B, Hq, Hkv, D) as plan:
    for _ in range(3):
        out_loop = plan.decode(q, k, v)

if rank == 0:
    ref, ref_lse = mpitree.reference_attention(q, k_all, v_all)
    print(
        f"{p} ranks, shards {sizes}: max |out - ref| = {np.abs(out - ref).max():.2e}, "
        f"max |lse - ref| = {np.abs(lse - ref_lse).max():.2e}, "
        f"plan == one-shot: {np.array_equal(out, out_loop)}"
    )
