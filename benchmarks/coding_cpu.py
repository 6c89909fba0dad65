"""A compressor's CPU time per allreduce: counted on threads (what the model uses) against real processes.

The performance model charges a compressed bucket's encode, merge and decode as the CPU time that
:func:`dtrain.perfmodel._traffic.compressed_traffic` counts: the collective run on ``--workers``
threads of one process (``time.thread_time`` of the busiest rank's thread), times the compute scale
and the compressor's ``cpu_ratio``. This script runs the calibration's own probe
(:func:`dtrain.planning._probes.coding_cpu`: ``--workers`` gloo processes on loopback, each rank's
``time.thread_time`` over the call, the median of ``--reps``, times the user-mode share of the calls'
CPU; the CNN's gradient with its parameter shapes as the data-parallel reducer passes them) and prints
it beside the thread count and their ratio (:func:`dtrain.perfmodel.fit.fit_cpu_ratio`, what a
calibration stores), and each rank's user share.

Run::

    python benchmarks/coding_cpu.py --compressors powersgd:2,onebit,topk:0.01
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compressors", default="powersgd:2,onebit,topk:0.01")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20)
    ns = ap.parse_args()
    import torch

    from dtrain.launch.agent import launch
    from dtrain.perfmodel._traffic import compressed_traffic
    from dtrain.perfmodel.fit import fit_cpu_ratio
    from dtrain.planning._probes import coding_cpu

    specs = ns.compressors.split(",")
    probes: dict[int, Any] = launch(coding_cpu, ("cnn", "digits", specs, ns.reps), nprocs=ns.workers, threads=1)
    results = {r: {"coding_cpu": p} for r, p in probes.items()}
    numel, shapes = probes[0]["numel"], tuple(tuple(sh) for sh in probes[0]["shapes"])
    print(
        f"torch {torch.__version__}; the CNN's gradient ({numel} floats, with its shapes), {ns.workers} ranks; "
        f"CPU ms per call"
    )
    print(f"{'compressor':<14}{'threads (model)':>16}{'processes, busiest':>20}{'ratio':>7}{'user shares':>26}")
    for spec in specs:
        counted = compressed_traffic(spec, ns.workers, numel, shapes)[2]
        real = max(float(p["cpu"][spec]) for p in probes.values())
        shares = " ".join(f"{p['user_share'][spec]:.2f}" for _, p in sorted(probes.items()))
        print(f"{spec:<14}{counted * 1e3:>16.2f}{real * 1e3:>20.2f}{fit_cpu_ratio(spec, results):>7.2f}{shares:>26}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
