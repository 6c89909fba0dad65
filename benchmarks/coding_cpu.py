"""A compressor's CPU time per allreduce: counted on threads (what the model uses) against real processes.

The performance model charges a compressed bucket's encode, merge and decode as the CPU time that
:func:`dtrain.perfmodel._traffic.compressed_traffic` counts: the collective run on ``--workers``
threads of one process (``time.thread_time`` of the busiest rank's thread), times the compute scale.
This script prints that count next to the same collective run by ``--workers`` processes (gloo,
loopback): each rank's ``time.thread_time`` over the call (its own CPU, no waiting), the median of
``--reps``, for the CNN's gradient as one flat bucket and with its parameter shapes (as the
data-parallel reducer passes them).

Run::

    python benchmarks/coding_cpu.py --compressors powersgd:2,onebit,topk:0.01
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any


def _per_process(specs: list[str], shapes: tuple[tuple[int, ...], ...], numel: int,
                 reps: int) -> dict[tuple[str, bool], float]:  # fmt: skip
    """Every rank: the median CPU seconds of its thread over each compressed allreduce."""
    import torch
    import torch.distributed as dist

    from dtrain.comm.allreduce import get_transport
    from dtrain.compress import from_spec
    from dtrain.compress.reduce import compressed_allreduce

    torch.set_num_threads(1)
    t = get_transport()
    out = {}
    for spec in specs:
        for sh in ((), shapes):
            comp, layout = from_spec(spec), [list(s) for s in sh] or None
            x = torch.randn(numel, generator=torch.Generator().manual_seed(dist.get_rank()))
            for _ in range(3):  # warm-up
                compressed_allreduce(x.clone(), comp, "k", t, algorithm="ring", shapes=layout)
            cpu = []
            for _ in range(reps):
                dist.barrier()
                c0 = time.thread_time()
                compressed_allreduce(x.clone(), comp, "k", t, algorithm="ring", shapes=layout)
                cpu.append(time.thread_time() - c0)
            out[(spec, bool(sh))] = statistics.median(cpu)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compressors", default="powersgd:2,onebit,topk:0.01")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20)
    ns = ap.parse_args()
    import torch

    from dtrain.launch import launch
    from dtrain.perfmodel._traffic import compressed_traffic
    from dtrain.workload import load_model

    torch.set_num_threads(1)
    model, _, _ = load_model("cnn", "digits", batch=64)
    shapes = tuple(tuple(p.shape) for p in model.parameters())
    numel = sum(p.numel() for p in model.parameters())
    specs = ns.compressors.split(",")
    res: dict[int, Any] = launch(_per_process, (specs, shapes, numel, ns.reps), nprocs=ns.workers)
    print(f"torch {torch.__version__}; the CNN's gradient ({numel} floats), {ns.workers} ranks; CPU ms per call")
    print(f"{'compressor':<14}{'bucket':<8}{'threads (model)':>16}{'processes, busiest':>20}{'ratio':>7}")
    for spec in specs:
        for sh in ((), shapes):
            counted = compressed_traffic(spec, ns.workers, numel, sh)[2]
            real = max(float(r[(spec, bool(sh))]) for r in res.values())
            print(f"{spec:<14}{'shapes' if sh else 'flat':<8}{counted * 1e3:>16.2f}{real * 1e3:>20.2f}"
                  f"{real / counted:>7.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
