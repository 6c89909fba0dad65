"""The pipeline bubble of a real GPT with a core per stage, against its closed form and the schedule played.

The sleeping stages of ``pipeline_bubble_sleep.py`` take the cores out of the question; this takes the sleep out:
each of ``P`` stage processes computes real GPT blocks (gpt-small's width, heads, vocabulary and sequence; 8
blocks by default, so that 4 stages, and 8 virtual stages of the interleaved schedule, cut evenly) on cores of its
own (``os.sched_setaffinity``: ``--cores-per-stage`` physical cores, one intra-op thread each, no two stages on
one core or on the two threads of one core). It needs ``P x --cores-per-stage`` physical cores; on a smaller
machine it stops and says so (``--cores-per-stage 0`` runs unpinned, a smoke run whose stages share the cores).

Two instruments outside the pipeline under test, each round:

* the step: rank 0's clock over ``Pipeline.step()`` between barriers (the median of ``--steps``);
* each virtual stage's compute: its layers alone on a micro-batch, forward then backward (the last stage with its
  loss), timed by the wall clock in the stage's own process on its own cores, outside any pipeline (the median
  of 5); a rank's busy time is ``M`` times the sum over its virtual stages.

The measured bubble is ``1 - mean over ranks of busy / step``; beside it the closed form ``(P-1)/(vM+P-1)``
(equal stages, free messages: Huang et al. 2019; Narayanan et al. 2021) and the schedule played by dtrain's
simulator (:func:`dtrain.pipeline.schedules.simulate`) with each virtual stage's measured times, a message's
measured latency and an action's measured cost (the empty pipeline of ``pipeline_bubble_sleep.py``). The ratio
is closed / measured; bar: within 10%. As a diagnostic only, each rank's compute inside the pipeline (the
pipeline's own count, ``Pipeline.last_stats.compute_s``) over the same compute timed alone: above 1, the stages
compute slower inside the pipeline than alone. (gloo's threads are started with the process group, before the
pin, and keep the whole machine's cores: only the stage's compute thread is pinned.)

Run::

    python benchmarks/pipeline_bubble_cores.py --out benchmarks/results/pipeline_bubble_cores.json  # >= 4 cores
    python benchmarks/pipeline_bubble_cores.py --cores-per-stage 0 --rounds 1 --microbatches 4 --quick  # smoke
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _loopback import launch_loopback
from pipeline_bubble_sleep import (
    EMPTY,
    SCHEDULES,
    _chunks,
    _key,
    _latency,
    action_cost,
    add_bubble_case,
    sleep_model,
    timed_step,
    valid,
)
from torch import nn

NONE = ("empty", 1)  # the empty pipeline's place among the cases (a gpipe of one micro-batch, no compute)


def physical_cores() -> list[int]:
    """One logical CPU of each physical core this process may run on (the first thread of each core)."""
    seen: dict[tuple[str, str], int] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            key = ((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip())
        except OSError:
            key = ("?", str(cpu))
        seen.setdefault(key, cpu)
    return sorted(seen.values())


def sizes(stages: int, layers: int) -> list[int]:
    """Children per virtual stage: ``layers / stages`` blocks each, the embedding with the first and the final
    norm and head with the last."""
    if layers % stages:
        raise SystemExit(f"--layers {layers} does not cut evenly into {stages} virtual stages")
    out = [layers // stages] * stages
    out[0] += 1
    out[-1] += 2
    return out


def _stage_times(
    model: nn.Sequential, cut: list[int], mine: list[int], x: torch.Tensor, y: torch.Tensor, reps: int = 5
) -> dict[int, tuple[float, float]]:
    """Each of ``mine``'s virtual stages alone, on the micro-batch ``x``: (forward s, backward s), medians."""
    from dtrain.workloads.models import task_loss

    kids = list(model.children())
    bounds = [sum(cut[:k]) for k in range(len(cut) + 1)]
    inputs, h = [], x
    with torch.no_grad():
        for k in range(len(cut)):
            inputs.append(h)
            for layer in kids[bounds[k] : bounds[k + 1]]:
                h = layer(h)
    out: dict[int, tuple[float, float]] = {}
    for k in mine:
        stage = nn.Sequential(*kids[bounds[k] : bounds[k + 1]])
        last = k == len(cut) - 1
        fs, bs = [], []
        for i in range(reps + 2):
            inp = inputs[k] if k == 0 else inputs[k].detach().requires_grad_(True)
            t0 = time.perf_counter()
            o = stage(inp)
            if last:
                o = task_loss(o, y)
            t1 = time.perf_counter()
            grad = None if last else torch.ones_like(o)
            o.backward(grad)
            t2 = time.perf_counter()
            if i >= 2:
                fs.append(t1 - t0)
                bs.append(t2 - t1)
        stage.zero_grad(set_to_none=True)
        out[k] = (statistics.median(fs), statistics.median(bs))
    return out


