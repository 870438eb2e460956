"""Prefix-tree packing of draft beams, greedy acceptance, and verification over MPI."""

import numpy as np
import pytest
import torch
from helpers import world
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.testing import assert_allclose

import mpitree
from mpitree import spec

WORDS = {w: i for i, w in enumerate("Mars is a red reddish when dark".split())}
SEED_BEAM = np.array(
    [
        [
            [WORDS[w] for w in s.split()]
            for s in ("Mars is a red", "Mars is reddish when", "Mars is dark red")
        ]
    ]
)


def test_seed_example_exactly():
    assert spec.dedup_prefix(SEED_BEAM)[0].tolist() == [[0, 0, 0, 0], [0, 0, 1, 1], [0, 0, 2, 2]]
    p = spec.pack(SEED_BEAM)
    assert p.token_indices[0].tolist() == [0, 1, 2, 3, 6, 7, 10, 11]
    assert p.unpack_map[0].tolist() == [[0, 1, 2, 3], [0, 1, 4, 5], [0, 1, 6, 7]]
    names = [list(WORDS)[t] for t in p.tokens[0]]
    assert names == "Mars is a red reddish when dark red".split()
    y = "Y"
    seed_matrix = [  # the seed's causality table, row = token, Y = may attend
        "Y",
        "YY",
        "YYY",
        "YYYY",
        "YY  Y",
        "YY  YY",
        "YY    Y",
        "YY    YY",
    ]
    expected = np.array([[ch == y for ch in row.ljust(8)] for row in seed_matrix])
    assert np.array_equal(p.mask[0], expected)
    assert p.position_offsets[0].tolist() == [0, 1, 2, 3, 2, 3, 2, 3]
    assert p.valid.all()


beams = st.builds(
    lambda b, m, c, seed, vocab: np.random.default_rng(seed).integers(0, vocab, (b, m, c)),
    st.integers(1, 3),
    st.integers(1, 6),
    st.integers(1, 5),
    st.integers(0, 2**31),
    st.integers(1, 3),
)


def brute_force(beam):
    """Nodes, ancestor relation and depths from explicit prefix sets."""
    out = []
    for row in beam:
        prefixes = {}
        for m, cand in enumerate(row):
            for c in range(len(cand)):
                prefixes.setdefault(tuple(cand[: c + 1]), (m, c))
        out.append(prefixes)
    return out


@settings(max_examples=150, deadline=None)
@given(beams)
def test_pack_properties(beam):
    p = spec.pack(beam)
    b, _m, c = beam.shape
    truth = brute_force(beam)
    for bi in range(b):
        n = int(p.valid[bi].sum())
        assert n == len(truth[bi])  # one node per distinct prefix
        assert np.array_equal(p.tokens[bi][p.unpack_map[bi]], beam[bi])
        assert p.unpack_map[bi].max() < n  # never points at padding
        nodes = [None] * n  # the prefix (tuple of tokens) each packed slot stands for
        for i in range(n):
            mi, ci = divmod(int(p.token_indices[bi, i]), c)
            nodes[i] = tuple(beam[bi, mi, : ci + 1])
            assert p.position_offsets[bi, i] == ci == len(nodes[i]) - 1
        for i in range(n):
            for j in range(n):  # j attends iff its prefix is a prefix of i's
                assert p.mask[bi, i, j] == (nodes[i][: len(nodes[j])] == nodes[j])
        pad = ~p.valid[bi]
        assert not p.mask[bi][:, pad][p.valid[bi]].any()  # nobody attends padding
        assert np.array_equal(p.mask[bi][pad][:, pad], np.eye(int(pad.sum()), dtype=bool))


@settings(max_examples=40, deadline=None)
@given(beams)
def test_torch_same_code_path_same_result(beam):
    a, t = spec.pack(beam), spec.pack(torch.from_numpy(beam))
    for field in ("tokens", "token_indices", "mask", "position_offsets", "unpack_map", "valid"):
        assert np.array_equal(getattr(a, field), getattr(t, field).numpy()), field


