"""Cross-rank merge strategies: one module each, found and registered on import; "auto"'s rule.

A strategy is one module of this package holding one :class:`Strategy` subclass
decorated with :func:`register`; its class attributes say what it is, and every list
of strategies is read from them (docs/strategies.md, "Adding a strategy").
"""

from __future__ import annotations

import importlib
import pkgutil
from abc import ABC, abstractmethod

from mpi4py import MPI

from .._registry import AUTO, REGISTRY, register
from .._state import FLAG_CLEAR, FLAG_FAILED, WEIGHTED, M
from .._topology import layout

__all__ = [
    "REGISTRY",
    "Strategy",
    "auto_strategy",
    "flagged",
    "free_requests",
    "op_needed",
    "register",
    "resolve",
    "set_flag",
]

# ``deterministic=True`` runs this strategy in place of any not ``reproducible``
DETERMINISTIC = "allgather"


class Strategy(ABC):
    """One way of merging a :class:`~mpitree._merger.Merger`'s record buffer across ranks.

    The buffer is ``(rows + 1, D + 2)``: the records, then a flag record whose
    ``m`` is 1 on a rank whose local work failed and ``-inf`` elsewhere. The
    flag merges like any record (its ``m`` is a max), so a failure anywhere
    reaches every rank in the same collective.

    A strategy reads the buffer through its kind (``mpitree._buffers``), one of
    those it declares in ``buffers``: :attr:`kind` ``.buf`` in the kind's own
    memory, :attr:`host` in host memory (the buffer itself for ``"host"`` and
    ``"pinned"``; for a device kind, a mirror that ``kind.to_host()`` fills). Both
    are allocated once, with the merger.

    Attributes
    ----------
    name : str
        What ``strategy=`` takes (not ``"auto"``).
    order : int
        Its place in every list of strategies: ``mpitree.STRATEGIES`` after
        ``"auto"``, the command line's tables.
    summary : str
        One line saying what travels and how, for help texts and docs.
    short : str
        Its column header in ``python -m mpitree bench``'s tables (10 characters at
        most); "" for the name.
    label : str
        Its row in ``python -m mpitree merge``'s table (34 characters at most; ``{nodes}``
        stands for the virtual node size); "" for the name.
    needs_kv : bool
        It moves keys and values, not records: only calls with K/V run it
        (``allreduce_state`` refuses it; the merge benchmark leaves it out).
    uses_op : bool
        It runs the native (m, d, n) user op, which the guarded path creates before the
        agreement (:func:`op_needed`).
    persistent : bool
        It can hold a persistent collective request (a merger built with
        ``persistent=True``), which a compiled step may start and wait on.
    buffers : tuple of str
        The buffer kinds it can merge in: ``"host"``, ``"pinned"`` (``"device"`` for a
        device-side merge). A merger takes, of the kinds registered under these names,
        the nearest to the call's arrays that serves them (device, then pinned, then
        host memory; ``mpitree._buffers.kind_for``); a call none serves is an error on
        every rank, before any communication.
    reproducible : bool
        It merges in rank order, bitwise the same on every rank and run:
        ``deterministic=True`` keeps it (others run :data:`DETERMINISTIC`).
    modelled : bool
        :mod:`mpitree.model` predicts its step time (``model.STRATEGIES``); a test
        holds every registered strategy to this.
    auto_priority : int or None
        None: ``"auto"`` never picks it. Else ``"auto"`` runs, of the strategies
        whose :meth:`auto_fits` holds, the one with the lowest priority.
    """

    name = ""
    order = 0
    summary = ""
    short = ""
    label = ""
    needs_kv = False
    uses_op = False
    persistent = False
    buffers = ("host", "pinned")
    reproducible = False
    modelled = True
    auto_priority = None

    def __init__(self, merger, node_size=0, persistent=True):
        self.merger = merger
        self.comm = merger.comm
        self.kind = merger.kind  # the buffer's kind: its memory, staging and output
        self.host = merger.kind.host  # the buffer in host memory, for MPI and the native op
        self.error = None  # an exception this rank hit inside the strategy's own steps
        self.requests = []  # persistent requests, freed with the merger (see free_requests)

    @classmethod
    def auto_fits(cls, size, native, nodes, ranks_per_node, ring_library):
        """Return whether ``"auto"`` may pick it (see :func:`auto_strategy`'s arguments)."""
        return False

    @abstractmethod
    def reduce(self, local, failed):
        """Merge the buffer in place; return whether any rank failed."""

    def bound_collective(self):
        """Return what a compiled step needs to run this merge itself; None: it may not."""
        return None

    def reduce_bound(self, bound, out):
        """Run a step bound to :meth:`bound_collective`; return its code (None: not now)."""
        return None


