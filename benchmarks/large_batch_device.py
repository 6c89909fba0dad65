"""Large batch on one device: gpt-small at 8x the base batch with LAMB, one process per variant.

dtrain's training loop runs its workers on CPU processes; a GPU turns gpt-small's 12-epoch runs (4,836 steps
at the base batch) from hours into minutes. This script trains each variant in one process on one device
(CUDA where there is one, else CPU) with the run's own pieces, taken from :class:`dtrain.training.context.
TrainContext` built from the same ``RunConfig`` as ``dtrain run``: the seeded model, the pytext windows, the
sampler's order (``DistributedSampler`` with one replica puts the same samples in each step as data
parallelism over any number of workers does), the optimizer (``dtrain.optim.LAMB``, torch's Adam) and the
rate of every step (``lr_multiplier``: batch scaling x warmup x schedule). One process computes the global
batch's gradient directly instead of averaging the workers' (equal up to rounding). The validation loss over
every validation window is taken after each epoch.

Variants (``--model``, ``--epochs``, base batch ``--base`` with Adam ``--lr``; warmup ``--warmup-epochs`` of the
8x run's epochs):

* ``1x adam``, ``1x adam cosine``: the base batch at a constant rate, and decayed to 0 by a cosine
* ``8x adam sqrt+warmup`` (and ``cosine``): Adam at 8x with the rate x sqrt(8) after warmup
* ``1x adam lr=X`` (constant, cosine) and ``8x adam sqrt+warmup lr=X cosine`` for each X of ``--base-lrs``
* ``1x adam P lr=X`` for P in fp32, bf16, fp16 at ``--precision-lr``: autocast on the device, fp16 with
  dtrain's loss scaler (``dtrain.optim.precision.LossScaler``, a skipped step on overflow)
* ``8x lamb lr=X`` (and ``cosine``): ``dtrain.optim.LAMB`` at 8x for each X of ``--lamb-lrs``, warmup
* ``8x lamb lr=X wd=0.01 cosine``: the paper's weight decay

``--jobs`` variants run at once (each its own process: on a GPU small models leave it mostly idle, so
they share it well). Results go to ``--json`` (merged by model, epochs and variant) and a table.

Run::

    python benchmarks/large_batch_device.py --model gpt-small --epochs 12 --jobs 11    # a GPU: minutes
    python benchmarks/large_batch_device.py --model gpt-tiny --epochs 1 --max-steps 20 --only "1x adam"
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "raw" / "large_batch_device.json"


def variants(ns: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """RunConfig keys of every variant, by name."""
    b, w = ns.base, ns.warmup_epochs
    sqrt = dict(batch_size=8 * b, lr_scaling="sqrt", base_batch=b, warmup_epochs=w)
    out: dict[str, dict[str, Any]] = {
        "1x adam": dict(batch_size=b),
        "1x adam cosine": dict(batch_size=b, lr_schedule="cosine"),
        "8x adam sqrt+warmup": sqrt,
        "8x adam sqrt+warmup cosine": dict(sqrt, lr_schedule="cosine"),
    }
    for prec in ("fp32", "bf16", "fp16"):  # mixed precision at the base batch (--precision-lr)
        out[f"1x adam {prec} lr={ns.precision_lr}"] = dict(batch_size=b, lr=ns.precision_lr, precision=prec)
    for lr in (x for x in ns.base_lrs.split(",") if x):
        out[f"1x adam lr={lr}"] = dict(batch_size=b, lr=float(lr))
        out[f"1x adam lr={lr} cosine"] = dict(batch_size=b, lr=float(lr), lr_schedule="cosine")
        out[f"8x adam sqrt+warmup lr={lr} cosine"] = dict(sqrt, lr=float(lr), lr_schedule="cosine")
    for lr in ns.lamb_lrs.split(","):
        lamb = dict(batch_size=8 * b, optimizer="lamb", lr=float(lr), warmup_epochs=w, weight_decay=0.0)
        out[f"8x lamb lr={lr}"] = lamb
        out[f"8x lamb lr={lr} cosine"] = dict(lamb, lr_schedule="cosine")
        out[f"8x lamb lr={lr} wd=0.01 cosine"] = dict(lamb, lr_schedule="cosine", weight_decay=0.01)
    return out


def train_one(name: str, keys: dict[str, Any], ns: argparse.Namespace) -> dict[str, Any]:
    """Train one variant in this process; its figures."""
    import torch

    from dtrain.config.schema import RunConfig
    from dtrain.optim.precision import LossScaler, Precision
    from dtrain.trace import MetricsWriter, Tracer
    from dtrain.training.context import TrainContext

    torch.set_num_threads(ns.threads)
    dev = torch.device(ns.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    values: dict[str, Any] = dict(
        model=ns.model,
        dataset="pytext",
        seq_len=ns.seq_len,
        optimizer="adam",
        lr=ns.lr,
        epochs=ns.epochs,
        max_steps=ns.max_steps,
        workers=1,
        seed=ns.seed,
        trace=False,
        progress=False,
    )
    values.update(keys)
    cfg = RunConfig.make(**values)
    with tempfile.TemporaryDirectory() as d:
        ctx = TrainContext(
            cfg=cfg,
            rank=0,
            world_size=1,
            out_dir=Path(d),
            data=cfg.load_data(),
            metrics=MetricsWriter(d, 0),
            tracer=Tracer(0, enabled=False),
        )
        model = ctx.make_model().to(dev)
        opt = ctx.make_optimizer(model.parameters())
        prec = Precision(cfg.precision, dev.type)  # autocast on the device; fp16: dtrain's loss scaler
        scaler = LossScaler(list(model.parameters()), device=dev.type) if prec.scales_loss else None
        overflows = 0
        total = ctx.total_steps(1)
        losses: list[list[float]] = []
        history: list[float] = []
        step, t0 = 0, time.perf_counter()
        for epoch in range(cfg.epochs):
            for x, y in ctx.loader(0, 1, epoch):
                if step >= total:
                    break
                ctx.schedule_lr(opt, step, total)
                with prec.autocast():
                    loss = ctx.loss(model(x.to(dev, non_blocking=True)), y.to(dev, non_blocking=True))
                opt.zero_grad(set_to_none=True)
                (scaler.scale_loss(loss) if scaler is not None else loss).backward()
                if scaler is None or not scaler.unscale(step):
                    opt.step()
                else:
                    overflows += 1
                if scaler is not None:
                    scaler.advance()
                if step % ns.log_every == 0 or step == total - 1:
                    losses.append([step, float(loss.detach())])
                step += 1
            history.append(ctx.evaluate(model))  # every validation window, on the device
            if step >= total:
                break
        if dev.type == "cuda":
            torch.cuda.synchronize()
        train_s = time.perf_counter() - t0
    return {
        "variant": name,
        "keys": keys,
        "device": str(dev),
        "steps": step,
        "train_s": round(train_s, 1),
        "val_loss": history[-1],
        "best_val_loss": min(history),
        "history": [round(h, 4) for h in history],
        "losses": losses,
        "nonfinite": not all(math.isfinite(v) for _, v in losses),
        "torch": torch.__version__,
        "precision": cfg.precision,
        "overflow_steps": overflows,
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "",
    }


def table(db: dict[str, Any], prefix: str) -> list[str]:
    """Every variant under ``prefix`` (model, epochs, max steps, seed), against the best base-batch fp32 run:
    the best 1x variant by the last epoch's loss, and the best 1x variant by its best epoch's loss."""
    rows = {k[len(prefix) :]: v for k, v in db.items() if k.startswith(prefix)}
    if not rows:
        return [f"(no results for {prefix!r})"]
    base = [
        r
        for n, r in rows.items()  # the fp32 runs at the base batch
        if n.startswith("1x") and r["keys"].get("precision", "fp32") == "fp32" and math.isfinite(r["val_loss"])
    ]
    last = min((r["val_loss"] for r in base), default=math.nan)
    best = min((r["best_val_loss"] for r in base), default=math.nan)
    r0 = next(iter(rows.values()))
    out = [
        f"{prefix}  {r0['device']} {r0['gpu']} torch {r0['torch']}; best 1x: last epoch {last:.4f}, "
        f"best epoch {best:.4f}",
        "",
        "| variant | val loss, last epoch | vs best 1x | best epoch's | vs best 1x | steps | train s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        out.append(
            f"| {name} | {r['val_loss']:.4f} | {100 * (r['val_loss'] / last - 1):+.2f}% | "
            f"{r['best_val_loss']:.4f} | {100 * (r['best_val_loss'] / best - 1):+.2f}% | {r['steps']} | "
            f"{r['train_s']} |"
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-small")
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--base", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.002)
    ap.add_argument("--warmup-epochs", type=float, default=0.5)
    ap.add_argument("--base-lrs", default="", help="more Adam rates for the 1x and 8x-sqrt variants")
    ap.add_argument("--precision-lr", type=float, default=0.001, help="Adam rate of the precision variants")
    ap.add_argument("--lamb-lrs", default="0.005,0.01,0.02")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default="", help="comma-separated variant names (or parts of names)")
    ap.add_argument("--jobs", type=int, default=1, help="variants at once, each its own process")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--device", default="", help="default: cuda if available, else cpu")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--variant", default="", help=argparse.SUPPRESS)  # a child: train this one, print JSON
    ap.add_argument("--json", default=str(DEFAULT_JSON))
    ap.add_argument("--table", action="store_true", help="only print the stored results")
    ns = ap.parse_args()
    every = variants(ns)
    if ns.variant:
        print("RESULT " + json.dumps(train_one(ns.variant, every[ns.variant], ns)), flush=True)
        return 0
    run = f"{ns.model}|{ns.epochs}e|{ns.max_steps}|"  # then seedS|variant
    prefix = f"{run}seed{ns.seed}|"
    path = Path(ns.json)
    db: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    if not ns.table:
        keys = [s.strip() for s in ns.only.split(",") if s.strip()]
        chosen = [k for k in every if not keys or any(s == k or s in k for s in keys)]
        pending = list(chosen)
        running: list[tuple[str, subprocess.Popen[str]]] = []
        env = dict(os.environ, OMP_NUM_THREADS=str(ns.threads))
        while pending or running:
            while pending and len(running) < ns.jobs:
                name = pending.pop(0)
                cmd = [sys.executable, __file__, *sys.argv[1:], "--variant", name]
                running.append((name, subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)))
            name, proc = running.pop(0)
            text, _ = proc.communicate()
            got = [x for x in text.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not got:
                print(f"  {name}: FAILED (exit {proc.returncode})", flush=True)
                continue
            r = json.loads(got[-1][len("RESULT ") :])
            db[prefix + name] = r
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(db, indent=1))
            print(
                f"  {name}: val loss {r['val_loss']:.4f} (best {r['best_val_loss']:.4f}), {r['steps']} steps, "
                f"{r['train_s']} s on {r['device']}",
                flush=True,
            )
    for seed in sorted({k[len(run) :].split("|")[0] for k in db if k.startswith(run)}):
        print("\n".join(table(db, f"{run}{seed}|")) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
