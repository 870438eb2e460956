"""Decode merge time per strategy across 2 emulated nodes at several link rates, vs the cost model.

Builds an emulated cluster (mpitree.cluster: network namespaces, tbf-shaped links;
needs root) per link rate, runs one decode step of a Llama-3.1-8B attention layer
(32 q heads, 8 kv heads, D = 128, float32) on nodes x ranks-per-node ranks with
every strategy, interleaved step by step, and reports the slowest rank's median
step time, the local attention time, the merge time (step minus local) and the
bytes each rank hands to MPI. Rates run in turn, ``--rounds`` times, so that a
change in machine load shows as a spread between rounds rather than as a rate.

The model columns are mpitree.model.predict on a two-level machine, fitted to
measurements of the same run that are not the strategies' own: inside a node the
"shm" preset; between nodes a link whose latency is half the median round trip
of a state-sized message between the nodes (a ping-pong) and whose bandwidth is
that of a --probe-mb exchange between the nodes in both directions at once (as
the ring's hops cross them); the local kernel fitted to the run's measured local
time. Every strategy's row is then a prediction, not a fit.

    python benchmarks/cluster_links.py --rates 100mbit,1gbit,unshaped --tokens 4096
    python benchmarks/cluster_links.py --report raw.json   # the table again, from --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace

STRATEGIES = ("allreduce", "hierarchical", "allgather", "ring")
SHAPE = (1, 32, 8, 128)  # batch, q heads, kv heads, head dim: one Llama-3.1-8B layer


def worker(args):
    """Under mpiexec: time every strategy's decode step; rank 0 prints one JSON line."""
    import numpy as np
    from mpi4py import MPI

    import mpitree
    from mpitree.extend import traffic

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
    intra, latency, bandwidth = probe(comm, args, sent["allreduce"])
    auto = mpitree.DecodePlan(b, hq, hkv, d, strategy="auto").strategy  # collective
    slowest = {n: np.max(comm.gather(np.array(t), root=0) or [t], axis=0) for n, t in times.items()}
    if comm.rank == 0:
        row = {
            name: {"median_s": float(np.median(slowest[name])), "bytes": sent[name]}
            for name in plans
        }
        row["probe"] = {"intra_s": intra, "latency_s": latency, "bandwidth": bandwidth}
        row["auto"] = auto
        print("RESULT " + json.dumps(row), flush=True)


def probe(comm, args, nbytes):
    """Return the links' (intra latency s, inter latency s, inter bandwidth B/s), all ranks busy.

    Latencies: half the median round trip of ``nbytes`` (one merge's state)
    between partner ranks, every rank in a pair at once (as an all-reduce's
    round): inside each node, then across the nodes. Bandwidth: a ring shift of
    ``--probe-mb`` (rank r sends to r + 1), one stream per direction per node
    link, less one latency.
    """
    import numpy as np
    from mpi4py import MPI

    rpn, p = args.ranks_per_node, comm.size
    state = np.zeros(nbytes, np.uint8)
    big = np.zeros(args.probe_mb * 2**20, np.uint8)
    back = np.empty_like(big)

    def trip(partner):
        comm.Barrier()
        start = time.perf_counter()
        if partner >= p:  # the last of an odd number of nodes sits out
            return float("nan")
        if comm.rank < partner:
            comm.Send(state, dest=partner)
            comm.Recv(state, source=partner)
        else:
            comm.Recv(state, source=partner)
            comm.Send(state, dest=partner)
        return time.perf_counter() - start

    intra = [trip(comm.rank ^ 1) for _ in range(20)] if rpn % 2 == 0 else [0.0]
    node = comm.rank // rpn
    inter = [trip(comm.rank + (rpn if node % 2 == 0 else -rpn)) for _ in range(20)]
    shift = []
    for _ in range(2):
        comm.Barrier()
        start = time.perf_counter()
        comm.Sendrecv(big, dest=(comm.rank + 1) % p, recvbuf=back, source=(comm.rank - 1) % p)
        shift.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    latency = [float(np.nanmedian(comm.allgather(np.median(t)))) / 2 for t in (intra, inter)]
    return latency[0], latency[1], big.nbytes / max(min(shift) - latency[1], 1e-9)


