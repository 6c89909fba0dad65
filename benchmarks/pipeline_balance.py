"""Cutting a pipeline by measured time against cutting it by layer counts, on layers whose costs differ 10x.

The model is an ``nn.Sequential``: ``inp`` (``Linear(64, W) + ReLU``), one block ``b<i>`` per
``--factors`` entry (``Linear(W, k*W) + ReLU + Linear(k*W, W) + ReLU``, so a block costs ``~4 k W^2`` flops
a sample forward) and a ``head`` (``Linear(W, 10)``); 12 children by default, ``k`` =
``1,1,1,1,1,10,10,10,1,1``: three blocks ten times heavier than the rest, all in the second
half, so that an even split of layer counts leaves the last stage with most of the work.

One launch of ``--nprocs`` processes (``dtrain.launch.agent.launch``, MASTER_ADDR 127.0.0.1, gloo on
loopback, CPU, one intra-op thread each). In it:

1. rank 0 profiles every child alone (``partition.profile_children``: forward + backward of one
   micro-batch, median of ``--profile-repeats``): the *reference* per-layer costs of the table.
   Over them, a brute force over every cut gives the best possible slowest stage;
2. for each ``--cuts`` (``equal``: layer counts as even as possible; ``time``: dtrain's own profile
   on rank 0 and the exact block partition, shared with the other ranks; ``params``: parameter
   bytes), a ``Pipeline(schedule="1f1b", microbatches=M)`` is built from the same seed;
3. ``--warmup`` discarded steps each, then ``--steps`` timed steps each in ``--rounds`` rounds that
   alternate the cuts (A B C A B C ..., a barrier before and after each cut's steps, rank 0's
   clock), so that a slow spell of a shared machine hits every cut;
4. each rank's mean ``compute_s`` per step (``Pipeline.last_stats``: its stage's forward and
   backward seconds) is gathered on rank 0 (``Pipeline.gather_floats``).

Columns: ``samples/s`` (batch x timed steps over the summed round times) and its ratio to
``equal``; ``pred slowest``: the cut's slowest stage under the reference costs, times M (ms per
step), beside ``optimum`` (the brute-force best cut's slowest stage, the same units) and their
ratio (1.00x: the cut is the best possible; the acceptance bound for ``time`` is 1.15x); per stage,
the measured compute (ms per step) and its slowest / mean ("imbalance", 1.00x is even). The time
cut's ``Pipeline.cut_table`` follows (dtrain's own profile, per micro-batch, beside the measured
compute over M). The time cut is chosen from a different profile than the reference (the same
layers timed again), so ``pred/opt`` for it shows the profile's noise as well as the partition.

For Linear layers, flops are proportional to parameters, so ``params`` usually lands on or next to
the time cut; it differs where a layer's fixed costs (small layers, the loss) weigh.

Run::

    python benchmarks/pipeline_balance.py               # 2 processes, batch 512, M = 8
    python benchmarks/pipeline_balance.py --quick       # a smoke run (< 40 s)
    python benchmarks/pipeline_balance.py --nprocs 4 --factors 10,1,1,1,1,1,1,1,10,10

Timings on a shared machine are indicative; run it on a quiet one for figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from _loopback import launch_loopback
from torch import nn

CUTS = ("equal", "time", "params")
IN_FEATURES, CLASSES = 64, 10
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "raw" / "pipeline_balance.json"


def _model(args: dict[str, Any]) -> nn.Sequential:
    """The uneven MLP, from ``--seed`` (the same weights on every rank and for every cut)."""
    torch.manual_seed(args["seed"])
    w = args["width"]
    layers: list[tuple[str, nn.Module]] = [("inp", nn.Sequential(nn.Linear(IN_FEATURES, w), nn.ReLU()))]
    layers += [
        (f"b{i}", nn.Sequential(nn.Linear(w, k * w), nn.ReLU(), nn.Linear(k * w, w), nn.ReLU()))
        for i, k in enumerate(args["factors"])
    ]
    return nn.Sequential(OrderedDict([*layers, ("head", nn.Linear(w, CLASSES))]))


def best_cut(costs: Sequence[float], parts: int) -> tuple[float, list[int]]:
    """The smallest slowest stage over every cut of ``costs`` into ``parts`` non-empty blocks, and that cut."""
    from dtrain.pipeline.partition import stage_costs

    n = len(costs)
    best: tuple[float, list[int]] = (math.inf, [n])
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        sizes = [b - a for a, b in zip(bounds, bounds[1:])]
        worst = max(stage_costs(costs, sizes))
        if worst < best[0]:
            best = (worst, sizes)
    return best


# ----------------------------------------------------------------------------- workers


def _worker(args: dict[str, Any]) -> dict[str, Any]:
    """Every cut on this rank: build, warm up, alternating timed rounds; rank 0 returns the figures."""
    import torch.distributed as dist

    from dtrain.pipeline import Pipeline
    from dtrain.pipeline.partition import profile_children

    torch.set_num_threads(1)
    rank, m = dist.get_rank(), args["microbatches"]
    g = torch.Generator().manual_seed(args["seed"] + 1)
    x = torch.randn(args["batch"], IN_FEATURES, generator=g)
    y = torch.randint(CLASSES, (args["batch"],), generator=g)
    sample = x[: args["batch"] // m]
    layer_s = None
    if rank == 0:
        costs = profile_children(_model(args), sample, repeats=args["profile_repeats"])
        layer_s = [c.time_s for c in costs]
    dist.barrier()

    pipes, opts = {}, {}
    for cut in args["cuts"]:
        pipes[cut] = Pipeline(
            _model(args), microbatches=m, schedule="1f1b", balance=cut, sample=sample, timeout=args["timeout"]
        )
        opts[cut] = torch.optim.SGD(pipes[cut].parameters(), lr=args["lr"])

    def step(cut: str) -> tuple[float, float]:
        opts[cut].zero_grad()
        pipes[cut].step(x, y)
        opts[cut].step()
        st = pipes[cut].last_stats
        assert st is not None
        return st.compute_s, st.wait_s

    for cut in args["cuts"]:
        for _ in range(args["warmup"]):
            step(cut)
    seconds: dict[str, list[float]] = {cut: [] for cut in args["cuts"]}
    busy = {cut: [0.0, 0.0] for cut in args["cuts"]}  # compute_s, wait_s summed over timed steps
    for n in _round_sizes(args["steps"], args["rounds"]):
        for cut in args["cuts"]:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                c, w = step(cut)
                busy[cut][0] += c
                busy[cut][1] += w
            dist.barrier()
            seconds[cut].append(time.perf_counter() - t0)

    out: dict[str, Any] = {"children": [name for name, _ in _model(args).named_children()], "layer_s": layer_s}
    for cut in args["cuts"]:
        pipe = pipes[cut]
        per_rank = pipe.gather_floats([v / args["steps"] for v in busy[cut]])  # collective: every rank
        if rank == 0:
            assert per_rank is not None
            out[cut] = {
                "sizes": list(pipe.sizes),
                "round_s": seconds[cut],
                "pipeline_predicted_s": pipe.predicted_s,
                "compute_s_per_rank": [r[0] for r in per_rank],
                "wait_s_per_rank": [r[1] for r in per_rank],
                "cut_table": pipe.cut_table([r[0] / m for r in per_rank]),
            }
    return out


def _round_sizes(steps: int, rounds: int) -> list[int]:
    return [steps // rounds + (k < steps % rounds) for k in range(rounds)]


# ----------------------------------------------------------------------------- report


def _summarize(r0: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's figures as one record per cut, with the predicted and best slowest stages."""
    from dtrain.pipeline.partition import block_partition, stage_costs

    p = args["nprocs"]
    layer_s = r0["layer_s"]
    opt_s, opt_sizes = best_cut(layer_s, p)
    bp = block_partition(layer_s, p)
    out: dict[str, Any] = {
        "children": r0["children"],
        "layer_s": layer_s,
        "optimum": {
            "sizes": opt_sizes,
            "slowest_stage_s": opt_s,
            "block_partition_sizes": bp,
            "block_partition_slowest_s": max(stage_costs(layer_s, bp)),
        },
        "cuts": {},
    }
    for cut in args["cuts"]:
        r = r0[cut]
        comp = r["compute_s_per_rank"]
        mean = sum(comp) / len(comp)
        pred = stage_costs(layer_s, r["sizes"])
        out["cuts"][cut] = {
            "sizes": r["sizes"],
            "round_s": r["round_s"],
            "samples_per_s": args["batch"] * args["steps"] / sum(r["round_s"]),
            "predicted_stage_s": pred,
            "predicted_slowest_s": max(pred),
            "predicted_over_optimum": max(pred) / opt_s if opt_s > 0 else None,
            "pipeline_predicted_stage_s": r["pipeline_predicted_s"],
            "compute_s_per_step_per_stage": comp,
            "wait_s_per_step_per_stage": r["wait_s_per_rank"],
            "imbalance": max(comp) / mean if mean > 0 else None,
            "cut_table": r["cut_table"],
        }
    if "equal" in out["cuts"]:
        base = out["cuts"]["equal"]["samples_per_s"]
        for rec in out["cuts"].values():
            rec["over_equal"] = rec["samples_per_s"] / base
    return out


