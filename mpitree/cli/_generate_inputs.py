"""``generate``'s texts: read on rank 0 (a file, stdin, a JSON lines batch) and tokenized.

mpiexec forwards stdin to rank 0 only, and a file may exist on rank 0's node
only, so rank 0 reads every text before the weights load and the caller
broadcasts it. A missing or empty prompt file, or a batch line that is not a
prompt, is a ``ValueError`` naming it.
"""

import json
import sys
from pathlib import Path

DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."
BATCH_KEYS = ("prompt", "id", "system", "max_new_tokens")


def _read(path, what):
    """Return the text of ``path`` (``-``: stdin) and its name for messages."""
    name = "stdin" if path == "-" else path
    try:  # UTF-8, strictly: stdin's own decoding may let invalid bytes through as surrogates
        if path == "-":
            return sys.stdin.buffer.read().decode("utf-8"), name
        return Path(path).read_text(encoding="utf-8"), name
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise ValueError(f"cannot read the {what} {name}: {reason}") from None


def read_prompt(path):
    """Return the prompt in the text file ``path`` (``-``: stdin); refuse an empty one."""
    text, name = _read(path, "prompt file")
    if not text.strip():
        raise ValueError(f"the prompt file {name} is empty")
    return text


def _count(value, where):
    """Return ``value`` if it is a positive int, else raise naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: max_new_tokens must be a positive integer, got {value!r}")
    return value


def read_batch(path, max_new_tokens, system):
    """Return the requests of a JSON lines file (``-``: stdin), in order.

    Each non-blank line is an object with a string ``"prompt"`` and optional
    ``"id"`` (default: its index among the prompts), ``"system"`` (default:
    ``system``) and ``"max_new_tokens"`` (default: ``max_new_tokens``).
    """
    text, name = _read(path, "prompts file")
    requests = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{name} line {number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
            raise ValueError(f'{where}: expected an object with a string "prompt", got {line!r}')
        unknown = sorted(set(item) - set(BATCH_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown} (known: {list(BATCH_KEYS)})")
        if not isinstance(item.get("system", ""), str):
            raise ValueError(f'{where}: "system" must be a string')
        requests.append(
            {
                "id": item.get("id", len(requests)),
                "prompt": item["prompt"],
                "system": item.get("system", system),
                "max_new_tokens": _count(item.get("max_new_tokens", max_new_tokens), where),
            }
        )
    if not requests:
        raise ValueError(f"the prompts file {name} holds no prompt")
    return requests


def messages(system, turns):
    """Return a chat's messages: the system message (if any), then the turns, user first."""
    head = [] if system is None else [{"role": "system", "content": system}]
    roles = ("user", "assistant")
    return head + [{"role": roles[i % 2], "content": text} for i, text in enumerate(turns)]


def token_ids(tokenizer, conversation, raw):
    """Return the ``(1, S)`` ids of a conversation, the assistant's turn opened.

    ``raw``: the last message's text alone, without the chat template (also
    when the tokenizer has none). Raises ``ValueError`` when there is no token.
    """
    import torch

    if raw or tokenizer.chat_template is None:
        ids = tokenizer(conversation[-1]["content"], return_tensors="pt").input_ids
    else:
        ids = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, return_tensors="pt"
        )
        ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    if ids.shape[1] == 0:
        raise ValueError("the prompt has no token (an empty text without the chat template)")
    return ids