def measure(rate, args):
    """Run the worker on a fresh cluster with links at ``rate``; return its row."""
    from mpitree.cluster import Cluster

    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--tokens", str(args.tokens),
            "--steps", str(args.steps), "--ring-steps", str(args.ring_steps),
            "--probe-mb", str(args.probe_mb)]  # fmt: skip
    with Cluster(args.nodes, link=rate) as cluster:
        res = cluster.run(argv, args.ranks_per_node, capture=True, timeout=args.timeout)
    if res.returncode:
        raise RuntimeError(f"worker failed at {rate}:\n{res.stdout}\n{res.stderr}")
    line = next(x for x in res.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def machines(rows, args):
    """Return ``{rate: (Workload, Machine)}``: shm inside nodes, the probed link between them."""
    from mpitree import model

    b, hq, hkv, d = SHAPE
    work = model.Workload("cluster_links", hq, hkv, d, batch=b, kv_itemsize=4)
    block = work.kv_bytes(args.tokens / (args.nodes * args.ranks_per_node))
    result = {}
    for rate, row in rows.items():
        device = model.Device("measured local kernel", block / row["local"]["median_s"], 0.0)
        link = model.Link(f"link {rate}", row["probe"]["latency_s"], row["probe"]["bandwidth"])
        shm = replace(model.LINKS["shm"], latency=row["probe"]["intra_s"])
        machine = model.Machine(rate, args.ranks_per_node, shm, link, device)
        result[rate] = (work, machine)
    return result


def report(rounds, args):
    """Print the table: measured medians over rounds, the model's prediction, the error."""
    from mpitree import model

    rates = list(rounds[0])
    rows = {}
    for rate in rates:
        names = ("local", *STRATEGIES)
        rows[rate] = {
            name: {
                "median_s": statistics.median(r[rate][name]["median_s"] for r in rounds),
                "spread": [r[rate][name]["median_s"] for r in rounds],
                "bytes": rounds[0][rate][name]["bytes"],
            }
            for name in names
        }
        rows[rate]["probe"] = {
            key: statistics.median(r[rate]["probe"][key] for r in rounds)
            for key in ("intra_s", "latency_s", "bandwidth")
        }
        rows[rate]["auto"] = rounds[0][rate]["auto"]
    p = args.nodes * args.ranks_per_node
    fitted = machines(rows, args)
    print(f"{args.nodes} nodes x {args.ranks_per_node} ranks, {args.tokens} keys, float32, "
          f"batch {SHAPE[0]}, {SHAPE[1]} q heads, {SHAPE[2]} kv heads, D {SHAPE[3]}; "
          f"slowest rank's median over {args.steps} steps (ring {args.ring_steps}), "
          f"median of {len(rounds)} rounds")  # fmt: skip
    head = f"{'link':>9} {'strategy':>12} {'step ms':>9} {'merge ms':>9} {'bytes/rank':>11} "
    print(head + f"{'model ms':>9} {'error %':>8} {'best':>5} {'rounds (ms)':>14}")
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
                f"{pred[name] * 1e3:9.3f} {(step / pred[name] - 1) * 100:+8.1f} "
                f"{'*' if name == best else '':>5} {spread:>14}"
            )
        tree = min(rows[rate][s]["median_s"] for s in ("allreduce", "hierarchical"))
        ring = rows[rate]["ring"]["median_s"]
        chosen = min(STRATEGIES, key=pred.get)
        auto = rows[rate]["auto"]
        gap = rows[rate][auto]["median_s"] / rows[rate][best]["median_s"] - 1
        print(f"{'':>9} fitted: in-node latency {machine.intra.latency * 1e6:.0f} us; link "
              f"latency {machine.inter.latency * 1e6:.0f} us, bandwidth "
              f"{machine.inter.bandwidth / 1e6:.1f} MB/s (nominal {_nominal(rate)}); local "
              f"kernel {machine.device.throughput / 1e9:.2f} GB/s")  # fmt: skip
        print(f"{'':>9} ring / tree: step {ring / tree:.0f}x, merge "
              f"{(ring - local) / max(tree - local, 1e-9):.0f}x; model picks {chosen}, auto "
              f"runs {auto}, measured best {best} (auto {gap * 100:+.1f}%)")  # fmt: skip
    print(f"machine load: {os.getloadavg()[0]:.2f} (1-min average, {os.cpu_count()} cores)")


def _nominal(rate):
    """Return the nominal bandwidth of ``rate`` in MB/s, as text ("veth" when unshaped)."""
    from mpitree.cluster import parse_rate

    bits = parse_rate(rate)
    return "veth" if bits is None else f"{bits / 8e6:.1f} MB/s"


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
    parser.add_argument("--probe-mb", type=int, default=32, help="MiB of the bandwidth probe")
    parser.add_argument("--json", help="also write the raw rounds to this file")
    parser.add_argument("--report", help="print the table of a --json file; measure nothing")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.report:
        with open(args.report) as f:
            raw = json.load(f)
        report(raw["rounds"], argparse.Namespace(**{**raw["args"], "report": args.report}))
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
