"""The transformers path across an emulated cluster, equal to one process; run by test_cluster.py.

A tiny random Llama (tests/models.py) generates greedily over a ShardedCache
(sharded prefill, then ``model.generate``) under each placement, one with the
hierarchical merge and one with the flat one, and speculatively with
``mtt.generate`` (hierarchical merge, interleaved placement); each must
give one process's tokens (eager attention, computed on every rank without MPI)
and its logits to 1e-4. Every rank's failures are gathered: rank 0 prints them
and every rank exits 1 on any failure, 0 otherwise.
"""

import sys

import mpitree.adapters.transformers as mtt
import torch
from helpers import report_failures
from models import greedy, prompt, tiny_llama
from mpi4py import MPI

NEW = 12
LOGIT_ATOL = 1e-4


def check_generate(model, ids, mask, ref, failures):
    """Sharded prefill plus ``model.generate`` under each placement, with either merge."""
    for placement, strategy in zip(mtt.PLACEMENTS, ("hierarchical", "allreduce"), strict=True):
        name = f"generate {placement} {strategy}"
        cache = mtt.ShardedCache(model.config, placement=placement, block_size=4, strategy=strategy)
        model.set_attn_implementation("mpitree")
        mtt.prefill(model, ids[:, :-1], cache, attention_mask=mask[:, :-1])
        got = greedy(model, ids, mask, cache, NEW)
        if not torch.equal(got.sequences, ref.sequences):
            failures.append(f"{name}: tokens differ from one process")
        err = float((torch.stack(got.logits, 1) - torch.stack(ref.logits, 1)).abs().max())
        if err > LOGIT_ATOL:
            failures.append(f"{name}: max |logits - one process| = {err:.3g}")
        if cache.get_seq_length() != ids.shape[1] + NEW - 1:
            failures.append(f"{name}: the cache holds {cache.get_seq_length()} tokens")


def check_speculative(model, ids, mask, ref, failures):
    """``mtt.generate`` with prompt lookup on a looping prompt: plain greedy's tokens."""
    more = ref.sequences[:, ids.shape[1] :]  # the model's own continuation: lookups hit
    ids, mask = torch.cat([ids, more], 1), torch.cat([mask, torch.ones_like(more)], 1)
    model.set_attn_implementation("eager")
    plain = greedy(model, ids, mask, None, NEW).sequences
    cache = mtt.ShardedCache(
        model.config, placement="interleave", block_size=4, strategy="hierarchical"
    )
    model.set_attn_implementation("mpitree")
    drafter = mtt.PromptLookup(num_tokens=4)
    out = mtt.generate(
        model, ids, cache, drafter=drafter, max_new_tokens=NEW, attention_mask=mask, node_cost=None
    )
    if not torch.equal(out.sequences, plain):
        failures.append("speculative: tokens differ from plain greedy")
    if float(out.accepted.float().mean()) < 1:
        failures.append(f"speculative: drafts were not accepted: {out.accepted}")


def main():
    comm = MPI.COMM_WORLD
    failures = []
    try:
        model = tiny_llama()
        ids, mask = prompt(29, True)
        model.set_attn_implementation("eager")
        ref = greedy(model, ids, mask, None, NEW)  # one process: no MPI involved
        check_generate(model, ids, mask, ref, failures)
        check_speculative(model, ids, mask, ref, failures)
    except Exception as exc:  # mpitree raises on every rank alike
        failures.append(f"{type(exc).__name__}: {exc}")
    return report_failures(
        comm, failures, f"cluster_transformers_prog: {comm.size} ranks: equal to one process"
    )


if __name__ == "__main__":
    sys.exit(main())
