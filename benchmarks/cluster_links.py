"""Decode merge time per strategy across 2 emulated nodes at several link rates, vs the cost model.

Builds an emulated cluster (mpitree.cluster: network namespaces, tbf-shaped links;
needs root) per link rate, runs one decode step of a Llama-3.1-8B attention layer
(32 q heads, 8 kv heads, D = 128, float32) on nodes x ranks-per-node ranks with
every strategy, interleaved step by step, and reports the slowest rank's median
step time, the local attention time, the merge time (step minus local) and the
bytes each rank hands to MPI. Rates run in turn, ``--rounds`` times, so that a
change in machine load shows as a spread between rounds rather than as a rate.

The model columns are mpitree.model.predict on a two-level machine: inside a node
the "shm" preset; between nodes a link of bandwidth rate / 8 bytes/s (unshaped:
fitted to the ring's measured transfer time) and a latency fitted to the flat
all-reduce's merge time on the unshaped links (per round between nodes, as the
model counts them); the local kernel fitted to the measured local time. So the
flat all-reduce on unshaped links and, there, the ring match by construction;
every other row is a prediction.

    python benchmarks/cluster_links.py --rates 100mbit,1gbit,unshaped --tokens 4096
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

STRATEGIES = ("allreduce", "hierarchical", "allgather", "ring")
SHAPE = (1, 32, 8, 128)  # batch, q heads, kv heads, head dim: one Llama-3.1-8B layer


def worker(args):
    """Under mpiexec: time every strategy's decode step; rank 0 prints one JSON line."""
    import numpy as np
    from mpi4py import MPI

    import mpitree
    from mpitree._traffic import traffic

    comm = MPI.COMM_WORLD
    b, hq, hkv, d = SHAPE
    rng = np.random.default_rng(comm.rank)
    q = np.random.default_rng(0).standard_normal((b, hq, 1, d)).astype(np.float32)
    k = rng.standard_normal((b, hkv, args.tokens // comm.size, d)).astype(np.float32)
    v = rng.standard_normal(k.shape).astype(np.float32)
    plans = {s: mpitree.DecodePlan(b, hq, hkv, d, strategy=s) for s in STRATEGIES}
    plans["local"] = mpitree.DecodePlan(b, hq, hkv, d, comm=MPI.COMM_SELF)
    outs, sent = {}, {}
    for name, plan in plans.items():  # warm-up, bytes, and every strategy's answer
        traffic.reset()
        outs[name] = plan.decode(q, k, v)
        sent[name] = traffic.bytes
    for name in STRATEGIES:
        err = float(np.max(np.abs(outs[name] - outs["allreduce"])))
        assert err < 1e-5, (name, err)
    times = {name: [] for name in plans}
    for step in range(args.steps):
        for name, plan in plans.items():
            if name == "ring" and step >= args.ring_steps:
                continue
            comm.Barrier()
            start = time.perf_counter()
            plan.decode(q, k, v)
            times[name].append(time.perf_counter() - start)
    slowest = {n: np.max(comm.gather(np.array(t), root=0) or [t], axis=0) for n, t in times.items()}
    if comm.rank == 0:
        row = {
            name: {"median_s": float(np.median(slowest[name])), "bytes": sent[name]}
            for name in plans
        }
        print("RESULT " + json.dumps(row), flush=True)


def measure(rate, args):
    """Run the worker on a fresh cluster with links at ``rate``; return its row."""
    from mpitree.cluster import Cluster

    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--tokens", str(args.tokens),
            "--steps", str(args.steps), "--ring-steps", str(args.ring_steps)]  # fmt: skip
    with Cluster(args.nodes, link=rate) as cluster:
        res = cluster.run(argv, args.ranks_per_node, capture=True, timeout=args.timeout)
    if res.returncode:
        raise RuntimeError(f"worker failed at {rate}:\n{res.stdout}\n{res.stderr}")
    line = next(x for x in res.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def machines(rows, args):
    """Return ``{rate: Machine}`` for the model: shm inside nodes, the link between them."""
    from mpitree import model
    from mpitree.cluster import parse_rate

    b, hq, hkv, d = SHAPE
    work = model.Workload("cluster_links", hq, hkv, d, batch=b, kv_itemsize=4)
    p = args.nodes * args.ranks_per_node
    block = work.kv_bytes(args.tokens / p)
    local = statistics.median(r["local"]["median_s"] for r in rows.values())
    device = model.Device("measured local kernel", block / local, 0.0)
    base = rows.get("unshaped") or next(iter(rows.values()))
    hops = max(1, (args.nodes - 1).bit_length())  # the model's rounds between nodes
    alpha = max((base["allreduce"]["median_s"] - base["local"]["median_s"]) / hops, 1e-7)
    result = {}
    for rate, row in rows.items():
        bits = parse_rate(rate)
        if bits is None:  # the ring's transfer time: p - 1 hops of one block each
            extra = row["ring"]["median_s"] - p * row["local"]["median_s"]
            bandwidth = (p - 1) * block / max(extra, 1e-9)
        else:
            bandwidth = bits / 8
        inter = model.Link(f"link {rate}", alpha, bandwidth)
        machine = model.Machine(rate, args.ranks_per_node, model.LINKS["shm"], inter, device)
        result[rate] = (work, machine)
    return result


def report(rounds, args):
    """Print the table: measured medians over rounds, the model's prediction, their ratio."""
    from mpitree import model

    rates = list(rounds[0])
    rows = {
        rate: {
            name: {
                "median_s": statistics.median(r[rate][name]["median_s"] for r in rounds),
                "spread": [r[rate][name]["median_s"] for r in rounds],
                "bytes": rounds[0][rate][name]["bytes"],
            }
            for name in rounds[0][rate]
        }
        for rate in rates
    }
    p = args.nodes * args.ranks_per_node
    fitted = machines(rows, args)
    print(f"{args.nodes} nodes x {args.ranks_per_node} ranks, {args.tokens} keys, float32, "
          f"batch {SHAPE[0]}, {SHAPE[1]} q heads, {SHAPE[2]} kv heads, D {SHAPE[3]}; "
          f"slowest rank's median over {args.steps} steps (ring {args.ring_steps}), "
          f"median of {len(rounds)} rounds")  # fmt: skip
    head = f"{'link':>9} {'strategy':>12} {'step ms':>9} {'merge ms':>9} {'bytes/rank':>11} "
    print(head + f"{'model ms':>9} {'meas/model':>10} {'best':>5} {'rounds (ms)':>14}")
    for rate in rates:
        work, machine = fitted[rate]
        pred = model.predict(work, args.tokens, p, machine, overlap_ring=False)
        local = rows[rate]["local"]["median_s"]
        best = min(STRATEGIES, key=lambda s: rows[rate][s]["median_s"])
        for name in ("local", *STRATEGIES):
            cell = rows[rate][name]
            step = cell["median_s"]
            merge = "" if name == "local" else f"{(step - local) * 1e3:9.3f}"
            spread = "/".join(f"{x * 1e3:.1f}" for x in cell["spread"])
            print(
                f"{rate:>9} {name:>12} {step * 1e3:9.3f} {merge:>9} {cell['bytes']:>11} "
                f"{pred[name] * 1e3:9.3f} {step / pred[name]:10.2f} "
                f"{'*' if name == best else '':>5} {spread:>14}"
            )
        print(f"{'':>9} model link: latency {machine.inter.latency * 1e6:.0f} us, "
              f"bandwidth {machine.inter.bandwidth / 1e6:.1f} MB/s")  # fmt: skip
    print(f"machine load: {os.getloadavg()[0]:.2f} (1-min average, {os.cpu_count()} cores)")


def main():
    """Measure every rate ``--rounds`` times (or be the worker); print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="100mbit,1gbit,unshaped")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096, help="keys in the whole cache")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per strategy")
    parser.add_argument("--ring-steps", type=int, default=3, help="timed steps of the ring")
    parser.add_argument("--rounds", type=int, default=2, help="passes over the rates")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", help="also write the raw rounds to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    rounds = []
    for _ in range(args.rounds):
        rounds.append({rate: measure(rate, args) for rate in args.rates.split(",")})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rounds": rounds}, f, indent=1)
    report(rounds, args)
    return 0


if __name__ == "__main__":
    subprocess.run(["uptime"], check=False)
    sys.exit(main())