def _worker(args: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from dtrain.pipeline import Pipeline
    from dtrain.workloads.models import build_gpt

    r, p = dist.get_rank(), dist.get_world_size()
    cores = args["cores"][r] if args["cores"] else []
    if cores:
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(max(1, len(cores)))

    def gpt() -> nn.Sequential:
        torch.manual_seed(0)
        return build_gpt("gpt-small", layers=args["layers"], seq_len=args["seq_len"])

    vocab = gpt().gpt_config.vocab_size
    cases = [(s, m) for m in args["microbatches"] for s in args["schedules"] if valid(s, p, m)]
    pipes: dict[tuple[str, int], Any] = {}
    for s, m in cases:
        v = _chunks(s)
        pipe = Pipeline(gpt(), microbatches=m, schedule=s, chunks=v, balance=sizes(p * v, args["layers"]), timeout=600)
        pipes[(s, m)] = (pipe, torch.optim.SGD(pipe.parameters(), lr=1e-3))
    empty = sleep_model(p, 0.0, 0.0)
    pipes[NONE] = (
        Pipeline(empty, microbatches=1, schedule="gpipe", balance=[1] * p, timeout=600),
        torch.optim.SGD(empty.parameters(), lr=1e-3),
    )
    reference = gpt()  # the stages timed alone
    g = torch.Generator().manual_seed(1)
    b, t = args["batch"], args["seq_len"]
    x, y = torch.randint(vocab, (b, t), generator=g), torch.randint(vocab, (b, t), generator=g)

    def step(s: str, m: int) -> float:
        pipe, opt = pipes[(s, m)]
        xs, ys = (torch.randn(16, 8), torch.randint(0, 8, (16,))) if (s, m) == NONE else (x, y)
        dt = timed_step(pipe, opt, xs, ys)
        if (s, m) != NONE:  # the pipeline's own count of this rank's compute: a diagnostic, not the instrument
            inside[(s, m)].append(pipe.last_stats.compute_s)
        return dt

    every = [*cases, NONE]
    inside: dict[tuple[str, int], list[float]] = {c: [] for c in cases}
    for c in every:
        step(*c)  # warm-up: the first step builds the channels
    for c in cases:
        inside[c].clear()
    out: dict[str, Any] = {_key(s, m, 1): [] for s, m in cases}
    out[_key(*EMPTY)] = []
    out["latency"] = {m: [] for m in args["microbatches"]}
    shapes = sorted({(m, _chunks(s)) for s, m in cases})  # the stages timed alone: one cut per (M, v)
    out["stages"] = {f"{m}/{v}": [] for m, v in shapes}
    for rnd in range(args["rounds"]):
        k = rnd % len(every)
        for c in every[k:] + every[:k]:
            n = args["steps"] * (10 if c == NONE else 1)
            out[_key(*EMPTY) if c == NONE else _key(*c, 1)].append(statistics.median(step(*c) for _ in range(n)))
        for m, v in shapes:
            mine = [k for k in range(p * v) if k % p == r]
            out["stages"][f"{m}/{v}"].append(
                _stage_times(reference, sizes(p * v, args["layers"]), mine, x[: b // m], y[: b // m])
            )
        for m in args["microbatches"]:  # a message the size of M's activation
            out["latency"][m].append(_latency(b // m * t * reference.gpt_config.d_model))
    out["inside"] = {_key(s, m, 1): statistics.median(v) for (s, m), v in inside.items()}
    for pipe, _ in pipes.values():
        pipe.flush()
    return out


def main(argv: list[str] | None = None) -> int:
    from dtrain.measure.harness import Benchmark, add_result_flags, command
    from dtrain.pipeline.schedules import bubble_closed_form, generate, simulate

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nprocs", type=int, default=4, help="pipeline ranks P (default: 4)")
    ap.add_argument(
        "--cores-per-stage",
        type=int,
        default=1,
        help="physical cores (threads) of each stage, pinned; 0: unpinned (default: 1)",
    )
    ap.add_argument("--layers", type=int, default=8, help="GPT blocks, gpt-small's shape otherwise (default: 8)")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=0, help="samples a step (default: 2 x the largest M)")
    ap.add_argument("--microbatches", default="1,4,8,16", help="comma list of M (default: 1,4,8,16)")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--steps", type=int, default=2, help="timed steps of each case a round (default: 2)")
    ap.add_argument("--rounds", type=int, default=5)
    add_result_flags(ap)
    a = ap.parse_args(argv)
    ms = [int(v) for v in a.microbatches.split(",") if v]
    scheds = [s for s in a.schedules.split(",") if s]
    if any(s not in SCHEDULES for s in scheds) or a.nprocs < 2 or not ms or min(ms) < 1 or a.cores_per_stage < 0:
        ap.error(f"schedules from {SCHEDULES}, --nprocs >= 2, M >= 1, --cores-per-stage >= 0")
    for s in scheds:
        sizes(a.nprocs * _chunks(s), a.layers)
    batch = a.batch or 2 * max(ms)
    if batch % math.lcm(*ms):
        ap.error(f"--batch {batch} must split into every M ({ms})")
    phys = physical_cores()
    need = a.nprocs * a.cores_per_stage
    if need > len(phys):
        ap.error(
            f"{a.nprocs} stages x {a.cores_per_stage} core(s) need {need} physical cores; this machine has "
            f"{len(phys)} ({', '.join(map(str, phys))}); --cores-per-stage 0 runs unpinned (stages share them)"
        )
    cores = [phys[r * a.cores_per_stage : (r + 1) * a.cores_per_stage] for r in range(a.nprocs)] if need else []
    args = dict(
        microbatches=ms,
        schedules=scheds,
        layers=a.layers,
        seq_len=a.seq_len,
        batch=batch,
        steps=a.steps,
        rounds=a.rounds,
        cores=cores,
    )
    where = (
        f"each stage pinned to {a.cores_per_stage} physical core(s) of its own ({cores})"
        if cores
        else "stages unpinned, sharing the machine's cores"
    )
    bench = Benchmark(
        "pipeline_bubble_cores",
        title="The pipeline bubble of a real GPT, a core per stage",
        family="pipeline parallelism",
        workload=f"{a.nprocs} stages of a GPT of gpt-small's shape with {a.layers} blocks, seq_len "
        f"{a.seq_len}, batch {batch}; {where}; {a.steps} timed steps a case a round",
        metric="bubble",
        higher_is_better=False,
        repeats=a.rounds,
        quick=a.quick,
        command=command("benchmarks/pipeline_bubble_cores.py", argv),
    )
    bench.start()
    ranks = launch_loopback(_worker, (args,), a.nprocs)
    bench.stop()
    p = a.nprocs
    lat = {m: statistics.median(ranks[0]["latency"][m]) for m in ms}
    small = min(lat.values())  # the empty pipeline's messages are the smallest
    empty = statistics.median(ranks[0][_key(*EMPTY)])
    slot = action_cost(empty, small, p)
    said = ", ".join(f"M={m} {lat[m] * 1e3:.3f}" for m in ms)
    print(
        f"{where}\na message, ms: {said}; the empty pipeline's step {empty * 1e3:.2f} ms: {slot * 1e3:.3f} ms an action"
    )
    print(
        f"{'schedule':<12} {'M':>3} {'step ms':>9} {'busy ms':>9} {'played':>9} {'bubble':>7} {'closed':>7} "
        f"{'played':>7} {'imbal':>6}"
    )
    notes = []
    for s in scheds:
        v = _chunks(s)
        for m in ms:
            if not valid(s, p, m):
                continue
            steps = ranks[0][_key(s, m, 1)]
            closed = bubble_closed_form(s, p, m, v)
            bubbles, played_b, imbalance, busy_s, played_s = [], [], [], [], []
            for i, st in enumerate(steps):
                times = {k: ft for r in range(p) for k, ft in ranks[r]["stages"][f"{m}/{v}"][i].items()}
                tf = [times[k][0] for k in range(p * v)]
                tb = [times[k][1] for k in range(p * v)]
                busy = [m * sum(tf[k] + tb[k] for k in range(r, p * v, p)) for r in range(p)]
                bubbles.append(1 - statistics.mean(busy) / st)
                played = simulate(
                    generate(s, p, m, v), tf=[f + slot for f in tf], tb=[b + slot for b in tb], comm=lat[m]
                ).makespan
                played_b.append(1 - statistics.mean(busy) / played)
                imbalance.append(max(busy) / statistics.mean(busy))
                busy_s.append(statistics.mean(busy))
                played_s.append(played)
            print(
                f"{s:<12} {m:>3} {statistics.median(steps) * 1e3:9.1f} {statistics.median(busy_s) * 1e3:9.1f} "
                f"{statistics.median(played_s) * 1e3:9.1f} {statistics.median(bubbles):7.3f} {closed:7.3f} "
                f"{statistics.median(played_b):7.3f} {statistics.median(imbalance):6.3f}"
            )
            notes.append(f"{s} M={m}: {statistics.median(imbalance):.3f}")
            alone = [
                m
                * sum(
                    statistics.median(t[k][j] for t in ranks[r]["stages"][f"{m}/{v}"])
                    for k in range(r, p * v, p)
                    for j in (0, 1)
                )
                for r in range(p)
            ]
            ins = [ranks[r]["inside"][_key(s, m, 1)] for r in range(p)]
            bench.extra.setdefault("inside_over_alone", {})[f"{s}/{m}"] = [round(i / o, 3) for i, o in zip(ins, alone)]
            per_stage = [[ranks[k % p]["stages"][f"{m}/{v}"][i][k] for i in range(len(steps))] for k in range(p * v)]
            bench.extra.setdefault("stage_ms", {})[f"{s}/{m}"] = [
                [round(statistics.median(t[j] for t in ts) * 1e3, 3) for j in (0, 1)] for ts in per_stage
            ]
            add_bubble_case(bench, f"{s}, M = {m}", bubbles, closed, played_b)
    bench.notes = (
        f"The ratio is closed form / measured. Each stage's compute is its layers timed alone in its "
        f"own process on its own cores each round; a message between two ranks (ms, the size of M's "
        f"activation): {said}; an action's own cost (the empty pipeline): {slot * 1e3:.3f} ms; 'played with "
        f"the costs' is the "
        f"schedule played by dtrain's simulator with each virtual stage's measured times and both costs. "
        f"The busiest rank's compute over the mean (1: equal stages): " + "; ".join(notes) + "."
    )
    for key, st in bench.extra.get("stage_ms", {}).items():
        print(
            f"{key}: each virtual stage's forward / backward ms, medians: "
            + ", ".join(f"{f:.2f}/{b:.2f}" for f, b in st)
            + "; each rank's compute inside the pipeline (its own count) over the same timed alone: "
            + ", ".join(f"{x:.2f}" for x in bench.extra["inside_over_alone"][key])
        )
    bench.report(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
