"""Mixed precision: fp32 against bf16 and fp16 on the same runs -- metric, bytes per step, overflows.

Every row is one ``dtrain run`` (``dtrain.job.run.run``; data parallel, ring allreduce, ``--workers``
processes on loopback) from the same seed for the same steps; only ``--precision`` changes:

* ``fp32``  the reference
* ``bf16``  torch autocast to bfloat16 on CPU, float32 master weights, gradients on the wire in 16 bits
* ``fp16``  the same in float16 with dynamic loss scaling (torch's GradScaler; a step whose gradients
            overflow is skipped on every rank that shares it: ``overflow_steps``)

Workloads:

* ``cnn``  the CNN on digits, ``--cnn-epochs`` epochs, global batch ``--cnn-batch``, SGD ``--cnn-lr``
           momentum 0.9: test accuracy on the 360 test samples (one sample = 0.28 points)
* ``gpt``  ``--gpt-model`` (gpt-small) on pytext, ``--seq-len`` tokens, global batch ``--gpt-batch``,
           Adam ``--gpt-lr``, ``--gpt-steps`` steps: validation loss (nats/token) over ``--eval-samples``
           validation windows (0: all 717 at seq 64)

For each precision: the metric (mean over ``--seeds``, and per seed), its difference from fp32 (points
of accuracy; relative for the loss; acceptance: within 1%), the seed-to-seed spread of fp32 beside it
(what a difference has to beat to mean anything), bytes sent per step and worker and their ratio to
fp32 (16-bit gradients: ~0.5), ``overflow_steps`` (fp16) and training seconds (CPU autocast; indicative
on a shared machine).

With ``--device cuda`` the runs train on the GPU (``dtrain run --device cuda``: with one GPU the
``--workers`` processes share it over gloo, whose collectives carry the CUDA gradients through host
memory). ``--jobs J`` runs J of them at once, each ``dtrain run`` its own set of processes; a run that
outlasts ``--deadline-s`` is stopped and kept with the evaluations it had printed (``partial``). A run
that evaluates more than once (``--gpt-epochs``) also has its best evaluation (``best``).

Run::

    python benchmarks/precision.py                        # both workloads, ~10 minutes on 2 cores
    python benchmarks/precision.py --part cnn --seeds 0,1,2
    python benchmarks/precision.py --table                # print the stored results
    python benchmarks/precision.py --part gpt --device cuda --gpt-seeds 0,1 --gpt-batch 64 --gpt-lr 0.001 \
        --gpt-epochs 12 --gpt-steps 0 --gpt-schedule cosine --jobs 6   # on a GPU
    python benchmarks/precision.py --part gpt --device cuda --gpt-seeds 0,1,2 --gpt-batch 64 --gpt-lr 0.001 \
        --gpt-epochs 8 --gpt-steps 0 --gpt-schedule cosine --gpt-warmup-epochs 0.5 --jobs 9   # with warmup
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "raw" / "precision.json"
PRECISIONS = ("fp32", "bf16", "fp16")


KEYS = (
    "metric",
    "metric_name",
    "steps",
    "train_s",
    "final_loss",
    "bytes_sent_per_step",
    "overflow_steps",
    "precision",
    "device",
    "backend",
)
_EVAL_LINE = re.compile(r"^step (\d+) \(epoch (\d+)\): (?:validation loss|test accuracy) ([0-9.]+)", re.M)


def _record(s: dict[str, Any]) -> dict[str, Any]:
    r = {k: s.get(k) for k in KEYS}
    history = [float(h["value"]) for h in s.get("metric_history", [])]
    if len(history) > 1:
        r["history"] = history
        r["best"] = min(history) if s.get("metric_name") != "test_accuracy" else max(history)
    return r


def _one(cfg: Any) -> dict[str, Any]:
    from dtrain.job.run import run

    with tempfile.TemporaryDirectory() as d:
        s, _ = run(cfg.replace(out=str(Path(d) / "run"), overwrite=True), quiet=True)
    return _record(s)


def _many(
    cfgs: dict[str, Any], jobs: int, deadline_s: float, logs: Path | None = None
) -> dict[str, dict[str, Any] | str]:
    """Each ``key: RunConfig`` as its own ``dtrain run`` process tree, ``jobs`` at a time: key -> its record,
    or why it failed. Runs still going at ``deadline_s`` are stopped and recorded from the evaluations they
    printed (``partial``). ``logs``: every run's output is appended there."""
    from dtrain.config.files import dump_toml

    out: dict[str, dict[str, Any] | str] = {}
    todo, running = list(cfgs), {}
    t_end = time.monotonic() + deadline_s
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        while todo or running:
            while todo and len(running) < jobs:
                key = todo.pop(0)
                folder = root / key.replace("|", "_")
                folder.mkdir()
                cfg = cfgs[key].replace(out=str(folder / "run"), progress=True)  # progress: each evaluation printed
                (folder / "run.toml").write_text(dump_toml(cfg))
                log = (folder / "log.txt").open("w")
                cmd = [sys.executable, "-m", "dtrain.cli", "run", str(folder / "run.toml")]
                running[key] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), folder, log)
            time.sleep(1.0)
            late = time.monotonic() > t_end
            for key in [k for k, (p, _, _) in running.items() if late or p.poll() is not None]:
                p, folder, log = running.pop(key)
                if p.poll() is None:
                    p.terminate()
                    p.wait(timeout=60)
                log.close()
                text = (folder / "log.txt").read_text(errors="replace")
                if logs is not None:
                    with logs.open("a") as f:
                        f.write(f"===== {key} (exit {p.returncode})\n{text}\n")
                from dtrain.rundir.files import is_finished, read_summary

                if is_finished(folder / "run"):  # the summary, written at the end (a run stopped at the deadline
                    out[key] = _record(read_summary(folder / "run"))  # may have got there)
                    continue
                evals = [(int(s), int(e), float(v)) for s, e, v in _EVAL_LINE.findall(text)]
                if late and evals:  # stopped at the deadline: what it had evaluated
                    hist = [v for _, _, v in evals]
                    out[key] = {
                        "metric": hist[-1],
                        "metric_name": "val_loss",
                        "steps": evals[-1][0],
                        "history": hist,
                        "best": min(hist),
                        "partial": True,
                        "precision": cfgs[key].precision,
                    }
                else:
                    out[key] = f"exit {p.returncode}: {text[-600:]}"
            if late:
                todo.clear()
    return out