def _print(res: dict[str, Any], args: dict[str, Any]) -> None:
    m = args["microbatches"]
    opt = res["optimum"]
    print(
        "\nper-layer profile (rank 0, ms per micro-batch, fwd+bwd): "
        + " ".join(f"{n}={t * 1e3:.2f}" for n, t in zip(res["children"], res["layer_s"]))
    )
    print(
        f"brute-force best cut {opt['sizes']}: slowest stage {opt['slowest_stage_s'] * m * 1e3:.1f} ms/step "
        f"(block_partition on the same costs: {opt['block_partition_sizes']}, "
        f"{opt['block_partition_slowest_s'] * m * 1e3:.1f} ms/step)"
    )
    print(
        f"\n{'cut':<7} {'sizes':<16} {'samples/s':>9} {'vs equal':>8} {'pred slowest':>12} {'optimum':>8} "
        f"{'pred/opt':>8}  {'measured compute ms/step per stage':<36} {'imbalance':>9}"
    )
    for cut, r in res["cuts"].items():
        ratio = f"{r['over_equal']:8.3f}" if "over_equal" in r else f"{'-':>8}"
        po = f"{r['predicted_over_optimum']:7.2f}x" if r["predicted_over_optimum"] is not None else f"{'-':>8}"
        imb = f"{r['imbalance']:8.2f}x" if r["imbalance"] is not None else f"{'-':>9}"
        stages = " ".join(f"{c * 1e3:6.1f}" for c in r["compute_s_per_step_per_stage"])
        print(
            f"{cut:<7} {str(r['sizes']):<16} {r['samples_per_s']:9.1f} {ratio} "
            f"{r['predicted_slowest_s'] * m * 1e3:12.1f} {opt['slowest_stage_s'] * m * 1e3:8.1f} {po}  "
            f"{'[' + stages + ']':<36} {imb}"
        )
    if "time" in res["cuts"]:
        print("\ntime cut (Pipeline.cut_table: dtrain's profile per micro-batch; measured = compute / M):")
        print(res["cuts"]["time"]["cut_table"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nprocs", type=int, default=2, help="processes = pipeline stages P (default: 2, one per core)")
    ap.add_argument("--width", type=int, default=256, help="block width W (default: 256)")
    ap.add_argument(
        "--factors",
        default="1,1,1,1,1,10,10,10,1,1",
        help="comma-separated hidden-width factor k of each block (default: %(default)s)",
    )
    ap.add_argument("--batch", type=int, default=512, help="samples per step (default: 512)")
    ap.add_argument("--microbatches", type=int, default=8, help="M (default: 8)")
    ap.add_argument("--cuts", default=",".join(CUTS), help=f"comma-separated, of {','.join(CUTS)} (default: all)")
    ap.add_argument("--steps", type=int, default=40, help="timed steps per cut (default: 40)")
    ap.add_argument("--warmup", type=int, default=3, help="discarded steps per cut (default: 3)")
    ap.add_argument("--rounds", type=int, default=8, help="alternating rounds the timed steps are split into")
    ap.add_argument("--profile-repeats", type=int, default=5, help="timed passes per layer, reference (default: 5)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds a send or receive may block")
    ap.add_argument("--json", default=str(DEFAULT_JSON), help=f"result file (default: {DEFAULT_JSON})")
    ap.add_argument("--quick", action="store_true", help="a smoke run (< 40 s): narrower, smaller batch, few steps")
    a = ap.parse_args(argv)
    if a.quick:
        a.width, a.batch, a.steps, a.warmup, a.rounds, a.profile_repeats = 128, 128, 6, 1, 2, 3
    try:
        factors = [int(v) for v in a.factors.split(",") if v]
    except ValueError:
        ap.error(f"--factors must be comma-separated ints, got {a.factors!r}")
    cuts = [c for c in a.cuts.split(",") if c]
    for c in cuts:
        if c not in CUTS:
            ap.error(f"unknown cut {c!r}; choose from {','.join(CUTS)}")
    if not cuts or len(set(cuts)) != len(cuts):
        ap.error("--cuts needs at least one cut, each once")
    if not factors or min(factors) < 1:
        ap.error("--factors needs at least one block, each factor >= 1")
    if a.nprocs < 2 or a.nprocs > len(factors) + 2:
        ap.error(f"--nprocs must be between 2 and the model's {len(factors) + 2} children")
    if a.microbatches < 1 or a.batch % a.microbatches:
        ap.error(f"--microbatches {a.microbatches} must divide --batch {a.batch}")
    if a.steps < 1 or a.rounds < 1 or a.warmup < 0 or a.profile_repeats < 1:
        ap.error("--steps, --rounds and --profile-repeats must be >= 1, --warmup >= 0")
    a.rounds = min(a.rounds, a.steps)

    args = dict(vars(a), factors=factors, cuts=cuts)
    del args["json"], args["quick"]
    print(
        f"torch {torch.__version__}, python {platform.python_version()}, {platform.machine()}, "
        f"{a.nprocs} processes x 1 intra-op thread, gloo on loopback, CPU"
    )
    print(
        f"MLP: inp {IN_FEATURES}->{a.width}, blocks k = {factors} (Linear(W, kW), Linear(kW, W), W = {a.width}), "
        f"head; batch {a.batch}, M = {a.microbatches}, 1f1b; {a.warmup} warm-up + {a.steps} timed steps per cut "
        f"in {a.rounds} alternating rounds"
    )
    t0 = time.perf_counter()
    ranks = launch_loopback(_worker, (args,), a.nprocs)
    results = _summarize(ranks[0], args)
    _print(results, args)
    wall = time.perf_counter() - t0
    print(f"\nwall {wall:.0f}s")
    path = Path(a.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "versions": {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine()},
        "config": args,
        "results": results,
        "wall_s": wall,
    }
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
