"""The numerics guard's cost per training step (``dtrain.optim.guard``).

Two figures:

1. **The check** (every run): one training step of a model (forward, cross entropy,
   backward, SGD with momentum) timed with and without :func:`first_nonfinite` over its
   gradients, in one process. The two variants alternate step by step so that a slow spell
   of a shared machine hits both; ``--warmup`` steps are discarded, then the medians of
   ``--steps`` steps each. The check's own time is also timed alone.
2. **The agreement** (``--skip-nonfinite N`` on data parallelism and pipelines): one
   :func:`flagged_ranks` all-reduce among ``--nprocs`` gloo processes (median of
   ``--steps`` calls, after a warm-up), next to the ring all-reduce of the CNN's gradients
   that every data-parallel step does anyway.

Run::

    python benchmarks/nonfinite_guard.py                  # the CNN at 32 samples, gpt-tiny at 8
    python benchmarks/nonfinite_guard.py --steps 2000 --nprocs 4

Timings on a shared machine are indicative; run it on a quiet one for figures.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Any

import torch


def _step_times(name: str, batch: int, steps: int, warmup: int) -> dict[str, float]:
    from dtrain.optim.guard import first_nonfinite
    from dtrain.workloads.models import build_model, task_loss

    torch.manual_seed(0)
    lm = name.startswith("gpt")
    model = build_model(name, (64,) if lm else (1, 8, 8), 256 if lm else 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randint(0, 256, (batch, 64)) if lm else torch.randn(batch, 1, 8, 8)
    y = torch.randint(0, 256, (batch, 64)) if lm else torch.randint(0, 10, (batch,))
    named = list(model.named_parameters())
    times: dict[str, list[float]] = {"plain": [], "checked": [], "check": []}
    for i in range(warmup + 2 * steps):
        checked = i % 2 == 1
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        loss = task_loss(model(x), y)
        loss.backward()
        float(loss.detach())
        t1 = time.perf_counter()
        if checked:
            assert first_nonfinite(named) is None
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if i >= warmup:
            times["checked" if checked else "plain"].append(t3 - t0)
            if checked:
                times["check"].append(t2 - t1)
    return {k: statistics.median(v) for k, v in times.items()}


def _agreement(steps: int) -> dict[str, float]:
    import torch.distributed as dist

    from dtrain.comm.allreduce import allreduce
    from dtrain.optim.guard import flagged_ranks
    from dtrain.workloads.models import build_model

    grads = torch.cat([p.detach().flatten() for p in build_model("cnn").parameters()])
    out: dict[str, list[float]] = {"flagged_ranks": [], "ring allreduce of the CNN's gradients": []}
    for i in range(steps + 20):
        dist.barrier()
        t0 = time.perf_counter()
        flagged_ranks(False)
        t1 = time.perf_counter()
        allreduce(grads.clone(), "sum", "ring")
        t2 = time.perf_counter()
        if i >= 20:
            out["flagged_ranks"].append(t1 - t0)
            out["ring allreduce of the CNN's gradients"].append(t2 - t1)
    return {k: statistics.median(v) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=500, help="timed steps per variant (default: 500)")
    ap.add_argument("--warmup", type=int, default=50, help="discarded steps (default: 50)")
    ap.add_argument("--nprocs", type=int, default=2, help="processes of the agreement all-reduce (default: 2)")
    a = ap.parse_args(argv)
    print(
        f"# nonfinite guard: torch {torch.__version__}, python {platform.python_version()}, "
        f"{torch.get_num_threads()} threads, {platform.machine()}"
    )
    print("model      batch   step (no check)   step (checked)   check alone   overhead")
    for name, batch in (("cnn", 32), ("gpt-tiny", 8)):
        t = _step_times(name, batch, a.steps, a.warmup)
        extra = t["checked"] / t["plain"] - 1
        print(
            f"{name:<10} {batch:>5}   {t['plain'] * 1e3:>12.3f} ms   {t['checked'] * 1e3:>11.3f} ms"
            f"   {t['check'] * 1e6:>8.1f} us   {extra * 100:>+7.1f}% ({t['check'] / t['plain'] * 100:.1f}% alone)"
        )
    from dtrain.launch.agent import launch

    res: Any = launch(_agreement, (a.steps,), nprocs=a.nprocs)[0]
    print(f"\nagreement among {a.nprocs} gloo processes (median per step):")
    for k, v in res.items():
        print(f"  {k:<40} {v * 1e6:>8.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
