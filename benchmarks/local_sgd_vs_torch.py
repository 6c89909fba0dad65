"""dtrain.LocalSGD beside torch's post-local SGD: mean step time, same model, data, period and warm-up.

One launch of ``--nprocs`` processes (``dtrain.launch.agent.launch``, gloo on CPU or NCCL on CUDA).
torch's side is its documented recipe: DDP with ``post_localSGD_hook``
(``PostLocalSGDState(process_group=None, subgroup=<1-rank groups>, start_localSGD_iter=W)``,
so gradients are averaged globally for ``W`` steps and not at all afterwards) and
``PostLocalSGDOptimizer(SGD, PeriodicModelAverager(period, W))``. dtrain's side is
``LocalSGD(model, period, warmup_steps=W, algorithm=...)`` around the same SGD. Both train the
same model (``dtrain.workloads.models.build_model``, default the CNN) on the same digits shards from the
same seed for ``--steps`` steps, warm-up included (barrier before and after; rank 0's clock).
The pair is repeated ``--repeats`` times, torch first in one round and second in the next, so
that a slow spell of a shared machine hits both alike; the figures are medians over rounds,
and the ratio is the median of the per-round ratios torch/dtrain (>= 1: dtrain as fast or faster).

Run::

    python benchmarks/local_sgd_vs_torch.py                         # 4 processes, CNN, period 8, warm-up 20
    python benchmarks/local_sgd_vs_torch.py --model mlp --period 4 --warmup-steps 0 --algorithm native
    python benchmarks/local_sgd_vs_torch.py --repeats 7 --out benchmarks/results/local_sgd_vs_torch.json

``--out`` writes the harness's result file (:mod:`dtrain.measure.harness`); the bar is >= 1.0x.

Timings on a shared machine are indicative; run it on a quiet one for figures.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from typing import Any

import torch


def _batches(batch: int, rank: int, world: int, count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's shard of digits, cut into local batches of ``batch // world`` (cycled to ``count``)."""
    from dtrain.workloads.data import load_dataset

    x, y = load_dataset("digits", seed=seed).train.tensors
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    local = batch // world
    out = []
    for k in range(count):
        start = (k * local * world) % (len(y) - local * world + 1)
        idx = perm[start + rank * local : start + (rank + 1) * local]
        out.append((x[idx], y[idx]))
    return out


def _run(kind: str, args: dict[str, Any], data: list[Any], solo: Any) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dtrain.decentralized import LocalSGD
    from dtrain.workloads.models import build_model

    torch.manual_seed(args["seed"])
    net = build_model(args["model"], (1, 8, 8), 10)
    period, warm = args["period"], args["warmup_steps"]
    local: Any = None
    if kind == "torch":
        model: Any = DDP(net)
        model.register_comm_hook(PostLocalSGDState(None, solo, warm), post_localSGD_hook)
        opt: Any = PostLocalSGDOptimizer(
            torch.optim.SGD(model.parameters(), lr=args["lr"], momentum=0.9), PeriodicModelAverager(period, warm)
        )
    else:
        model = local = LocalSGD(net, period=period, warmup_steps=warm, algorithm=args["algorithm"])
        opt = torch.optim.SGD(net.parameters(), lr=args["lr"], momentum=0.9)
    dist.barrier()
    t0 = time.perf_counter()
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if local is not None:
            local.step()
    dist.barrier()
    dt = time.perf_counter() - t0
    stats = local.stats() if local is not None else {}
    return dict(step_ms=1e3 * dt / len(data), bytes=stats.get("bytes_sent", 0) / len(data))


