"""``generate``'s decoding: one answer at a time over a ShardedCache kept between answers.

A :class:`Session` holds the model and one cache. Each :meth:`Session.answer`
decodes one prompt's ids: from an empty cache (the prompt prefilled, its work
split over the ranks), or, for a chat's next turn, after cropping the cache to
the longest prefix it shares with the new ids, so only the turn's new tokens
run. Every rank calls it alike; rank 0 may stream the text, holding back a stop
string and whatever could still become one.
"""

import math
import time
from dataclasses import dataclass


@dataclass
class Answer:
    """One decoded answer and its figures (every rank holds the same, gathers on rank 0)."""

    sequences: object  # (1, S + n) torch int64: the prompt's ids, then the answer's
    prompt_tokens: int  # S
    reused: int  # prompt tokens the cache already held (a chat's earlier turns)
    text: str  # the answer, special tokens skipped, cut before a stop string
    finish: str  # "stop" (a stop string), "eos" (an end-of-sequence token) or "length"
    ttft: float  # seconds from the start to the first new token
    decode_tps: float  # new tokens after the first per second (nan under two tokens)
    steps: int | None  # speculative decoding's steps (None: one token per step)
    local_tokens: list | None  # per rank (rank 0; None elsewhere)
    cache_bytes: list | None  # per rank (rank 0; None elsewhere)
    total_tokens: int  # the cache's global length afterwards
    check: str | None = None  # "PASS" or "FAIL: ..." under --check (every rank)

    @property
    def new_ids(self):
        """The answer's token ids (a list)."""
        return self.sequences[0, self.prompt_tokens :].tolist()


def _shown(text, stops):
    """Return the part of ``text`` that may be shown now, and whether a stop string ended it.

    Cut before the first stop string; otherwise hold back a trailing part that
    could begin one, and an incomplete character (U+FFFD at the end).
    """
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    if found:
        return text[: min(found)], True
    end = len(text)
    for stop in stops:
        for n in range(min(len(stop) - 1, end), 0, -1):
            if text.endswith(stop[:n]):
                end = min(end, len(text) - n)
                break
    while end and text[end - 1] == "\ufffd":
        end -= 1
    return text[:end], False


class Stream:
    """A streamer (transformers' interface) that times the first token and may print it.

    ``out``: where rank 0 writes the answer as it grows (None: nowhere).
    """

    def __init__(self, tokenizer, stops, out):
        self.tokenizer, self.stops, self.out = tokenizer, stops, out
        # the ids since the last shown line end, and how much of their text is shown
        self.ids, self.first, self.prompt_seen, self.done = [], None, False, 0

    def put(self, tokens):
        """Time the first new token; print what may be shown (the prompt comes first: skipped)."""
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        if self.first is None:
            self.first = time.perf_counter()
        if self.out is not None:
            self.ids += tokens.reshape(-1).tolist()
            text = self._text()
            shown = _shown(text, self.stops)[0]
            self._show(shown)
            if shown == text and text.endswith("\n"):  # nothing held back: start a new line
                self.ids, self.done = [], 0

    def _text(self):
        """Return the text of the ids since the last shown line end."""
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def _show(self, text):
        """Print the part of ``text`` not printed yet."""
        if len(text) > self.done:
            self.out.write(text[self.done :])
            self.out.flush()
            self.done = len(text)

    def end(self):
        """Print the rest of the answer (up to a stop string) and end its line."""
        if self.out is not None:
            text = self._text()
            found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
            self._show(text[: min(found)] if found else text)
            self.out.write("\n")
            self.out.flush()


class _NoDraft:
    """A drafter with nothing to propose: ``mtt.generate`` takes plain (sampled) steps."""

    def propose(self, tokens, attention_mask, depth):
        """Propose no candidate (``(B, 1, 0)``)."""
        return tokens.new_empty(tokens.shape[0], 1, 0)


def _common(a, b):
    """Return the length of the longest common prefix of two 1-D tensors."""
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0, 0]) if len(differ) else n


