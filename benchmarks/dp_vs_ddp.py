"""dtrain.DataParallel beside torch DDP: training steps per second, same model, data and seed.

One launch of ``--nprocs`` processes (``dtrain.launch.agent.launch``, gloo on CPU or
NCCL on CUDA). Inside it, each ``dtrain.DataParallel`` configuration (allreduce
algorithm x overlap mode) is timed back to back with torch DDP: the same model
(``dtrain.workloads.models.build_model``, default the CNN), the same digits shards and the
same seed train for ``--warmup`` discarded steps and then ``--steps`` timed steps
(barrier before and after; rank 0's clock). The pairs are repeated
``--repeats`` times, DDP first in one round and second in the next, so that a
slow spell of a shared machine hits both sides of a pair alike; the table gives
medians over the rounds, and the ratio is the median of the per-pair ratios.
DDP runs with ``bucket_cap_mb=--bucket-mb`` and DataParallel with
``bucket_mb=--bucket-mb`` (both: first bucket 1 MiB).

Columns: steps/s of DDP and of DataParallel, their ratio (DataParallel / DDP),
and DataParallel's mean per-step comm, wait and bytes sent (``step_stats()``).

Run::

    python benchmarks/dp_vs_ddp.py                      # 4 processes, all algorithms, overlap=backward
    python benchmarks/dp_vs_ddp.py --algorithms native,ring --overlap backward,forward
    python benchmarks/dp_vs_ddp.py --model mlp --steps 400 --repeats 5
    python benchmarks/dp_vs_ddp.py --algorithms ring --repeats 7 --out benchmarks/results/dp_vs_ddp.json
    python benchmarks/dp_vs_ddp.py --model gpt-small --batch-size 16 --algorithms ring --steps 20 --warmup 3 \
        --repeats 7 --out benchmarks/results/dp_vs_ddp_gpt.json
    python benchmarks/dp_vs_ddp.py --model hf-llama-small --nprocs 2 --seq-len 128 --batch-size 16 \
        --algorithms ring,native --steps 8 --warmup 2 --repeats 7 --out benchmarks/results/dp_vs_ddp_hf_llama_small.json

``hf-llama-small`` is a transformers Llama of gpt-small's size that dtrain did not write (``benchmarks/_models.py``).

``--out`` writes the harness's result file (:mod:`dtrain.measure.harness`): every round's steps/s of
both systems, the per-round ratio DataParallel / DDP with its median, interquartile range and min-max,
held against the bar (>= 1.0x).

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
from _models import HF_MODELS, LANGUAGE, build

ALL_ALGORITHMS = ("native", "ring", "tree", "recursive_doubling", "rabenseifner", "hierarchical")


VOCAB = 256  # a language model's vocabulary here (random tokens: the step's time, not learning)


def _batches(
    model: str, batch: int, rank: int, world: int, count: int, seed: int, seq: int = 64
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's shard of digits, cut into local batches of ``batch // world`` (cycled to ``count``); for a
    language model, this rank's share of a few global batches of random tokens (``seq`` a sample), cycled."""
    from dtrain.workloads.data import load_dataset

    if model in LANGUAGE:
        g = torch.Generator().manual_seed(seed + 1)
        local = batch // world
        fixed = []
        for _ in range(4):
            x, y = torch.randint(VOCAB, (batch, seq), generator=g), torch.randint(VOCAB, (batch, seq), generator=g)
            fixed.append((x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]))
        return [fixed[k % len(fixed)] for k in range(count)]

    ds = load_dataset("digits", seed=seed).train
    x, y = ds.tensors
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(y), generator=g)
    local = batch // world
    per_step = local * world
    out = []
    for k in range(count):
        start = (k * per_step) % (len(y) - per_step + 1)
        idx = perm[start + rank * local : start + (rank + 1) * local]
        out.append((x[idx], y[idx]))
    return out


