"""Large-batch training: what keeps accuracy when the global batch grows 8x and 32x.

Every variant is one ``dtrain run`` (``dtrain.job.run.run``, data parallel with ring allreduce, loopback
unless ``--part cluster``) from the same seed for the same number of epochs, so a larger batch takes
fewer steps. The metric is the one the run reports after its last epoch (not the best epoch).

``--part cnn`` (default): the CNN on digits (1,437 training samples, 360 test samples: one test sample
is 0.28 points), ``--workers`` processes, SGD with momentum 0.9 and a constant rate, no weight decay:

* ``1x sgd``                  the base global batch ``--base`` at the base rate ``--lr`` (the reference)
* ``8x sgd`` / ``32x sgd``    the same rate at 8x / 32x the batch (no scaling)
* ``8x/32x linear+warmup``    ``--lr-scaling linear --base-batch BASE`` (rate x8 / x32) with Goyal et al.'s
                              gradual warmup over ``--warmup-epochs`` epochs
* ``32x lars lr=X``           ``--optimizer lars`` (trust coefficient 0.001, biases excluded: plain momentum
                              SGD at X) at 32x for each X of ``--lars-lrs``, warmup from ~0 over the same epochs
* ``growth 1x->8x``           ``--batch-schedule`` from the base batch doubling every ``epochs/6`` epochs up
                              to 8x, at the base rate (Smith et al. 2018: grow the batch instead of decaying)
* ``auto``                    ``--batch-schedule auto --max-batch 8x``: the batch doubles while the measured
                              gradient noise scale exceeds it (dp, 2+ workers), at the base rate
* ``auto every``              (cluster) the same rule decided every ``--auto-every`` steps, inside epochs too,
                              with linear scaling (the growth is the warmup)
* ``auto time``               (cluster) the same, doubling while the noise scale times the step's fixed time
                              over its batch's compute time exceeds twice the batch (``--auto-rule time``)
* ``auto time from 8x ...``   (cluster) the time rule starting at 8x with 8x's rate and warmup, up to 32x:
                              ``linear`` (the rate doubles with the batch) or ``rate held`` (Smith et al.),
                              and ``rate held max 16x``, capped at 16x

``--part gpt``: ``--gpt-model`` (gpt-tiny) on pytext, ``--gpt-epochs`` epochs, validation loss over every
validation window: the base batch ``--gpt-base`` with Adam ``--gpt-lr``; 8x with Adam at the same rate; 8x
with Adam, sqrt scaling and warmup; 8x with ``--optimizer lamb`` at each rate of ``--lamb-lrs`` with warmup.

``--part cluster``: on an emulated cluster (root; one network namespace per host, tbf-shaped links at
``--bandwidth``), dp on ``--hosts`` hosts, the CNN: the base batch against 8x with linear scaling and
warmup (an eighth of the allreduces), the growth schedule and ``auto``: training seconds and final accuracy,
and the training seconds to the first evaluation (one per epoch) at or above ``--target`` test accuracy
(each run goes on to its last epoch).

``--part cluster-gpt``: the same cluster, ``--gpt-model`` on pytext, where a step's compute grows with the
batch: the base batch with Adam ``--gpt-lr``; 2x-16x with square-root scaling and warmup; ``auto`` with the
time rule from the base batch (square-root scaling, caps 8x and 16x, ``--noise-beta`` 0.95 and 0.9, and with the
fixed batches' warmup). The target (``--target``) is a validation loss to reach; ``--eval-every`` evaluates
inside epochs.

Results go to ``--json`` keyed by (part, variant, seed) and merged with what is there, so a later call
with ``--only`` adds rows (e.g. ``auto`` once it exists); the table is printed from the whole file.

Run::

    python benchmarks/large_batch.py --part cnn --seeds 0,1,2          # ~25 minutes on 2 cores
    python benchmarks/large_batch.py --part cnn --only auto            # add a variant
    python benchmarks/large_batch.py --part gpt
    python benchmarks/large_batch.py --part cluster --bandwidth 100mbit  # root
    python benchmarks/large_batch.py --table                           # print the stored results
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "raw" / "large_batch.json"


def cnn_variants(ns: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """RunConfig keys of every CNN variant, by name."""
    b, e, w = ns.base, ns.epochs, ns.warmup_epochs
    scaled = dict(lr_scaling="linear", base_batch=b, warmup_epochs=w)
    out: dict[str, dict[str, Any]] = {"1x sgd": dict(batch_size=b)}
    for k in (8, 32):
        out[f"{k}x sgd"] = dict(batch_size=k * b)
        out[f"{k}x linear+warmup"] = dict(batch_size=k * b, **scaled)
    for lr in ns.lars_lrs.split(","):
        out[f"32x lars lr={lr}"] = dict(batch_size=32 * b, optimizer="lars", lr=float(lr), warmup_epochs=w)
    every = max(1, e // 6)
    out["growth 1x->8x"] = dict(batch_schedule=",".join(f"{i * every}:{b << i}" for i in range(4)))
    out["auto"] = dict(batch_size=b, batch_schedule="auto", max_batch=8 * b, noise_scale=True)
    return out


def gpt_variants(ns: argparse.Namespace) -> dict[str, dict[str, Any]]:
    b, w = ns.gpt_base, ns.gpt_warmup_epochs
    out: dict[str, dict[str, Any]] = {
        "1x adam": dict(batch_size=b),
        "8x adam": dict(batch_size=8 * b),
        "8x adam sqrt+warmup": dict(batch_size=8 * b, lr_scaling="sqrt", base_batch=b, warmup_epochs=w),
    }
    for lr in ns.lamb_lrs.split(","):
        out[f"8x lamb lr={lr}"] = dict(batch_size=8 * b, optimizer="lamb", lr=float(lr), warmup_epochs=w)
    return out


def cluster_variants(ns: argparse.Namespace) -> dict[str, dict[str, Any]]:
    b, w = ns.base, ns.warmup_epochs
    out = {
        "1x sgd": dict(batch_size=b),
        "8x linear+warmup": dict(batch_size=8 * b, lr_scaling="linear", base_batch=b, warmup_epochs=w),
        "growth 1x->8x": cnn_variants(ns)["growth 1x->8x"],
        "auto": dict(batch_size=b, batch_schedule="auto", max_batch=8 * b, noise_scale=True),
    }
    scaled = dict(lr_scaling="linear", base_batch=b, warmup_epochs=w)
    for k in ns.cluster_fixed.split(","):  # more fixed batches: which one is fastest to the target
        if k.strip() and f"{k}x linear+warmup" not in out:
            out[f"{k}x linear+warmup"] = dict(batch_size=int(k) * b, **scaled)
    within = dict(
        batch_size=b,
        batch_schedule="auto",
        max_batch=8 * b,
        auto_every=ns.auto_every,
        lr_scaling="linear",
        base_batch=b,
    )
    out["auto every"] = dict(within, auto_rule="noise")
    out["auto time"] = dict(within, auto_rule="time")
    out["auto time sqrt"] = dict(within, auto_rule="time", lr_scaling="sqrt")
    for k in (16, 32):  # past 8x: square-root scaling, fixed (with warmup) and as auto's cap
        out[f"{k}x sqrt+warmup"] = dict(batch_size=k * b, lr_scaling="sqrt", base_batch=b, warmup_epochs=w)
        out[f"auto time sqrt max {k}x"] = dict(within, auto_rule="time", lr_scaling="sqrt", max_batch=k * b)
    big_epoch = (1437 // ns.hosts) // (8 * b // ns.hosts)  # digits: steps of an epoch at 8x
    out["auto time warmup"] = dict(within, auto_rule="time", warmup_steps=round(w * big_epoch))  # 8x's ramp
    # auto from the best fixed batch (8x, its rate and warmup), growing past it as the time rule says: with
    # linear scaling (the rate doubles with the batch), or with the rate held (Smith et al. 2018: a larger
    # batch at the same rate is a smaller step's noise, as a decay would give)
    from8 = dict(
        batch_size=8 * b,
        batch_schedule="auto",
        max_batch=32 * b,
        auto_every=ns.auto_every,
        auto_rule="time",
        warmup_epochs=w,
    )
    out["auto time from 8x linear"] = dict(from8, lr_scaling="linear", base_batch=b)
    out["auto time from 8x rate held"] = dict(from8, lr=8 * ns.lr)
    # the same, capped at 16x (from 8x the time rule reached 32x within the warmup)
    out["auto time from 8x rate held max 16x"] = dict(from8, lr=8 * ns.lr, max_batch=16 * b)
    return out


def cluster_gpt_variants(ns: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """``--part cluster-gpt``: the language model on the emulated cluster, where a step's compute grows with the
    batch (gpt-tiny at 100 Mbit: ~83 ms a step that does not, ~0.4 ms a sample that does), so no one fixed batch
    is best from the first step to the last: fixed batches with Adam at sqrt-scaled rates and warmup, against
    auto with the time rule growing from the base batch at the same sqrt-scaled rate."""
    b, w = ns.gpt_base, ns.gpt_warmup_epochs
    out: dict[str, dict[str, Any]] = {"1x adam": dict(batch_size=b)}
    for k in (2, 4, 8, 16):
        out[f"{k}x adam sqrt+warmup"] = dict(batch_size=k * b, lr_scaling="sqrt", base_batch=b, warmup_epochs=w)
    auto = dict(
        batch_size=b, batch_schedule="auto", auto_every=ns.auto_every, auto_rule="time", lr_scaling="sqrt", base_batch=b
    )
    for k in (8, 16):
        out[f"auto time sqrt max {k}x"] = dict(auto, max_batch=k * b)
    for beta in (0.95, 0.9):  # a shorter memory of the noise scale's averages: less lag while |G|^2 falls fast
        out[f"auto time sqrt max 8x beta {beta}"] = dict(auto, max_batch=8 * b, noise_beta=beta)
    out["auto time sqrt max 8x warmup"] = dict(auto, max_batch=8 * b, warmup_epochs=w)  # the fixed batches' ramp
    return out


def _selected(variants: dict[str, dict[str, Any]], only: str) -> dict[str, dict[str, Any]]:
    if not only:
        return {k: v for k, v in variants.items() if k != "auto"} if not _has_auto() else variants
    keys = [s.strip() for s in only.split(",")]
    return {k: v for k, v in variants.items() if any(s == k or s in k for s in keys)}


def _has_auto() -> bool:
    """Whether this dtrain wires ``--batch-schedule auto`` (it landed after the rest of the issue)."""
    from dtrain.training.context import TrainContext

    return hasattr(TrainContext, "begin_epoch")


def _one(cfg: Any) -> dict[str, Any]:
    """Run ``cfg`` in a fresh folder; the summary's figures this benchmark keeps."""
    from dtrain.job.run import run

    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        s, out = run(cfg.replace(out=str(Path(d) / "run"), overwrite=True), quiet=True)
        from dtrain.rundir.files import read_metrics

        rows = read_metrics(out)
    steps_per_epoch: dict[int, int] = {}
    for r in rows:
        if r.get("rank", 0) == 0:
            steps_per_epoch[int(r["epoch"])] = steps_per_epoch.get(int(r["epoch"]), 0) + 1
    decisions = s.get("batch_decisions") or []
    if decisions and "step" in decisions[0]:  # auto deciding every N steps: each epoch's first batch
        first: dict[int, int] = {}
        for r in sorted((r for r in rows if r.get("rank", 0) == 0), key=lambda r: int(r["step"])):
            first.setdefault(int(r["epoch"]), int(r["batch"]))
        epoch_batches = [first[e] for e in sorted(first)]
    elif decisions:  # auto: the batch it chose for each epoch
        epoch_batches = [int(d["batch"]) for d in decisions]
    else:
        from dtrain.optim.large_batch import BatchPlan

        n = _train_size(cfg)
        epoch_batches = BatchPlan.of(cfg.batch_size, cfg.batch_schedule, n, cfg.epochs).batches
    noise = [float(r["b_simple"]) for r in rows if r.get("rank", 0) == 0 and r.get("b_simple") is not None]
    return {
        "metric": s["metric"],
        "metric_name": s["metric_name"],
        "history": [round(h["value"], 4) for h in s.get("metric_history") or []],
        "history_train_s": [round(h["train_s"], 2) for h in s.get("metric_history") or []],
        "steps": s["steps"],
        "train_s": s["train_s"],
        "wall_s": round(time.perf_counter() - t0, 1),
        "final_loss": s["final_loss"],
        "bytes_sent_per_step": s["bytes_sent_per_step"],
        "time_to_target_s": s.get("time_to_target_s"),
        "target_step": s.get("target_step"),
        "batches_seen": sorted({int(r["batch"]) for r in rows if r.get("batch")} or set(epoch_batches)),
        "decisions": decisions if decisions and "step" in decisions[0] else None,
        "epoch_batches": epoch_batches,
        "steps_per_epoch": [steps_per_epoch[e] for e in sorted(steps_per_epoch)],
        "noise_scale_last": s.get("noise_scale", noise[-1] if noise else None),
        "noise_scale_per_epoch": [round(float(d["b_simple"]), 1) for d in decisions if d.get("b_simple") is not None],
    }