def table(db: dict[str, Any], part: str) -> list[str]:
    by: dict[str, dict[int, dict[str, Any]]] = {}
    for key, r in db["runs"].items():
        p, prec, seed = key.split("|")
        if p == part:
            by.setdefault(prec, {})[int(seed)] = r
    if "fp32" not in by:
        return []
    lm = by["fp32"][min(by["fp32"])]["metric_name"] != "test_accuracy"

    def mean(prec: str, k: str) -> float:
        return statistics.mean(float(r.get(k) or 0) for r in by[prec].values())

    ref, ref_bytes = mean("fp32", "metric"), mean("fp32", "bytes_sent_per_step")
    vals = [r["metric"] for r in by["fp32"].values()]
    spread = (max(vals) - min(vals)) / (ref if lm else 1)
    unit = "val loss" if lm else "test acc %"
    lines = [
        f"\n{part}: {'precision':<10}{unit:>11}{'vs fp32':>10}{'per seed':>24}{'bytes/step':>12}{'vs fp32':>9}"
        f"{'overflow steps':>16}{'steps':>7}{'train s':>9}",
        f"{'':<{len(part) + 2}}"
        + (
            f"(fp32 seed spread: {spread * 100:.2f}{'%' if lm else ' points'}, {len(vals)} seeds)"
            if len(vals) > 1
            else "(one seed: no spread measured)"
        ),
    ]
    for prec in PRECISIONS:
        if prec not in by:
            continue
        m = mean(prec, "metric")
        seeds = [by[prec][s]["metric"] for s in sorted(by[prec])]
        if lm:
            shown, diff, each = f"{m:.4f}", f"{m / ref - 1:+.2%}", " ".join(f"{v:.3f}" for v in seeds)
        else:
            shown, diff, each = f"{m * 100:.2f}", f"{(m - ref) * 100:+.2f}", " ".join(f"{v * 100:.1f}" for v in seeds)
        ov = [by[prec][s].get("overflow_steps") for s in sorted(by[prec])]
        ovs = " ".join(str(o) for o in ov) if prec == "fp16" else "-"
        b = mean(prec, "bytes_sent_per_step")
        lines.append(
            f"{'':<{len(part) + 2}}{prec:<10}{shown:>11}{diff:>10}{each:>24}{b:>12.0f}"
            f"{b / ref_bytes if ref_bytes else 0:>9.3f}{ovs:>16}{mean(prec, 'steps'):>7.0f}"
            f"{mean(prec, 'train_s'):>9.1f}"
        )
    if all("best" in r for runs in by.values() for r in runs.values()):  # evaluated every epoch: the best too
        ref_best = mean("fp32", "best")
        for prec in by:
            m = mean(prec, "best")
            seeds = " ".join(f"{by[prec][s]['best']:.3f}" for s in sorted(by[prec]))
            diff = f"{m / ref_best - 1:+.2%}" if lm else f"{(m - ref_best) * 100:+.2f}"
            lines.append(f"{'':<{len(part) + 2}}{prec + ' best':<10}{m:>11.4f}{diff:>10}{seeds:>24}")
    partial = sorted(f"{p}/{s}" for p, runs in by.items() for s, r in runs.items() if r.get("partial"))
    if partial:
        lines.append(
            f"{'':<{len(part) + 2}}stopped at the deadline (their last evaluation counted): " + ", ".join(partial)
        )
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("cnn", "gpt", "both"), default="both")
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--seeds", default="0,1,2", help="CNN seeds (default: 0,1,2)")
    ap.add_argument("--gpt-seeds", default="0")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--cnn-epochs", type=int, default=20)
    ap.add_argument("--cnn-batch", type=int, default=64)
    ap.add_argument("--cnn-lr", type=float, default=0.05)
    ap.add_argument("--gpt-model", default="gpt-small")
    ap.add_argument("--gpt-batch", type=int, default=16)
    ap.add_argument("--gpt-lr", type=float, default=0.002)
    ap.add_argument("--gpt-steps", type=int, default=150, help="stop after N steps (0: train every epoch)")
    ap.add_argument("--gpt-epochs", type=int, default=1)
    ap.add_argument("--gpt-schedule", choices=("constant", "cosine"), default="constant")
    ap.add_argument("--gpt-warmup-epochs", type=float, default=0.0, help="gradual warmup over the first N epochs")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once, each its own dtrain run (default: 1)")
    ap.add_argument("--deadline-s", type=float, default=1e9, help="with --jobs: stop the runs still going then")
    ap.add_argument("--logs", default="", help="with --jobs: append every run's output to this file")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--eval-samples", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=900.0, help="each run's timeout for one blocking call")
    ap.add_argument("--json", default=str(DEFAULT_JSON))
    ap.add_argument("--table", action="store_true", help="only print the stored results")
    ns = ap.parse_args()
    path = Path(ns.json)
    db: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    parts = ("cnn", "gpt") if ns.part == "both" else (ns.part,)
    if not ns.table:
        import torch

        from dtrain.config.schema import RunConfig

        common = dict(trace=False, progress=False, workers=ns.workers, timeout_s=ns.timeout_s, device=ns.device)
        bases = {
            "cnn": RunConfig.make(
                model="cnn",
                dataset="digits",
                optimizer="sgd",
                momentum=0.9,
                lr=ns.cnn_lr,
                batch_size=ns.cnn_batch,
                epochs=ns.cnn_epochs,
                **common,
            ),
            "gpt": RunConfig.make(
                model=ns.gpt_model,
                dataset="pytext",
                seq_len=ns.seq_len,
                optimizer="adam",
                lr=ns.gpt_lr,
                batch_size=ns.gpt_batch,
                epochs=ns.gpt_epochs,
                max_steps=ns.gpt_steps,
                lr_schedule=ns.gpt_schedule,
                warmup_epochs=ns.gpt_warmup_epochs,
                eval_samples=ns.eval_samples,
                **common,
            ),
        }
        print(
            f"torch {torch.__version__}; {ns.workers} workers on {ns.device}, dp ring; cnn: digits, "
            f"{ns.cnn_epochs} epochs, batch {ns.cnn_batch}, SGD {ns.cnn_lr}; gpt: {ns.gpt_model} on pytext, seq "
            f"{ns.seq_len}, batch {ns.gpt_batch}, Adam {ns.gpt_lr} {ns.gpt_schedule}, "
            f"warmup {ns.gpt_warmup_epochs:g} epoch(s), {ns.gpt_epochs} epoch(s), "
            f"{ns.gpt_steps or 'all'} steps, eval windows {ns.eval_samples or 'all'}"
        )
        if ns.device == "cuda":
            print(f"GPU: {torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} device(s)")
        if ns.jobs > 1:
            seeds = {"cnn": ns.seeds, "gpt": ns.gpt_seeds}
            cfgs = {
                f"{part}|{prec}|{seed}": bases[part].replace(precision=prec, seed=seed)
                for part in parts
                for seed in (int(s) for s in seeds[part].split(","))
                for prec in ns.precisions.split(",")
            }
            t0 = time.monotonic()
            for key, r in _many(cfgs, ns.jobs, ns.deadline_s, Path(ns.logs) if ns.logs else None).items():
                if isinstance(r, str):
                    print(f"  {key}: FAILED {r}", flush=True)
                    continue
                db["runs"][key] = r
                print(
                    f"  {key}: {r['metric']:.4f} best {r.get('best')}, overflow {r.get('overflow_steps')}, "
                    f"train {r.get('train_s')}s{' PARTIAL' if r.get('partial') else ''}",
                    flush=True,
                )
            print(f"{len(cfgs)} runs, {ns.jobs} at once: {time.monotonic() - t0:.0f} s")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(db, indent=1))
            parts = tuple(p for p in parts if any(k.startswith(p + "|") for k in db["runs"]))
        for part in parts if ns.jobs <= 1 else ():
            for seed in (int(s) for s in (ns.seeds if part == "cnn" else ns.gpt_seeds).split(",")):
                for prec in ns.precisions.split(","):
                    try:
                        r = _one(bases[part].replace(precision=prec, seed=seed))
                    except Exception as exc:  # noqa: BLE001 - a failed run is reported, the others go on
                        print(f"  {part} seed {seed} {prec}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                        continue
                    db["runs"][f"{part}|{prec}|{seed}"] = r
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(json.dumps(db, indent=1))
                    print(
                        f"  {part} seed {seed} {prec}: {r['metric_name']} {r['metric']:.4f}, "
                        f"{r['bytes_sent_per_step']:.0f} B/step, overflow {r.get('overflow_steps')}, "
                        f"train {r['train_s']:.1f}s",
                        flush=True,
                    )
    for part in parts:
        print("\n".join(table(db, part)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
