"""The measured bubble of dtrain's pipeline schedules beside the closed form, on balanced stages.

A pipeline's idle fraction ("bubble") is, for GPipe and 1F1B, ``(P-1)/(M+P-1)`` (Huang et al.,
"GPipe", 2019; Narayanan et al., "PipeDream-Flush", 2021) and, for the interleaved schedule with
``v`` chunks per rank, ``(P-1)/(v*M+P-1)`` (Narayanan et al., "Efficient Large-Scale Language
Model Training on GPU Clusters", SC 2021); these assume equal stages and free messages.
PipeDream-2BW has no flush (0 in steady state). Measured here per rank as ``1 - compute_s /
step_s`` (``Pipeline.last_stats``: forward and backward seconds over the whole ``step()``), mean
over ranks and timed steps.

The model is made to cut evenly: a narrow input layer (64 -> W, cheap, so that stage 0 does not
gain from skipping the input's gradient), ``2K`` blocks ``Linear(W, W) + ReLU`` and a small head;
``P = 2`` processes (one per core of this 2-core machine, ``torch.set_num_threads(1)``), each stage
one input-or-head layer and ``K`` blocks (interleaved: ``K/2`` blocks per virtual stage).

Run::

    python benchmarks/pipeline_bubble.py                 # M = 2, 4, 8; ~3 minutes here
    python benchmarks/pipeline_bubble.py --quick         # a smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from _loopback import launch_loopback
from torch import nn

SCHEDULES = ("gpipe", "1f1b", "interleaved", "2bw")
DEFAULT_JSON = Path(__file__).parent / "results" / "raw" / "pipeline_bubble.json"


def _model(width: int, blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[tuple[str, nn.Module]] = [("inp", nn.Sequential(nn.Linear(64, width), nn.ReLU()))]
    layers += [(f"b{i}", nn.Sequential(nn.Linear(width, width), nn.ReLU())) for i in range(blocks)]
    return nn.Sequential(OrderedDict([*layers, ("head", nn.Linear(width, 10))]))


def _cut(schedule: str, blocks: int, ranks: int) -> list[int]:
    """Equal work per virtual stage: the input layer and the head ride with the first and last."""
    stages = ranks * (2 if schedule == "interleaved" else 1)
    per = blocks // stages
    sizes = [per] * stages
    sizes[0] += 1
    sizes[-1] += 1
    return sizes


def _one(schedule: str, m: int, args: dict[str, Any]) -> dict[str, float]:
    import torch.distributed as dist

    from dtrain.pipeline import Pipeline

    world = dist.get_world_size()
    pipe = Pipeline(
        _model(args["width"], args["blocks"]),
        microbatches=m,
        schedule=schedule,
        chunks=2,
        balance=_cut(schedule, args["blocks"], world),
        timeout=120,
    )
    opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(args["batch"], 64, generator=g), torch.randint(0, 10, (args["batch"],), generator=g)
    step, comp = 0.0, 0.0
    for k in range(args["warmup"] + args["steps"]):
        opt.zero_grad()
        pipe.step(x, y)
        opt.step()
        st = pipe.last_stats
        assert st is not None
        if k >= args["warmup"]:
            step += st.step_s
            comp += st.compute_s
    pipe.flush()
    dist.barrier()
    return {"step_s": step / args["steps"], "compute_s": comp / args["steps"], "bubble": 1 - comp / step}


def _worker(args: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {f"{s}/{m}": _one(s, m, args) for m in args["microbatches"] for s in args["schedules"]}


def closed_form(schedule: str, ranks: int, m: int) -> float:
    from dtrain.pipeline.schedules import bubble_closed_form

    return bubble_closed_form(schedule, ranks, m, 2 if schedule == "interleaved" else 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nprocs", type=int, default=2, help="pipeline ranks P (default: 2, one per core here)")
    ap.add_argument("--width", type=int, default=2048, help="block width W (default: 2048)")
    ap.add_argument("--blocks", type=int, default=8, help="Linear(W, W) blocks; a multiple of 2P (default: 8)")
    ap.add_argument("--batch", type=int, default=512, help="batch (default: 512)")
    ap.add_argument("--microbatches", default="2,4,8", help="comma list of M (default: 2,4,8)")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", default=str(DEFAULT_JSON))
    ap.add_argument("--quick", action="store_true", help="small widths and few steps (a smoke run)")
    a = ap.parse_args(argv)
    if a.quick:
        a.width, a.batch, a.steps, a.warmup = 256, 64, 2, 1
    ms = [int(v) for v in a.microbatches.split(",") if v]
    scheds = [s for s in a.schedules.split(",") if s]
    if a.blocks % (2 * a.nprocs):
        ap.error(f"--blocks must be a multiple of 2 x nprocs ({2 * a.nprocs}) so that every stage is equal")
    for m in ms:
        if a.batch % m or ("interleaved" in scheds and m % a.nprocs):
            ap.error(f"M={m} must divide --batch and (interleaved) be a multiple of --nprocs")
    args = dict(
        width=a.width, blocks=a.blocks, batch=a.batch, microbatches=ms, schedules=scheds, steps=a.steps, warmup=a.warmup
    )
    print(
        f"torch {torch.__version__}, python {platform.python_version()}, {a.nprocs} processes x 1 thread, gloo "
        f"on loopback; MLP 64->{a.width}, {a.blocks} x Linear({a.width}, {a.width}), head; batch {a.batch}; "
        f"{a.warmup} warm-up + {a.steps} timed steps"
    )
    t0 = time.perf_counter()
    ranks = launch_loopback(_worker, (args,), a.nprocs)
    rows = []
    print(f"{'schedule':<12} {'M':>3} {'step ms':>9} {'bubble':>7} {'closed':>7} {'rel err':>8}  per rank")
    for m in ms:
        for s in scheds:
            per = [ranks[r][f"{s}/{m}"] for r in sorted(ranks)]
            bubble = sum(p["bubble"] for p in per) / len(per)
            closed = closed_form(s, a.nprocs, m)
            rel = (bubble - closed) / closed if closed > 0 else float("nan")
            step = max(p["step_s"] for p in per)
            rows.append(
                dict(
                    schedule=s,
                    microbatches=m,
                    step_s=step,
                    bubble=bubble,
                    closed_form=closed,
                    relative_error=rel,
                    per_rank=per,
                )
            )
            print(
                f"{s:<12} {m:>3} {step * 1e3:>9.1f} {bubble:>7.3f} {closed:>7.3f} {rel:>+8.1%}  "
                + " ".join(f"{p['bubble']:.3f}" for p in per)
            )
    out = dict(torch=torch.__version__, nprocs=a.nprocs, args=args, rows=rows, wall_s=time.perf_counter() - t0)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
