"""The guard's entry: MPI used outside its lifetime gives a Python exception, never an abort.

And the guarded-call recipe (agree, resolve the strategy, get the merger) is written once.
"""

import ast
import os
import sys
from pathlib import Path

import pytest
from launch import run

AFTER_FINALIZE = """
import numpy as np, torch, mpitree
import mpitree.adapters.torch as mtorch
import mpitree.adapters.transformers as mtt
from models import tiny_llama
from mpi4py import MPI

q = np.ones((1, 2, 1, 8), np.float32)
plan = mpitree.DecodePlan(1, 2, 2, 8)  # made while MPI runs, used after
state = mpitree.local_state(q, q, q)
model = tiny_llama(1)
model.set_attn_implementation("mpitree")
cache = mtt.ShardedCache(model.config)
for _ in range(2):  # a recurring call: the next one takes allreduce_state's lane
    mpitree.allreduce_state(state)
MPI.Finalize()
calls = {
    "tree_decode": lambda: mpitree.tree_decode(q, q, q),
    "DecodePlan": lambda: mpitree.DecodePlan(1, 2, 2, 8),
    "DecodePlan.decode": lambda: plan.decode(q, q, q),
    "allreduce_state (its lane)": lambda: mpitree.allreduce_state(state),
    "allreduce_state": lambda: mpitree.allreduce_state(mpitree.State.empty((3,), 8)),
    "default_comm": mpitree.default_comm,
    "torch adapter": lambda: mtorch.tree_decode(*(torch.from_numpy(q),) * 3),
    "energy": lambda: mpitree.energy.tree_energy(q, q, q),
    "ShardedCache": lambda: mtt.ShardedCache(model.config),
    "transformers forward": lambda: model(torch.ones(1, 3, dtype=torch.long),
                                          cache=cache),
    "verify_attention": lambda: mpitree.spec.verify_attention(
        q, q, q, q, q, np.ones((1, 1, 1), bool)),
    "attention_variance": lambda: mpitree.energy.attention_variance(q, q, q),
    "prefill": lambda: mtt.prefill(model, torch.ones(1, 3, dtype=torch.long), cache),
    "generate": lambda: mtt.generate(model, torch.ones(1, 3, dtype=torch.long), cache,
                                     drafter=mtt.PromptLookup(), max_new_tokens=2),
}
lines = []
for name, call in calls.items():
    try:
        call()
    except RuntimeError as exc:
        assert "MPI has been finalized" in str(exc), (name, exc)
        lines.append(f"raised {name}\\n")
    else:
        raise AssertionError(f"{name} ran after MPI.Finalize()")
lines.append(f"repr {plan!r}\\n")  # reads no MPI (before: MPICH aborted in Comm_size)
import sys
sys.stdout.write("".join(lines))  # one write per rank: the two ranks' lines never interleave
sys.stdout.flush()
"""


BEFORE_INIT = """
import mpi4py
mpi4py.rc.initialize = False
import numpy as np, mpitree
from mpi4py import MPI

q = np.ones((1, 2, 1, 8), np.float32)
for when in ("before init", "after init", "after finalize"):
    try:
        out = mpitree.tree_decode(q, q, q)
    except RuntimeError as exc:
        print(when, "raised:", exc)
    else:
        print(when, "ran:", float(out.ravel()[0]))
    if when == "before init":
        MPI.Init()
    elif when == "after init":
        MPI.Finalize()
"""


@pytest.mark.timeout(120)
def test_an_entry_point_before_init_raises_then_runs_once_initialized():
    """Without MPI initialized an entry point raises; once initialized it runs, and it
    still raises after MPI is finalized (initialized is remembered, finalized never)."""
    res = run(1, [sys.executable, "-c", BEFORE_INIT])
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("before init raised: mpitree: MPI is not initialized"), lines
    assert lines[1] == "after init ran: 1.0", lines
    assert lines[2].startswith("after finalize raised: mpitree: MPI has been finalized"), lines


@pytest.mark.timeout(120)
def test_every_entry_point_raises_after_finalize():
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    res = run(2, [sys.executable, "-c", AFTER_FINALIZE], env={"PYTHONPATH": path})
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("raised") == 2 * 14, res.stdout
    assert res.stdout.count("repr DecodePlan(") == 2, res.stdout
    assert "Attempting to use an MPI routine" not in res.stderr


