"""Which ranks of a communicator share a node, cached on the communicator itself."""

import threading
from dataclasses import dataclass

from mpi4py import MPI

_keyval = None
_lock = threading.Lock()


@dataclass
class Layout:
    """A communicator split into nodes, and the communicator of the node leaders."""

    node: MPI.Intracomm  # the ranks on my node (real or virtual), leader = rank 0
    leaders: MPI.Intracomm  # one rank per node; COMM_NULL on non-leaders
    nodes: int
    ranks_per_node: int  # the largest node

    def free(self):
        """Free the sub-communicators."""
        for c in (self.node, self.leaders):
            if c != MPI.COMM_NULL and not MPI.Is_finalized():
                c.Free()


def _delete(comm, keyval, layouts):
    """Attribute delete callback: free the cached sub-communicators with their parent."""
    for lay in layouts.values():
        lay.free()


def _build(comm, size):
    """Split ``comm`` by node (``size`` > 0: consecutive blocks of ``size`` ranks)."""
    rank = comm.Get_rank()
    if size > 0:
        node = comm.Split(color=rank // size, key=rank)
    else:
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    leader = node.Get_rank() == 0
    leaders = comm.Split(color=0 if leader else MPI.UNDEFINED, key=rank)
    everyone = comm.allgather((leader, node.Get_size()))
    return Layout(node, leaders, sum(e[0] for e in everyone), max(e[1] for e in everyone))


def layout(comm, size=0):
    """Return the node layout of ``comm``; collective over ``comm`` on first use per size."""
    global _keyval
    if _keyval is None:
        with _lock:
            if _keyval is None:
                _keyval = MPI.Comm.Create_keyval(delete_fn=_delete)
    cache = comm.Get_attr(_keyval)
    if cache is None:
        cache = {}
        comm.Set_attr(_keyval, cache)
    if size not in cache:
        cache[size] = _build(comm, size)
    return cache[size]