def free_requests(requests):
    """Free persistent requests (local, never collective); safe after MPI finalized."""
    while requests:
        request = requests.pop()
        if not MPI.Is_finalized() and request != MPI.REQUEST_NULL:
            request.Free()


def set_flag(buf, failed):
    """Write this rank's failure flag into the last record."""
    buf[-1, M] = FLAG_FAILED if failed else FLAG_CLEAR
    buf[-1, WEIGHTED] = 0


def flagged(buf):
    """Whether the merged flag record says some rank failed."""
    return float(buf[-1, M]) != FLAG_CLEAR


def op_needed(strategy, deterministic, acc, head_dim):
    """Return the ``(dtype, width)`` of the native op a requested strategy may run, or None.

    Obtained in the guarded local phase, before the agreement, so that running
    out of op slots is an agreed error rather than a failure after it. A strategy
    needs it where it ``uses_op``; ``"auto"`` where the native op is available
    (``"auto"`` then picks one that uses it; without it, one that does not).
    """
    from .._op import native_op_available

    if deterministic:
        return None
    if strategy == AUTO:
        if not native_op_available():
            return None
    else:
        cls = REGISTRY.get(strategy)
        if cls is None or not cls.uses_op:
            return None
    return (acc, head_dim + 2)


def resolve(strategy, comm, native, node_size=0, deterministic=False):
    """Map a requested strategy to the one that runs; collective over ``comm`` for ``"auto"``.

    Call it only after the agreement: ``native`` is the agreed fact (every rank
    has the compiled op), so every rank resolves ``"auto"`` the same way.
    ``deterministic=True`` turns every strategy but a ``reproducible`` one (already
    rank-ordered) into :data:`DETERMINISTIC`: a gather of all states merged in rank order.
    """
    if deterministic and (strategy == AUTO or not REGISTRY[strategy].reproducible):
        return DETERMINISTIC
    if strategy != AUTO:
        return strategy
    size = comm.Get_size()
    if size == 1:
        return auto_strategy(1, native, 1, 1, False)
    lay = layout(comm, node_size)
    ring_library = "open mpi" in MPI.Get_library_version().lower()
    return auto_strategy(size, native, lay.nodes, lay.ranks_per_node, ring_library)


def auto_strategy(size, native, nodes, ranks_per_node, ring_library):
    """Return the strategy ``"auto"`` runs (README, "Choosing a strategy").

    Of the registered strategies whose ``auto_fits`` holds, the one of the lowest
    ``auto_priority``. Today's rule, from the strategies' own attributes: with the
    native op, one all-reduce, except across several nodes of several ranks under an
    MPI whose all-reduce for user ops is ring or Rabenseifner (Open MPI's tuned
    component), whose many steps each cross the slow node links; two levels cross
    them log2(nodes) times. MPICH runs recursive doubling for user ops, which
    already crosses node links only log2(nodes) times for any regular placement, so
    there the extra intra-node rounds of two levels only cost. Without the native
    op: ``allgather`` up to ``allgather.MAX_RANKS`` ranks, ``allreduce3`` beyond.

    Parameters
    ----------
    size : int
        Ranks in the communicator.
    native : bool
        Whether every rank has the compiled op (agreed).
    nodes, ranks_per_node : int
        The communicator's node layout (``ranks_per_node``: the most on one node).
    ring_library : bool
        Whether the MPI library's all-reduce for user ops is ring or Rabenseifner.
    """
    fits = (
        cls
        for cls in REGISTRY.values()
        if cls.auto_priority is not None
        and cls.auto_fits(size, native, nodes, ranks_per_node, ring_library)
    )
    return min(fits, key=lambda cls: cls.auto_priority).name


for _module in pkgutil.iter_modules(__path__):  # each module registers its strategy
    importlib.import_module(f"{__name__}.{_module.name}")
