"""CPU time per allreduce and rank, back to back: where dtrain's ring spends more than gloo's own.

``dtrain bench allreduce`` times each call from a barrier; on a machine with fewer
cores than ranks the wall time then follows the CPU every rank burns, so this
script measures that CPU directly: each rank calls one algorithm ``--iters`` times
back to back (no barrier between calls) and reports wall time per call and its
process's CPU time per call (``time.process_time``: every thread, gloo's included).
Run it under ``perf record -a`` to see where the CPU goes.

Run::

    python benchmarks/allreduce_cpu.py --size 64MB --algorithms native,ring --iters 12
    python benchmarks/allreduce_cpu.py --size 64MB --algorithms ring --max-pieces 2,4,64
    python benchmarks/allreduce_cpu.py --size 16MB --algorithms ring --iters 400 &
    sleep 14; perf record -a -F 999 -- sleep 8; perf report --sort dso
"""

from __future__ import annotations

import argparse
import sys
import time


def _calls(algorithm: str, numel: int, iters: int, piece: int, max_pieces: int) -> tuple[float, float]:
    import torch
    import torch.distributed as dist

    from dtrain.comm.allreduce import AllreduceOptions, allreduce

    x = torch.randn(numel)
    opts = AllreduceOptions(piece_bytes=piece, max_pieces=max_pieces)
    for _ in range(2):
        allreduce(x, "sum", algorithm, options=opts)
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(iters):
        allreduce(x, "sum", algorithm, options=opts)
        x.div_(dist.get_world_size())  # keep the values bounded
    return (time.perf_counter() - t0) / iters, (time.process_time() - c0) / iters


def main() -> int:
    from dtrain.launch.agent import launch
    from dtrain.measure.allreduce import parse_size

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--size", default="64MiB")
    ap.add_argument("--algorithms", default="native,ring")
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--piece", default="1MiB", help="ring piece size (default: 1MiB)")
    ap.add_argument("--max-pieces", default="64", help="comma-separated: one ring run per value (default: 64)")
    ns = ap.parse_args()
    numel = parse_size(ns.size) // 4
    piece = parse_size(ns.piece)
    print(f"{ns.workers} processes, {ns.size} float32, {ns.iters} calls back to back; ms per call, mean over ranks")
    print(f"{'algorithm':<28}{'wall ms':>10}{'CPU ms':>10}{'CPU ms, max rank':>18}")
    for alg in ns.algorithms.split(","):
        for mp in [int(v) for v in ns.max_pieces.split(",")] if alg == "ring" else [64]:
            res = launch(_calls, (alg, numel, ns.iters, piece, mp), nprocs=ns.workers)
            walls = [w for w, _ in res.values()]
            cpus = [c for _, c in res.values()]
            label = f"{alg} (<= {mp} pieces/segment)" if alg == "ring" else alg
            print(
                f"{label:<28}{sum(walls) / len(walls) * 1e3:>10.1f}{sum(cpus) / len(cpus) * 1e3:>10.1f}"
                f"{max(cpus) * 1e3:>18.1f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
