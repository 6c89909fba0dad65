"""The pipeline bubble without core contention: stages whose compute is a sleep, timed by the wall clock.

Each pipeline stage is a tiny layer whose forward sleeps ``--forward-ms`` and whose backward sleeps
``--backward-ms`` a micro-batch (split over the ``v`` chunks of the interleaved schedule), so ``P`` stage
processes do not compete for this machine's cores, while the schedule, the executor and its messages are
dtrain's own (:class:`dtrain.pipeline.Pipeline`, gloo on loopback). The instrument is outside the code under
test: rank 0's clock over ``step()`` between barriers, against the compute that the sleeps fix,
``M (tf + tb)``; the measured bubble is ``1 - M (tf + tb) / step``, beside the closed form
``(P-1)/(vM+P-1)`` (:func:`dtrain.pipeline.schedules.bubble_closed_form`; Huang et al. 2019, Narayanan et
al. 2021). The sleeps end on time (the last half millisecond spun: :func:`busy_for`). What is not the
schedule is named and measured in the same launch: a message's latency (half a ping-pong's round trip between
two ranks) and an action's own cost (the Python around a stage's compute, its send and its receive: the rest of
an empty one-micro-batch pipeline's step, ten times the steps, over its ``2P`` actions); the bubble is also held
against the schedule played by dtrain's schedule simulator with both (:func:`played_step_s`). ``hop ms`` is the
step's time beyond the ideal one, ``M (tf + tb) / (1 - closed form)``, over the critical path's
``2 (vM + P - 1)`` slots.

Rounds: every (schedule, M), and the empty pipeline, runs ``--steps`` timed steps a round, the order rotated
each round, then the ping-pong; the harness reports each round's bubble against the closed form, and against
the schedule played with the costs (ratio closed / measured, bar: within 10%).

Run::

    python benchmarks/pipeline_bubble_sleep.py                               # P = 4; M = 1, 4, 8, 16; 20/40 ms
    python benchmarks/pipeline_bubble_sleep.py --out benchmarks/results/pipeline_bubble_sleep.json
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from typing import Any

import torch
from _loopback import launch_loopback
from torch import nn

SCHEDULES = ("gpipe", "1f1b", "interleaved")


_SPIN_S = 0.5e-3  # the end of a sleep spent spinning: time.sleep overshoots by 0.07-0.18 ms here (10-40 ms)


def busy_for(seconds: float) -> None:
    """Take ``seconds`` of the wall clock, no more: sleep all but the last half millisecond, then spin to the
    deadline (a plain ``time.sleep`` of 20 ms here ends 0.17 ms late, the same again every slot)."""
    if seconds <= 0:
        return
    end = time.perf_counter() + seconds
    if seconds > _SPIN_S:
        time.sleep(seconds - _SPIN_S)
    while time.perf_counter() < end:
        pass


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tf: float, tb: float) -> torch.Tensor:  # noqa: D102
        ctx.tb = tb
        busy_for(tf)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: D102
        busy_for(ctx.tb)
        return grad, None, None


class SleepStage(nn.Module):
    """A stage's compute as sleeps: ``tf`` seconds forward, ``tb`` backward, for every micro-batch."""

    def __init__(self, tf: float, tb: float, width: int = 8) -> None:
        super().__init__()
        self.tf, self.tb = tf, tb
        self.lin = nn.Linear(width, width)  # a parameter to step (microseconds of compute)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(self.lin(x), self.tf, self.tb)  # type: ignore[no-any-return]


def sleep_model(stages: int, tf: float, tb: float, classes: int = 8) -> nn.Sequential:
    """``stages`` sleeping stages of equal work (the loss's head rides with the last)."""
    torch.manual_seed(0)
    return nn.Sequential(*[SleepStage(tf, tb, classes) for _ in range(stages)])


def ideal_step_s(schedule: str, ranks: int, m: int, tf: float, tb: float) -> float:
    """The makespan that the closed form gives: the compute, ``M (tf + tb)``, over one minus the bubble."""
    from dtrain.pipeline.schedules import bubble_closed_form

    return m * (tf + tb) / (1 - bubble_closed_form(schedule, ranks, m, _chunks(schedule)))


def hops(schedule: str, ranks: int, m: int) -> int:
    """Hand-offs on the critical path: a forward and a backward one per slot of ``vM + P - 1``."""
    return 2 * (_chunks(schedule) * m + ranks - 1)


def _chunks(schedule: str) -> int:
    return 2 if schedule == "interleaved" else 1


def valid(schedule: str, ranks: int, m: int) -> bool:
    """Whether dtrain runs ``schedule`` at ``M = m`` (the interleaved one needs M a multiple of P)."""
    return schedule != "interleaved" or m % ranks == 0


EMPTY = ("gpipe", 1, 0)  # the pipeline that measures an action's cost: one micro-batch through empty stages


def _key(schedule: str, m: int, sleeping: int) -> str:
    return f"{schedule}/{m}" + ("" if sleeping else "/empty")