def _train_size(cfg: Any) -> int:
    from dtrain.workloads.data import load_dataset

    return len(load_dataset(cfg.dataset, seq_len=cfg.seq_len).train)


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {"runs": {}}


def _save(path: Path, db: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(db, indent=1))


def table(db: dict[str, Any], part: str) -> list[str]:
    """Mean (and each seed's) final metric per variant, its difference from the base-batch row, steps, time."""
    runs = {k: v for k, v in db["runs"].items() if k.startswith(part + "|")}
    by: dict[str, dict[int, dict[str, Any]]] = {}
    for key, r in runs.items():
        _, name, seed = key.split("|")
        by.setdefault(name, {})[int(seed)] = r
    if not by:
        return []
    ref_name = next((n for n in by if n.startswith("1x")), None)
    lm = next(iter(next(iter(by.values())).values()))["metric_name"] != "test_accuracy"
    ref = statistics.mean(r["metric"] for r in by[ref_name].values()) if ref_name else float("nan")
    unit = "val loss" if lm else "test acc %"
    w = max(22, *(len(n) + 1 for n in by))  # the variant column fits the longest name
    lines = [
        f"\n{part}: {'variant':<{w}}{unit:>11}{'vs 1x':>10}{'per seed':>26}{'steps':>7}{'train s':>9}"
        f"{'to target s':>18}{'batches':>18}"
    ]
    for name, seeds in by.items():
        vals = [seeds[s]["metric"] for s in sorted(seeds)]
        mean = statistics.mean(vals)
        if lm:
            shown, diff, each = f"{mean:.4f}", f"{mean / ref - 1:+.2%}", " ".join(f"{v:.3f}" for v in vals)
        else:
            shown, diff, each = (
                f"{mean * 100:.2f}",
                f"{(mean - ref) * 100:+.2f}",
                " ".join(f"{v * 100:.1f}" for v in vals),
            )
        r0 = seeds[min(seeds)]
        ttt = [seeds[s].get("time_to_target_s") for s in sorted(seeds)]
        ttt_s = " ".join(f"{t:.1f}" if t is not None else "-" for t in ttt)
        steps = statistics.mean(seeds[s]["steps"] for s in seeds)
        train = statistics.mean(seeds[s]["train_s"] for s in seeds)
        bs = r0.get("batches_seen") or []
        lines.append(
            f"{'':<{len(part) + 2}}{name:<{w}}{shown:>11}{diff:>10}{each:>26}{steps:>7.0f}{train:>9.1f}"
            f"{ttt_s:>18}{','.join(map(str, bs)):>18}"
        )
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("cnn", "gpt", "cluster", "cluster-gpt"), default="cnn")
    ap.add_argument("--only", default="", help="comma-separated variant names (or parts of names) to run")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--base", type=int, default=16, help="CNN base global batch (default: 16)")
    ap.add_argument("--lr", type=float, default=0.02, help="CNN base SGD rate (default: 0.02)")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--warmup-epochs", type=float, default=5.0)
    ap.add_argument("--lars-lrs", default="1,2,5,10")
    ap.add_argument("--gpt-model", default="gpt-tiny")
    ap.add_argument("--gpt-base", type=int, default=16)
    ap.add_argument("--gpt-lr", type=float, default=0.002)
    ap.add_argument("--gpt-epochs", type=int, default=3)
    ap.add_argument("--gpt-warmup-epochs", type=float, default=0.5)
    ap.add_argument("--lamb-lrs", default="0.005,0.01,0.02")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--bandwidth", default="100mbit")
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument(
        "--target",
        type=float,
        default=0.95,
        help="cluster parts: test accuracy to reach (cluster), validation loss to reach (cluster-gpt)",
    )
    ap.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (default: after each epoch)")
    ap.add_argument(
        "--cluster-fixed",
        default="",
        help="cluster part: more fixed batches, as multiples of the base, with linear scaling and warmup (e.g. 4,16)",
    )
    ap.add_argument("--auto-every", type=int, default=5, help="'auto every' / 'auto time': decide every N steps")
    ap.add_argument("--name", default="lbatch")
    ap.add_argument("--json", default=str(DEFAULT_JSON))
    ap.add_argument("--table", action="store_true", help="only print the stored results")
    ns = ap.parse_args()
    path = Path(ns.json)
    db = _load(path)
    if ns.table:
        for part in ("cnn", "gpt", "cluster", "cluster-gpt"):
            print("\n".join(table(db, part)))
        return 0
    import torch

    from dtrain.config.schema import RunConfig

    common = dict(
        trace=False, progress=False, momentum=0.9, lr_schedule="constant", timeout_s=900.0, eval_every=ns.eval_every
    )
    on_cluster = ns.part.startswith("cluster")
    if ns.part in ("gpt", "cluster-gpt"):
        base = RunConfig.make(
            model=ns.gpt_model,
            dataset="pytext",
            seq_len=ns.seq_len,
            optimizer="adam",
            lr=ns.gpt_lr,
            epochs=ns.gpt_epochs,
            workers=ns.hosts if on_cluster else ns.workers,
            **common,
        )
        variants = gpt_variants(ns) if ns.part == "gpt" else cluster_gpt_variants(ns)
        what = (
            f"{ns.gpt_model} on pytext (seq {ns.seq_len}), {ns.gpt_epochs} epochs, base batch {ns.gpt_base}, "
            f"Adam {ns.gpt_lr}, warmup {ns.gpt_warmup_epochs:g} epochs"
        )
    else:
        base = RunConfig.make(
            model="cnn",
            dataset="digits",
            optimizer="sgd",
            lr=ns.lr,
            epochs=ns.epochs,
            workers=ns.hosts if ns.part == "cluster" else ns.workers,
            **common,
        )
        variants = cnn_variants(ns) if ns.part == "cnn" else cluster_variants(ns)
        what = (
            f"CNN on digits, {ns.epochs} epochs, base batch {ns.base}, SGD {ns.lr} momentum 0.9, "
            f"warmup {ns.warmup_epochs:g} epochs"
        )
    todo = _selected(variants, ns.only)
    if not _has_auto():
        print("this dtrain has no --batch-schedule auto yet: 'auto' left out")
    print(f"torch {torch.__version__}; {what}; {base.workers} workers; seeds {ns.seeds}; part {ns.part}")
    cname = ""
    if on_cluster:
        import dtrain.cluster as dc

        cname = f"{ns.name}_{ns.bandwidth}"[:24]
        dc.down(cname)
        dc.up(cname, hosts=ns.hosts, bandwidth=ns.bandwidth)
    try:
        for seed in (int(s) for s in ns.seeds.split(",")):
            for name, kw in todo.items():
                extra: dict[str, Any] = {"seed": seed}
                if on_cluster:
                    extra.update(cluster=cname)
                cfg = base.replace(**{**kw, **extra})
                try:
                    r = _one(cfg)
                except Exception as exc:  # noqa: BLE001 - a failed variant is a row too
                    print(f"  seed {seed} {name}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                    continue
                if on_cluster:  # the run goes on to its last epoch; the target is read off its evaluations
                    sign = 1 if r["metric_name"] == "test_accuracy" else -1  # a loss is reached from above
                    hit = [t for t, v in zip(r["history_train_s"], r["history"]) if sign * v >= sign * ns.target]
                    r.update(target=ns.target, time_to_target_s=hit[0] if hit else None)
                r["config"] = {k: v for k, v in kw.items()}
                db["runs"][f"{ns.part}|{name}|{seed}"] = r
                _save(path, db)
                print(
                    f"  seed {seed} {name:<22} {r['metric_name']} {r['metric']:.4f}  steps {r['steps']}  "
                    f"train {r['train_s']:.1f}s  wall {r['wall_s']:.0f}s  batches {r['batches_seen']}",
                    flush=True,
                )
    finally:
        if cname:
            import dtrain.cluster as dc

            dc.down(cname)
    print("\n".join(table(db, ns.part)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
