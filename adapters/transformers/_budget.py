"""The adaptive draft budget: how deep a draft is verified, from measured cost and acceptance.

A verified tree of ``L`` nodes (the pending token included) costs about
``1 + c * (L - 1)`` plain steps. ``c`` is fitted from the step times this run
measured (a least-squares line of seconds against nodes, plain steps as one node),
each rank's fit agreed as the largest over the ranks after every drafted step; or
it is fixed by the caller. The expected tokens a step gains from a tree cut at
depth ``k`` are ``sum_{j <= k} prod_{i <= j} q_i``, where ``q_i`` is the running
rate at which the draft's token at depth ``i`` was accepted when the ones above it
were. Each step keeps the depth with the most expected tokens per unit of cost
(depth 0 is the plain step), so the drafter proposes and the budget prunes. When
no depth pays, steps go plain and a one-deep probe is tried after 1, 2, 4, ...
plain steps. Every input of a decision is the same on every rank (agreed drafts,
accepted counts, the agreed cost), so the ranks decide alike.
"""

from __future__ import annotations

import math
import time

import numpy as np
from mpi4py import MPI

from mpitree import extend

PRIOR_COST = 0.15  # SmolLM2-135M on a 2-core x86-64 VM: a 13-row forward cost 2.8x a 1-row one
_DECAY = 0.9  # the weight each older step keeps in the cost's fit
_MIN_SPREAD = 0.5  # node counts must vary this much (variance) before the fit is used


def check_node_cost(node_cost):
    """Raise unless ``node_cost`` is ``"auto"``, None or a finite float ``>= 0``."""
    if node_cost is None or (isinstance(node_cost, str) and node_cost == "auto"):
        return
    if isinstance(node_cost, bool) or not isinstance(node_cost, (int, float)):
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
        ``"auto"``: ``c`` fitted from measured step times (:data:`PRIOR_COST` until
        the fit has steps of different sizes); a float: ``c`` fixed; None: every
        step verifies the whole draft.
    comm : mpi4py.MPI.Intracomm
        The cache's communicator (the cost's agreement).
    """

    def __init__(self, node_cost, comm):
        self.every, self.measured = node_cost is None, node_cost == "auto"
        self.cost = PRIOR_COST if self.measured or self.every else float(node_cost)
        self.comm = comm
        self.rates = []  # q_i: running acceptance at depth i + 1, given the depths above
        self.fit = np.zeros(5)  # decayed sums of 1, n, t, n*n, n*t over timed steps
        self.wait, self.backoff, self.probe = 0, 1, False
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
        return (1.0 + self._gain(depth)) / (1.0 + self.cost * (nodes - 1))

    def _pays(self):
        """Whether some depth of a single chain beats the plain step."""
        return any(self._value(k, k + 1) > 1.0 for k in range(1, len(self.rates) + 2))

    def drafts(self):
        """Whether this step asks the drafter."""
        if self.every or self._pays():
            return True
        self.wait -= 1
        if self.wait < 0:
            self.probe = True
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
        self.probe = False
        return beam[:, :, :best].contiguous()

    def start(self):
        """Mark the start of a step's forward (its time goes into the cost's fit)."""
        self.started = time.perf_counter()

    def plain(self):
        """Record a plain step's time (one node)."""
        self._timed(1)

    def saw(self, accepted, depth, nodes):
        """Record a verified step: draft tokens accepted, the tree's depth and its node count.

        Runs the cost's agreement (one small collective, the same point on every rank).
        """
        self._timed(nodes)
        for i in range(min(accepted + 1, depth)):
            hit = float(i < accepted)
            if i == len(self.rates):
                self.rates.append(hit)
            else:
                self.rates[i] = 0.5 * (self.rates[i] + hit)
        if self.measured:
            self._agree_cost()
        if self._pays():
            self.backoff = 1
        else:
            self.wait, self.backoff = self.backoff, 2 * self.backoff

    def _timed(self, nodes):
        """Add the step that started at :meth:`start` to the decayed least-squares sums."""
        seconds = time.perf_counter() - self.started
        self.fit = _DECAY * self.fit + np.array([1, nodes, seconds, nodes * nodes, nodes * seconds])

    def _local_cost(self):
        """Return this rank's fitted ``c`` (slope over a one-node step's time), or -1 if none."""
        w, n, t, nn, nt = self.fit
        spread = nn / w - (n / w) ** 2 if w else 0.0
        if spread < _MIN_SPREAD:
            return -1.0
        slope = (nt / w - (n / w) * (t / w)) / spread
        one = t / w - slope * (n / w) + slope  # the fitted time of a one-node step
        return max(slope, 0.0) / one if one > 0 else -1.0

    def _agree_cost(self):
        """Take the largest rank's fitted ``c`` (the slowest rank sets a step's pace)."""
        agreed = float(extend.flagged_allreduce(self.comm, [self._local_cost()], MPI.MAX, None)[0])
        if agreed >= 0:
            self.cost = agreed