def test_padding_mask_gives_positions_and_unpack_roundtrips():
    beam = np.array([[[1, 2, 3], [1, 2, 4]], [[5, 6, 7], [8, 9, 9]]])
    prompt_mask = np.array([[False, True, True], [True, True, True]])  # row 0 left-padded
    p = spec.pack(beam, padding_mask=prompt_mask)
    assert p.valid.sum(-1).tolist() == [4, 6]
    assert p.position_ids[0, :4].tolist() == [2, 3, 4, 4] and p.position_ids[1].tolist() == [
        3,
        4,
        5,
        3,
        4,
        5,
    ]
    x = np.random.default_rng(0).standard_normal((2, p.tokens.shape[1], 5))
    y = spec.unpack(x, p.unpack_map)
    assert y.shape == (2, 2, 3, 5)
    assert np.array_equal(y[0, 1, 2], x[0, p.unpack_map[0, 1, 2]])


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        (np.zeros((1, 2, 3)), TypeError, "integer"),
        (np.zeros((2, 3), int), ValueError, "shape"),
        (np.zeros((1, 0, 3), int), ValueError, "M >= 1"),
        (np.zeros((1, 2, 0), int), ValueError, "C >= 1"),
        ([[[1, 2]]], TypeError, "numpy, torch or CuPy"),
    ],
)
def test_bad_beams(bad, exc, match):
    with pytest.raises(exc, match=match):
        spec.pack(bad)


def test_greedy_accept():
    beam = np.array([[[1, 2, 3], [1, 2, 4], [5, 6, 7]]])
    p = spec.pack(beam)
    vocab = 10
    logits = np.zeros((1, p.tokens.shape[1], vocab))
    # the target's next token after each prefix: "1 2 4" and "5 6 7" fully agree
    follow = {(1,): 2, (1, 2): 4, (1, 2, 3): 0, (1, 2, 4): 9, (5,): 6, (5, 6): 7, (5, 6, 7): 8}
    for i in range(p.tokens.shape[1]):
        m, c = divmod(int(p.token_indices[0, i]), 3)
        logits[0, i, follow[tuple(beam[0, m, : c + 1])]] = 1
    index, accepted, bonus = spec.greedy_accept(beam, p, logits)
    # without context logits the first tokens count as accepted: candidates 1 and 2
    # tie at 3 tokens, the lowest index wins; then the target's 9
    assert (index[0], accepted[0], bonus[0]) == (1, 3, 9)
    context = np.zeros((1, vocab))
    context[0, 5] = 1  # the target wants 5 first: only candidate 2 starts right
    index, accepted, bonus = spec.greedy_accept(beam, p, logits, context)
    assert (index[0], accepted[0], bonus[0]) == (2, 3, 8)
    context[0] = 0
    context[0, 3] = 1  # nothing starts with 3: accept 0 tokens, bonus is the target's 3
    index, accepted, bonus = spec.greedy_accept(beam, p, logits, context)
    assert (accepted[0], bonus[0]) == (0, 3)


def test_pack_sizes_from_the_issue():
    beam = np.random.default_rng(0).integers(0, 4, (8, 64, 16))
    p = spec.pack(beam)
    assert p.mask.shape[1] <= 64 * 16
    assert np.array_equal(
        np.take_along_axis(p.tokens, p.unpack_map.reshape(8, -1), 1), beam.reshape(8, -1)
    )


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("ragged", [False, True])
def test_verify_attention_matches_full_mask_reference(ragged):
    comm = world()
    rng = np.random.default_rng(3)
    beam = rng.integers(0, 3, (2, 4, 3))
    p = spec.pack(beam)
    b, length = p.tokens.shape
    hq, hkv, d = 4, 2, 8
    sizes = [5, 0, 7][: comm.size]
    n = sum(sizes)
    q = rng.standard_normal((b, hq, length, d))
    k_ctx, v_ctx = rng.standard_normal((2, b, hkv, n, d))
    k_tree, v_tree = rng.standard_normal((2, b, hkv, length, d))
    lens = [rng.integers(0, s + 1, size=b) for s in sizes] if ragged else [None] * len(sizes)
    lo = sum(sizes[: comm.rank])
    mine = slice(lo, lo + sizes[comm.rank])
    out = spec.verify_attention(
        q, k_ctx[:, :, mine], v_ctx[:, :, mine], k_tree, v_tree, p.mask, kv_len=lens[comm.rank]
    )
    ctx_vis = np.ones((b, n), dtype=bool)
    start = 0
    for s, kl in zip(sizes, lens, strict=False):
        if kl is not None:
            ctx_vis[:, start : start + s] = np.arange(s) < kl[:, None]
        start += s
    visible = np.concatenate([np.broadcast_to(ctx_vis[:, None], (b, length, n)), p.mask], -1)
    ref, _ = mpitree.reference_attention(
        q,
        np.concatenate([k_ctx, k_tree], 2),
        np.concatenate([v_ctx, v_tree], 2),
        visible=visible[:, None],
    )
    assert_allclose(out, ref, atol=1e-12)


