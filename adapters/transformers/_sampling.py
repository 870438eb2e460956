"""Sampling for :func:`generate`: the filtered target distribution, one agreed random stream.

Every random number is a function of the agreed key and ``(row, column)`` only,
the column being the token's index in the row (prompt and padding included):
``u(row, column)`` is the ``row``-th double of a Philox counter-based stream keyed
by the key, its counter starting at ``column``. A tree node's column is the
committed length plus its depth, so the numbers are a function of the key, the
step, the row and the node. Every rank draws the same numbers, whatever it drew
before.

Why sample-and-match is exact on a draft tree
---------------------------------------------
At a tree node with children ``c_1..c_k``, SpecInfer's multi-candidate rule
accepts ``c_i`` with probability ``min(1, p(c_i) / q_i(c_i))`` and on rejection
sets ``p <- normalize(max(p - q_i, 0))``; if no child is accepted the next token is
drawn from the residual ``p``. :func:`mpitree.spec.pack` merges shared prefixes,
so a node's children are distinct tokens. A drafter here returns token ids only
(no ``q``): as a function of the tokens so far, its candidates are point masses,
``q_i = delta(c_i)``. Then the rule accepts ``c_1`` with probability ``p(c_1)``,
``c_2`` with ``(1 - p(c_1)) * p(c_2) / (1 - p(c_1)) = p(c_2)``, ..., and draws
``x`` outside the children with ``p(x)``: exactly one draw ``x ~ p``, descending
when ``x`` is a child. That is what :meth:`Sampler.accept` does. Its output is
``p`` at every node whatever the candidates are, so it is exact for any drafter
whose proposals do not read this stream (a drafter with its own randomness
included); a drafter that could report a non-degenerate ``q`` would only gain
acceptance from the general rule, never exactness.

Why it equals plain sampling, lockstep included
-----------------------------------------------
The token at column ``t`` of a row is always ``F(p(. | tokens[:t]), u(row, t))``
(``F``: the filtered inverse CDF), whether it is drawn in a plain step or at a
tree node: the node at depth ``d`` after a pending token at column ``t - 1 - d``
holds exactly ``tokens[:t]`` (its path is the drafted tokens that equalled the
draws). Plain sampling draws the same ``F(p(. | tokens[:t]), u(row, t))``, so by
induction over ``t`` the tokens are plain sampling's, token for token, whatever
the drafts and however many tokens each step commits (to the logits' float
rounding: a tree node's logits and a plain step's agree to about 1e-6, so a
uniform that close to a CDF boundary could pick its neighbour, as a near tie can
flip a greedy argmax). Lockstep commit cannot
bias them: a row that drew beyond the batch's committed length draws the same
columns again in the next step, from the same prefix with the same uniform, and
gets the same tokens. Plain sampling with ``u(row, t)`` i.i.d. uniform is an
autoregressive sample of the filtered target, each row independent of the others.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}  # transformers' global defaults
SEEDS = 2**64


def _real(name, value):
    """Return ``value`` as a finite float; raise unless it is a real number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


def _setting(name, value, model):
    """Return the argument, else the ``generation_config``'s value, else transformers' default."""
    if value is None:
        value = getattr(getattr(model, "generation_config", None), name, None)
    return DEFAULTS[name] if value is None else value


def _key(seed):
    """Return the stream's 64-bit key: the seed, or one draw from a torch generator."""
    if seed is None or isinstance(seed, torch.Generator):
        if seed is not None and seed.device.type != "cpu":
            raise ValueError(f"seed must be a CPU torch.Generator, got one on {seed.device}")
        return int(torch.randint(0, 2**63 - 1, (), generator=seed))
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an int in [0, 2**64), a torch.Generator or None: {seed!r}")
    if not 0 <= int(seed) < SEEDS:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return int(seed)


def sampler_for(model, do_sample, temperature, top_k, top_p, seed):
    """Validate the sampling arguments; return ``(Sampler or None, agreed signature fields)``.

    ``None`` (greedy) when ``do_sample`` is False or the temperature is 0. The
    key is drawn from ``seed`` only when sampling.
    """
    if not isinstance(do_sample, (bool, np.bool_)):
        raise TypeError(f"do_sample must be a bool, got {do_sample!r}")
    temperature = _real("temperature", _setting("temperature", temperature, model))
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    top_k = _setting("top_k", top_k, model)
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0: no top-k filter), got {top_k!r}")
    top_p = _real("top_p", _setting("top_p", top_p, model))
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not do_sample or temperature == 0:
        if seed is not None and not isinstance(seed, torch.Generator):
            _key(seed)  # a bad seed is refused even when unused
        return None, {"sampling": None, "sampling seed": None}
    key = _key(seed)
    sampler = Sampler(temperature, int(top_k), top_p, key)
    return sampler, {"sampling": (temperature, int(top_k), top_p), "sampling seed": key}