def _worker(args: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Per round: (torch figures, dtrain figures), timed back to back."""
    import torch.distributed as dist

    import dtrain

    rank, world = dtrain.rank(), dtrain.world_size()
    data = _batches(args["batch_size"], rank, world, args["steps"], args["seed"])
    solo, _ = dist.new_subgroups(group_size=1)  # DDP's gradient allreduce after warm-up: this rank alone
    rounds = []
    for k in range(args["repeats"]):
        if k % 2 == 0:
            t = _run("torch", args, data, solo)
            d = _run("dtrain", args, data, solo)
        else:
            d = _run("dtrain", args, data, solo)
            t = _run("torch", args, data, solo)
        rounds.append((t, d))
    return rounds


def main(argv: list[str] | None = None) -> int:
    from dtrain.measure.harness import Bar, Benchmark, add_result_flags, command

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nprocs", type=int, default=4)
    ap.add_argument("--model", default="cnn", choices=("cnn", "mlp"))
    ap.add_argument("--algorithm", default="ring", help="dtrain allreduce algorithm (default: ring)")
    ap.add_argument("--period", type=int, default=8)
    ap.add_argument("--warmup-steps", type=int, default=20, help="post-local SGD warm-up, both sides")
    ap.add_argument("--batch-size", type=int, default=64, help="global batch (default: 64)")
    ap.add_argument("--steps", type=int, default=200, help="timed steps per run, warm-up included")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds; the median is reported")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    add_result_flags(ap)
    a = ap.parse_args(argv)

    from dtrain.launch.agent import launch, threads_per_worker

    args = dict(
        model=a.model,
        algorithm=a.algorithm,
        period=a.period,
        warmup_steps=a.warmup_steps,
        batch_size=a.batch_size,
        steps=a.steps,
        repeats=a.repeats,
        lr=a.lr,
        seed=a.seed,
    )
    print(
        f"torch {torch.__version__}, python {platform.python_version()}, {platform.machine()}, "
        f"{a.nprocs} processes x {threads_per_worker(a.nprocs)} intra-op thread(s), "
        f"backend {'nccl' if torch.cuda.is_available() else 'gloo'}"
    )
    print(
        f"model {a.model}, digits, global batch {a.batch_size}, period {a.period}, warm-up {a.warmup_steps}, "
        f"{a.steps} steps per run, median of {a.repeats} rounds; dtrain algorithm {a.algorithm}"
    )
    bench = Benchmark(
        "local_sgd_vs_torch",
        title="LocalSGD against torch's post-local SGD",
        family="decentralized",
        workload=f"{a.model} on digits, global batch {a.batch_size}, {a.nprocs} processes, period "
        f"{a.period} after {a.warmup_steps} synchronous steps; {a.steps} steps a run",
        metric="ms/step",
        higher_is_better=False,
        repeats=a.repeats,
        quick=a.quick,
        command=command("benchmarks/local_sgd_vs_torch.py", argv),
        notes="torch's side: DDP with post_localSGD_hook and PostLocalSGDOptimizer("
        "PeriodicModelAverager); dtrain's: LocalSGD with the "
        f"{a.algorithm} allreduce. The two alternate inside one launch.",
    )
    t0 = time.perf_counter()
    bench.start()
    rounds = launch(_worker, (args,), nprocs=a.nprocs)[0]
    bench.stop()
    bench.add_case(
        f"period {a.period}",
        samples={
            "LocalSGD": [d["step_ms"] for _, d in rounds],
            "PostLocalSGDOptimizer": [t["step_ms"] for t, _ in rounds],
        },
        compare=[("LocalSGD", "PostLocalSGDOptimizer", Bar.at_least(1.0))],
    )
    torch_ms = statistics.median(t["step_ms"] for t, _ in rounds)
    dtrain_ms = statistics.median(d["step_ms"] for _, d in rounds)
    ratio = statistics.median(t["step_ms"] / d["step_ms"] for t, d in rounds)
    print()
    print(f"{'torch PostLocalSGDOptimizer + DDP hook':42} {torch_ms:9.3f} ms/step")
    print(
        f"{'dtrain LocalSGD (' + a.algorithm + ')':42} {dtrain_ms:9.3f} ms/step   "
        f"{rounds[0][1]['bytes']:.0f} bytes/step sent"
    )
    print(f"{'ratio torch/dtrain (>= 1: dtrain as fast)':42} {ratio:9.3f}")
    per_round = ", ".join(f"{t['step_ms'] / d['step_ms']:.3f}" for t, d in rounds)
    print(f"per round torch/dtrain: {per_round}; wall {time.perf_counter() - t0:.0f}s")
    bench.report(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
