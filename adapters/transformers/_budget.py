"""The adaptive draft budget: how deep a draft is verified, from measured cost and acceptance.

A verified tree of ``L > 1`` nodes (the pending token included) costs
``cost(L) = base + slope * L`` plain steps (a plain step is one node and costs 1).
A CPU's BLAS runs a 2-row matrix product at about twice a 1-row one and more rows
at little more (SmolLM2-135M, one thread: 2 rows 1.68x, 13 rows 2.1x), so the line
is fitted over verified steps only, against the mean plain step: a least-squares
line of seconds against nodes, decayed, each rank's fit agreed as the largest over
the ranks after every verified step (the slowest rank sets a step's pace). A fixed
``node_cost`` c gives ``cost(L) = 1 + c * (L - 1)``. The expected tokens a step
gains from a tree cut at depth ``k`` are ``sum_{j <= k} prod_{i <= j} q_i``, where
``q_i`` is the running rate at which the draft's token at depth ``i`` was accepted
when the ones above it were. Each step keeps the depth with the most expected
tokens per unit of cost (depth 0 is the plain step), so the drafter proposes and
the budget prunes. When no depth pays, steps go plain and a one-deep probe is
tried after 1, 2, 4, ... plain steps. Every input of a decision is the same on
every rank (agreed drafts, accepted counts, the agreed cost), so the ranks decide
alike.
"""

from __future__ import annotations

import math
import numbers
import time

import numpy as np
from mpi4py import MPI

from mpitree import extend

# cost(L) = 1.6 + 0.04 L until fitted: SmolLM2-135M on the 2-core x86-64 CI machine type
PRIOR_BASE, PRIOR_SLOPE = 1.6, 0.04
_DECAY = 0.9  # the weight each older step keeps in the cost's fit
_MIN_SPREAD = 0.5  # node counts must vary this much (variance) before the fit is used


def check_node_cost(node_cost):
    """Raise unless ``node_cost`` is ``"auto"``, None or a finite float ``>= 0``."""
    if node_cost is None or (isinstance(node_cost, str) and node_cost == "auto"):
        return
    if isinstance(node_cost, bool) or not isinstance(node_cost, numbers.Real):
        raise TypeError(f"node_cost must be 'auto', None or a float >= 0, got {node_cost!r}")
    if not math.isfinite(node_cost) or node_cost < 0:
        raise ValueError(f"node_cost must be 'auto', None or a float >= 0, got {node_cost!r}")


def tree_nodes(beam):
    """Return ``nodes[k]``: the packed tree's length with the ``(B, M, C)`` beam cut at depth k.

    The pending token is the root (``nodes[0] == 1``); candidates sharing a prefix
    share its nodes; the longest row counts (rows are packed to one length).
    """
    rows = beam.tolist()
    depth = beam.shape[2]
    nodes = [1] * (depth + 1)
    for cands in rows:
        seen = set()
        for k in range(1, depth + 1):
            seen.update(tuple(c[:k]) for c in cands)
            nodes[k] = max(nodes[k], 1 + len(seen))
    return nodes


