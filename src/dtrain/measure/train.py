"""``dtrain bench train``: whole training runs of several strategies, side by side with the first (torch DDP).

Each entry of ``--strategies`` is ``strategy[:key=value,...]`` over RunConfig
fields, e.g. ``dp:algorithm=tree``, ``ps:servers=2+consistency=asp``,
``dp:compression=topk:0.01``; several keys are joined by ``+``. Every run uses the same model, data, seed and
global batch; the table shows samples/s, its ratio to the first entry's run of the same
session (DDP in the default list), test accuracy and bytes sent per step per worker. Runs alternate
rounds (``--repeat``) and the median is reported, since this machine is shared.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from typing import Any

import torch

from dtrain.config.schema import RunConfig

__all__ = ["main", "parse_entry"]

DEFAULT = (
    "ddp,dp:algorithm=native,dp:algorithm=ring,dp:algorithm=tree,dp:algorithm=recursive_doubling,"
    "dp:algorithm=rabenseifner"
)


def parse_entry(entry: str) -> dict[str, Any]:
    """``"dp:algorithm=tree+bucket_mb=1"`` -> {"strategy": "dp", "algorithm": "tree", "bucket_mb": 1.0}."""
    strategy, _, rest = entry.partition(":")
    out: dict[str, Any] = {"strategy": strategy}
    if rest:
        for kv in rest.split("+"):
            k, _, v = kv.partition("=")
            out[k] = v
    return out


def _coerce(values: dict[str, Any]) -> dict[str, Any]:
    from dtrain.config.schema import option_fields

    base = {f.name: f.default for f in RunConfig.shared_fields()}
    base.update({name: owners[0][1].default for name, owners in option_fields().items()})
    out: dict[str, Any] = {}
    for k, v in values.items():
        d = base.get(k)
        if isinstance(d, bool):
            out[k] = str(v).lower() in ("1", "true", "yes")
        elif isinstance(d, (int, float)) and isinstance(v, str):
            out[k] = type(d)(float(v)) if isinstance(d, float) else int(v)
        else:
            out[k] = v
    return out


def main(argv: list[str] | None = None) -> int:
    from dtrain.job.run import run

    ap = argparse.ArgumentParser(prog="dtrain bench train", description=__doc__)
    ap.add_argument(
        "--strategies",
        default=DEFAULT,
        help="comma-separated entries strategy[:key=value+key=value], the first the reference "
        "(default: DDP and every algorithm)",
    )
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--dataset", default="digits")
    ap.add_argument("--repeat", type=int, default=1, help="rounds; the median is shown")
    a = ap.parse_args(argv)
    entries = [parse_entry(e) for e in a.strategies.split(",") if e]
    print(
        f"# dtrain bench train: torch {torch.__version__}, {a.workers} workers, model {a.model}, "
        f"dataset {a.dataset}, {a.epochs} epochs, {a.repeat} round(s)"
    )
    results: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(entries))}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(a.repeat):
            for i, e in enumerate(entries):
                cfg = RunConfig.from_mapping(
                    _coerce(
                        {
                            "workers": a.workers,
                            "epochs": a.epochs,
                            "model": a.model,
                            "dataset": a.dataset,
                            "progress": False,
                            "trace": False,
                            "out": f"{tmp}/{rnd}-{i}",
                            **e,
                        }
                    )
                )
                s, _ = run(cfg)
                results[i].append(s)
    ref = statistics.median(r["samples_per_s"] for r in results[0]) if entries else None
    print(f"{'strategy':<44} {'samples/s':>10} {'vs 1st':>7} {'test acc':>9} {'bytes/step':>11}")
    for i, e in enumerate(entries):
        sps = statistics.median(r["samples_per_s"] for r in results[i])
        acc = statistics.median(r["test_accuracy"] or 0.0 for r in results[i])
        b = statistics.median(r["bytes_sent_per_step"] for r in results[i])
        name = ",".join(f"{k}={v}" for k, v in e.items() if k != "strategy")
        label = e["strategy"] + (f":{name}" if name else "")
        ratio = f"{sps / ref:7.3f}" if ref else "      -"
        print(f"{label:<44} {sps:>10.0f} {ratio} {acc:>9.4f} {b:>11.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