LANE_AFTER_FINALIZE = """
import torch
import mpitree.adapters.transformers as mtt
from models import tiny_llama
from mpi4py import MPI

model = tiny_llama(layers=2)
model.set_attn_implementation("mpitree")
cache = mtt.ShardedCache(model.config, block_size=4)  # every rank holds keys
ids = torch.ones(1, 24, dtype=torch.long)
mtt.prefill(model, ids, cache)
with torch.no_grad():
    for _ in range(2):  # every layer binds its one compiled call
        model(ids[:, -1:], cache=cache)
one_call = MPI.COMM_WORLD.size == 1 or "open mpi" not in MPI.Get_library_version().lower()
fused = all(layer.fast is not None and layer.fast.fused == one_call for layer in cache.layers)
# after layer 0's merge, before layer 1's attention, which runs in the entry point's lane
model.model.layers[1].self_attn.register_forward_pre_hook(lambda *a: MPI.Finalize())
try:
    with torch.no_grad():
        model(ids[:, -1:], cache=cache)
except RuntimeError as exc:
    line = f"raised {exc}"
else:
    line = "ran"
import sys
sys.stdout.write(f"fused as MPI allows: {fused}; {line}\\n")  # one write per rank
sys.stdout.flush()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nprocs", [1, 2])
def test_a_later_layer_in_the_lane_raises_after_finalize(nprocs):
    """A step's later layer runs its one compiled call before the guard (the entry
    point's lane): that call asks MPI_Finalized itself, so MPI finalized mid-step
    raises there too, and does not abort (nor, with one rank, compute on)."""
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    res = run(nprocs, [sys.executable, "-c", LANE_AFTER_FINALIZE], env={"PYTHONPATH": path})
    assert res.returncode == 0, res.stdout + res.stderr
    want = "fused as MPI allows: True; raised mpitree: MPI has been finalized"
    assert res.stdout.count(want) == nprocs, res.stdout
    assert "Attempting to use an MPI routine" not in res.stderr


ROOT = Path(__file__).resolve().parent.parent
# the recipe's steps after the agreement, and the op it needs before: only these modules
# call them (the helper, Call's default op, and where they are defined)
RECIPE = {"resolve", "merger_for", "op_needed"}
RECIPE_HOME = {"mpitree/_agreed.py", "mpitree/_guard.py", "mpitree/_merger.py"}


def _recipe_calls(tree):
    """Yield ``(line, name)`` of calls to a recipe step, bare or through a module (extend.X)."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in RECIPE:
            yield node.lineno, func.id
        elif (
            isinstance(func, ast.Attribute)
            and func.attr in RECIPE
            and isinstance(func.value, ast.Name)
            and func.value.id in ("extend", "_strategies", "strategies", "_merger")
        ):
            yield node.lineno, f"{func.value.id}.{func.attr}"


def test_only_the_helper_spells_out_the_guarded_recipe():
    """Static check: every entry point reaches its merger through ``agree_merger``."""
    offenders = []
    for path in [*(ROOT / "mpitree").rglob("*.py"), *(ROOT / "adapters").rglob("*.py")]:
        rel = path.relative_to(ROOT).as_posix()
        if rel in RECIPE_HOME or rel.startswith("mpitree/_strategies/"):
            continue
        tree = ast.parse(path.read_text())
        offenders += [f"{rel}:{line} {name}(...)" for line, name in _recipe_calls(tree)]
    assert not offenders, offenders


def test_the_recipe_check_catches_a_copy():
    """The static check above flags each step of the recipe written out by hand."""
    copy = """
def entry(comm, prepare):
    call = extend.agree(comm, prepare)
    chosen = extend.resolve(opts.strategy, comm, call.native)
    merger = merger_for(comm, 1, 8, "float32", chosen)
    op = op_needed("auto", False, "float32", 8)
    opts = Options.resolve(8)
"""
    found = [name for _, name in _recipe_calls(ast.parse(copy))]
    assert sorted(found) == ["extend.resolve", "merger_for", "op_needed"], found