@pytest.mark.parallel(nprocs=[1, 2, 3])
@pytest.mark.parametrize("source", ["argument", "env"])
def test_verify_attention_honours_node_size(source, monkeypatch):
    """strategy="hierarchical" merges over the virtual nodes of node_size (or its env)."""
    from mpitree import _merger

    node_size = 2
    kw = {"node_size": node_size} if source == "argument" else {}
    if source == "env":
        monkeypatch.setenv("MPITREE_NODE_SIZE", str(node_size))
    world_comm = world()
    comm = world_comm.Dup()  # a fresh communicator: its cached mergers are this call's
    try:
        rng = np.random.default_rng(4)
        p = spec.pack(rng.integers(0, 3, (2, 4, 3)))
        b, length = p.tokens.shape
        sizes = [4, 6, 0][: comm.size]
        q = rng.standard_normal((b, 4, length, 8))
        k_ctx, v_ctx = rng.standard_normal((2, b, 2, sum(sizes), 8))
        k_tree, v_tree = rng.standard_normal((2, b, 2, length, 8))
        lo = sum(sizes[: comm.rank])
        mine = slice(lo, lo + sizes[comm.rank])
        out = spec.verify_attention(
            q, k_ctx[:, :, mine], v_ctx[:, :, mine], k_tree, v_tree, p.mask, comm,
            strategy="hierarchical", **kw,
        )  # fmt: skip
        mergers = comm.Get_attr(_merger._keyval)
        assert [key[3:5] for key in mergers] == [("hierarchical", node_size)], list(mergers)
        if comm.size > 1:  # one rank merges nothing: it builds no layout
            lay = next(iter(mergers.values()))._impl.layout
            assert lay.nodes == -(-comm.size // node_size)
            first = comm.rank // node_size * node_size
            assert lay.node.Get_size() == min(node_size, comm.size - first)
        visible = np.concatenate([np.ones((b, length, sum(sizes)), bool), np.asarray(p.mask)], -1)[
            :, None
        ]
        ref, _ = mpitree.reference_attention(
            q,
            np.concatenate([k_ctx, k_tree], 2),
            np.concatenate([v_ctx, v_tree], 2),
            visible=visible,
        )
        assert_allclose(out, ref, atol=1e-12)
    finally:
        comm.Free()


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_one_packed_pass_equals_each_candidate_separately(impl):
    """A tiny random-weight Llama: logits of the packed tree pass == per-candidate passes."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation(impl)
    rng = np.random.default_rng(1)
    prompt = torch.tensor(rng.integers(0, 50, (2, 5)))
    beam = torch.tensor(rng.integers(0, 3, (2, 5, 4)))  # small vocab: many shared prefixes
    p = spec.pack(beam)
    b, length = p.tokens.shape
    n_prompt = prompt.shape[1]
    allowed = torch.zeros(b, 1, n_prompt + length, n_prompt + length, dtype=torch.bool)
    allowed[:, 0, :n_prompt, :n_prompt] = torch.tril(torch.ones(n_prompt, n_prompt)).bool()
    allowed[:, 0, n_prompt:, :n_prompt] = True
    allowed[:, 0, n_prompt:, n_prompt:] = p.mask
    # eager attention adds the 4-D mask to the scores: it must be 0 / -inf-like floats
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
    positions = torch.cat([torch.arange(n_prompt).expand(b, -1), n_prompt + p.position_offsets], 1)
    with torch.no_grad():
        packed = model(
            input_ids=torch.cat([prompt, p.tokens], 1), attention_mask=mask, position_ids=positions
        ).logits[:, n_prompt:]
        alone = torch.stack(
            [
                model(input_ids=torch.cat([prompt, beam[:, m]], 1)).logits[:, n_prompt:]
                for m in range(beam.shape[1])
            ],
            1,
        )
    assert p.valid.sum() < beam.numel()  # the tree really deduplicated something
    assert_allclose(spec.unpack(packed, p.unpack_map).numpy(), alone.numpy(), atol=1e-5)
