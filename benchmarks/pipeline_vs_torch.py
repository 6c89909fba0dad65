"""dtrain.Pipeline beside torch.distributed.pipelining: samples/s, same model, same cut, same micro-batches.

One launch of ``--nprocs`` processes (``dtrain.launch.agent.launch``, MASTER_ADDR 127.0.0.1, gloo on
loopback, CPU, one intra-op thread each: ``torch.set_num_threads(1)``). Inside it, for each
workload and each schedule pair, both systems are built from the same seed and cut the same
way (``--balance``, computed once by ``dtrain.pipeline.partition.balance`` and passed as
explicit layer counts to both), then trained with plain SGD on the same batches split into the
same ``--microbatches`` micro-batches:

* ``gpipe``       dtrain ``schedule="gpipe"``       vs torch ``ScheduleGPipe``
* ``1f1b``        dtrain ``schedule="1f1b"``        vs torch ``Schedule1F1B``
* ``interleaved`` dtrain ``schedule="interleaved"`` vs torch ``ScheduleInterleaved1F1B`` (2 virtual
  stages per rank; virtual stage ``s`` on rank ``s % P`` on both sides)
* ``2bw``         dtrain ``schedule="2bw"``         vs dtrain ``schedule="1f1b"`` (torch has no 2BW); 2bw
  runs without a flush from its first to its last step (the rounds of the other system in between
  do not disturb it: each pipeline has its own tag space), and is flushed once after the pair

torch's side is built by hand so that both cut identically: this rank's children of the same
``nn.Sequential`` become one ``PipelineStage(submodule, stage_index, num_stages, cpu)`` per local
stage (shapes inferred on the first step), driven with ``loss_fn=task_loss`` (a per-micro-batch
mean). torch leaves the gradient of the *mean* over micro-batches: with ``scale_grads=True`` (its
default) each stage divides its ``.grad`` by ``n_microbatches`` after the last backward
(``_PipelineStageBase.scale_grads``, called from ``perform_reduce_grad``); dtrain scales each
micro-batch's loss by ``1 / M`` before its backward. Same gradient either way; the first warm-up
step checks it (``grad diff``: the largest absolute difference of any local gradient entry, over
the largest entry; 2bw's first call leaves no gradient, so its pair shows none).

Timing: ``--warmup`` discarded steps per system, then ``--steps`` timed steps per system, run in
``--rounds`` rounds that alternate the two systems (A B A B ...) so that a slow spell of a shared
machine hits both; a round is one system's steps between two barriers (rank 0's clock), and
samples/s is the batch times the timed steps over the summed round times. The ratio is dtrain
over its peer (>= 1: dtrain as fast or faster).

Bubble (dtrain only; torch exposes no per-step busy time): on each rank, the mean over timed steps
of ``1 - compute_s / step_s`` from ``Pipeline.last_stats``, so it includes messages and waiting on
slow peers as well as the schedule's own idle slots; beside it the closed form ``(P-1)/(M+P-1)``,
``(P-1)/(v*M+P-1)`` interleaved, and 0 for 2bw (no flush: the fill of one batch overlaps the
drain of the last).

Memory: after timing, two more steps per system run under ``torch.autograd.graph.saved_tensors_hooks``
that count the bytes autograd holds for backward (tensor storages, each once, parameters excluded);
the column is the peak during the second step, per process (= per rank). It is the activation
memory a schedule keeps in flight; for 2bw it also holds the stashed weight version. Process peak
RSS (``ru_maxrss``, over the whole run, all systems) goes to the JSON only: the systems alternate in
one process, so its deltas would not separate them.

Run::

    python benchmarks/pipeline_vs_torch.py                      # gpt-small and a 16-layer MLP, 4 processes
    python benchmarks/pipeline_vs_torch.py --quick              # a smoke run of about a minute
    python benchmarks/pipeline_vs_torch.py --workloads mlp --pairs 1f1b,2bw --steps 40 --rounds 8

Timings on a shared machine are indicative; run it on a quiet one for figures.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _loopback import launch_loopback
from torch import nn

PAIRS = ("gpipe", "1f1b", "interleaved", "2bw")
WORKLOADS = ("gpt", "mlp")


def _peer(pair: str) -> tuple[str, str]:
    """The system dtrain's ``pair`` schedule is compared with: (system, schedule)."""
    return ("dtrain", "1f1b") if pair == "2bw" else ("torch", pair)


