"""Shared test helpers: reproducible sharded problems and dtype tolerances."""

from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from mpitree import _steps, reference_attention

# atol against the float64 reference on the same (rounded) inputs; outputs are O(1).
ATOL = {np.float16: 2e-3, np.float32: 2e-5, np.float64: 1e-12}


def atol(dtype):
    return ATOL[np.dtype(dtype).type]


@dataclass
class Problem:
    """A global decode problem, and how it is split into per-rank shards."""

    q: np.ndarray  # (B, Hq, Sq, D)
    k: np.ndarray  # (B, Hkv, N, D)
    v: np.ndarray
    sizes: list  # shard length per rank; sum == N
    kv_len: list  # per rank: None or int (B,)
    q_pos: np.ndarray  # None or (B, Sq)
    k_pos: np.ndarray  # None or (B, N)
    mask: np.ndarray  # None or bool (B, 1|Hq, Sq, N)
    scale: float = None

    def shard(self, rank):
        lo = sum(self.sizes[:rank])
        hi = lo + self.sizes[rank]
        kw = {"kv_len": self.kv_len[rank]}
        if self.q_pos is not None:
            kw["q_pos"] = self.q_pos
            kw["k_pos"] = np.ascontiguousarray(self.k_pos[:, lo:hi])
        if self.mask is not None:
            kw["mask"] = np.ascontiguousarray(self.mask[..., lo:hi])
        k = np.ascontiguousarray(self.k[:, :, lo:hi])
        v = np.ascontiguousarray(self.v[:, :, lo:hi])
        return k, v, kw

    def visible(self):
        b, _, n, _ = self.k.shape
        vis = np.ones((b, 1, 1, n), dtype=bool)
        lo = 0
        for size, kl in zip(self.sizes, self.kv_len, strict=False):
            if kl is not None:
                vis[:, 0, 0, lo : lo + size] &= np.arange(size) < kl[:, None]
            lo += size
        if self.q_pos is not None:
            vis = vis & (self.k_pos[:, None, None, :] <= self.q_pos[:, None, :, None])
        if self.mask is not None:
            vis = vis & self.mask
        return vis

    def reference(self):
        return reference_attention(self.q, self.k, self.v, scale=self.scale, visible=self.visible())


def make_problem(
    seed,
    sizes,
    *,
    batch=2,
    q_heads=4,
    kv_heads=2,
    q_len=1,
    head_dim=16,
    dtype=np.float32,
    kv_len=False,
    positions=False,
    mask=None,
    logit=1.0,
    scale=None,
):
    """Build a reproducible problem; identical on every rank for the same arguments."""
    rng = np.random.default_rng(seed)
    n = sum(sizes)
    q = (rng.standard_normal((batch, q_heads, q_len, head_dim)) * logit).astype(dtype)
    k = rng.standard_normal((batch, kv_heads, n, head_dim)).astype(dtype)
    v = rng.standard_normal((batch, kv_heads, n, head_dim)).astype(dtype)
    lens = [rng.integers(0, s + 1, size=batch) if kv_len else None for s in sizes]
    q_pos = k_pos = None
    if positions:
        k_pos = np.tile(np.arange(n), (batch, 1))
        # the queries are the last q_len tokens of a sequence whose length varies by row
        ends = rng.integers(min(max(n - 3, q_len), n), n + 1, size=batch)
        q_pos = ends[:, None] - q_len + np.arange(q_len)
    m = None
    if mask is not None:
        heads = q_heads if mask == "head" else 1
        m = rng.random((batch, heads, q_len, n)) < 0.7
        m[0, 0, 0, :] = False  # one row sees nothing anywhere
    return Problem(q, k, v, list(sizes), lens, q_pos, k_pos, m, scale)


def gathered_identical(comm, x):
    """Return True on every rank iff ``x`` is bitwise identical on all ranks."""
    parts = comm.allgather(np.ascontiguousarray(x).tobytes())
    return all(p == parts[0] for p in parts)


def world():
    return MPI.COMM_WORLD


def report_failures(comm, failures, success):
    """Gather every rank's failures; rank 0 prints them (or ``success``); return the exit code."""
    everyone = comm.allgather(failures)
    if comm.rank == 0:
        for rank, found in enumerate(everyone):
            for line in found:
                print(f"rank {rank}: {line}", flush=True)
        if not any(everyone):
            print(success, flush=True)
    return 1 if any(everyone) else 0


