"""ZeRO on an emulated cluster: the step time of each sharding level beside unsharded data parallelism and DDP.

Brings up an emulated cluster (one network namespace per host, tbf-shaped links; root), then runs ``dtrain
run`` (one torchrun node per host) for plain ``dp`` (ring allreduce of buckets overlapped with backward), torch
DDP, and ``dp --shard optimizer|gradients|parameters`` (stage 2 with ``--overlap forward`` too: the allgather
of the stepped parameters waited unit by unit in the next forward), in interleaved rounds, and prints the
median step time of the training loop (its metrics rows, after warm-up) and its ratio to unsharded dp, with
bytes per step, next to the performance model's prediction for the same cluster (calibrated first).

Run (root; ~10 minutes)::

    python benchmarks/sharded_cluster.py --bandwidth 1gbit --hosts 4 --steps 30 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from _cluster import measure

from dtrain.strategies import Choice, choice

SYSTEMS: list[tuple[str, Choice]] = [
    ("dp ring (no sharding)", choice("dp", 4, "ring")),
    ("torch DDP", Choice("ddp", 4)),
    ("zero-1 (optimizer)", choice("dp", 4, "ring", shard="optimizer")),
    ("zero-2 (gradients)", choice("dp", 4, "ring", shard="gradients")),
    ("zero-2, overlap forward", choice("dp", 4, "ring", shard="gradients", overlap="forward")),
    ("zero-3 (parameters)", choice("dp", 4, "ring", shard="parameters")),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bandwidth", default="1gbit")
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--model", default="gpt-small")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default="benchmarks/results/sharded_cluster.json")
    ap.add_argument("--name", default="zero")
    ns = ap.parse_args()
    import torch

    import dtrain.cluster as dc
    from dtrain.config.schema import RunConfig
    from dtrain.perfmodel.ranking import plan
    from dtrain.planning.calibrate import calibrate_cluster, summary
    from dtrain.workloads.load import load_model

    print(
        f"torch {torch.__version__}; {ns.model} on pytext, global batch {ns.batch} x {ns.seq_len} tokens, "
        f"{ns.hosts} emulated hosts at {ns.bandwidth}, {ns.steps} steps (median after {ns.warmup}), "
        f"{ns.rounds} interleaved rounds"
    )
    base = RunConfig.make(
        model=ns.model,
        dataset="pytext",
        seq_len=ns.seq_len,
        batch_size=ns.batch,
        max_steps=ns.steps,
        epochs=1000,
        optimizer="adam",
        lr=0.002,
        trace=False,
        progress=False,
        workers=ns.hosts,
        eval_samples=16,
    )
    systems = [(label, Choice(s.strategy, ns.hosts, s.options)) for label, s in SYSTEMS]
    cname = f"{ns.name}_{ns.bandwidth.replace('.', '_')}"[:24]
    dc.down(cname)
    dc.up(cname, hosts=ns.hosts, bandwidth=ns.bandwidth)
    times: dict[str, list[float]] = {label: [] for label, _ in systems}
    sent: dict[str, float] = {}
    try:
        spec = calibrate_cluster(cname, model=ns.model, dataset="pytext", batch=ns.batch, quick=True)
        print(summary(spec))
        model, sample, name = load_model(ns.model, "pytext", batch=ns.batch, seq_len=ns.seq_len)
        pr = plan(model, sample, spec, workers=ns.hosts, name=name, strategies=[s for _, s in systems])
        for r in range(ns.rounds):
            for label, s in systems if r % 2 == 0 else list(reversed(systems)):
                cfg = base.replace(strategy=s.strategy, workers=s.workers, options=s.options, cluster=cname)
                t, b = measure(cfg, cname, ns.warmup)
                times[label] += t
                sent[label] = b
                print(f"round {r}: {label:<26} median {statistics.median(t) * 1e3:8.1f} ms", flush=True)
    finally:
        dc.down(cname)
    ref = statistics.median(times[systems[0][0]])
    print(f"\n{'system (' + ns.bandwidth + ')':<28}{'ms/step':>9}{'vs dp':>8}{'MB/step':>9}{'predicted ms':>14}")
    out = []
    for label, s in systems:
        med = statistics.median(times[label])
        found = pr.find(s.label())
        pred = found.step_s * 1e3 if found else float("nan")
        print(f"{label:<28}{med * 1e3:>9.1f}{ref / med:>8.3f}{sent[label] / 1e6:>9.2f}{pred:>14.1f}")
        out.append(
            {
                "system": label,
                "ms": med * 1e3,
                "speed_vs_dp": ref / med,
                "bytes_per_step": sent[label],
                "predicted_ms": pred,
            }
        )
    Path(ns.json).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.json).write_text(
        json.dumps({"bandwidth": ns.bandwidth, "hosts": ns.hosts, "model": ns.model, "rows": out}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
