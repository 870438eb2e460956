"""Speculative decoding over a :class:`ShardedCache`: draft, verify, commit (greedy or sampled)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch
from mpi4py import MPI

from mpitree import extend, spec

from ._budget import Budget, check_node_cost
from ._cache import ShardedCache
from ._drafters import _positions
from ._sampling import sampler_for
from ._spec import verify


@dataclass
class Speculation:
    """What :func:`generate` returns.

    Attributes
    ----------
    sequences : torch.Tensor
        ``(B, S + max_new_tokens)`` int64: the prompt, then the greedy (or sampled) tokens.
    accepted : torch.Tensor
        ``(steps, B)`` int64: drafted tokens of each row's best candidate that the
        target accepted, per step.
    committed : torch.Tensor
        ``(steps,)`` int64: tokens each row gained per step (every row the same).
    tree_nodes : torch.Tensor
        ``(steps,)`` int64: packed tree length ``L`` verified per step (the pending
        token included).
    """

    sequences: torch.Tensor
    accepted: torch.Tensor
    committed: torch.Tensor
    tree_nodes: torch.Tensor


def _digest(*tensors):
    """Return a short hex digest of the tensors' values (ranks compare it)."""
    h = hashlib.blake2b(digest_size=12)
    for t in tensors:
        h.update(repr((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _positive(name, value):
    """Raise unless ``value`` is a positive int."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_start(
    model, input_ids, cache, drafter, max_new_tokens, attention_mask, node_cost, sampling, ends
):
    """Validate :func:`generate`'s arguments; return a call of the signature, (sampler, stops).

    ``ends``: ``(eos_token_id, pad_token_id, stop_strings, tokenizer)``.
    """
    if not isinstance(cache, ShardedCache):
        raise TypeError(f"cache must be a ShardedCache, got {type(cache).__name__}")
    if getattr(model.config, "_attn_implementation", None) != "mpitree":
        raise ValueError("the model must run attn_implementation='mpitree'")
    if not callable(getattr(drafter, "propose", None)):
        raise TypeError(
            f"drafter needs a propose(tokens, attention_mask, depth) method: {drafter!r}"
        )
    _positive("max_new_tokens", max_new_tokens)
    check_node_cost(node_cost)
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.shape[1] < 1:
        raise ValueError("input_ids must be a (B, S) torch tensor with S >= 1")
    if input_ids.dtype == torch.bool or input_ids.is_floating_point() or input_ids.is_complex():
        raise TypeError(f"input_ids must hold integer token ids, got {input_ids.dtype}")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}, "
            f"got {tuple(attention_mask.shape)}"
        )
    config = model.config
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) and window is not None:
        if window < input_ids.shape[1] + max_new_tokens:
            raise ValueError(
                f"a sliding window ({window}) shorter than the sequence "
                f"({input_ids.shape[1]} + {max_new_tokens}) is not supported: the draft "
                "tree's 4-D mask would override it"
            )
    cached = cache.get_seq_length()
    if cached >= input_ids.shape[1]:
        raise ValueError(
            f"the cache holds {cached} tokens: it must hold a strict prefix of input_ids "
            f"({input_ids.shape[1]} tokens), e.g. prefill(model, input_ids[:, :-1], cache)"
        )
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    sampler, agreed = sampler_for(model, *sampling)
    stops = _Stops(model, input_ids.shape[1], input_ids.shape[0], *ends)
    signature = {
        "input": (*input_ids.shape, cached),
        "max_new_tokens": max_new_tokens,
        # the ranks' budgets must decide alike (1 and 1.0 are the same cost)
        "node_cost": node_cost
        if node_cost is None or isinstance(node_cost, str)
        else float(node_cost),
        "prompt": _digest(input_ids, mask.long()),
        "ends": stops.signature(),  # rows must end alike on every rank
        **agreed,
    }
    return extend.Call(signature, (sampler, stops))


def _choose(logits, sampler, column):
    """Return the next token ``(B, 1)`` of ``(B, V)`` logits: the argmax, or the column's draw."""
    if sampler is None:
        return logits.argmax(-1, keepdim=True)
    return sampler.draw_rows(logits, column)


def _draft(drafter, tokens, mask, depth, vocab):
    """Ask the drafter for this step's candidates and check them; ``(B, 0, 0)`` when depth is 0."""
    b = tokens.shape[0]
    if depth == 0:  # one token left to produce: the target's own next token, no draft
        return torch.empty(b, 1, 0, dtype=torch.long)
    beam = drafter.propose(tokens.clone(), mask.clone(), depth)
    if not isinstance(beam, torch.Tensor):
        raise TypeError(f"the drafter must return a torch tensor, got {type(beam).__name__}")
    if beam.dtype == torch.bool or beam.is_floating_point() or beam.is_complex():
        raise TypeError(f"the drafter must return integer token ids, got {beam.dtype}")
    if beam.ndim != 3 or beam.shape[0] != b:
        raise ValueError(f"the drafter must return a (B={b}, M, C) draft, got {tuple(beam.shape)}")
    if beam.shape[1] < 1:
        raise ValueError(f"the drafter returned an empty draft {tuple(beam.shape)} (M = 0)")
    if beam.shape[2] == 0:  # nothing worth verifying: a plain step
        return torch.empty(b, 1, 0, dtype=torch.long)
    if beam.shape[2] > depth:
        raise ValueError(
            f"the draft is {beam.shape[2]} tokens deep, but only {depth} more fit in "
            "max_new_tokens (after the target's own next token)"
        )
    beam = beam.to(device=tokens.device, dtype=torch.long)
    if bool(((beam < 0) | (beam >= vocab)).any()):
        bad = beam[(beam < 0) | (beam >= vocab)]
        raise ValueError(f"the drafter proposed token ids outside [0, {vocab}): {bad[:8].tolist()}")
    return beam


class _Stops:
    """Which rows have ended, by an end-of-sequence token or a stop string (as ``generate``)."""

    def __init__(self, model, prompt_len, batch, eos_token_id, pad_token_id, stop, tokenizer):
        config = model.generation_config
        eos = config.eos_token_id if eos_token_id is None else eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        pad = config.pad_token_id if pad_token_id is None else pad_token_id
        if pad is None and eos:
            pad = eos[0]  # as model.generate does, with a warning
        stop = [stop] if isinstance(stop, str) else list(stop or ())
        if not all(isinstance(s, str) for s in stop):
            raise TypeError(f"stop_strings must be a str or a list of str, got {stop!r}")
        if stop and tokenizer is None:  # "" too: it names a stop string
            raise ValueError("stop_strings needs the tokenizer (tokenizer=...)")
        self.eos, self.pad = torch.tensor(eos, dtype=torch.long), pad
        self.stop, self.tokenizer = stop, tokenizer
        self.start = prompt_len
        self.end = torch.full((batch,), -1, dtype=torch.long)  # sequence length at the end

    def signature(self):
        """Return what every rank must share: the end tokens, the padding, the stop strings."""
        name = None if self.tokenizer is None else getattr(self.tokenizer, "name_or_path", "")
        pad = None if self.pad is None else int(self.pad)
        return (tuple(self.eos.tolist()), pad, tuple(self.stop), name)

    def see(self, tokens, new):
        """Note the rows that ended among the last ``new`` tokens of ``tokens`` ``(B, S)``."""
        for b in (self.end < 0).nonzero()[:, 0].tolist():
            for j in range(tokens.shape[1] - new, tokens.shape[1]):
                if bool(torch.isin(tokens[b, j], self.eos)) or self._stopped(tokens[b, : j + 1]):
                    self.end[b] = j + 1
                    break

    def _stopped(self, row):
        """Whether the row's generated text contains a stop string."""
        if not self.stop:
            return False
        text = self.tokenizer.decode(row[self.start :].clone())  # a copy: not our tokens
        return any(s in text for s in self.stop)

    @property
    def all_done(self):
        """Whether every row has ended."""
        return bool((self.end >= 0).all())

    def finish(self, tokens):
        """Pad every row after its end; cut after the last row's end once all have ended."""
        if self.end.numel() and self.all_done:
            tokens = tokens[:, : int(self.end.max())]
        if self.pad is not None:
            after = torch.arange(tokens.shape[1])[None, :] >= self.end[:, None]
            tokens = tokens.masked_fill(after & (self.end[:, None] >= 0), self.pad)
        return tokens


def _observe(stops, streamer, tokens, new, prompt=None):
    """Note the rows that ended in the last ``new`` tokens and stream row 0's; return a failure.

    The tokenizer (stop strings) and the streamer are the user's code, run on this
    rank alone: an exception they raise is returned, not raised, so that
    :func:`_settle` raises it on every rank. They get copies (``.cpu()`` of a CPU
    tensor is a view): what they write into them cannot reach the tokens, which
    no collective compares after a plain step. ``prompt``: streamed first.
    """
    try:
        stops.see(tokens, new)
        if streamer is not None:
            if prompt is not None:
                streamer.put(prompt[0].cpu().clone())
            first = tokens.shape[1] - new  # row 0's new tokens, up to its end
            stop = tokens.shape[1] if stops.end[0] < 0 else int(stops.end[0])
            if stop > first:
                streamer.put(tokens[0, first:stop].cpu().clone())
    except Exception as exc:  # this rank's verdict, settled in the next collective
        return exc
    return None


def _settle(comm, stops, streamer, failed):
    """Agree on a step's local outcome; return whether any rank has a streamer.

    One flagged all-reduce (MAX) of ``[streaming, ends, -ends]``, every rank's row
    ends (``stops.end``): ``failed`` on any rank raises on every rank (the failing
    rank's own exception, :class:`RankError` elsewhere); rows that ended at other
    tokens on other ranks raise ``ValueError`` on every rank.
    """
    end = stops.end.double().numpy()
    sent = np.concatenate([[float(streamer is not None)], end, -end])
    agreed = extend.flagged_allreduce(comm, sent, MPI.MAX, failed)
    b = end.shape[0]
    if (agreed[1 : 1 + b] != -agreed[1 + b :]).any():  # every rank sees it: all raise
        _raise_ends_differ(comm, stops)
    return bool(agreed[0])


def _raise_ends_differ(comm, stops):
    """Raise ``ValueError`` on every rank, naming each rank's row ends (failure path only)."""
    ends = tuple(stops.end.tolist())
    try:
        extend.agree(comm, lambda: extend.Call({"row ends": ends}))
    except ValueError as exc:
        raise ValueError(
            f"{exc}: the ranks ended rows at different tokens (a row's length at its end, "
            "-1 while it runs); with stop_strings, do their tokenizers decode the same "
            "tokens differently?"
        ) from None
    raise RuntimeError("mpitree internal error: the row ends differ but every rank agreed")


def _plain_step(model, cache, tokens, mask, sampler):
    """One token per row from the pending one: ``(new (B, 1), 1, 1, accepted zeros (B,))``."""
    with torch.no_grad():
        logits = model(
            tokens[:, -1:],
            attention_mask=mask,
            position_ids=_positions(mask)[:, -1:],
            cache=cache,
            use_cache=True,
        ).logits
    nxt = _choose(logits[:, -1], sampler, tokens.shape[1])
    return nxt, 1, 1, torch.zeros(tokens.shape[0], dtype=torch.long)


def _speculative_step(model, cache, tokens, mask, beam, batch, sampler):
    """Verify the draft tree after the pending token; commit the accepted path.

    Greedy: the longest candidate prefix equal to the target's argmax. Sampling:
    :meth:`Sampler.accept`'s walk, a draw at each node with its column's uniforms.

    Returns the new tokens ``(B, m)``, ``m``, the tree's node count and each row's
    accepted draft tokens ``(B,)``.
    """
    b = tokens.shape[0]
    tree = torch.cat([tokens[:, -1:, None].expand(b, beam.shape[1], 1), beam], -1)
    packed = spec.pack(tree, padding_mask=mask[:, :-1].bool())
    with cache._capturing() as states:
        logits = verify(model, cache, packed, attention_mask=mask[:, :-1])
    if sampler is None:
        index, accepted, _ = spec.greedy_accept(tree, packed, logits)
    else:
        index, accepted, drawn = sampler.accept(tree, packed, logits, tokens.shape[1])
    m = int(accepted.min())  # lockstep: every row commits the shortest acceptance
    path = packed.unpack_map[batch, index, :m]  # (B, m) tree nodes, root first
    rows = batch[:, None]
    cache._commit(
        [k[rows, :, path].transpose(1, 2).contiguous() for k, _ in states],
        [v[rows, :, path].transpose(1, 2).contiguous() for _, v in states],
        packed.position_ids[rows, path],
    )
    if sampler is None:
        nxt = logits.argmax(-1)[batch, path[:, -1]]
        new = torch.cat([tree[batch, index, 1:m], nxt[:, None]], 1)
    else:  # the draws along the path: the tree's tokens below m - 1, then the last draw
        new = drawn[:, :m]
    return new, m, packed.tokens.shape[1], accepted - 1


@extend.entry_point
def generate(
    model,
    input_ids,
    cache,
    *,
    drafter,
    max_new_tokens,
    attention_mask=None,
    eos_token_id=None,
    pad_token_id=None,
    stop_strings=None,
    tokenizer=None,
    streamer=None,
    node_cost="auto",
    do_sample=False,
    temperature=None,
    top_k=None,
    top_p=None,
    seed=None,
):
    """Speculative decoding over a :class:`ShardedCache`: greedy, or sampled exactly.

    Each step, the drafter proposes a tree of candidates after the pending token;
    :func:`mpitree.spec.pack` deduplicates it, one forward pass scores every node
    over the sharded cache (one tree reduction per layer), and the longest
    candidate prefix equal to the target's argmax is accepted, plus the target's
    next token. The accepted tokens' K/V, computed in that pass, are appended on
    the ranks that own their global indices under the cache's placement, at their
    true positions; rejected nodes leave no trace. With ``do_sample=True`` a token
    is drawn at each node of the path instead (one agreed random stream), and the
    path goes on while the draw is one of the node's children: the tokens are plain
    sampling's with the same seed, token for token, so exactly distributed as
    sampling from the filtered target.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Under ``attn_implementation="mpitree"``, the same on every rank.
    input_ids : torch.Tensor
        ``(B, S)`` integer prompt, the same on every rank (left-padded rows allowed).
    cache : ShardedCache
        Empty, or holding a strict prefix of ``input_ids`` (e.g. from
        :func:`prefill` of ``input_ids[:, :-1]``). The rest of the prompt runs
        first, in one step, as ``model.generate``'s first step does; it gives the
        first new token. Holds ``S - 1 + max_new_tokens`` tokens afterwards, as
        after ``model.generate``.
    drafter : Drafter
        Proposes ``(B, M, C)`` candidates (:class:`PromptLookup`,
        :class:`DraftModel`, or your own); runs locally on every rank.
    max_new_tokens : int
        At most this many tokens are generated per row.
    attention_mask : torch.Tensor, optional
        ``(B, S)``, 0 at left padding.
    eos_token_id : int or list of int, optional
        Tokens that end a row (default: the model's ``generation_config``); a row
        ends after the first of them, as in ``model.generate``.
    pad_token_id : int, optional
        Fills a row after its end (default: ``generation_config``'s, else the
        first end-of-sequence token).
    stop_strings : str or list of str, optional
        A row also ends at the token after which its generated text contains one
        of them (needs ``tokenizer``).
    tokenizer : transformers.PreTrainedTokenizerBase, optional
        For ``stop_strings``; every rank's must decode alike (rows that end at
        different tokens on different ranks raise on every rank).
    streamer : transformers.generation.BaseStreamer, optional
        Gets ``put(prompt)``, then row 0's new tokens after every step, then
        ``end()`` (batch 1, as transformers' streamers), on the ranks that pass one.
        What it raises on one rank raises on every rank, at the end of that step.
    node_cost : {"auto"} or float or None, optional
        The adaptive draft budget's cost model. ``"auto"`` (default): a verified
        tree of ``L`` nodes costs ``base + slope * L`` plain steps, the line fitted
        from this call's measured step times (verified steps against the mean
        plain step, agreed as the largest over the ranks; ``1.6 + 0.04 L`` until
        both kinds were timed: SmolLM2-135M on a 2-core x86-64 VM). A float ``c``
        fixes ``1 + c * (L - 1)``. Each step verifies the draft cut at the depth
        with the most expected tokens (from the running acceptance at each depth)
        per unit of cost, or takes a plain step when no depth pays, probing one
        token deep after 1, 2, 4, ... plain steps. ``None``: verify the whole
        draft every step.
    do_sample : bool, optional
        Sample instead of greedy (default False: greedy).
    temperature : float, optional
        ``>= 0``; logits are divided by it before the filters. 0 is greedy. Default:
        the model's ``generation_config``, else 1.0 (as ``model.generate``).
    top_k : int, optional
        ``>= 0``: keep the ``top_k`` likeliest tokens (0: no filter). Default: the
        ``generation_config``'s, else 50 (as ``model.generate``).
    top_p : float, optional
        In ``(0, 1]``: then drop the least likely tokens whose total mass is at most
        ``1 - top_p`` (1: no filter). Default: the ``generation_config``'s, else 1.0.
    seed : int or torch.Generator, optional
        The random stream's 64-bit key, in ``[0, 2**64)``; a CPU ``torch.Generator``
        (or ``None``: torch's default one) gives it by one draw. The ranks agree on
        the key: ranks with different keys raise. The token at column ``t`` of row
        ``b`` is drawn with a uniform that is a function of the key, ``b`` and ``t``
        only, so every rank draws the same tokens, and the tokens are those of
        plain sampling with the same key, whatever the drafter. Unused (and nothing
        drawn) when greedy.

    Returns
    -------
    Speculation
        ``sequences`` ``(B, S + n)`` int64, ``n <= max_new_tokens``, equal to greedy
        ``model.generate``'s (rows ended early padded, the batch cut after its last
        row's end), or sampled, and per-step statistics.

    Raises
    ------
    ValueError, TypeError
        On every rank, when any rank's arguments are bad, its drafter fails or
        returns an empty draft, out-of-vocabulary ids or a tree deeper than the
        tokens left to generate, or when the ranks' prompts, drafts, sampling
        settings or sampling keys differ; on bad sampling arguments (a negative or
        non-finite temperature, ``top_p`` outside ``(0, 1]``, a negative or
        non-integer ``top_k``, a seed outside ``[0, 2**64)``); when the ranks'
        tokenizers end a row at different tokens.
    Exception
        What a rank's streamer or tokenizer raised, on that rank;
        :class:`mpitree.RankError` naming it on the others (in the same step: no
        rank goes on alone).

    Notes
    -----
    Rows accept different numbers of tokens in one step; every row then commits
    the smallest of them (lockstep). This is exact: any prefix of an accepted path
    is accepted, and the token after it is the target's argmax there (the next
    accepted draft token of a row that accepted more). So the cache always holds
    the same global indices as plain decoding, on the same ranks, with the same
    positions, and the tokens are plain greedy's; a batch advances at its slowest
    row's pace. A step costs three small agreements (draft, verification, the
    forward's) and one merge per layer; while any rank streams or stop strings are
    set, one more small collective settles the step's user code (a failure on any
    rank, every row's end: the same on every rank, or a ``ValueError``), and once
    per call otherwise.

    Sampling keeps the target's distribution exactly over draft trees: SpecInfer's
    multi-candidate rule with point-mass drafts (a drafter returns token ids) is one
    draw per node, descending when it is a child. Each token's uniform depends on
    its row and column only, so a token is the same function of its prefix in a
    plain step, at a tree node, or redrawn after lockstep dropped it: the tokens are
    plain sampling's with the same key (the proof is in ``_sampling.py``).
    """
    comm = extend.check_comm(getattr(cache, "comm", None))
    sampling = (do_sample, temperature, top_k, top_p, seed)
    ends = (eos_token_id, pad_token_id, stop_strings, tokenizer)
    start = (model, input_ids, cache, drafter, max_new_tokens, attention_mask, node_cost, sampling)
    sampler, stops = extend.agree(comm, lambda: _check_start(*start, ends)).payload
    tokens = input_ids.long()
    b, s = tokens.shape
    mask = torch.ones_like(tokens) if attention_mask is None else attention_mask.long()
    cached = cache.get_seq_length()
    with torch.no_grad():  # the uncached prompt, as generate's first step runs it
        logits = model(
            tokens[:, cached:],
            attention_mask=mask,
            position_ids=_positions(mask)[:, cached:],
            cache=cache,
            use_cache=True,
        ).logits
    tokens = torch.cat([tokens, _choose(logits[:, -1], sampler, s)], 1)
    mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    failed = _observe(stops, streamer, tokens, 1, prompt=input_ids)
    # once per call: any rank's failure, the rows' ends, and whether any rank streams
    streaming = _settle(comm, stops, streamer, failed)
    settling = streaming or bool(stops.stop)
    vocab = int(model.config.vocab_size)
    batch = torch.arange(b, device=tokens.device)
    steps = []
    budget = Budget(node_cost, comm)
    while tokens.shape[1] < s + max_new_tokens and not stops.all_done:
        depth = s + max_new_tokens - tokens.shape[1] - 1 if budget.drafts() else 0
        beam = tokens.new_empty(b, 1, 0)
        if depth:

            def prepare(tokens=tokens, mask=mask, depth=depth):
                beam = _draft(drafter, tokens, mask, depth, vocab)
                return extend.Call(
                    {"draft": tuple(beam.shape), "draft tokens": _digest(tokens, beam)}, beam
                )

            beam = budget.prune(extend.agree(comm, prepare).payload)
        budget.start()
        if beam.shape[2]:
            new, m, nodes, accepted = _speculative_step(
                model, cache, tokens, mask, beam, batch, sampler
            )
            budget.saw(m - 1, beam.shape[2], nodes)
        else:  # nothing drafted: the plain decode step model.generate takes
            new, m, nodes, accepted = _plain_step(model, cache, tokens, mask, sampler)
            budget.plain()
        tokens = torch.cat([tokens, new], 1)
        mask = torch.cat([mask, torch.ones_like(new)], 1)
        steps.append((accepted, m, nodes))
        failed = _observe(stops, streamer, tokens, new.shape[1])
        if settling:  # a streamer on some rank, or stop strings: the ranks settle the step
            _settle(comm, stops, streamer, failed)
        elif failed is not None:  # end-of-sequence tokens alone: the same on every rank
            raise failed
    if streaming:  # end() on the ranks that stream, then settled
        failed = None
        try:
            if streamer is not None:
                streamer.end()
        except Exception as exc:  # the user's streamer: raised on every rank by the settlement
            failed = exc
        _settle(comm, stops, streamer, failed)
    accepted = (
        torch.stack([a for a, _, _ in steps]) if steps else torch.zeros(0, b, dtype=torch.long)
    )
    committed = torch.tensor([m for _, m, _ in steps], dtype=torch.long)
    tree_nodes = torch.tensor([n for _, _, n in steps])
    return Speculation(stops.finish(tokens), accepted, committed, tree_nodes)
