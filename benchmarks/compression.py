"""Gradient compression side by side with uncompressed training.

Two tables:

1. **codec** (one process): for each compressor, the payload of a 1 MiB fp32
   gradient (bytes and ratio to dense) and encode+decode time per MB (median of
   ``--reps`` after one discarded warm-up), with ``none`` as the peer.
2. **training** (``--workers`` processes through ``dtrain.launch.agent.launch``, each
   compressor in turn inside one launch): ``dtrain.DataParallel(compression=...)``
   trains a model on digits for ``--epochs`` epochs; per compressor the bytes a
   worker sent per step (the transport's counters) and the ratio to the
   uncompressed run, the test accuracy after each epoch, the final accuracy, and
   the training time until the test accuracy first reached ``--target``
   (evaluations excluded; epoch granularity), also as a ratio to uncompressed.
   Models: the default CNN, and a larger MLP (``--mlp-hidden``, default 512,512).
   As in ``dtrain run``, sign, sign:mv and onebit take SGD's momentum into their
   error feedback (the optimizer then has none); ``--momentum-after`` leaves it in
   the optimizer for every compressor, to show why.
   With ``--ps`` the CNN is also trained under the parameter server (BSP) through
   ``dtrain.job.run.run`` (``--ps-servers`` server processes beside the workers).
   Every row follows the same learning-rate schedule, ``--lr-schedule`` (default:
   cosine, ``dtrain run --lr-schedule cosine``), stepped per optimizer step.

A row may run at its own settings: ``SPEC@lr=0.2,momentum=0,epochs=30`` (keys
``lr``, ``momentum``, ``epochs``, ``batch`` (global); in ``--specs`` the commas
after ``@`` belong to the row). The default grid runs unbiased rand-k at ratio 0.1 (lr 0.2, momentum 0,
30 epochs, :data:`TUNED`, beside ``none`` there as its peer) and rand-k with memory
at 0.01 (the same for 40 epochs): at the common settings neither trains
(measured by this script at those settings).
The settings of every row are printed with it.

Run (all compressors, both models; ``--ps`` adds the parameter server; the three rows
of 30-40 epochs make the grid about 1.7 times as long as the 15 rows at 10 epochs)::

    python benchmarks/compression.py
    python benchmarks/compression.py --specs none,topk:0.01,powersgd:2 --models cnn --epochs 5
    python benchmarks/compression.py --ps --models cnn
    python benchmarks/compression.py --specs sign,onebit --models cnn --momentum-after
    python benchmarks/compression.py --specs randomk:0.1@lr=0.2,momentum=0,epochs=30 --models cnn --ps

Timings on a shared machine are indicative; the ratios of bytes are exact.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

DEFAULT_SPECS = [
    "none",
    "fp16",
    "bf16",
    "qsgd:16",
    "terngrad",
    "sign",
    "sign:mv",
    "onebit",
    "topk:0.01",
    "randomk:0.01",
    "randomk:0.1",
    "randomk:0.01:memory",
    "randomk:0.1:memory",
    "threshold:0.001",
    "powersgd:2",
]

#: Rows at their own settings in the default grid: rand-k needs a larger step without
#: momentum and more epochs (unbiased at ratio 0.01 its variance is 99 times the
#: gradient's and it does not train at all; with memory at 0.01 each element arrives
#: 100 steps late on average, and with the cosine schedule 30 epochs ended at 0.947,
#: 40 at 0.961). ``none`` at the same settings is their peer.
TUNED = "@lr=0.2,momentum=0,epochs=30"
DEFAULT_SPECS += [f"none{TUNED}", f"randomk:0.1{TUNED}", "randomk:0.01:memory@lr=0.2,momentum=0,epochs=40"]

_KEYS = {"lr": float, "momentum": float, "epochs": int, "batch": int}


def split_specs(text: str) -> list[str]:
    """``--specs`` into rows: a ``key=value`` item after a comma belongs to the row before it."""
    rows: list[str] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        if rows and "@" in rows[-1] and "=" in item and "@" not in item:
            rows[-1] += "," + item
        else:
            rows.append(item)
    return rows


def parse_row(row: str, args: argparse.Namespace) -> dict[str, Any]:
    """``SPEC[@key=value,...]`` -> {label, spec, lr, momentum, epochs}, the rest from ``args``."""
    spec, _, extra = row.partition("@")
    out: dict[str, Any] = {
        "label": row,
        "spec": spec,
        "lr": args.lr,
        "momentum": args.momentum,
        "epochs": args.epochs,
        "batch": args.batch_size,
    }
    for kv in [t for t in extra.split(",") if t]:
        key, eq, value = kv.partition("=")
        if not eq or key not in _KEYS:
            raise SystemExit(f"row {row!r}: write SPEC@key=value,... with keys {', '.join(_KEYS)}; got {kv!r}")
        try:
            out[key] = _KEYS[key](value)
        except ValueError:
            raise SystemExit(f"row {row!r}: {key} must be a {_KEYS[key].__name__}, got {value!r}") from None
    if not out["lr"] > 0 or not 0 <= out["momentum"] < 1 or out["epochs"] < 1 or out["batch"] % args.workers:
        raise SystemExit(f"row {row!r}: needs lr > 0, momentum in [0, 1), epochs >= 1, batch a multiple of --workers")
    return out


def _settings(r: dict[str, Any]) -> str:
    return f"lr {r['lr']:g} m {r['momentum']:g} {r['epochs']} ep" + (f" b {r['batch']}" if r["batch"] != 64 else "")


# ----------------------------------------------------------------------------- codec table


def codec_table(specs: list[str], reps: int) -> list[dict[str, Any]]:
    from dtrain.compress import from_spec
    from dtrain.compress.base import payload_nbytes

    torch.set_num_threads(1)  # as in the workers; less noise from a busy machine
    n = (1 << 20) // 4
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)) * 1e-2
    rows = []
    for spec in specs:
        c = from_spec(spec)
        times = []
        nbytes = 0
        for i in range(reps + 1):
            t0 = time.perf_counter()
            payload, ctx = c.compress(x, "probe")
            c.decompress(payload, ctx)
            dt = time.perf_counter() - t0
            nbytes = payload_nbytes(payload)
            if i:  # the first is warm-up
                times.append(dt)
        ms_per_mb = 1e3 * statistics.median(times)
        rows.append({"spec": spec, "bytes": nbytes, "ratio": nbytes / (4 * n), "ms_per_mb": ms_per_mb})
    return rows


# ----------------------------------------------------------------------------- DataParallel runs


def _evaluate(model: torch.nn.Module, data: Any) -> float:
    model.eval()
    x, y = data.test.tensors
    with torch.no_grad():
        acc = float((model(x).argmax(1) == y).float().mean())
    model.train()
    return acc


def dp_worker(
    rows: list[dict[str, Any]],
    model_name: str,
    hidden: list[int],
    seed: int,
    momentum_after: bool = False,
    lr_schedule: str = "constant",
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """One process of the training table: every row in turn, a fresh model each."""
    from torch.utils.data import DataLoader, DistributedSampler

    import dtrain
    from dtrain.compress import from_spec
    from dtrain.job.run import lr_factor
    from dtrain.workloads.data import load_dataset
    from dtrain.workloads.models import build_model

    torch.set_num_threads(1)
    rank, world = dtrain.rank(), dtrain.world_size()
    data = load_dataset("digits", seed=seed)
    results: dict[str, Any] = {}
    for row in rows:
        spec, lr, momentum, epochs, batch = row["spec"], row["lr"], row["momentum"], row["epochs"], row["batch"]
        torch.manual_seed(seed)
        kw = {"hidden": tuple(hidden)} if model_name == "mlp" else {}
        net = build_model(model_name, data.input_shape, data.num_classes, **kw)
        # as dtrain run does: sign/onebit take the momentum into their error feedback, SGD then has none
        comp = None if spec == "none" else from_spec(spec, momentum=0.0 if momentum_after else momentum)
        dp = dtrain.DataParallel(net, compression=comp, timeout_s=timeout_s)
        opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.0 if comp is not None and comp.momentum else momentum)
        loss_fn = torch.nn.CrossEntropyLoss()
        per_epoch = len(data.train) // world // (batch // world)
        total = per_epoch * epochs
        steps, sent, train_s, history = 0, 0, 0.0, []
        for epoch in range(epochs):
            sampler = DistributedSampler(data.train, world, rank, shuffle=True, seed=seed, drop_last=True)
            sampler.set_epoch(epoch)
            loader = DataLoader(data.train, batch_size=batch // world, sampler=sampler, drop_last=True)
            t0 = time.perf_counter()
            for x, y in loader:
                for g in opt.param_groups:  # as dtrain run's --lr-schedule: per optimizer step
                    g["lr"] = lr * lr_factor(lr_schedule, steps, total)
                opt.zero_grad(set_to_none=False)
                loss_fn(dp(x), y).backward()
                opt.step()
                steps += 1
                sent += int(dp.step_stats()["bytes_sent"])
            train_s += time.perf_counter() - t0
            history.append((round(train_s, 3), _evaluate(net, data)))
        dp.close()
        results[row["label"]] = {
            "params": sum(p.numel() for p in net.parameters()),
            "steps": steps,
            "bytes_per_step": sent / max(1, steps),
            "train_s": train_s,
            "history": history,
        }
    return results


def train_table(
    rows: list[dict[str, Any]], model: str, hidden: list[int], args: argparse.Namespace
) -> list[dict[str, Any]]:
    from dtrain.launch.agent import launch

    out = launch(
        dp_worker,
        (rows, model, hidden, args.seed, args.momentum_after, args.lr_schedule, args.timeout),
        nprocs=args.workers,
    )
    table = []
    for row in rows:
        per_rank = [out[r][row["label"]] for r in sorted(out)]
        hist = per_rank[0]["history"]
        table.append(
            {
                **row,
                "params": per_rank[0]["params"],
                "bytes_per_step": statistics.mean(r["bytes_per_step"] for r in per_rank),
                "accuracy": hist[-1][1],
                "history": [a for _, a in hist],
                "time_to_target_s": next((t for t, a in hist if a >= args.target), None),
                "train_s": max(r["train_s"] for r in per_rank),
            }
        )
    return table


def ps_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    from dtrain.config.schema import RunConfig
    from dtrain.job.run import run

    table = []
    for row in rows:
        with tempfile.TemporaryDirectory() as d:
            cfg = RunConfig.make(
                strategy="ps",
                workers=args.workers,
                servers=args.ps_servers,
                consistency="bsp",
                compression=row["spec"],
                epochs=row["epochs"],
                batch_size=row["batch"],
                lr=row["lr"],
                momentum=row["momentum"],
                lr_schedule=args.lr_schedule,
                seed=args.seed,
                out=d,
                progress=False,
                trace=False,
                timeout_s=args.timeout,
            )
            s, _ = run(cfg, quiet=True)
        hist = s.get("accuracy_history", [])
        table.append(
            {
                **row,
                "bytes_per_step": s["bytes_sent_per_step"],
                "accuracy": s["test_accuracy"],
                "history": [h[-1] for h in hist],
                "time_to_target_s": next((h[0] for h in hist if h[-1] >= args.target), None),
                "train_s": s.get("train_s"),
            }
        )
    return table


# ----------------------------------------------------------------------------- printing


def _fmt(v: float | None, f: str) -> str:
    return "-" if v is None else format(v, f)


def print_codec(rows: list[dict[str, Any]]) -> None:
    base = next((r for r in rows if r["spec"] == "none"), rows[0])
    print("\n## codec: 1 MiB fp32 gradient (N(0, 0.01^2)), one process, one thread")
    print(f"{'compressor':20s} {'payload B':>10s} {'vs none':>9s} {'enc+dec ms/MB':>14s}")
    for r in rows:
        print(f"{r['spec']:20s} {r['bytes']:10d} {r['bytes'] / base['bytes']:9.4f} {r['ms_per_mb']:14.3f}")


def _peer(r: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The ``none`` row at the same settings (lr, momentum, epochs), else the first ``none``."""
    nones = [b for b in rows if b["spec"] == "none"]
    same = [b for b in nones if _settings(b) == _settings(r)]
    return (same or nones or [None])[0]