def _chunks(schedule: str) -> int:
    return 2 if schedule == "interleaved" else 1


# ----------------------------------------------------------------------------- workloads


def _build(workload: str, schedule: str, args: dict[str, Any]) -> nn.Sequential:
    """The workload's model, from ``--seed`` (the same weights on every rank and for both systems)."""
    torch.manual_seed(args["seed"])
    if workload == "gpt":
        from dtrain.workloads.models import build_gpt

        layers = args["interleaved_layers"] if schedule == "interleaved" else 0  # 0: the preset's depth
        return build_gpt(args["gpt_model"], seq_len=args["seq_len"], layers=layers)
    w = args["mlp_width"]
    body: list[tuple[str, nn.Module]] = [
        (f"l{i}", nn.Sequential(nn.Linear(w, w), nn.ReLU())) for i in range(args["mlp_depth"] - 1)
    ]
    return nn.Sequential(OrderedDict([*body, ("head", nn.Linear(w, args["classes"]))]))


def _batches(workload: str, model: nn.Sequential, args: dict[str, Any], count: int = 4) -> list[Any]:
    """A few fixed batches (the same on every rank), cycled through the steps."""
    g = torch.Generator().manual_seed(args["seed"] + 1)
    b = args["batch_size"]
    if workload == "gpt":
        vocab, seq = model.gpt_config.vocab_size, args["seq_len"]
        return [
            (torch.randint(vocab, (b, seq), generator=g), torch.randint(vocab, (b, seq), generator=g))
            for _ in range(count)
        ]
    return [
        (torch.randn(b, args["mlp_width"], generator=g), torch.randint(args["classes"], (b,), generator=g))
        for _ in range(count)
    ]


def _cut(model: nn.Sequential, sizes: list[int]) -> list[nn.Sequential]:
    """The model's children in consecutive groups of ``sizes``, under their original names."""
    children = list(model.named_children())
    offsets = [sum(sizes[:s]) for s in range(len(sizes) + 1)]
    return [nn.Sequential(OrderedDict(children[offsets[s] : offsets[s + 1]])) for s in range(len(sizes))]


# ----------------------------------------------------------------------------- saved activations


class _Held:
    """A tensor autograd saved for backward; releases its storage's count when autograd drops it."""

    __slots__ = ("t", "owner", "ptr")

    def __init__(self, t: torch.Tensor, owner: _SavedBytes, ptr: int) -> None:
        self.t, self.owner, self.ptr = t, owner, ptr

    def __del__(self) -> None:
        self.owner.release(self.ptr)


