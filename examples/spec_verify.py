"""Verify draft candidates against a sharded context.

.venv/bin/mpiexec -n 3 .venv/bin/python examples/spec_verify.py
"""

import numpy as np
from mpi4py import MPI

import mpitree
from mpitree import spec

comm = MPI.COMM_WORLD
rng = np.random.default_rng(0)  # every rank builds the same data
beam = rng.integers(0, 4, (1, 8, 5))  # 8 draft candidates of 5 tokens, many shared prefixes
packed = spec.pack(beam)
n_ctx, length = 300 * comm.size, packed.tokens.shape[1]
q = rng.standard_normal((1, 8, length, 64))  # the packed tokens' queries (one layer)
k_ctx, v_ctx = rng.standard_normal((2, 1, 2, n_ctx, 64))  # the context cache...
mine = slice(300 * comm.rank, 300 * (comm.rank + 1))  # ...sharded across ranks
k_tree, v_tree = rng.standard_normal((2, 1, 2, length, 64))  # the packed tokens' K/V

out = spec.verify_attention(q, k_ctx[:, :, mine], v_ctx[:, :, mine], k_tree, v_tree, packed.mask)

if comm.rank == 0:
    visible = np.concatenate([np.ones((1, length, n_ctx), bool), packed.mask], -1)[:, None]
    ref, _ = mpitree.reference_attention(
        q, np.concatenate([k_ctx, k_tree], 2), np.concatenate([v_ctx, v_tree], 2), visible=visible
    )
    print(
        f"{beam.shape[1]} candidates x {beam.shape[2]} tokens packed into {length} nodes; "
        f"max |verify_attention - full-mask reference| = {np.abs(out - ref).max():.1e}"
    )
