"""Pipeline and tensor parallelism on a transformers model dtrain did not write, beside torch's own: steps/s.

One launch of ``--nprocs`` processes (``dtrain.launch.agent.launch``, MASTER_ADDR 127.0.0.1, gloo on loopback,
CPU, one intra-op thread each). The model is ``--model`` of ``benchmarks/_models.py`` (``hf-llama-small``: a
transformers Llama of gpt-small's size, built from a configuration, random weights, nothing downloaded, its
key-value cache off), the same weights on every rank and for every system, trained with plain SGD (``--lr``)
on the same fixed batches of ``--batch`` windows of ``--seq-len`` tokens.

``tensor``: the whole batch on every rank, as tensor parallelism has it.

* ``dtrain``  ``dtrain.tensor_parallel.derive_plan(model, P)`` (the plan found from the model: q, k and v
  column-parallel by heads, grouped-query attention's k and v by key-value heads, o_proj row-parallel,
  gate/up column-parallel, down row-parallel, the embedding and the head by vocabulary) and ``parallelize``;
  loss ``vocab_parallel_cross_entropy`` (the logits never gathered).
* ``torch``   DTensor's ``parallelize_module`` over ``init_device_mesh("cpu", (P,))`` with transformers' own
  plan for the architecture (``config.base_model_tp_plan``: ``colwise`` -> ``ColwiseParallel()``, ``rowwise``
  -> ``RowwiseParallel()``; the head by the model class's ``_tp_plan``, ``colwise_gather_output`` ->
  ``ColwiseParallel(output_layouts=Replicate())``); the embedding replicated as that plan leaves it;
  ``F.cross_entropy`` on the gathered logits.

``pipeline``: ``P`` stages, one a process, the batch in ``--microbatches`` micro-batches, the same cut
(``--balance`` layer counts, found once by dtrain and given to both):

* ``dtrain``  ``dtrain.Pipeline(model, microbatches=M, schedule=S, balance=sizes, sample=...)``: the model's
  own forward runs on every stage with the stage's decoder layers in place.
* ``torch``   ``torch.distributed.pipelining.pipeline(model, mb_args=..., split_spec=...)``, its tracer
  (``torch.export``) cutting at the same decoder layers, then ``build_stage`` and ``ScheduleGPipe`` /
  ``Schedule1F1B`` with the same micro-batches and a per-micro-batch mean loss.

Correctness: the first step's loss of each system against the unsplit model's, in one process (printed and
kept in ``--json``). Timing: ``--warmup`` discarded steps per system, then ``--steps`` timed steps a system in
``--rounds`` rounds, each round every system's share between barriers, the order rotated each round; a round's
figure is rank 0's steps/s (barrier to barrier); the ratio dtrain / torch per round; the bar >= 1.0x.

Run::

    python benchmarks/hf_model_parallel.py tensor --out benchmarks/results/tensor_vs_dtensor_hf_llama_small.json
    python benchmarks/hf_model_parallel.py pipeline --out benchmarks/results/pipeline_vs_torch_hf_llama_small.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _loopback import launch_loopback
from _models import HF_MODELS, build
from torch import nn

VOCAB = 256
KINDS = ("tensor", "pipeline")


def _model(args: dict[str, Any]) -> nn.Module:
    torch.manual_seed(args["seed"])
    net = build(args["model"], seq_len=args["seq_len"], vocab_size=VOCAB)
    net.config.use_cache = False  # torch's tracer cannot carry transformers' cache object through its graph
    return net


def _batches(args: dict[str, Any], count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A few fixed batches, the same on every rank, cycled through the steps."""
    g = torch.Generator().manual_seed(args["seed"] + 1)
    shape = (args["batch"], args["seq_len"])
    return [(torch.randint(VOCAB, shape, generator=g), torch.randint(VOCAB, shape, generator=g)) for _ in range(count)]


def _loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    from dtrain.workloads.models import logits_of

    return F.cross_entropy(logits_of(out).reshape(-1, VOCAB), y.reshape(-1))


