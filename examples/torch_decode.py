"""Tree decoding of torch tensors.

.venv/bin/mpiexec -n 4 .venv/bin/python examples/torch_decode.py [--device cuda]
"""

import argparse

import numpy as np
import torch
from mpi4py import MPI
from mpitree.adapters import torch as mt

import mpitree

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cpu")
parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
args = parser.parse_args()
comm = MPI.COMM_WORLD
rank, p = comm.Get_rank(), comm.Get_size()
dtype = getattr(torch, args.dtype)
gen = torch.Generator().manual_seed(0)  # every rank builds the same q and the whole cache
q = torch.randn(1, 32, 1, 128, generator=gen).to(dtype)
k, v = torch.randn(2, 1, 8, 4096 * p, 128, generator=gen).to(dtype)
mine = slice(4096 * rank, 4096 * (rank + 1))  # Llama-3.1-8B shapes: 32 q heads, 8 kv heads

dev = args.device
out = mt.tree_decode(q.to(dev), k[:, :, mine].to(dev), v[:, :, mine].to(dev))
if rank == 0:
    ref, _ = mpitree.reference_attention(*(x.double().numpy() for x in (q, k, v)))
    err = np.abs(out.double().cpu().numpy() - ref).max()
    print(f"{p} ranks, {args.dtype} on {dev}: max |out - float64 reference| = {err:.2e}")