def counting(monkeypatch, cache=None):
    """Count the one-call path's kernel runs (inside the merge, or the whole step in one call).

    A bound step is the compiled function itself (``Bound.run``, an instance
    attribute): those bound from now on are counted, and those of ``cache``'s layers.
    """
    runs = []
    fill, bind = _steps.Bound.fill, _steps.Bound.bind_merge

    def count(bound):
        step = bound.run
        monkeypatch.setattr(bound, "run", lambda out: runs.append(2) or step(out))

    monkeypatch.setattr(_steps.Bound, "fill", lambda self, r: runs.append(1) or fill(self, r))
    monkeypatch.setattr(_steps.Bound, "bind_merge", lambda self, *a: bind(self, *a) or count(self))
    for layer in cache.layers if cache is not None else ():
        if layer.fast is not None and layer.fast.bound.merger is not None:
            count(layer.fast.bound)
    return runs


def counted_lane_calls(monkeypatch, local):
    """Count the lanes' compiled steps whose records come ``local`` ways, from no lane kept."""
    _steps.STEPS.clear()
    _steps._seen.clear()
    calls, bind = [], _steps.bind_call

    def counted(fn, args, keep=()):  # a lane kept from now on takes the counting step
        step = bind(fn, args, keep)

        def run(out):
            if args.local == local:
                calls.append(1)
            return step(out)

        return run

    monkeypatch.setattr(_steps, "bind_call", counted)
    return calls


def lane_expected(comm=None):
    """Whether a recurring float32 ``allreduce_state`` on ``comm`` can take its lane here."""
    from mpitree._library import native_lib
    from mpitree._strategies.allreduce import _PERSISTENT_OK

    size = (comm or world()).Get_size()
    return native_lib() is not None and (_PERSISTENT_OK or size == 1)


def compiled_runs(plan):
    """Count ``plan``'s compiled calls (its one compiled step) in the returned list."""
    runs, compiled = [], plan._compiled
    if compiled is not None:
        run = compiled.run
        compiled.run = lambda out: runs.append(1) or run(out)
    return runs


def rank_cache(comm, shape, seed):
    """This rank's clean float32 K and V of ``shape``, different on every rank."""
    rng = np.random.default_rng([seed, comm.rank])
    k = rng.standard_normal(shape).astype(np.float32)
    return k, rng.standard_normal(shape).astype(np.float32)


def assert_gathered_reference(comm, q, k, v, visible, out, lse=None):
    """``out`` (and ``lse``) against the float64 reference over every rank's ``k``, ``v``.

    ``visible``: bool, broadcastable to ``(B, Hm, Sq, T)`` on this rank's ``T`` keys:
    the keys each row sees here. A row that sees no key on any rank is 0 (lse -inf),
    and no output is NaN.
    """
    b, _, sq, _ = q.shape
    mine = np.broadcast_to(visible, (b, np.shape(visible)[1], sq, k.shape[2]))
    vis = np.concatenate(comm.allgather(np.ascontiguousarray(mine)), axis=3)
    keys = np.concatenate(comm.allgather(k), axis=2).astype(np.float64)
    values = np.concatenate(comm.allgather(v), axis=2).astype(np.float64)
    ref, ref_lse = reference_attention(q, keys, values, visible=vis)
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(out[fin], ref[fin], atol=3e-5, rtol=0)
    if lse is not None:
        np.testing.assert_allclose(lse[fin], ref_lse[fin], atol=1e-4, rtol=1e-5)
        assert (lse[~fin] == -np.inf).all()
    assert not out[~fin].any() and not np.isnan(out).any()


def allocations_in_spans(step, span):
    """Run ``step()`` under torch's profiler; return (allocations inside the ``span``-named
    profiler ranges, how many such ranges, step's result)."""
    import torch

    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        result = step()
    events = prof.profiler.kineto_results.events()
    spans = [(e.start_ns(), e.start_ns() + e.duration_ns()) for e in events if e.name() == span]
    made = [e.start_ns() for e in events if e.name() == "[memory]" and e.nbytes() > 0]
    return sum(any(a <= t <= b for a, b in spans) for t in made), len(spans), result