class _SavedBytes:
    """Live and peak bytes of the tensors autograd saves for backward, each storage once, parameters excluded."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.live: dict[int, list[int]] = {}  # storage pointer -> [bytes, saved tensors on it]
        self.now = self.peak = 0

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def reset_peak(self) -> None:
        self.peak = self.now

    def _pack(self, t: torch.Tensor) -> Any:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # no plain storage (sparse, meta...): not counted
            return t
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self.skip:
            return t
        entry = self.live.get(ptr)
        if entry is None:
            entry = self.live[ptr] = [storage.nbytes(), 0]
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        return _Held(t, self, ptr)

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.t if isinstance(packed, _Held) else packed

    def release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            del self.live[ptr]
            self.now -= entry[0]


# ----------------------------------------------------------------------------- the two systems


class _System:
    """One pipeline (dtrain's or torch's) on this rank: ``step(x, y)`` runs a batch, then SGD."""

    def __init__(self, kind: str, schedule: str, model: nn.Sequential, sizes: list[int], args: dict[str, Any]) -> None:
        import torch.distributed as dist

        self.kind, self.schedule, self.pipe = kind, schedule, None
        rank, world = dist.get_rank(), dist.get_world_size()
        if kind == "dtrain":
            from dtrain.pipeline import Pipeline

            self.pipe = Pipeline(
                model,
                microbatches=args["microbatches"],
                schedule=schedule,
                chunks=_chunks(schedule),
                balance=sizes,
                timeout=args["timeout"],
            )
            if list(self.pipe.sizes) != sizes:
                raise RuntimeError(f"dtrain cut the model as {self.pipe.sizes}, not {sizes}")
            named = list(self.pipe.named_parameters())
            self.first, self.last = self.pipe.is_first, self.pipe.is_last
            self._run: Callable[[torch.Tensor, torch.Tensor], float] = self._dtrain
        else:
            from torch.distributed import pipelining as pp

            from dtrain.workloads.models import task_loss

            parts, n = _cut(model, sizes), len(sizes)
            local = [s for s in range(n) if s % world == rank]
            stages: list[Any] = [pp.PipelineStage(parts[s], s, n, torch.device("cpu")) for s in local]
            m = args["microbatches"]
            if schedule == "interleaved":
                self.sched: Any = pp.ScheduleInterleaved1F1B(stages, m, loss_fn=task_loss)
            else:
                cls = pp.ScheduleGPipe if schedule == "gpipe" else pp.Schedule1F1B
                self.sched = cls(stages[0], m, loss_fn=task_loss)
            named = [kv for s in local for kv in parts[s].named_parameters()]
            self.first, self.last = 0 in local, n - 1 in local
            self._run = self._torch
        self.named = named
        self.opt = torch.optim.SGD([p for _, p in named], lr=args["lr"])
        self.saved = _SavedBytes([p for _, p in named])
        self.bytes0 = 0

    def _dtrain(self, x: torch.Tensor, y: torch.Tensor) -> float:
        assert self.pipe is not None
        return float(self.pipe.step(x, y))

    def _torch(self, x: torch.Tensor, y: torch.Tensor) -> float:
        losses: list[torch.Tensor] = []
        inputs = (x,) if self.first else ()
        if self.last:
            self.sched.step(*inputs, target=y, losses=losses, return_outputs=False)
            return float(torch.stack(losses).detach().mean())
        self.sched.step(*inputs, return_outputs=False)
        return float("nan")

    def step(self, x: torch.Tensor, y: torch.Tensor, grads: dict[str, torch.Tensor] | None = None) -> float:
        loss = self._run(x, y)
        if grads is not None:
            grads.update({n: p.grad.detach().clone() for n, p in self.named if p.grad is not None})
        self.opt.step()
        self.opt.zero_grad()
        return loss

    def finish(self) -> None:
        """2bw: the last batch's deferred backwards and its update (every rank, once, after the pair)."""
        if self.schedule == "2bw":
            assert self.pipe is not None
            if self.pipe.flush():
                self.opt.step()
                self.opt.zero_grad()


def _grad_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float | None:
    """max |a - b| over every entry, over max |b|; None where either side has no gradient yet."""
    if not a or not b or set(a) != set(b):
        return None
    scale = max(float(g.abs().max()) for g in b.values())
    return max(float((a[n] - b[n]).abs().max()) for n in b) / max(scale, 1e-30)


