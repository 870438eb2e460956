"""Drafters for :func:`generate`: they propose a tree of candidate continuations.

A drafter is any object with a ``propose(tokens, attention_mask, depth)`` method
(:class:`Drafter`). It runs locally on every rank and must not communicate; the
ranks' drafts are compared by :func:`generate`, never assumed equal.
"""

from __future__ import annotations

import copy
from typing import Protocol, runtime_checkable

import torch
from transformers import DynamicCache


@runtime_checkable
class Drafter(Protocol):
    """What :func:`generate` needs from a drafter: one method, run on every rank alike."""

    def propose(
        self, tokens: torch.Tensor, attention_mask: torch.Tensor, depth: int
    ) -> torch.Tensor:
        """Propose candidate continuations of every row.

        Parameters
        ----------
        tokens : torch.Tensor
            ``(B, S)`` int64: every token so far (left-padded prompt, then the
            generated ones); the candidates continue after ``tokens[:, -1]``.
        attention_mask : torch.Tensor
            ``(B, S)`` int64: 1 at real tokens, 0 at left padding.
        depth : int
            The most tokens a candidate may have (``>= 1``).

        Returns
        -------
        torch.Tensor
            ``(B, M, C)`` int64 token ids, ``M >= 1``, ``1 <= C <= depth``: ``M``
            candidates of ``C`` tokens per row. Candidates that share a prefix form
            a tree; duplicates cost nothing.
        """
        ...


def _positions(mask):
    """Return generate's position ids of a ``(B, S)`` mask: real tokens counted, 0 at padding."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


def _beam(rows, fill):
    """Stack per-row lists of 1-D candidates into a ``(B, M, C)`` int64 beam.

    Short candidates repeat their last token, rows with fewer candidates repeat their
    first one (a duplicate packs to no new node); a row without any gets ``fill[b]``.
    """
    rows = [cands or [fill[b : b + 1]] for b, cands in enumerate(rows)]
    m = max(len(cands) for cands in rows)
    c = max(len(x) for cands in rows for x in cands)
    beam = torch.empty(len(rows), m, c, dtype=torch.long)
    for b, cands in enumerate(rows):
        for j in range(m):
            x = cands[j] if j < len(cands) else cands[0]
            beam[b, j, : len(x)] = x
            beam[b, j, len(x) :] = x[-1]
    return beam


class PromptLookup:
    """Prompt lookup: continuations of earlier occurrences of the last n-gram.

    For ``n`` from ``max_ngram`` down to 1, every earlier place where the row's last
    ``n`` real tokens occurred (prompt or generated text, most recent first)
    proposes the tokens that followed it. Several matches make a tree: they share
    prefixes where their continuations agree. A row without any match proposes its
    last token again; when no row has a match, the step drafts nothing (a plain step).

    Parameters
    ----------
    num_tokens : int
        The most tokens per candidate (the tree's depth).
    max_ngram : int
        The longest n-gram matched.
    max_matches : int
        The most candidates per row.
    """

    def __init__(self, num_tokens=4, max_ngram=3, max_matches=4):
        for name, value in dict(
            num_tokens=num_tokens, max_ngram=max_ngram, max_matches=max_matches
        ).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_tokens, self.max_ngram, self.max_matches = num_tokens, max_ngram, max_matches

    def propose(self, tokens, attention_mask, depth):
        """Propose up to ``max_matches`` continuations per row; see :class:`Drafter`."""
        width = min(self.num_tokens, depth)
        rows = [
            self._matches(seq[keep.bool()], width)
            for seq, keep in zip(tokens, attention_mask, strict=True)
        ]
        if not any(rows):
            return tokens.new_empty(tokens.shape[0], 1, 0)
        return _beam(rows, tokens[:, -1])

    def _matches(self, seq, width):
        """Distinct continuations (1-D, at most ``width`` tokens) of one row's real tokens."""
        found, seen = [], set()
        for n in range(min(self.max_ngram, seq.numel() - 1), 0, -1):
            windows = seq[:-1].unfold(0, n, 1)  # starts 0..len-1-n: a continuation follows
            starts = (windows == seq[-n:]).all(-1).nonzero()[:, 0].flip(0)
            for i in starts.tolist():
                cont = seq[i + n : i + n + width]
                key = tuple(cont.tolist())
                if key not in seen:
                    seen.add(key)
                    found.append(cont)
                if len(found) == self.max_matches:
                    return found
        return found


class DraftModel:
    """A small transformers model, replicated on every rank, drafts greedy chains.

    Its ``top_k`` likeliest next tokens each start a candidate, continued greedily:
    a tree of ``top_k`` branches from the root. It runs locally (``"eager"`` or
    ``"sdpa"`` attention), with the target's vocabulary. It keeps its own
    ``DynamicCache`` of the tokens it saw last, so a call runs only the tokens added
    since (the cache starts afresh when the tokens are not a continuation).

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The draft model, the same weights on every rank; not under the ``"mpitree"``
        attention (a drafter must not communicate).
    num_tokens : int
        The most tokens per candidate.
    top_k : int
        Branches at the root (``1``: a single chain).
    """

    def __init__(self, model, num_tokens=4, top_k=2):
        for name, value in dict(num_tokens=num_tokens, top_k=top_k).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.model, self.num_tokens, self.top_k = model, num_tokens, top_k
        self._seen = None  # (tokens, mask, DynamicCache holding them) of the last call

    def propose(self, tokens, attention_mask, depth):
        """Propose ``top_k`` greedy chains per row; see :class:`Drafter`."""
        if getattr(self.model.config, "_attn_implementation", None) == "mpitree":
            raise ValueError(
                "DraftModel runs locally on every rank: give its model attn_implementation "
                "'eager' or 'sdpa', not 'mpitree'"
            )
        b, width, k = tokens.shape[0], min(self.num_tokens, depth), self.top_k
        mask = attention_mask.long()
        cache, done = self._reuse(tokens, mask)
        with torch.no_grad():
            out = self.model(
                tokens[:, done:],
                attention_mask=mask,
                position_ids=_positions(mask)[:, done:],
                cache=cache,
            )
            self._seen = (tokens.clone(), mask.clone(), cache)
            chain = [out.logits[:, -1].topk(k, -1).indices.reshape(b * k, 1)]
            cache = copy.deepcopy(cache)
            cache.batch_repeat_interleave(k)
            mask = mask.repeat_interleave(k, 0)
            position = mask.sum(-1, keepdim=True)
            for _ in range(width - 1):
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
                logits = self.model(
                    chain[-1], attention_mask=mask, position_ids=position, cache=cache
                ).logits
                chain.append(logits[:, -1].argmax(-1, keepdim=True))
                position = position + 1
        return torch.cat(chain, 1).reshape(b, k, width)

    def _reuse(self, tokens, mask):
        """Return the kept cache and its length if it holds a strict prefix; else a new one."""
        if self._seen is not None:
            seen, seen_mask, cache = self._seen
            n = seen.shape[1]
            if (
                seen.shape[0] == tokens.shape[0]
                and n < tokens.shape[1]
                and torch.equal(seen, tokens[:, :n])
                and torch.equal(seen_mask, mask[:, :n])
            ):
                return cache, n
        return DynamicCache(config=self.model.config), 0