def print_train(title: str, rows: list[dict[str, Any]], target: float) -> None:
    print(f"\n## {title}")
    print("(vs none: against the none row at the same lr, momentum and epochs)")
    print(
        f"{'compressor':20s} {'settings':>20s} {'B/step':>10s} {'vs none':>8s} {'final acc':>9s} "
        f"{'t->' + format(target, '.0%'):>8s} {'vs none':>8s}  accuracy per epoch"
    )
    for r in rows:
        base = _peer(r, rows)
        ratio = r["bytes_per_step"] / base["bytes_per_step"] if base and base["bytes_per_step"] else None
        tt = r["time_to_target_s"]
        tr = tt / base["time_to_target_s"] if base and tt is not None and base["time_to_target_s"] else None
        hist = " ".join(f"{a:.3f}" for a in r["history"])
        print(
            f"{r['spec']:20s} {_settings(r):>20s} {r['bytes_per_step']:10.0f} {_fmt(ratio, '8.4f'):>8s} "
            f"{r['accuracy']:9.4f} {_fmt(tt, '7.2f') + 's' if tt is not None else '-':>8s} {_fmt(tr, '8.2f'):>8s}  "
            f"{hist}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--specs",
        default=",".join(DEFAULT_SPECS),
        help="comma-separated rows: SPEC or SPEC@lr=..,momentum=..,epochs=.. (default: the full grid)",
    )
    ap.add_argument("--models", default="cnn,mlp", help="cnn, mlp, both, or '' for none (default: cnn,mlp)")
    ap.add_argument("--mlp-hidden", default="512,512", help="hidden sizes of the larger MLP (default: 512,512)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=64, help="global batch (default: 64)")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument(
        "--momentum",
        type=float,
        default=0.9,
        help="SGD momentum (default: 0.9): applied after averaging, or before the compressor for sign/onebit",
    )
    ap.add_argument(
        "--momentum-after",
        action="store_true",
        help="DataParallel only: momentum in the optimizer for every compressor (what sign/onebit did before)",
    )
    ap.add_argument(
        "--lr-schedule",
        default="cosine",
        choices=("constant", "cosine"),
        help="learning rate over each row's steps, the same for every row (default: cosine)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", type=float, default=0.95, help="accuracy for time-to-target (default: 0.95)")
    ap.add_argument("--reps", type=int, default=5, help="codec timing repetitions (default: 5)")
    ap.add_argument("--no-train", action="store_true", help="codec table only")
    ap.add_argument("--ps", action="store_true", help="also train the CNN under the parameter server (bsp)")
    ap.add_argument("--ps-servers", type=int, default=1)
    ap.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        help="seconds a worker waits for its peers before failing (default: 900; a run that other "
        "jobs pause for minutes needs this long)",
    )
    ap.add_argument("--json", help="write all figures to this file")
    args = ap.parse_args(argv)
    rows = [parse_row(r, args) for r in split_specs(args.specs)]
    if not any(r["spec"] == "none" for r in rows):
        rows.insert(0, parse_row("none", args))
    from dtrain.compress import from_spec

    for r in rows:
        from_spec(r["spec"])  # bad specs fail here, before any process starts
    specs = list(dict.fromkeys(r["spec"] for r in rows))
    hidden = [int(h) for h in args.mlp_hidden.split(",")]
    momentum_at = (
        "after averaging for every compressor"
        if args.momentum_after
        else "before the compressor for sign/onebit, after averaging for the others"
    )
    print(
        f"# dtrain compression benchmark: torch {torch.__version__}, python {platform.python_version()}, "
        f"{args.workers} workers, {args.epochs} epochs, global batch {args.batch_size}, SGD lr {args.lr} "
        f"momentum {args.momentum} ({momentum_at}), lr schedule {args.lr_schedule} for every row"
    )
    tuned = [r for r in rows if "@" in r["label"]]
    if tuned:
        print("# rows at their own settings: " + "; ".join(f"{r['spec']}: {_settings(r)}" for r in tuned))
    report: dict[str, Any] = {"args": vars(args)}
    report["codec"] = codec_table(specs, args.reps)
    print_codec(report["codec"])
    if not args.no_train:
        for model in [m for m in args.models.split(",") if m]:
            table = train_table(rows, model, hidden, args)
            label = "default CNN" if model == "cnn" else f"MLP {args.mlp_hidden}"
            title = f"DataParallel, {label} ({table[0]['params']} parameters), digits, {args.workers} workers"
            print_train(title, table, args.target)
            report[f"dp_{model}"] = table
            sys.stdout.flush()
        if args.ps:
            table = ps_table(rows, args)
            title = f"parameter server (bsp, {args.ps_servers} server), default CNN, {args.workers} workers"
            print_train(title, table, args.target)
            report["ps_cnn"] = table
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