def _run_config(cfg: dict[str, Any], args: dict[str, Any], data: list[Any]) -> dict[str, float]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import dtrain
    from dtrain.workloads.models import build_model, task_loss

    torch.manual_seed(args["seed"])
    net: torch.nn.Module
    if args["model"] in LANGUAGE:
        net = build(args["model"], seq_len=args["seq_len"], vocab_size=VOCAB)
    else:
        net = build_model(args["model"], (1, 8, 8), 10)

    def make_opt(ps: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(ps, lr=args["lr"], momentum=0.9)

    if cfg["kind"] == "ddp":
        model: Any = DDP(net, bucket_cap_mb=args["bucket_mb"])
        opt = make_opt(model.parameters())
        engine_steps = False
    else:
        kw: dict[str, Any] = dict(algorithm=cfg["algorithm"], overlap=cfg["overlap"], bucket_mb=args["bucket_mb"])
        engine_steps = cfg["overlap"] == "forward"
        if engine_steps:
            kw["optimizer_factory"] = make_opt
        model = dtrain.DataParallel(net, **kw)
        opt = model.optimizer if engine_steps else make_opt(model.parameters())
    comm = wait = nbytes = 0.0
    warm, steps = args["warmup"], args["steps"]
    t0 = 0.0
    for k, (x, y) in enumerate(data[: warm + steps]):
        if k == warm:
            if engine_steps:
                model.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
        if not engine_steps:
            opt.zero_grad(set_to_none=False)
        task_loss(model(x), y).backward()
        if not engine_steps:
            opt.step()
        if k >= warm and cfg["kind"] == "dp":
            st = model.step_stats()
            comm += st["comm_s"]
            wait += st["wait_s"]
            nbytes += st["bytes_sent"]
    if engine_steps:
        model.synchronize()
    dist.barrier()
    dt = time.perf_counter() - t0
    if cfg["kind"] == "dp":
        model.close()
    return dict(steps_per_s=steps / dt, comm_ms=1e3 * comm / steps, wait_ms=1e3 * wait / steps, bytes=nbytes / steps)


def _worker(
    configs: list[dict[str, Any]], args: dict[str, Any]
) -> list[list[tuple[dict[str, float], dict[str, float]]]]:
    """Per round, per DataParallel configuration: (DDP figures, DataParallel figures) timed back to back."""
    import dtrain

    rank, world = dtrain.rank(), dtrain.world_size()
    if args["pin"]:
        from _loopback import pin_to_core

        pin_to_core(rank)
    data = _batches(
        args["model"], args["batch_size"], rank, world, args["warmup"] + args["steps"], args["seed"], args["seq_len"]
    )
    ddp = dict(kind="ddp")
    rounds = []
    for k in range(args["repeats"]):
        pairs = []
        for c in configs:
            if k % 2 == 0:
                d = _run_config(ddp, args, data)
                m = _run_config(c, args, data)
            else:
                m = _run_config(c, args, data)
                d = _run_config(ddp, args, data)
            pairs.append((d, m))
        rounds.append(pairs)
    return rounds


def main(argv: list[str] | None = None) -> int:
    from dtrain.measure.harness import Bar, Benchmark, add_result_flags, command

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nprocs", type=int, default=4)
    ap.add_argument("--algorithms", default=",".join(ALL_ALGORITHMS))
    ap.add_argument("--overlap", default="backward", help="comma-separated: backward,forward")
    ap.add_argument(
        "--model",
        default="cnn",
        choices=("cnn", "mlp", "gpt-tiny", "gpt-small", *HF_MODELS),
        help=f"cnn or mlp on digits; a gpt model, or a transformers one dtrain did not write "
        f"(hf-llama-small), on random tokens (vocabulary {VOCAB})",
    )
    ap.add_argument("--seq-len", type=int, default=64, help="a language model's tokens a sample (default: 64)")
    ap.add_argument("--batch-size", type=int, default=64, help="global batch (default: 64)")
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--steps", type=int, default=200, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=20, help="discarded steps per configuration")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds; the median is reported")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pin", action="store_true", help="pin each rank's threads to a core of its own (both systems)")
    add_result_flags(ap)
    a = ap.parse_args(argv)

    from dtrain.launch.agent import launch, threads_per_worker

    algorithms = [s for s in a.algorithms.split(",") if s]
    overlaps = [s for s in a.overlap.split(",") if s]
    for s in algorithms:
        if s not in ALL_ALGORITHMS:
            ap.error(f"unknown algorithm {s!r}; choose from {','.join(ALL_ALGORITHMS)}")
    for s in overlaps:
        if s not in ("backward", "forward"):
            ap.error(f"unknown overlap {s!r}; use backward and/or forward")
    configs = [dict(kind="dp", algorithm=al, overlap=ov) for ov in overlaps for al in algorithms]
    args = dict(
        model=a.model,
        batch_size=a.batch_size,
        bucket_mb=a.bucket_mb,
        steps=a.steps,
        warmup=a.warmup,
        repeats=a.repeats,
        lr=a.lr,
        seed=a.seed,
        seq_len=a.seq_len,
        pin=a.pin,
    )
    print(
        f"torch {torch.__version__}, python {platform.python_version()}, {platform.machine()}, "
        f"{a.nprocs} processes x {threads_per_worker(a.nprocs)} intra-op thread(s), "
        f"backend {'nccl' if torch.cuda.is_available() else 'gloo'}"
    )
    lm = a.model in LANGUAGE
    data = f"random tokens, seq_len {a.seq_len}" if lm else "digits"  # the model's own inputs
    print(
        f"model {a.model}, {data}, global batch {a.batch_size}, bucket {a.bucket_mb} MiB, "
        f"{a.warmup} warm-up + {a.steps} timed steps, median of {a.repeats} rounds of (DDP, DP) pairs"
    )
    name = "dp_vs_ddp_gpt" if lm else "dp_vs_ddp"
    if a.model in HF_MODELS:  # a model dtrain did not write: its own result file
        name = f"dp_vs_ddp_{a.model.replace('-', '_')}"
    bench = Benchmark(
        name,
        family="data parallelism",
        title=f"Data parallelism against DDP{', ' + a.model if lm else ''}",
        workload=f"{a.model} on {data}, global batch {a.batch_size}, {a.nprocs} processes, SGD "
        f"momentum; {a.steps} timed steps after {a.warmup}",
        metric="steps/s",
        higher_is_better=True,
        repeats=a.repeats,
        quick=a.quick,
        command=command("benchmarks/dp_vs_ddp.py", argv),
        notes="DataParallel and DDP alternate inside one launch (DDP first in even rounds); bucket "
        f"{a.bucket_mb} MiB both."
        + (" Each rank's threads pinned to a core of its own (--pin), both systems alike." if a.pin else ""),
    )
    t0 = time.perf_counter()
    bench.start()
    res = launch(_worker, (configs, args), nprocs=a.nprocs)
    bench.stop()
    rounds = res[0]
    for i, c in enumerate(configs):
        bench.add_case(
            f"{c['algorithm']}, overlap {c['overlap']}",
            samples={
                "DataParallel": [r[i][1]["steps_per_s"] for r in rounds],
                "DDP": [r[i][0]["steps_per_s"] for r in rounds],
            },
            compare=[("DataParallel", "DDP", Bar.at_least(1.0))],
        )
    print()
    print(
        f"{'configuration':40} {'DDP steps/s':>12} {'DP steps/s':>11} {'DP/DDP':>7} "
        f"{'comm ms':>8} {'wait ms':>8} {'bytes/step':>11}"
    )
    for i, c in enumerate(configs):
        ddp = statistics.median(r[i][0]["steps_per_s"] for r in rounds)
        dp = {k: statistics.median(r[i][1][k] for r in rounds) for k in rounds[0][i][1]}
        ratio = statistics.median(r[i][1]["steps_per_s"] / r[i][0]["steps_per_s"] for r in rounds)
        name = f"{c['algorithm']} (overlap={c['overlap']})"
        print(
            f"{name:40} {ddp:12.1f} {dp['steps_per_s']:11.1f} {ratio:7.3f} "
            f"{dp['comm_ms']:8.3f} {dp['wait_ms']:8.3f} {dp['bytes']:11.0f}"
        )
    spread = [p[0]["steps_per_s"] for r in rounds for p in r]
    print(
        f"\nDDP steps/s over all its runs: min {min(spread):.1f}, median {statistics.median(spread):.1f}, "
        f"max {max(spread):.1f}; wall {time.perf_counter() - t0:.0f}s"
    )
    bench.report(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
