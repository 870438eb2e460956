"""Structural properties of the cost model (never the numbers it was built from)."""

import itertools
import json
import math
import sys

import pytest
from launch import run

from mpitree import model

W = model.WORKLOADS["llama3-8b"]
M = model.MACHINES["dgx-h100"]


def test_one_rank_is_local_attention():
    t = model.predict(W, 65536, 1, M)
    assert all(t[s] == pytest.approx(t["local"]) for s in model.STRATEGIES)


def test_tree_overhead_does_not_grow_with_sequence_length():
    over = [
        model.predict(W, n, 8, M)["allreduce"] - model.predict(W, n, 8, M)["local"]
        for n in (2**15, 2**18, 2**21)
    ]
    assert max(over) == pytest.approx(min(over))


def test_ring_grows_linearly_in_ranks_at_fixed_shard():
    t_per_rank = 8192
    ring = [model.predict(W, t_per_rank * p, p, M)["ring"] for p in (8, 16, 32, 64)]
    steps = [b - a for a, b in itertools.pairwise(ring)]
    assert all(s > 0 for s in steps)
    assert ring[-1] / ring[0] > 7  # ~(64 - 1) / (8 - 1) of transfer-bound steps


def test_allreduce_grows_logarithmically_in_ranks():
    one_node = [model.allreduce_time(W.state_bytes, p, M) for p in (2, 4, 8)]
    assert one_node[1] - one_node[0] == pytest.approx(one_node[2] - one_node[1], rel=1e-9)


def test_ring_over_tree_increases_with_sequence_length():
    ratios = [
        model.predict(W, n, 8, M)["ring"] / model.predict(W, n, 8, M)["allreduce"]
        for n in (2**15, 2**16, 2**17, 2**18)
    ]
    assert ratios == sorted(ratios) and ratios[0] > 1


def test_crossing_nodes_uses_the_slower_link():
    intra = model.predict(W, 2**20, 8, M)["ring"]
    inter = model.predict(W, 2**20 * 2, 16, M)["ring"]  # same shard, ring now spans 2 nodes
    assert inter > 2 * intra


@pytest.mark.parametrize("p", [1, 7, 1024])
def test_predictions_are_finite_up_to_large_scale(p):
    t = model.predict(W, 10_000_000, p, M)
    assert all(math.isfinite(v) and v > 0 for v in t.values())


def test_bad_arguments():
    with pytest.raises(ValueError):
        model.predict(W, 100, 0, M)


def test_calibrate_recovers_a_synthetic_machine():
    """Build a bench result from known parameters; calibrate must find them again."""
    p, thr, ovh, bw, lat = 4, 10e9, 1e-4, 2e9, 5e-5
    cells = []
    for n in (4096, 8192, 16384):
        per_rank = 2 * 8 * 128 * 4 * n / p
        local = ovh + per_rank / thr
        sent = (p - 1) * per_rank
        cells.append(
            {
                "tokens": n,
                "ranks": p,
                "paper": {"eq31_ring_bytes": per_rank * p},
                "bytes_sent_per_rank": {"ring": sent},
                "times": {
                    "local (C kernel)": {"median_ms": local * 1e3},
                    "ring": {"median_ms": (p * local + sent / bw) * 1e3},
                    "allreduce": {"median_ms": (local + 2 * lat) * 1e3},
                },
            }
        )
    m = model.calibrate({"results": cells})
    assert m.device.throughput == pytest.approx(thr, rel=1e-6)
    assert m.device.overhead == pytest.approx(ovh, rel=1e-6)
    assert m.intra.bandwidth == pytest.approx(bw, rel=1e-6)
    assert m.intra.latency == pytest.approx(lat, rel=1e-6)


def test_model_cli():
    res = run(
        1, [sys.executable, "-m", "mpitree", "model", "--ranks", "8,128", "--tokens", "65536"]
    )
    assert res.returncode == 0, res.stderr
    assert "ring/tree" in res.stdout and len(res.stdout.splitlines()) == 5


def test_bench_quick_smoke(tmp_path):
    """The benchmark runs under real ranks and counts bytes exactly as the strategies send."""
    out = tmp_path / "bench.json"
    res = run(
        3,
        [
            sys.executable,
            "-m",
            "mpitree",
            "bench",
            "--quick",
            "--tokens",
            "300,600",
            "--workloads",
            "llama3-8b",
            "--json",
            str(out),
        ],
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(out.read_text())
    assert data["environment"]["ranks"] == 3
    for cell in data["results"]:
        rows = 32  # B=1 x 32 query heads x 1 query
        record = (rows + 1) * (128 + 2) * 4  # records plus the error-flag row, float32
        sent = cell["bytes_sent_per_rank"]
        assert sent["allreduce"] == record and sent["allgather"] == record
        assert sent["allreduce3"] == record  # m, then d, then n: the same floats in 3 calls
        largest = max(cell["shard_tokens"])
        kv = 2 * 8 * 128 * 4  # K and V bytes per token
        assert sent["ring"] > 2 * min(cell["shard_tokens"]) * kv
        assert sent["ring"] <= 2 * largest * kv + 10_000
        assert max(cell["max_abs_diff_vs_allreduce"].values()) < 1e-5
        assert cell["times"]["ring"]["median_ms"] > 0