# ----------------------------------------------------------------------------- tensor parallel


class _Tensor:
    """One tensor-parallel system on this rank: ``step(x, y)`` is zero_grad, forward, loss, backward, SGD."""

    def __init__(self, name: str, args: dict[str, Any], sample: torch.Tensor) -> None:
        import torch.distributed as dist

        import dtrain.tensor_parallel as tp

        self.name, self.tp = name, tp
        net = _model(args)
        size = dist.get_world_size()
        if name == "dtrain":
            self.plan = tp.derive_plan(net, size, sample=sample)
            tp.parallelize(net, self.plan, None)
            self.head: Any = [m for m in net.modules() if isinstance(m, tp.VocabParallelHead)][-1]
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import Replicate
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
            mesh = init_device_mesh("cpu", (size,))
            base = {k: styles[v]() for k, v in net.config.base_model_tp_plan.items()}
            parallelize_module(net.base_model, mesh, base)
            head = type(net)._tp_plan  # type: ignore[attr-defined]
            if head.get("lm_head") == "colwise_gather_output":
                parallelize_module(net, mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
            self.head = None
        self.model = net
        self.opt = torch.optim.SGD(net.parameters(), lr=args["lr"])

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        from dtrain.workloads.models import logits_of

        self.opt.zero_grad()
        if self.head is not None:
            loss = self.tp.vocab_parallel_cross_entropy(logits_of(self.model(x)), y, self.head)
        else:
            loss = _loss(self.model(x), y)
        loss.backward()
        self.opt.step()
        return float(loss.detach())


# ----------------------------------------------------------------------------- the rounds


def _rounds(systems: list[Any], data: list[tuple[torch.Tensor, torch.Tensor]], args: dict[str, Any]) -> dict[str, Any]:
    """Warm-up, then the timed rounds (every system's share between barriers, the order rotated each round)."""
    import torch.distributed as dist

    res: dict[str, Any] = {s.name: {"round_steps_per_s": []} for s in systems}
    steps = dict.fromkeys(res, 0)

    def run(s: Any, n: int) -> float:
        loss = float("nan")
        for _ in range(n):
            x, y = data[steps[s.name] % len(data)]
            loss = s.step(x, y)
            steps[s.name] += 1
        return loss

    for s in systems:
        res[s.name]["loss0"] = run(s, 1)
        run(s, args["warmup"] - 1)
    share = [args["steps"] // args["rounds"] + (k < args["steps"] % args["rounds"]) for k in range(args["rounds"])]
    for r, n in enumerate(share):
        for i in range(len(systems)):
            s = systems[(i + r) % len(systems)]
            dist.barrier()
            t0 = time.perf_counter()
            run(s, n)
            dist.barrier()
            res[s.name]["round_steps_per_s"].append(n / (time.perf_counter() - t0))
    return res


def _reference(args: dict[str, Any], data: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The unsplit model's loss on the first batch, in this process."""
    full = _model(args)
    x, y = data[0]
    with torch.no_grad():
        return float(_loss(full(x), y))


def _tensor_worker(args: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    data = _batches(args)
    ref = _reference(args, data)
    systems = [_Tensor(name, args, data[0][0][:1]) for name in ("dtrain", "torch")]
    out = _rounds(systems, data, args)
    return {"reference_loss0": ref, "systems": out, "plan": systems[0].plan.text()}


# ----------------------------------------------------------------------------- pipeline


def _blocks(net: nn.Module) -> tuple[str, int]:
    """The decoder layers' list: its name and length (``model.layers``, 6)."""
    for name, m in net.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > 1:
            return name, len(m)
    raise ValueError(f"{type(net).__name__} has no list of decoder layers")


class _Pipe:
    """One pipeline system on this rank: ``step(x, y)`` runs the batch's micro-batches, then SGD."""

    def __init__(self, kind: str, schedule: str, args: dict[str, Any], sizes: list[int]) -> None:
        import torch.distributed as dist

        self.name, self.kind = f"{kind} {schedule}", kind
        net = _model(args)
        m, rank = args["microbatches"], dist.get_rank()
        sample = _batches(args, 1)[0][0][: args["batch"] // m]
        self.last = rank == dist.get_world_size() - 1
        self.first = rank == 0
        if kind == "dtrain":
            from dtrain.pipeline import Pipeline

            self.pipe: Any = Pipeline(net, m, schedule=schedule, loss_fn=_loss, balance=sizes, sample=sample)
            params = list(self.pipe.parameters())
        else:
            from torch.distributed import pipelining as pp

            name, _ = _blocks(net)
            starts = [sum(sizes[:s]) for s in range(1, len(sizes))]
            spec = {f"{name}.{i}": pp.SplitPoint.BEGINNING for i in starts}
            traced = pp.pipeline(net, mb_args=(sample,), split_spec=spec)
            stage = traced.build_stage(rank, torch.device("cpu"))
            cls = pp.ScheduleGPipe if schedule == "gpipe" else pp.Schedule1F1B
            self.pipe = cls(stage, m, loss_fn=_loss)
            params = list(stage.submod.parameters())
        self.opt = torch.optim.SGD(params, lr=args["lr"])
        self.params = sum(p.numel() for p in params)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        if self.kind == "dtrain":
            loss = float(self.pipe.step(x, y))
        else:
            losses: list[torch.Tensor] = []
            args = (x,) if self.first else ()
            if self.last:
                self.pipe.step(*args, target=y, losses=losses, return_outputs=False)
                loss = float(torch.stack(losses).detach().mean())
            else:
                self.pipe.step(*args, return_outputs=False)
                loss = float("nan")
        self.opt.step()
        self.opt.zero_grad()
        return loss


def _pipeline_worker(args: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's tracer on its own pytree specs
    data = _batches(args)
    ref = _reference(args, data)
    _, layers = _blocks(_model(args))
    stages = dist.get_world_size()
    sizes = [layers // stages + (s < layers % stages) for s in range(stages)]
    systems = [_Pipe(kind, sched, args, sizes) for sched in args["schedules"] for kind in ("dtrain", "torch")]
    out = _rounds(systems, data, args)
    return {"reference_loss0": ref, "systems": out, "sizes": sizes, "params": {s.name: s.params for s in systems}}


def _pipeline_bench(args: dict[str, Any], a: argparse.Namespace, argv: list[str] | None) -> tuple[Any, Any]:
    from dtrain.measure.harness import Bar, Benchmark, command

    bench = Benchmark(
        f"pipeline_vs_torch_{a.model.replace('-', '_')}",
        title=f"Pipeline of a transformers model against torch.distributed.pipelining's tracer, {a.model}",
        family="pipeline parallelism",
        workload=f"{a.model} (transformers Llama, 6 x 256), {a.nprocs} stages, batch {a.batch} x {a.seq_len} "
        f"tokens in {a.microbatches} micro-batches, SGD; {a.steps} timed steps a system in {a.rounds} rounds",
        metric="steps/s",
        higher_is_better=True,
        repeats=a.rounds,
        command=command("benchmarks/hf_model_parallel.py", argv),
        notes="The same cut between decoder layers for both: dtrain runs the model's own forward on each stage "
        "with that stage's layers in place; torch's tracer (torch.export, the key-value cache off, which it "
        "cannot carry) splits the traced graph at the same layers. Both alternate inside one launch.",
    )
    bench.start()
    ranks = launch_loopback(_pipeline_worker, (args,), a.nprocs)
    bench.stop()
    last = ranks[a.nprocs - 1]
    print(f"cut {ranks[0]['sizes']}; step-0 loss: unsplit {last['reference_loss0']:.6f}", end="")
    for name, s in last["systems"].items():
        print(f"; {name} {s['loss0']:.6f}", end="")
    print()
    for sched in args["schedules"]:
        ours, peer = f"dtrain {sched}", f"torch {sched}"
        bench.add_case(
            sched,
            samples={
                ours: ranks[0]["systems"][ours]["round_steps_per_s"],
                peer: ranks[0]["systems"][peer]["round_steps_per_s"],
            },
            compare=[(ours, peer, Bar.at_least(1.0))],
        )
    return bench, ranks


# ----------------------------------------------------------------------------- the report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=KINDS)
    ap.add_argument("--model", default="hf-llama-small", choices=sorted(HF_MODELS))
    ap.add_argument("--nprocs", type=int, default=2, help="processes: the tensor-parallel size or the stages")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="windows a step (default: 8)")
    ap.add_argument("--microbatches", type=int, default=4, help="pipeline: M (default: 4)")
    ap.add_argument("--schedules", default="gpipe,1f1b", help="pipeline: comma-separated, gpipe and/or 1f1b")
    ap.add_argument("--balance", default="equal", help="pipeline: how the cut is chosen, for both (default: equal)")
    ap.add_argument("--steps", type=int, default=14, help="timed steps a system (default: 14)")
    ap.add_argument("--warmup", type=int, default=2, help="discarded steps a system (default: 2)")
    ap.add_argument("--rounds", type=int, default=7, help="rounds the timed steps are split into (default: 7)")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write every figure here")
    ap.add_argument("--out", default=None, help="write the harness's result file (JSON) here")
    a = ap.parse_args(argv)
    if a.nprocs < 2 or a.warmup < 1 or a.rounds < 5 or a.steps < a.rounds:
        ap.error("--nprocs >= 2, --warmup >= 1, --rounds >= 5 and --steps >= --rounds")
    args = dict(vars(a), schedules=[s for s in a.schedules.split(",") if s])
    print(
        f"torch {torch.__version__}, python {platform.python_version()}, {a.nprocs} processes x 1 intra-op "
        f"thread, gloo on loopback, CPU; {a.model} seq_len {a.seq_len}, batch {a.batch}; {a.warmup} warm-up + "
        f"{a.steps} timed steps a system in {a.rounds} rotated rounds"
    )
    from dtrain.measure.harness import Bar, Benchmark, command

    t0 = time.perf_counter()
    if a.kind == "tensor":
        bench = Benchmark(
            f"tensor_vs_dtensor_{a.model.replace('-', '_')}",
            title=f"Tensor parallelism with the derived plan against DTensor with transformers' plan, {a.model}",
            family="tensor parallelism",
            workload=f"{a.model} (transformers Llama, 6 x 256), tp {a.nprocs}, batch {a.batch} x {a.seq_len} "
            f"tokens, SGD; {a.steps} timed steps a system in {a.rounds} rounds",
            metric="steps/s",
            higher_is_better=True,
            repeats=a.rounds,
            command=command("benchmarks/hf_model_parallel.py", argv),
            notes="dtrain splits by the plan it derives from the model (embedding and head by vocabulary too); "
            "torch's DTensor by the table transformers ships for Llama (the embedding replicated, the "
            "logits gathered). Both on the same weights and batches, alternating inside one launch.",
        )
        bench.start()
        ranks = launch_loopback(_tensor_worker, (args,), a.nprocs)
        bench.stop()
        r0 = ranks[0]
        print(r0["plan"])
        sys_res = r0["systems"]
        print(f"step-0 loss: unsplit {r0['reference_loss0']:.6f}", end="")
        for name, s in sys_res.items():
            print(f"; {name} {s['loss0']:.6f}", end="")
        print()
        bench.add_case(
            f"tp {a.nprocs}",
            samples={
                f"dtrain tp{a.nprocs}": sys_res["dtrain"]["round_steps_per_s"],
                f"DTensor tp{a.nprocs}": sys_res["torch"]["round_steps_per_s"],
            },
            compare=[(f"dtrain tp{a.nprocs}", f"DTensor tp{a.nprocs}", Bar.at_least(1.0))],
        )
    else:
        bench, ranks = _pipeline_bench(args, a, argv)
    print(f"wall {time.perf_counter() - t0:.0f}s")
    bench.report(a.out)
    if a.json:
        Path(a.json).write_text(json.dumps({"config": args, "ranks": ranks}, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
