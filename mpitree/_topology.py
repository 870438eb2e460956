"""Which ranks of a communicator share a node, cached on the communicator itself."""

import threading
from dataclasses import dataclass

from mpi4py import MPI


class CommCache:
    """One object per communicator, made on first use and freed with the communicator.

    ``make(comm)`` builds it (collectively where it communicates: every rank asks at
    the same point); its ``free()`` runs when the communicator is freed (an
    attribute's delete callback, as MPI calls it). What is cached here: the node
    layouts, and the node strategies' shared record slots.
    """

    def __init__(self, make):
        self._make, self._keyval, self._lock = make, None, threading.Lock()

    def __call__(self, comm):
        """Return ``comm``'s object, made now on first use."""
        if self._keyval is None:
            with self._lock:
                if self._keyval is None:
                    self._keyval = MPI.Comm.Create_keyval(delete_fn=_free_cached)
        value = comm.Get_attr(self._keyval)
        if value is None:
            value = self._make(comm)
            comm.Set_attr(self._keyval, value)
        return value


def _free_cached(comm, keyval, value):
    """Attribute delete callback: free the cached object with its communicator."""
    value.free()


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


class _Layouts(dict):
    """A communicator's layouts by node size; freed with it."""

    def free(self):
        """Free every layout's sub-communicators."""
        for lay in self.values():
            lay.free()


_layouts = CommCache(lambda comm: _Layouts())


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
    cache = _layouts(comm)
    if size not in cache:
        cache[size] = _build(comm, size)
    return cache[size]