def _run_pair(workload: str, pair: str, args: dict[str, Any]) -> dict[str, Any]:
    """Both systems of one pair on this rank: warm-up, alternating timed rounds, then memory steps."""
    import torch.distributed as dist

    from dtrain.pipeline.partition import balance

    specs = [("dtrain", pair), _peer(pair)]
    probe = _build(workload, pair, args)
    sizes = balance(probe, dist.get_world_size() * _chunks(pair), args["balance"])
    data = _batches(workload, probe, args)
    systems = [_System(kind, sched, _build(workload, pair, args), sizes, args) for kind, sched in specs]
    grads: list[dict[str, torch.Tensor]] = [{}, {}]
    first_loss = [float("nan")] * 2
    for i, s in enumerate(systems):
        for k in range(args["warmup"]):
            x, y = data[k % len(data)]
            loss = s.step(x, y, grads[i] if k == 0 else None)
            if k == 0:
                first_loss[i] = loss
    rounds = [args["steps"] // args["rounds"] + (k < args["steps"] % args["rounds"]) for k in range(args["rounds"])]
    seconds = [[0.0] * len(rounds) for _ in systems]
    bubbles: list[list[float]] = [[], []]
    for s in systems:
        s.bytes0 = s.pipe.transport.stats.bytes_sent if s.pipe is not None else 0
    step = args["warmup"]
    for r, n in enumerate(rounds):
        for i, s in enumerate(systems):
            dist.barrier()
            t0 = time.perf_counter()
            for k in range(n):
                x, y = data[(step + k) % len(data)]
                s.step(x, y)
                if s.pipe is not None:
                    st = s.pipe.last_stats
                    bubbles[i].append(max(0.0, 1.0 - st.compute_s / st.step_s) if st.step_s > 0 else 0.0)
            dist.barrier()
            seconds[i][r] = time.perf_counter() - t0
        step += n
    out: dict[str, Any] = {
        "sizes": sizes,
        "children": [n for n, _ in probe.named_children()],
        "grad_diff": _grad_diff(grads[0], grads[1]),
        "first_loss": first_loss,
    }
    for i, s in enumerate(systems):
        sent = s.pipe.transport.stats.bytes_sent - s.bytes0 if s.pipe is not None else None
        for k in range(2):  # memory: the peak of the second step (2bw: its first holds the previous batch's graph)
            if k == 1:
                s.saved.reset_peak()
            with s.saved.hooks():
                x, y = data[(step + k) % len(data)]
                s.step(x, y)
        in_flight = dict(s.pipe.last_stats.in_flight) if s.pipe is not None else None
        s.finish()
        out["dtrain" if i == 0 else "peer"] = {
            "system": s.kind,
            "schedule": s.schedule,
            "round_s": seconds[i],
            "bubble": sum(bubbles[i]) / len(bubbles[i]) if bubbles[i] else None,
            "saved_bytes": s.saved.peak,
            "bytes_sent_per_step": sent / args["steps"] if sent is not None else None,
            "in_flight": in_flight,
        }
    return out


def _worker(args: dict[str, Any]) -> dict[str, Any]:
    """Per workload, per pair: this rank's figures."""
    torch.set_num_threads(1)
    res: dict[str, Any] = {}
    for w in args["workloads"]:
        for pair in args["pairs"]:
            res[f"{w}/{pair}"] = _run_pair(w, pair, args)
    res["maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return res


# ----------------------------------------------------------------------------- report


def _closed_form(pair: str, p: int, m: int) -> float:
    if pair == "2bw":
        return 0.0
    return (p - 1) / (_chunks(pair) * m + p - 1)


def _simulated(pair: str, p: int, m: int) -> float:
    """The bubble of dtrain's schedule played with backward = 2 x forward and free messages (one call;
    for 2bw, the first call's ramp)."""
    from dtrain.pipeline.schedules import generate, simulate

    return float(simulate(generate(pair, p, m, _chunks(pair)), tf=1.0, tb=2.0).bubble)


def _summarize(ranks: dict[int, dict[str, Any]], args: dict[str, Any]) -> dict[str, Any]:
    """The per-rank figures folded into one record per workload and pair (rank 0's clock for time)."""
    p, m, b = args["nprocs"], args["microbatches"], args["batch_size"]
    out: dict[str, Any] = {}
    for w in args["workloads"]:
        for pair in args["pairs"]:
            key = f"{w}/{pair}"
            r0 = ranks[0][key]
            rec: dict[str, Any] = {
                "children": r0["children"],
                "sizes": r0["sizes"],
                "bubble_closed_form": _closed_form(pair, p, m),
                "bubble_simulated_tb2tf": _simulated(pair, p, m),
            }
            diffs = [ranks[r][key]["grad_diff"] for r in ranks if ranks[r][key]["grad_diff"] is not None]
            rec["grad_max_rel_diff"] = max(diffs) if diffs else None
            rec["first_loss"] = ranks[p - 1][key]["first_loss"]
            for side in ("dtrain", "peer"):
                s = r0[side]
                per_rank = [ranks[r][key][side] for r in range(p)]
                bub = [x["bubble"] for x in per_rank]
                rec[side] = {
                    "system": s["system"],
                    "schedule": s["schedule"],
                    "samples_per_s": b * args["steps"] / sum(s["round_s"]),
                    "round_samples_per_s": [b * n / t for n, t in zip(_round_sizes(args), s["round_s"])],
                    "bubble_per_rank": bub if None not in bub else None,
                    "bubble_mean": sum(bub) / p if None not in bub else None,
                    "saved_mib_per_rank": [x["saved_bytes"] / 2**20 for x in per_rank],
                    "bytes_sent_per_step_per_rank": [x["bytes_sent_per_step"] for x in per_rank],
                    "in_flight_per_rank": [x["in_flight"] for x in per_rank],
                }
            rec["ratio"] = rec["dtrain"]["samples_per_s"] / rec["peer"]["samples_per_s"]
            out[key] = rec
    return out


def _round_sizes(args: dict[str, Any]) -> list[int]:
    r, n = args["rounds"], args["steps"]
    return [n // r + (k < n % r) for k in range(r)]


def _print(results: dict[str, Any], args: dict[str, Any]) -> None:
    p = args["nprocs"]
    for w in args["workloads"]:
        print()
        head = (
            f"{'pair':<13} {'dtrain':>11} {'peer':>18} {'dtrain/s':>9} {'peer/s':>9} {'ratio':>6} "
            f"{'bubble':>6} {'closed':>6} {'sim':>6} {'grad diff':>9}"
        )
        print(
            f"== {w}: batch {args['batch_size']}, M={args['microbatches']}, P={p} (samples/s; ratio dtrain/peer; "
            f"bubble: dtrain's measured, mean over ranks; sim: tb = 2 tf)"
        )
        print(head)
        for pair in args["pairs"]:
            r = results[f"{w}/{pair}"]
            d, q = r["dtrain"], r["peer"]
            gd = "n/a" if r["grad_max_rel_diff"] is None else f"{r['grad_max_rel_diff']:.1e}"
            print(
                f"{pair:<13} {d['schedule']:>11} {q['system'] + ' ' + q['schedule']:>18} "
                f"{d['samples_per_s']:9.1f} {q['samples_per_s']:9.1f} {r['ratio']:6.3f} "
                f"{d['bubble_mean']:6.3f} {r['bubble_closed_form']:6.3f} {r['bubble_simulated_tb2tf']:6.3f} "
                f"{gd:>9}"
            )
        print(f"-- {w} per rank: measured bubble; peak MiB autograd saved for backward (params excluded); cut")
        for pair in args["pairs"]:
            r = results[f"{w}/{pair}"]
            for side in ("dtrain", "peer"):
                s = r[side]
                bub = " ".join(f"{x:.2f}" for x in s["bubble_per_rank"]) if s["bubble_per_rank"] else "-"
                mem = " ".join(f"{x:6.2f}" for x in s["saved_mib_per_rank"])
                name = f"{s['system']} {s['schedule']}"
                cut = f"  cut {r['sizes']}" if side == "dtrain" else ""
                print(f"  {pair:<12} {name:<19} bubble [{bub}]  saved MiB [{mem}]{cut}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nprocs", type=int, default=4, help="processes = pipeline ranks P (default: 4)")
    ap.add_argument("--workloads", default="gpt,mlp", help="comma-separated: gpt,mlp")
    ap.add_argument("--pairs", default=",".join(PAIRS), help="comma-separated: " + ",".join(PAIRS))
    ap.add_argument("--gpt-model", default="gpt-small")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument(
        "--interleaved-layers",
        type=int,
        default=8,
        help="GPT blocks for the interleaved pair, so that each of the 2P virtual stages gets one "
        "(default: 8; 0: the preset's)",
    )
    ap.add_argument("--mlp-depth", type=int, default=16, help="Linear layers, the last one the head (default: 16)")
    ap.add_argument("--mlp-width", type=int, default=512)
    ap.add_argument("--classes", type=int, default=10, help="MLP outputs (default: 10)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--microbatches", type=int, default=8, help="M (default: 8)")
    ap.add_argument("--balance", default="params", help="how the cut is chosen, for both systems (default: params)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per system (default: 20)")
    ap.add_argument("--warmup", type=int, default=3, help="discarded steps per system (default: 3)")
    ap.add_argument("--rounds", type=int, default=6, help="alternating rounds the timed steps are split into")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds a dtrain send or receive may block")
    ap.add_argument("--json", default=None, help="also write every figure (bubbles, memory, bytes) here")
    ap.add_argument("--out", default=None, help="write the harness's result file (JSON) here")
    ap.add_argument("--quick", action="store_true", help="a quick run: small batches, 5 rounds of a step")
    a = ap.parse_args(argv)
    if a.quick:
        a.seq_len, a.batch_size, a.steps, a.warmup, a.rounds, a.mlp_width = 32, 16, 5, 1, 5, 256
    workloads = [s for s in a.workloads.split(",") if s]
    pairs = [s for s in a.pairs.split(",") if s]
    for s in workloads:
        if s not in WORKLOADS:
            ap.error(f"unknown workload {s!r}; choose from {','.join(WORKLOADS)}")
    for s in pairs:
        if s not in PAIRS:
            ap.error(f"unknown pair {s!r}; choose from {','.join(PAIRS)}")
    if a.nprocs < 2:
        ap.error("--nprocs must be >= 2 (one pipeline stage per process)")
    if a.batch_size % a.microbatches:
        ap.error(f"--microbatches {a.microbatches} must divide --batch-size {a.batch_size}")
    if a.microbatches < a.nprocs:
        ap.error(f"--microbatches must be >= --nprocs ({a.nprocs}): torch's Schedule1F1B needs M >= stages")
    if a.steps < 1 or a.rounds < 1 or a.warmup < 1:
        ap.error("--steps, --rounds and --warmup must be >= 1 (the first warm-up step checks the gradients)")
    a.rounds = min(a.rounds, a.steps)

    args = dict(vars(a), workloads=workloads, pairs=pairs)
    print(
        f"torch {torch.__version__}, python {platform.python_version()}, {platform.machine()}, "
        f"{a.nprocs} processes x 1 intra-op thread, gloo on loopback, CPU"
    )
    print(
        f"{a.warmup} warm-up + {a.steps} timed steps per system in {a.rounds} alternating rounds; "
        f"gpt: {a.gpt_model} seq_len {a.seq_len} (interleaved: {a.interleaved_layers or 'preset'} layers); "
        f"mlp: {a.mlp_depth} x {a.mlp_width}; cut by {a.balance}"
    )
    from dtrain.measure.harness import Bar, Benchmark, command

    bench = Benchmark(
        "pipeline_vs_torch",
        title="Pipeline schedules against torch.distributed.pipelining",
        family="pipeline parallelism",
        workload=f"{a.nprocs} stages, batch {a.batch_size} in {a.microbatches} micro-batches; gpt: "
        f"{a.gpt_model} seq_len {a.seq_len}; mlp: {a.mlp_depth} x {a.mlp_width}; "
        f"{a.steps} timed steps a system in {a.rounds} rounds",
        metric="samples/s",
        higher_is_better=True,
        repeats=a.rounds,
        quick=a.quick,
        command=command("benchmarks/pipeline_vs_torch.py", argv),
        notes="The same cut (by parameters) for both systems; the two alternate round by round inside "
        "one launch. 2bw (asynchronous, weight stashing) has no torch peer: it is held against "
        "dtrain's own 1f1b. Four stage processes share this machine's cores, so the stages "
        "compete for them.",
    )
    t0 = time.perf_counter()
    bench.start()
    ranks = launch_loopback(_worker, (args,), a.nprocs)
    bench.stop()
    results = _summarize(ranks, args)
    _print(results, args)
    for w in workloads:
        for pair in pairs:
            r = results[f"{w}/{pair}"]
            ours, peer = (f"{r[k]['system']} {r[k]['schedule']}" for k in ("dtrain", "peer"))
            if ours == peer:
                ours, peer = f"{ours} (dtrain)", f"{peer} (peer)"
            bench.add_case(
                f"{w} {pair}",
                samples={ours: r["dtrain"]["round_samples_per_s"], peer: r["peer"]["round_samples_per_s"]},
                compare=[(ours, peer, Bar.at_least(1.0))],
            )
    wall = time.perf_counter() - t0
    rss = [ranks[r]["maxrss_mib"] for r in range(a.nprocs)]
    print(f"\nprocess peak RSS MiB (whole run): {' '.join(f'{x:.0f}' for x in rss)}; wall {wall:.0f}s")
    bench.report(a.out)
    if not a.json:
        return 0
    path = Path(a.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "versions": {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine()},
        "config": {k: v for k, v in args.items() if k != "json"},
        "results": results,
        "maxrss_mib_per_rank": rss,
        "wall_s": wall,
    }
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
