"""One message after idle on an emulated link: measured time against the line rate.

A tbf-shaped link is a token bucket: after idle it lets ``burst`` bytes through at
memory speed, then holds traffic to the rate. dtrain's emulated cluster sets the
burst to 1 ms of traffic (``dtrain.cluster.netns``), so on a 1 Gbit/s link a
message of up to ~122 KiB arrives as fast as on loopback, and a larger one pays
the rate for the rest and the qdisc's wake-ups. A real NIC has no such credit.
This script shows the effect the performance model does not charge: rank 0
sleeps (the link goes idle and the bucket refills, as during a step's compute),
sends ``n`` bytes to rank 1 on another emulated host and waits for a 4-byte
reply; the median of the round trips is printed next to ``n / rate``. Every row
also carries the wake-up of the two processes after the sleep (the model's
``wake``: on this 2-vCPU VM 1-2 ms, against ~0.1 ms of latency between busy
processes), so read the rows against each other: up to the burst the time does
not grow with ``n``.

Run (root)::

    python benchmarks/cluster_message_time.py --bandwidth 1gbit --sizes 16KB,64KB,128KB,150KB,256KB,512KB,1MB
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def _pingpong(sizes: list[int], reps: int, idle_s: float) -> dict[int, float] | None:
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    reply = torch.zeros(1)
    out: dict[int, float] = {}
    for nbytes in sizes:
        x = torch.zeros(max(1, nbytes // 4))
        times = []
        for _ in range(reps + 2):  # the first two warm the connection
            if rank > 1:
                break
            time.sleep(idle_s)
            if rank == 0:
                t0 = time.perf_counter()
                dist.send(x, 1)
                dist.recv(reply, 1)
                times.append(time.perf_counter() - t0)
            else:
                dist.recv(x, 0)
                dist.send(reply, 0)
        if rank == 0:
            out[nbytes] = statistics.median(times[2:])
    return out if rank == 0 else None


def main() -> int:
    from dtrain.measure.allreduce import format_size, parse_size

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--bandwidth", default="1gbit")
    ap.add_argument("--sizes", default="16KiB,64KiB,128KiB,150KiB,256KiB,512KiB,1MiB")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--idle-ms", type=float, default=20.0, help="sleep before each message (default: 20)")
    ap.add_argument("--name", default="msgtime")
    ns = ap.parse_args()
    sizes = [parse_size(s) for s in ns.sizes.split(",")]

    import dtrain.cluster as dc
    from dtrain.cluster import launch_on_cluster
    from dtrain.perfmodel.units import parse_rate

    rate = parse_rate(ns.bandwidth)  # bytes per second
    dc.down(ns.name)
    dc.up(ns.name, hosts=ns.hosts, bandwidth=ns.bandwidth)
    try:
        res = launch_on_cluster(
            _pingpong,
            (sizes, ns.reps, ns.idle_ms / 1e3),
            nprocs=ns.hosts,
            cluster=ns.name,
            stream_first=False,
            timeout_s=600,
        )
    finally:
        dc.down(ns.name)
    times = res[0]
    print(
        f"{ns.hosts} emulated hosts at {ns.bandwidth}; round trip of n bytes + 4-byte reply after "
        f"{ns.idle_ms:g} ms idle, median of {ns.reps}"
    )
    print(f"{'size':>10}{'measured ms':>13}{'n / rate ms':>13}")
    for nbytes in sizes:
        print(f"{format_size(nbytes):>10}{times[nbytes] * 1e3:>13.3f}{nbytes / rate * 1e3:>13.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