class Budget:
    """How deep each step's draft is verified (see the module docstring).

    Parameters
    ----------
    node_cost : {"auto"} or float or None
        ``"auto"``: ``cost(L)`` fitted from measured step times (``PRIOR_BASE`` and
        ``PRIOR_SLOPE`` until both plain and verified steps were timed); a float
        ``c``: ``cost(L) = 1 + c * (L - 1)``; None: every step verifies the whole
        draft.
    comm : mpi4py.MPI.Intracomm
        The cache's communicator (the cost's agreement).
    """

    def __init__(self, node_cost, comm):
        self.every, self.measured = node_cost is None, node_cost == "auto"
        if self.measured or self.every:
            self.base, self.slope = PRIOR_BASE, PRIOR_SLOPE
        else:
            self.base, self.slope = 1.0 - float(node_cost), float(node_cost)
        self.comm = comm
        self.rates = []  # q_i: running acceptance at depth i + 1, given the depths above
        self.plains = np.zeros(2)  # decayed sums of 1, t over plain steps
        self.trees = np.zeros(5)  # decayed sums of 1, n, t, n*n, n*t over verified steps
        self.wait, self.backoff, self.probe = 0, 1, False
        self.held = False  # the last tree did not pay: wait before asking the drafter again
        self.started = 0.0

    def _gain(self, depth):
        """Return the expected accepted draft tokens of a tree cut at ``depth``."""
        gain, alive = 0.0, 1.0
        for i in range(depth):
            rate = self.rates[i] if i < len(self.rates) else (self.rates[-1] if self.rates else 1.0)
            alive *= rate
            gain += alive
        return gain

    def _value(self, depth, nodes):
        """Return expected tokens per unit of cost of a ``depth``-deep tree of ``nodes`` nodes."""
        cost = 1.0 if nodes == 1 else max(self.base + self.slope * nodes, 1.0)
        return (1.0 + self._gain(depth)) / cost

    def _pays(self):
        """Whether some depth of a single chain beats the plain step."""
        return any(self._value(k, k + 1) > 1.0 for k in range(1, len(self.rates) + 2))

    def drafts(self):
        """Whether this step asks the drafter."""
        if self.every or (self._pays() and not self.held):
            return True
        self.wait -= 1
        if self.wait < 0:
            self.probe, self.held = True, False
            return True
        return False

    def prune(self, beam):
        """Return the agreed ``(B, M, C)`` beam cut at the depth of most tokens per cost."""
        if self.every or beam.shape[2] == 0:
            return beam
        nodes = tree_nodes(beam)
        best = max(range(len(nodes)), key=lambda k: (self._value(k, nodes[k]), -k))
        if best == 0 and self.probe:
            best = 1
        elif best == 0:  # no cut of this tree pays: ask again after a wait
            self.held, self.wait, self.backoff = True, self.backoff, 2 * self.backoff
        self.probe = False
        return beam[:, :, :best].contiguous()

    def start(self):
        """Mark the start of a step's forward (its time goes into the cost's fit)."""
        self.started = time.perf_counter()

    def plain(self):
        """Record a plain step's time (one node)."""
        self.plains = _DECAY * self.plains + np.array([1.0, self._seconds()])

    def saw(self, accepted, depth, nodes):
        """Record a verified step: draft tokens accepted, the tree's depth and its node count.

        Runs the cost's agreement (one small collective, the same point on every rank).
        """
        t = self._seconds()
        self.trees = _DECAY * self.trees + np.array([1, nodes, t, nodes * nodes, nodes * t])
        for i in range(min(accepted + 1, depth)):
            hit = float(i < accepted)
            if i == len(self.rates):
                self.rates.append(hit)
            else:
                self.rates[i] = 0.5 * (self.rates[i] + hit)
        if self.measured:
            self._agree_cost()
        if self._value(depth, nodes) > 1.0:  # the tree verified paid: keep drafting
            self.backoff = 1
        else:
            self.held, self.wait, self.backoff = True, self.backoff, 2 * self.backoff

    def _seconds(self):
        """Return the seconds since :meth:`start`."""
        return time.perf_counter() - self.started

    def _local_cost(self):
        """Return this rank's fitted ``(base, slope)``, in plain steps; ``(-1, -1)`` if none."""
        w1, t1 = self.plains
        w, n, t, nn, nt = self.trees
        if not w1 or not w or t1 <= 0:
            return [-1.0, -1.0]
        plain = t1 / w1
        spread = nn / w - (n / w) ** 2
        slope = (nt / w - (n / w) * (t / w)) / spread if spread >= _MIN_SPREAD else None
        slope = PRIOR_SLOPE * plain if slope is None else max(slope, 0.0)
        return [(t / w - slope * (n / w)) / plain, slope / plain]

    def _agree_cost(self):
        """Take the largest rank's fitted line (the slowest rank sets a step's pace)."""
        agreed = extend.flagged_allreduce(self.comm, self._local_cost(), MPI.MAX, None)
        if agreed[1] >= 0:
            self.base, self.slope = float(agreed[0]), float(agreed[1])
