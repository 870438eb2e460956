"""Attention as the gradient of an energy: mpiexec -n 3 python examples/energy.py"""

import numpy as np
import torch
from mpi4py import MPI

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