def sampler(model, *, temperature=None, top_k=None, top_p=None, seed=None):
    """Return the :class:`Sampler` that ``generate(..., do_sample=True)`` would draw with.

    The model's generation config fills every setting left ``None`` (transformers'
    defaults where it has none), exactly as :func:`generate` does; the tools show
    the settings a sampled decode really uses (``sampler.top_k``, ``sampler.top_p``).

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Its ``generation_config`` gives the defaults.
    temperature : float, optional
        ``>= 0``; 0 means greedy.
    top_k : int, optional
        ``>= 0``; 0 keeps every token.
    top_p : float, optional
        In ``(0, 1]``.
    seed : int or torch.Generator, optional
        The random stream's key, an int in ``[0, 2**64)``; a CPU generator (or
        None: torch's global one) draws it once.

    Returns
    -------
    Sampler or None
        None when the temperature is 0 (greedy).

    Raises
    ------
    TypeError, ValueError
        For a setting :func:`generate` refuses.
    """
    return sampler_for(model, True, temperature, top_k, top_p, seed)[0]


class Sampler:
    """Draws from the filtered target distribution with the agreed stream.

    Parameters
    ----------
    temperature : float
        ``> 0``: logits are divided by it first.
    top_k : int
        Keep the ``top_k`` likeliest tokens (ties at the boundary kept); 0: all.
    top_p : float
        Then drop the least likely tokens whose total mass is at most ``1 - top_p``
        (transformers' rule; the likeliest token is always kept); 1: none dropped.
    key : int
        The agreed 64-bit key of the random stream.
    """

    def __init__(self, temperature, top_k, top_p, key):
        self.temperature, self.top_k, self.top_p, self.key = temperature, top_k, top_p, key

    def uniforms(self, column, rows):
        """Return the agreed uniforms ``u(row, column)`` of rows ``0..rows-1``, ``(rows,)``."""
        bits = np.random.Philox(key=self.key, counter=[0, 0, column, 0])
        return np.random.Generator(bits).random(rows)

    def weights(self, logits):
        """Unnormalised float64 probabilities ``(V,)`` of one ``(V,)`` logits row, filtered."""
        z = logits.detach().to("cpu", torch.float64).numpy() / self.temperature
        if np.isnan(z).any() or not np.isfinite(z.max()):
            raise ValueError("the target's logits are not finite: cannot sample")
        v = z.size
        if 0 < self.top_k < v:
            z = np.where(z < np.partition(z, v - self.top_k)[v - self.top_k], -np.inf, z)
        w = np.exp(z - z.max())
        if self.top_p < 1:  # keep a token while the mass of likelier ones is below top_p
            mass, n = self.top_p * w.sum(), min(v, 64)
            while True:  # sort only the likeliest n tokens, n growing until they hold top_p
                top = np.argpartition(-w, n - 1)[:n] if n < v else np.arange(v)
                top = top[np.argsort(-w[top], kind="stable")]
                above = np.cumsum(w[top]) - w[top]
                if n == v or above[-1] + w[top[-1]] >= mass:
                    break
                n = min(v, 4 * n)
            kept = np.zeros_like(w)
            kept[top[above < mass]] = w[top[above < mass]]
            w = kept
        return w

    def draw(self, logits, u):
        """Draw one token of a ``(V,)`` logits row: the filtered inverse CDF at ``u``."""
        cdf = np.cumsum(self.weights(logits))
        return min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), cdf.size - 1)

    def draw_rows(self, logits, column):
        """Return ``(B, 1)`` int64 tokens of ``(B, V)`` logits: every row's token at ``column``."""
        u = self.uniforms(column, logits.shape[0])
        out = [self.draw(logits[b], u[b]) for b in range(logits.shape[0])]
        return torch.tensor(out, dtype=torch.long, device=logits.device)[:, None]

    def accept(self, tree, packed, logits, column):
        """Walk each row's tree: draw at the node, descend while the draw is a child.

        Parameters
        ----------
        tree : torch.Tensor
            ``(B, M, C)`` int64: the pending token, then the candidates.
        packed : mpitree.spec.Packed
            ``pack(tree)``.
        logits : torch.Tensor
            ``(B, L, V)``: the target's logits at each packed node.
        column : int
            The column of the token after the pending one (the root's draw).

        Returns
        -------
        index : torch.Tensor
            ``(B,)`` int64: a candidate holding the walked path.
        accepted : torch.Tensor
            ``(B,)`` int64: nodes on the path (the pending token included).
        drawn : torch.Tensor
            ``(B, C)`` int64: the token drawn at each depth of the path (valid
            below ``accepted``); ``drawn[:, d]`` is the tree's token at depth
            ``d + 1`` where the path goes on.
        """
        b, m, depth = tree.shape
        index = torch.zeros(b, dtype=torch.long)
        accepted = torch.zeros(b, dtype=torch.long)
        drawn = torch.zeros(b, depth, dtype=torch.long)
        u = [self.uniforms(column + d, b) for d in range(depth)]
        for row in range(b):
            alive = torch.arange(m)
            for d in range(depth):
                x = self.draw(logits[row, packed.unpack_map[row, alive[0], d]], u[d][row])
                drawn[row, d], index[row], accepted[row] = x, alive[0], d + 1
                if d + 1 == depth:
                    break
                alive = alive[tree[row, alive, d + 1] == x]
                if not len(alive):
                    break
        return index, accepted, drawn
