"""``generate``'s output on rank 0: figures, ``--check``'s verdict, JSON objects, notes."""

import math
import sys

from ._display import progress


def prefill_bar(model, rank):
    """Draw a progress bar over the decoder layers during the prompt's first forward (rank 0)."""
    layers = model.model.layers
    total, hooks = len(layers), []

    def hook(index):
        progress("prefill", index + 1, total, f"layer {index + 1} of {total}")
        if index + 1 == total:  # one pass: prefill's last-token step runs without a bar
            for handle in hooks:
                handle.remove()

    if rank == 0:
        for index, layer in enumerate(layers):
            hooks.append(layer.register_forward_hook(lambda m, i, o, index=index: hook(index)))
    return hooks


def _number(x):
    """Return a float for JSON: rounded, None when not finite."""
    return round(x, 6) if math.isfinite(x) else None


def record(answer, **extra):
    """Return the JSON object of one answer (rank 0)."""
    cache = [
        {"rank": r, "tokens": t, "bytes": b}
        for r, (t, b) in enumerate(zip(answer.local_tokens, answer.cache_bytes, strict=True))
    ]
    record = {
        **extra,
        "text": answer.text,
        "token_ids": answer.new_ids,
        "prompt_tokens": answer.prompt_tokens,
        "new_tokens": len(answer.new_ids),
        "finish": answer.finish,
        "time_to_first_token_s": _number(answer.ttft),
        "decode_tokens_per_s": _number(answer.decode_tps),
        "cache_tokens": answer.total_tokens,
        "cache": cache,
    }
    if answer.steps is not None:
        record["steps"] = answer.steps
    if answer.check is not None:
        record["check"] = answer.check
    return record


def header(args, comm):
    """Print the run's settings (rank 0)."""
    p = comm.Get_size()
    print(
        f"\nmpitree generate: {p} rank{'s' if p > 1 else ''}, placement {args.placement}, "
        f"deterministic {args.deterministic or 'off'}, speculative {args.speculative}"
    )
    if args.temperature > 0:
        print(f"sampling: temperature {args.temperature}, top-k {args.top_k}, top-p "
              f"{args.top_p}, seed {0 if args.seed is None else args.seed}")  # fmt: skip
    else:
        print("greedy")


def figures(answer):
    """Print one answer's figures (rank 0)."""
    new = len(answer.new_ids)
    print(f"prompt {answer.prompt_tokens} tokens, generated {new} tokens ({answer.finish})")
    print(f"time to first token {answer.ttft:.2f} s, decode {answer.decode_tps:.1f} tokens/s")
    if answer.steps:
        print(f"tokens per step {new / answer.steps:.2f} ({answer.steps} steps)")
    shares = ", ".join(
        f"{tokens} tok / {size / 2**20:.2f} MiB"
        for tokens, size in zip(answer.local_tokens, answer.cache_bytes, strict=True)
    )
    print(f"cache per rank ({answer.total_tokens} tokens in all): {shares}")


def verdict(answer):
    """Print ``--check``'s verdict line (rank 0)."""
    same = answer.check == "PASS"
    detail = f"{len(answer.new_ids)} tokens" if same else answer.check[len("FAIL: ") :]
    print(f"{'PASS' if same else 'FAIL'}: token ids {'identical to' if same else 'differ from'} "
          f"one process's greedy decode (transformers, sdpa; {detail})")  # fmt: skip


class Notes:
    """Says once (rank 0, stderr) when some ranks hold no token of the cache."""

    def __init__(self, args, cache):
        self.args, self.cache, self.said = args, cache, False

    def see(self, answer):
        """Note the ranks an answer left empty (rank 0)."""
        empty = [r for r, n in enumerate(answer.local_tokens) if n == 0]
        if self.said or not empty:
            return
        self.said = True
        if self.args.placement == "interleave":
            how = f"blocks of {self.cache.block_size} tokens dealt round-robin"
        else:
            how = "the prompt in even chunks, later tokens on the last rank"
        ranks = ", ".join(map(str, empty))
        print(f"python -m mpitree generate: note: rank{'s' if len(empty) > 1 else ''} {ranks} "
              f"hold{'s' if len(empty) == 1 else ''} no token of the cache ({answer.total_tokens} "
              f"tokens, placement {self.args.placement}: {how}); an empty rank joins every "
              "merge with nothing to add", file=sys.stderr)  # fmt: skip
