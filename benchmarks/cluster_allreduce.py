"""Allreduce on an emulated cluster against the link-rate bound ``2(P-1)/P * n / B``.

Brings up an emulated cluster (``dtrain.cluster.up``: one network namespace per
host, tbf-shaped links), runs one torchrun node per host, times dtrain's ring
allreduce and gloo's own (the peer) on a 16 MiB fp32 tensor, and prints the
achieved fraction of the bound. The cluster is removed afterwards, and the script
checks that no namespace of it is left. Needs root.

With the default MTU of 1500, Ethernet, IP and TCP headers (66 of every 1514
bytes tbf counts) and the ACKs that share each link cap TCP payload near 93% of
the rate; ``--mtu 9000`` (jumbo frames, as data-centre links are usually set up)
lifts that cap to about 99%.

Run::

    sudo python benchmarks/cluster_allreduce.py --hosts 4 --bandwidth 100mbit --mib 16 --reps 3 [--mtu 9000]
    sudo python benchmarks/cluster_allreduce.py --hosts 4 --bandwidth 50mbit --kib 150 --reps 15 \
        --algorithms ring,native,recursive_doubling,tree --name bench_ar50   # the model's step sizes
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def _bench(nbytes: int, reps: int, algorithms: list[str]) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist

    import dtrain.comm

    out: dict[str, list[float]] = {}
    for alg in algorithms:
        t = torch.ones(nbytes // 4)
        dtrain.comm.allreduce(t, algorithm=alg)  # warm-up (connections, buffers)
        times = []
        for _ in range(reps):
            t.fill_(1.0)
            dist.barrier()
            t0 = time.perf_counter()
            dtrain.comm.allreduce(t, algorithm=alg)
            times.append(time.perf_counter() - t0)
        if t[0].item() != dist.get_world_size():
            raise RuntimeError(f"{alg}: wrong sum {t[0].item()}")
        out[alg] = times
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--bandwidth", default="100mbit")
    ap.add_argument("--mib", type=int, default=16, help="tensor size in MiB (default: 16)")
    ap.add_argument("--kib", type=int, default=None, help="tensor size in KiB instead (e.g. 150: the CNN's gradient)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--algorithms", default="ring,native")
    ap.add_argument("--mtu", type=int, default=1500, help="MTU of the host links (9000: jumbo frames)")
    ap.add_argument("--name", default="bench_ar")
    ns = ap.parse_args()
    import torch

    import dtrain.cluster as dc
    from dtrain.perfmodel.units import parse_rate

    algs = ns.algorithms.split(",")
    nbytes = ns.kib << 10 if ns.kib else ns.mib << 20
    dc.down(ns.name)
    c = dc.up(ns.name, hosts=ns.hosts, bandwidth=ns.bandwidth, mtu=ns.mtu)
    try:
        res = dc.run_on_cluster(_bench, (nbytes, ns.reps, algs), cluster=c, timeout_s=600)
    finally:
        dc.down(ns.name)
    left = [
        n
        for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        if n.startswith(f"dtc-{ns.name}-")
    ]
    P, B = ns.hosts, parse_rate(ns.bandwidth)
    bound = 2 * (P - 1) / P * nbytes / B
    size = f"{ns.kib} KiB" if ns.kib else f"{ns.mib} MiB"
    print(
        f"torch {torch.__version__}; {P} hosts at {ns.bandwidth}, {size} fp32, MTU {ns.mtu}, {ns.reps} timed reps "
        f"after 1 warm-up; bound 2(P-1)/P*n/B = {bound:.3f} s"
    )
    print(f"{'algorithm':<12}{'median s':>10}{'of bound':>10}{'best':>8}{'vs native':>11}")
    med = {a: statistics.median(max(res[r][a][i] for r in res) for i in range(ns.reps)) for a in algs}
    for a in algs:
        best = min(max(res[r][a][i] for r in res) for i in range(ns.reps))
        ratio = med["native"] / med[a] if "native" in med else float("nan")
        print(f"{a:<12}{med[a]:>10.3f}{bound / med[a]:>10.1%}{bound / best:>8.1%}{ratio:>11.2f}")
    print(f"namespaces left after down: {len(left)}")
    return 0 if not left else 1


if __name__ == "__main__":
    sys.exit(main())
