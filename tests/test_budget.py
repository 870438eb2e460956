"""The adaptive draft budget (transformers adapter): tree sizes, pruning, the cost's fit."""

import numpy as np
import pytest
import torch
from mpi4py import MPI
from mpitree.adapters.transformers import _budget
from mpitree.adapters.transformers._budget import Budget, check_node_cost, tree_nodes

from mpitree import spec


@pytest.mark.parametrize("seed", range(6))
def test_tree_nodes_equal_the_packed_length_at_every_depth(seed):
    g = torch.Generator().manual_seed(seed)
    beam = torch.randint(0, 3, (3, 4, 5), generator=g)  # few ids: many shared prefixes
    root = torch.full((3, 4, 1), 7)
    nodes = tree_nodes(beam)
    for k in range(6):
        packed = spec.pack(torch.cat([root, beam[:, :, :k]], -1))
        assert nodes[k] == packed.tokens.shape[1], (k, nodes)


def run(budget, steps, accept, depth=4, width=1):
    """Drive ``budget`` over ``steps`` with a chain (or ``width`` chains) that gains ``accept``."""
    seen = []
    for _ in range(steps):
        if not budget.drafts():
            seen.append(0)
            budget.start()
            budget.plain()
            continue
        beam = torch.arange(width * depth).reshape(1, width, depth) + 1
        cut = budget.prune(beam)
        seen.append(cut.shape[2])
        budget.start()
        if cut.shape[2]:
            budget.saw(min(accept, cut.shape[2]), cut.shape[2], tree_nodes(cut)[-1])
        else:
            budget.plain()
    return seen


def test_rejected_drafts_go_plain_and_probe_one_token_deep_after_doubling_waits():
    seen = run(Budget(0.15, MPI.COMM_SELF), 16, accept=0)
    assert seen == [4, 0, 1, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0], seen


def test_accepted_drafts_keep_the_whole_depth():
    assert run(Budget(0.15, MPI.COMM_SELF), 12, accept=4) == [4] * 12


def test_the_cut_is_the_depth_of_most_tokens_per_cost():
    budget = Budget(0.15, MPI.COMM_SELF)  # cost(L) = 1 + 0.15 (L - 1)
    budget.rates = [1.0, 0.5, 0.0, 0.0]  # gains 1, 1.5, 1.5, 1.5 at depths 1..4
    # values 2/1.15, 2.5/1.3, 2.5/1.45, 2.5/1.6: depth 2
    assert budget.prune(torch.arange(4).reshape(1, 1, 4)).shape[2] == 2
    budget.base, budget.slope = -1.0, 2.0  # every node costs two plain steps: nothing pays
    assert budget.prune(torch.arange(4).reshape(1, 1, 4)).shape[2] == 0
    wide = torch.arange(16).reshape(1, 4, 4)  # four disjoint chains: 4 nodes a depth
    budget.base, budget.slope, budget.rates = 0.85, 0.15, [1.0, 1.0, 1.0, 1.0]
    # values (1 + k) / (1 + 0.6 k): 1.25, 1.36, 1.43, 1.47: the whole depth still pays
    assert budget.prune(wide).shape[2] == 4
    budget.base, budget.slope = 0.7, 0.3  # (1 + k) / (1 + 1.2 k) < 1 at every depth
    assert budget.prune(wide).shape[2] == 0


def test_a_costly_first_node_favours_deep_trees():
    """With cost(L) = 1.6 + 0.04 L, a 1-deep tree of a 50 % drafter loses, a deep one wins."""
    budget = Budget("auto", MPI.COMM_SELF)
    budget.rates = [0.5, 1.0, 1.0, 1.0]  # gains 0.5, 1, 1.5, 2 at depths 1..4
    chain = torch.arange(4).reshape(1, 1, 4)
    # values 1.5/1.68, 2/1.72, 2.5/1.76, 3/1.8: depth 4
    assert budget.prune(chain).shape[2] == 4
    budget.rates = [0.5, 0.0, 0.0, 0.0]  # only 1.5/1.68 < 1 on offer: the plain step
    assert budget.prune(chain).shape[2] == 0


def test_a_tree_that_never_pays_is_asked_for_after_doubling_waits():
    """Four candidates a depth at c = 0.5: no cut pays though a single chain would."""
    budget, asked = Budget(0.5, MPI.COMM_SELF), []
    wide = torch.arange(16).reshape(1, 4, 4) + 1
    for _ in range(24):
        asked.append(budget.drafts())
        cut = budget.prune(wide) if asked[-1] else wide[:, :, :0]
        budget.start()
        if cut.shape[2]:
            budget.saw(cut.shape[2], cut.shape[2], tree_nodes(cut)[-1])
        else:
            budget.plain()
    assert sum(asked) <= 8, asked  # was asked 22 times in 23 steps, every tree pruned away


def test_every_step_budget_keeps_every_draft():
    assert run(Budget(None, MPI.COMM_SELF), 8, accept=0) == [4] * 8


def timed_steps(monkeypatch, budget, steps, seconds):
    """Feed ``budget`` steps of ``steps[i]`` nodes taking ``seconds(nodes)`` (1 node: plain)."""
    clock = [0.0]
    monkeypatch.setattr(_budget.time, "perf_counter", lambda: clock[0])
    for nodes in steps:
        budget.start()
        clock[0] += seconds(nodes)
        if nodes == 1:
            budget.plain()
        else:
            budget.saw(nodes - 1, nodes - 1, nodes)


def test_the_measured_cost_is_the_verified_steps_line_over_the_plain_step(monkeypatch):
    budget = Budget("auto", MPI.COMM_SELF)
    assert (budget.base, budget.slope) == (_budget.PRIOR_BASE, _budget.PRIOR_SLOPE)
    # plain steps 0.05 s, verified ones 0.08 + 0.005 L: cost(L) = 1.6 + 0.1 L
    steps = [1, 5, 1, 9, 3, 1, 7, 2, 1, 4]
    timed_steps(monkeypatch, budget, steps, lambda n: 0.05 if n == 1 else 0.08 + 0.005 * n)
    assert budget.base == pytest.approx(1.6, rel=1e-9)
    assert budget.slope == pytest.approx(0.1, rel=1e-9)


def test_the_measured_cost_keeps_the_prior_slope_until_tree_sizes_vary(monkeypatch):
    budget = Budget("auto", MPI.COMM_SELF)
    timed_steps(monkeypatch, budget, [5, 5, 5], lambda n: 0.3)  # no plain step yet: no fit
    assert (budget.base, budget.slope) == (_budget.PRIOR_BASE, _budget.PRIOR_SLOPE)
    timed_steps(monkeypatch, budget, [1, 5], lambda n: 0.1 if n == 1 else 0.3)
    # every tree 5 nodes and 3 plain steps: the prior slope, the base through (5, 3)
    assert budget.slope == pytest.approx(_budget.PRIOR_SLOPE)
    assert budget.base == pytest.approx(3 - 5 * _budget.PRIOR_SLOPE)


@pytest.mark.parametrize(
    "bad, error",
    [(-0.1, ValueError), (float("nan"), ValueError), ("fast", TypeError), (True, TypeError)],
)
def test_bad_node_costs_raise(bad, error):
    with pytest.raises(error, match="node_cost"):
        check_node_cost(bad)
    for good in ("auto", None, 0, 0.15, np.float32(0.5), np.float64(2)):
        check_node_cost(good)