def _worker(args: dict[str, Any]) -> dict[str, list[float]]:
    """Every (schedule, M)'s step seconds per round (rank 0's clock between barriers; the median of a round)."""
    import torch.distributed as dist

    from dtrain.pipeline import Pipeline

    torch.set_num_threads(1)
    p = dist.get_world_size()
    tf, tb = args["forward_ms"] / 1e3, args["backward_ms"] / 1e3
    # every case with its stages sleeping, and one empty pipeline of one micro-batch (no compute: the hand-offs
    # alone, one stage busy at a time)
    cases = [(s, m, 1) for m in args["microbatches"] for s in args["schedules"] if valid(s, p, m)]
    cases.append(EMPTY)
    pipes = {}
    for s, m, e in cases:
        v = _chunks(s)
        pipe = Pipeline(
            sleep_model(p * v, tf * e / v, tb * e / v),
            microbatches=m,
            schedule=s,
            chunks=v,
            balance=[1] * (p * v),
            timeout=120,
        )
        pipes[(s, m, e)] = (pipe, torch.optim.SGD(pipe.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(1)
    out: dict[str, list[float]] = {_key(*c): [] for c in cases}

    def step(s: str, m: int, e: int) -> float:
        x, y = torch.randn(args["batch"], 8, generator=g), torch.randint(0, 8, (args["batch"],), generator=g)
        return timed_step(*pipes[(s, m, e)], x, y)

    for c in cases:  # warm-up: the first step of each builds its channels
        step(*c)
    out["latency"] = []
    for r in range(args["rounds"]):
        k = r % len(cases)
        for c in cases[k:] + cases[:k]:
            n = args["steps"] * (10 if c == EMPTY else 1)  # the empty step is milliseconds: more of them
            out[_key(*c)].append(statistics.median(step(*c) for _ in range(n)))
        out["latency"].append(_latency(args["batch"] * 8))
    for pipe, _ in pipes.values():
        pipe.flush()
    return out


def timed_step(pipe: Any, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    """One training step of ``pipe``; its seconds by this rank's clock over ``step()`` between two barriers."""
    import torch.distributed as dist

    opt.zero_grad()
    dist.barrier()
    t0 = time.perf_counter()
    pipe.step(x, y)
    dist.barrier()
    dt = time.perf_counter() - t0
    opt.step()
    return dt


def action_cost(empty_s: float, latency_s: float, ranks: int) -> float:
    """An action's own cost: the empty one-micro-batch pipeline's step, less its ``2 (P - 1)`` messages on the
    critical path, over its ``2P`` actions."""
    return max(0.0, (empty_s - 2 * (ranks - 1) * latency_s) / (2 * ranks))


def add_bubble_case(bench: Any, name: str, measured: list[float], closed: float, played: list[float]) -> None:
    """A case of every round's measured bubble against the closed form and the played schedule, within 10%."""
    from dtrain.measure.harness import Bar

    bench.add_case(
        name,
        samples={"measured": measured, "closed form": [closed] * len(measured), "played with the costs": played},
        compare=[
            ("measured", "closed form", Bar.within(0.10)),
            ("measured", "played with the costs", Bar.within(0.10)),
        ],
        headline=False,
    )


def _latency(numel: int, trips: int = 50) -> float:
    """A message's one-way time between ranks 0 and 1 (gloo, ``numel`` floats: the largest activation here),
    half the median round trip; the other ranks wait at the barrier."""
    import torch.distributed as dist

    from dtrain.measure.p2p import round_trip

    buf, times = torch.zeros(numel), []
    dist.barrier()
    if dist.get_rank() < 2:
        me = dist.get_rank()
        times = [round_trip("native", None, buf, 1 - me, initiator=me == 0) for _ in range(trips + 5)]
    dist.barrier()
    return statistics.median(times[5:]) / 2 if times else 0.0


def played_step_s(schedule: str, ranks: int, m: int, tf: float, tb: float, slot_s: float, latency_s: float) -> float:
    """The step of ``schedule`` played by dtrain's schedule simulator (:func:`dtrain.pipeline.schedules.simulate`:
    each rank's actions in order, each waiting for what it needs) with a cost a compute action, ``slot_s``, on
    top of its compute, and ``latency_s`` for each dependency on another rank (a message)."""
    from dtrain.pipeline.schedules import generate, simulate

    v = _chunks(schedule)
    return simulate(generate(schedule, ranks, m, v), tf / v + slot_s, tb / v + slot_s, comm=latency_s).makespan


def _iqr_ms(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return f"{q[0] * 1e3:.3f}-{q[2] * 1e3:.3f} ms"


def main(argv: list[str] | None = None) -> int:
    from dtrain.measure.harness import Benchmark, add_result_flags, command
    from dtrain.pipeline.schedules import bubble_closed_form

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nprocs", type=int, default=4, help="pipeline ranks P (default: 4)")
    ap.add_argument("--microbatches", default="1,4,8,16", help="comma list of M (default: 1,4,8,16)")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--forward-ms", type=float, default=20.0, help="a stage's forward a micro-batch (default: 20)")
    ap.add_argument("--backward-ms", type=float, default=40.0, help="its backward (default: 40)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps of each case a round (default: 2)")
    ap.add_argument("--rounds", type=int, default=5)
    add_result_flags(ap)
    a = ap.parse_args(argv)
    ms = [int(v) for v in a.microbatches.split(",") if v]
    scheds = [s for s in a.schedules.split(",") if s]
    unknown = [s for s in scheds if s not in SCHEDULES]
    if unknown or a.nprocs < 2 or not ms or min(ms) < 1:
        ap.error(f"schedules from {SCHEDULES}, --nprocs >= 2 and M >= 1 (got {scheds}, {a.nprocs}, {ms})")
    batch = 16 * math.lcm(*ms)
    args = dict(
        microbatches=ms,
        schedules=scheds,
        forward_ms=a.forward_ms,
        backward_ms=a.backward_ms,
        steps=a.steps,
        rounds=a.rounds,
        batch=batch,
    )
    bench = Benchmark(
        "pipeline_bubble_sleep",
        title="The pipeline bubble against its closed form, stages that sleep",
        family="pipeline parallelism",
        workload=f"{a.nprocs} stages, each {a.forward_ms:g} ms forward and {a.backward_ms:g} ms backward "
        f"a micro-batch as sleeps (interleaved: over 2 chunks); {a.steps} timed steps a case "
        f"a round",
        metric="bubble",
        higher_is_better=False,
        repeats=a.rounds,
        quick=a.quick,
        command=command("benchmarks/pipeline_bubble_sleep.py", argv),
    )
    bench.start()
    ranks = launch_loopback(_worker, (args,), a.nprocs)
    bench.stop()
    tf, tb = a.forward_ms / 1e3, a.backward_ms / 1e3
    # what is not the schedule, measured: a message's latency (ping-pong), and a compute action's own cost, the
    # rest of the empty one-micro-batch pipeline's step (2P actions, 2 (P - 1) messages on its critical path)
    lat = statistics.median(ranks[0]["latency"])
    empty = statistics.median(ranks[0][_key(*EMPTY)])
    slot = action_cost(empty, lat, a.nprocs)
    print(
        f"a message {lat * 1e3:.3f} ms (IQR {_iqr_ms(ranks[0]['latency'])}); the empty pipeline's step "
        f"{empty * 1e3:.2f} ms (IQR {_iqr_ms(ranks[0][_key(*EMPTY)])}): {slot * 1e3:.3f} ms an action"
    )
    print(
        f"{'schedule':<12} {'M':>3} {'step ms':>9} {'ideal ms':>9} {'played':>9} {'bubble':>7} {'closed':>7} "
        f"{'played':>7} {'hop ms':>7}"
    )
    notes = []
    for s in scheds:
        for m in ms:
            if not valid(s, a.nprocs, m):
                print(f"{s:<12} {m:>3}  (not run: the interleaved schedule needs M a multiple of P)")
                continue
            steps = ranks[0][_key(s, m, 1)]
            closed = bubble_closed_form(s, a.nprocs, m, _chunks(s))
            ideal = ideal_step_s(s, a.nprocs, m, tf, tb)
            played = played_step_s(s, a.nprocs, m, tf, tb, slot, lat)
            bubbles = [1 - m * (tf + tb) / t for t in steps]
            with_costs = 1 - m * (tf + tb) / played
            hop = (statistics.median(steps) - ideal) / hops(s, a.nprocs, m)
            print(
                f"{s:<12} {m:>3} {statistics.median(steps) * 1e3:9.1f} {ideal * 1e3:9.1f} {played * 1e3:9.1f} "
                f"{statistics.median(bubbles):7.3f} {closed:7.3f} {with_costs:7.3f} {hop * 1e3:7.2f}"
            )
            notes.append(f"{s} M={m}: {hop * 1e3:.2f}")
            add_bubble_case(bench, f"{s}, M = {m}", bubbles, closed, [with_costs] * len(bubbles))
    bench.notes = (
        f"The ratio is closed form / measured (1: the schedule's own bubble and nothing else). What is "
        f"not the schedule, measured in the same launch: a message between two ranks, {lat * 1e3:.3f} "
        f"ms (half a ping-pong's round trip, the median of the rounds), and an action's own cost (the "
        f"Python around a stage's compute, a send and a receive), {slot * 1e3:.3f} ms: the rest of an "
        f"empty one-micro-batch pipeline's step ({empty * 1e3:.2f} ms: 2P actions, 2 (P - 1) messages). "
        f"'played with the costs' is the schedule played by dtrain's schedule simulator with both. The "
        f"step's time beyond the ideal one over the critical path's 2 (vM + P - 1) slots, in ms a slot: "
        + "; ".join(notes)
        + "."
    )
    bench.report(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
