"""Where a compressed data-parallel step's time goes on an emulated cluster, beside the performance model.

Brings up ``--hosts`` emulated hosts at ``--bandwidth``, calibrates them (as model_vs_measured.py
does: the calibration, one load refresh, their pooled readings), then for each compressor:

* the model's prediction of ``dp ring`` with it (step, and the detail: forward, backward, optimizer,
  encode/decode), and the busiest rank's traffic as the model counts it
  (``dtrain.perfmodel._traffic.compressed_traffic``: the collective on threads, on a flat bucket);
* the same compressed allreduce of the model's gradient, alone on the cluster (every rank at once,
  after a barrier; the median of 20): on a flat bucket, and with the bucket's parameter shapes,
  which is how the data-parallel reducer calls it (PowerSGD then factors each weight matrix and sends
  the vectors dense);
* one traced ``dtrain run`` (``--steps`` steps): the mean step, and per rank the bucket span, the
  allreduce spans inside it and what is left of the bucket (encode/decode and bookkeeping).

Run (root; ~5 minutes)::

    python benchmarks/compression_traced.py --bandwidth 50mbit --compressors powersgd:2,topk:0.01,fp16
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any


def _alone(numel: int, shapes: list[tuple[int, ...]], specs: list[str]) -> dict[str, float]:
    """Every rank: the median seconds of each compressor's allreduce, flat and with the shapes."""
    import torch
    import torch.distributed as dist

    from dtrain.comm.allreduce import get_transport
    from dtrain.compress import from_spec
    from dtrain.compress.reduce import compressed_allreduce

    t = get_transport(None, 120.0)
    g = torch.randn(numel, generator=torch.Generator().manual_seed(dist.get_rank()))
    out: dict[str, float] = {}
    for spec in specs:
        for name, layout in (("flat", None), ("shapes", shapes)):
            comp = from_spec(spec)
            for _ in range(3):
                compressed_allreduce(g.clone(), comp, name, t, algorithm="ring", shapes=layout)
            times = []
            for _ in range(20):
                y = g.clone()
                dist.barrier()
                t0 = time.perf_counter()
                compressed_allreduce(y, comp, name, t, algorithm="ring", shapes=layout)
                times.append(time.perf_counter() - t0)
            out[f"{spec} {name}"] = statistics.median(times)
    return out


def _mean(names: dict[str, list[float]], n: str, skip: int, per_step: int = 1) -> float:
    """Mean ms per step of span ``n`` after ``skip`` steps (``per_step`` spans a step: their sum)."""
    v = names.get(n, [])[skip * per_step :]
    return statistics.mean(v) * per_step if v else 0.0


def _spans(out: Path) -> dict[int, dict[str, list[float]]]:
    t = json.loads((out / "trace.json").read_text())
    per: dict[int, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for e in t["traceEvents"] if isinstance(t, dict) else t:
        if e.get("ph") == "X" and isinstance(e.get("pid"), int):
            per[e["pid"]][e["name"]].append(e.get("dur", 0) / 1e3)
    return per


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bandwidth", default="50mbit")
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--compressors", default="powersgd:2,topk:0.01,fp16")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--batch", type=int, default=64)
    ns = ap.parse_args()
    import dtrain.cluster as dc
    from dtrain.cluster import launch_on_cluster
    from dtrain.config.schema import RunConfig
    from dtrain.job.run import worker_main
    from dtrain.perfmodel._traffic import compressed_traffic
    from dtrain.perfmodel.ranking import plan
    from dtrain.planning.calibrate import calibrate_cluster, pool_load, refresh_load, summary
    from dtrain.strategies import choice
    from dtrain.trace import merge_rank_files
    from dtrain.workloads.load import load_model

    specs = ns.compressors.split(",")
    model, sample, name = load_model("cnn", "digits", batch=ns.batch)
    shapes = [tuple(p.shape) for p in model.parameters()]
    numel = sum(p.numel() for p in model.parameters())
    cname = "ctraced"
    dc.down(cname)
    dc.up(cname, hosts=ns.hosts, bandwidth=ns.bandwidth)
    try:
        spec = calibrate_cluster(cname, model="cnn", dataset="digits", batch=ns.batch, quick=True)
        print(summary(spec))
        spec = pool_load([spec, refresh_load(spec, cname, batch=ns.batch)])
        todo = [choice("dp", ns.hosts, "ring", compression=c) for c in specs]
        pr = plan(model, sample, spec, workers=ns.hosts, name=name, strategies=todo)
        alone: dict[int, Any] = launch_on_cluster(
            _alone, (numel, shapes, specs), nprocs=ns.hosts, cluster=cname, stream_first=False, timeout_s=600
        )
        base = RunConfig.make(
            model="cnn",
            dataset="digits",
            batch_size=ns.batch,
            max_steps=ns.steps,
            epochs=1000,
            trace=True,
            progress=False,
            workers=ns.hosts,
        )
        for s, c in zip(todo, specs):
            f = pr.find(s.label())
            assert f is not None
            msgs, sent, cpu = compressed_traffic(c, ns.hosts, numel)
            print(f"\n== {s.label()} ({ns.bandwidth}, {ns.hosts} hosts, {numel} gradient floats)")
            print(
                f"model: step {f.step_s * 1e3:.2f} ms; "
                + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in f.detail.items() if isinstance(v, float))
                + f"; counted on a flat bucket: {msgs} messages, {sent} bytes, {cpu * 1e3:.2f} ms CPU unscaled"
            )
            print(
                "alone on the cluster (median of 20, ms, per rank): flat "
                + " ".join(f"{alone[r][c + ' flat'] * 1e3:.2f}" for r in sorted(alone))
                + "; with the bucket's shapes "
                + " ".join(f"{alone[r][c + ' shapes'] * 1e3:.2f}" for r in sorted(alone))
            )
            with tempfile.TemporaryDirectory() as d:
                out = Path(d)
                cfg = replace(
                    base.replace(strategy=s.strategy, workers=s.workers, options=s.options, out=str(out)), cluster=cname
                )
                launch_on_cluster(
                    worker_main,
                    (cfg.to_dict(), str(out)),
                    nprocs=ns.hosts,
                    cluster=cname,
                    stream_first=False,
                    timeout_s=900,
                )
                merge_rank_files(out)
                from dtrain.rundir.files import read_metrics

                rows = read_metrics(out)
                steps = [ns.batch / r["samples_per_s"] * 1e3 for r in rows if r["step"] >= ns.warmup]
                print(f"traced run: step {statistics.mean(steps):.2f} ms (mean over ranks, steps >= {ns.warmup})")
                for rank, names in sorted(_spans(out).items()):
                    w = ns.warmup
                    k = len(names.get("allreduce(ring)", [])) // max(1, len(names.get("step", [])))
                    bucket, ar = _mean(names, "bucket 0", w), _mean(names, "allreduce(ring)", w, k) if k else 0.0
                    print(
                        f"  rank {rank}: step {_mean(names, 'step', w):.2f}, forward {_mean(names, 'forward', w):.2f}"
                        f", backward {_mean(names, 'backward', w):.2f}, bucket {bucket:.2f} = {k} ring allreduce(s) "
                        f"{ar:.2f} + the rest {bucket - ar:.2f}, optimizer {_mean(names, 'optimizer', w):.2f}"
                    )
    finally:
        dc.down(cname)
    return 0


if __name__ == "__main__":
    sys.exit(main())