class Session:
    """The model, its tokenizer and one ShardedCache over ``comm``, for answers in turn.

    Parameters
    ----------
    settings : argparse.Namespace
        ``generate``'s options (placement, deterministic, speculative, stop, ...).
    sampling : dict
        ``mtt.generate``'s sampling arguments ({} when greedy).
    mtt, model, tokenizer, draft
        The adapter module, the model (attn ``"mpitree"``), its tokenizer, and the
        draft model (None without ``--speculative draft-model``).
    comm : mpi4py.MPI.Intracomm
    """

    def __init__(self, settings, sampling, mtt, model, tokenizer, draft, comm):
        self.settings, self.sampling, self.comm = settings, sampling, comm
        self.mtt, self.model, self.tokenizer, self.draft = mtt, model, tokenizer, draft
        kw = {"deterministic": settings.deterministic} if settings.deterministic else {}
        self.cache = mtt.ShardedCache(model.config, comm=comm, placement=settings.placement, **kw)
        self.known = None  # the last answer's sequence: the cache holds a prefix of it
        self.stops = list(settings.stop or ())

    def _start(self, ids, keep):
        """Empty the cache, or (``keep``) crop it to its prefix shared with ``ids``; return that."""
        cache, held = self.cache, self.cache.get_seq_length()
        reused = 0
        if keep and self.known is not None:
            reused = min(_common(ids[0], self.known), held, ids.shape[1] - 1)
        if reused < held:  # the same on every rank: each crops its own shard
            if reused:
                cache.crop(reused - held)
            else:
                cache.reset()
        return reused

    def answer(self, ids, max_new_tokens, *, keep=False, out=None, prefill_bar=None):
        """Decode the ``(1, S)`` prompt ``ids``; return an :class:`Answer` (collective).

        ``keep``: reuse the cached prefix shared with ``ids`` (a chat's next turn);
        ``out``: where rank 0 streams the text; ``prefill_bar``: called with the
        model around a long prompt's prefill (it returns hooks to remove).
        """
        import torch

        mtt, model, cache = self.mtt, self.model, self.cache
        reused = self._start(ids, keep)
        stream = Stream(self.tokenizer, self.stops, out)
        start = time.perf_counter()
        if reused == 0 and ids.shape[1] > 1:
            hooks = prefill_bar(model) if prefill_bar and ids.shape[1] >= 512 else []
            try:
                mtt.prefill(model, ids[:, :-1], cache)
            finally:
                for hook in hooks:
                    hook.remove()
        steps = None
        s = self.settings
        if s.speculative == "none" and not self.sampling and not self.stops:
            with torch.no_grad():
                sequences = model.generate(
                    ids,
                    cache=cache,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    streamer=stream,
                )
        else:
            drafter = _NoDraft()
            if s.speculative != "none":
                drafter = mtt.PromptLookup() if self.draft is None else mtt.DraftModel(self.draft)
            stop = {"stop_strings": self.stops, "tokenizer": self.tokenizer} if self.stops else {}
            spec = mtt.generate(
                model,
                ids,
                cache,
                drafter=drafter,
                max_new_tokens=max_new_tokens,
                streamer=stream,
                **stop,
                **self.sampling,
            )
            sequences = spec.sequences
            steps = None if s.speculative == "none" else len(spec.committed) + 1
        end = time.perf_counter()
        self.known = sequences[0]
        return self._answer(ids, sequences, reused, stream, start, end, steps)

    def _answer(self, ids, sequences, reused, stream, start, end, steps):
        """Gather the cache's figures and build the :class:`Answer` (collective)."""
        cache = self.cache
        size = sum(x.nbytes for layer in cache.layers for x in (layer.keys, layer.values))
        new = sequences.shape[1] - ids.shape[1]
        first = stream.first or end
        text = self.tokenizer.decode(sequences[0, ids.shape[1] :], skip_special_tokens=True)
        shown, stopped = _shown(text, self.stops)
        eos = self.model.generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        ended = new and int(sequences[0, -1]) in eos
        return Answer(
            sequences=sequences,
            prompt_tokens=ids.shape[1],
            reused=reused,
            text=shown if stopped else text,
            finish="stop" if stopped else "eos" if ended else "length",
            ttft=first - start,
            decode_tps=(new - 1) / (end - first) if new > 1 and end > first else math.nan,
            steps=steps,
            local_tokens=self.comm.gather(cache.local_length()),
            cache_bytes=self.comm.gather(size),
            total_tokens=cache.get_seq_length(),
        )

    def check(self, answer, max_new_tokens):
        """Compare ``answer`` with one process's greedy decode (sdpa, its own cache).

        Rank 0 decodes; every rank gets the verdict ("PASS" or "FAIL: ...").
        A stop string ends the answer early: it must then be a prefix of the
        reference, cut where the stop string appeared.
        """
        verdict = None
        if self.comm.Get_rank() == 0:
            verdict = _compare(self._reference(answer, max_new_tokens), answer, bool(self.stops))
        answer.check = self.comm.bcast(verdict, root=0)
        return answer.check

    def _reference(self, answer, max_new_tokens):
        """One process's greedy decode of ``answer``'s prompt: transformers' sdpa, own cache."""
        import torch

        model = self.model
        model.set_attn_implementation("sdpa")
        try:
            with torch.no_grad():
                ids = answer.sequences[:, : answer.prompt_tokens]
                return model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        finally:
            model.set_attn_implementation("mpitree")


def _compare(want, answer, stops):
    """Return "PASS" or "FAIL: where the token ids differ" (``stops``: a prefix may pass)."""
    got, s = answer.sequences, answer.prompt_tokens
    same = want.shape == got.shape or (stops and answer.finish == "stop")
    width = min(want.shape[1], got.shape[1])
    at = _common(want[0, :width], got[0, :width])
    if same and at == width:
        return "PASS"
    return f"FAIL: first difference at generated token {at - s}"
