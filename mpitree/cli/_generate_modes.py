"""``generate``'s three ways to run: one prompt, an interactive chat, a batch of prompts.

Each is collective: every rank runs it with the same arguments; rank 0
(``show``) prints and writes the output.
"""

import json
import sys
import time

from ._generate_inputs import messages, token_ids
from ._generate_report import figures, header, prefill_bar, record, verdict


def one(args, session, notes, ids, show, rank):
    """Decode one prompt; print its text and figures or its JSON object (rank 0).

    Return the exit status: 0, or 1 when ``--check`` failed.
    """
    out = sys.stdout if show and not args.json else None
    bar = lambda model: prefill_bar(model, rank)  # noqa: E731
    answer = session.answer(ids, args.max_new_tokens, out=out, prefill_bar=bar)
    if args.check:
        session.check(answer, args.max_new_tokens)
    if show:
        notes.see(answer)
        if args.json:
            print(json.dumps(record(answer)))
        else:
            header(args, session.comm)
            figures(answer)
            if args.check:
                verdict(answer)
    return 0 if answer.check in (None, "PASS") else 1


def _next_turn(comm, echo):
    """Rank 0 reads the next user turn from stdin (None: the chat ends); every rank gets it.

    ``echo``: print the turn (stdin is not a terminal, which would have shown it).
    """
    turn = None
    if comm.Get_rank() == 0:
        if sys.stdin.isatty():
            print("> ", end="", flush=True)
        try:
            line = sys.stdin.readline()
        except (OSError, UnicodeDecodeError) as exc:  # ends the chat, on every rank
            print(f"python -m mpitree generate: stdin: {exc}", file=sys.stderr)
            line = ""
        turn = line.rstrip("\r\n") or None
        if turn is not None and echo and not sys.stdin.isatty():
            print(f"> {turn}", flush=True)
    return comm.bcast(turn, root=0)


def chat(args, session, notes, first, show):
    """Run the interactive chat, a turn per line, the cache kept; return the exit status."""
    comm, turns, ok, answer = session.comm, [], True, None
    text = show and not args.json
    if text and first is not None:
        print(f"> {first}", flush=True)
    while True:
        turn = _next_turn(comm, text) if first is None else first
        first = None
        if turn is None:
            break
        turns.append(turn)
        ids = token_ids(session.tokenizer, messages(args.system, turns), False)
        out = sys.stdout if text else None
        answer = session.answer(ids, args.max_new_tokens, keep=True, out=out)
        turns.append(answer.text)
        if args.check:
            ok = session.check(answer, args.max_new_tokens) == "PASS" and ok
        if not show:
            continue
        notes.see(answer)
        number = len(turns) // 2
        if args.json:
            line = record(answer, turn=number, reused_tokens=answer.reused)
            print(json.dumps(line), flush=True)
            continue
        print(f"[turn {number}: {answer.prompt_tokens - answer.reused} new prompt tokens after "
              f"{answer.reused} kept in the cache, {len(answer.new_ids)} tokens, first token "
              f"{answer.ttft:.2f} s, {answer.decode_tps:.1f} tokens/s]")  # fmt: skip
        if args.check:
            verdict(answer)
    if text and answer is not None:
        header(args, comm)
        figures(answer)
    if show and answer is None:  # stdin ended (or began with an empty line) before a turn
        print("python -m mpitree generate: --chat: no turn read from stdin (a turn is "
              "a line; an empty line or stdin's end ends the chat)", file=sys.stderr)  # fmt: skip
    return 0 if ok else 1


def batch(args, session, notes, requests, show):
    """Answer a batch one prompt at a time; rank 0 writes the JSON lines, in input order.

    Return the exit status: 0, 1 (a ``--check`` failed) or 2 (``--output`` failed).
    """
    ok, total, seconds = True, 0, 0.0
    out = open(args.output, "w") if show else None  # closed below
    try:
        for request in requests:
            n = request["max_new_tokens"]
            start = time.perf_counter()
            answer = session.answer(request["ids"], n)
            seconds += time.perf_counter() - start  # the check's own decode not counted
            if args.check:
                ok = session.check(answer, n) == "PASS" and ok
            total += len(answer.new_ids)
            failure = None
            if show:
                notes.see(answer)
                try:  # rank 0 alone: the verdict is broadcast, so no rank goes on without it
                    out.write(json.dumps(record(answer, id=request["id"])) + "\n")
                    out.flush()
                except OSError as exc:
                    failure = f"cannot write --output {args.output}: {exc}"
            failure = session.comm.bcast(failure, root=0)
            if failure is not None:
                if show:
                    print(f"python -m mpitree generate: error: {failure}", file=sys.stderr)
                return 2
            if show:
                check = f", {answer.check}" if answer.check else ""
                print(f"[{request['id']}] prompt {answer.prompt_tokens} tokens, generated "
                      f"{len(answer.new_ids)} ({answer.finish}), first token "
                      f"{answer.ttft:.2f} s, decode {answer.decode_tps:.1f} tokens/s{check}",
                      flush=True)  # fmt: skip
    finally:
        if out is not None:
            out.close()
    if show:
        header(args, session.comm)
        rate = total / seconds
        print(f"{len(requests)} prompts, {total} tokens generated in {seconds:.2f} s "
              f"({rate:.1f} tokens/s over the batch); answers in {args.output}")  # fmt: skip
    return 0 if ok else 1
