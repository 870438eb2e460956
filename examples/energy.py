"""Attention as the gradient of an energy.

.venv/bin/mpiexec -n 3 .venv/bin/python examples/energy.py
"""

import sys

import numpy as np
from mpi4py import MPI

try:
    import torch
except ImportError:  # every rank exits the same way; rank 0 says why
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(
            "examples/energy.py compares with torch autograd and needs torch: "
            ".venv/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu",
            file=sys.stderr,
        )
    sys.exit(1)

from mpitree.energy import attention_variance, free_energy, tree_energy

rank, p = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
rng = np.random.default_rng(0)  # every rank builds the same q and the whole cache
q = rng.standard_normal((1, 8, 1, 64))
k, v = rng.standard_normal((2, 1, 2, 96 * p, 64))
mine = slice(96 * rank, 96 * (rank + 1))  # this rank's shard of the sequence

zeta = torch.zeros(q.shape, dtype=torch.float64, requires_grad=True)
free_energy(*map(torch.from_numpy, (q, k, v)), zeta).sum().backward()  # dF/dzeta, one process

energy, grad = tree_energy(q, k[:, :, mine], v[:, :, mine], algorithm="paper")  # Algs. 1-2
out, var = attention_variance(q, k[:, :, mine], v[:, :, mine])  # d2F/dzeta2, one all-reduce
if rank == 0:
    print(
        f"|autograd - Algorithm 2| = {np.abs(zeta.grad.numpy() - grad).max():.1e}, "
        f"|attention - Algorithm 2| = {np.abs(out - grad).max():.1e}, "
        f"mean variance of v under attention = {var.mean():.4f}"
    )
