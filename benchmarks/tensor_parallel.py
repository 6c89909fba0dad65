"""dtrain.tensor_parallel beside torch's DTensor tensor parallelism: step time, bytes, memory.

One launch of ``--tp`` processes (``dtrain.launch.agent.launch``, MASTER_ADDR 127.0.0.1, gloo on loopback,
CPU, one intra-op thread each) is one tensor-parallel group. Inside it every system is built from
the same seed (``dtrain.workloads.models.build_model(--model, seq_len, vocab_size=256)``) and trained with
plain SGD (``--lr``) on the same fixed batches (``--batch`` x ``--seq-len`` tokens, the whole batch
on every rank, as tensor parallelism has it):

* ``dtrain``    ``tp.parallelize(model, tp.plans.gpt, None)`` (Megatron's split: fused qkv colwise:3
  by heads, attn.proj rowwise, fc1 colwise, fc2 rowwise, embed.tok and head by vocabulary), loss
  ``tp.vocab_parallel_cross_entropy(model(x), y, model.head)`` (logits never gathered)
* ``dtrain sp`` the same with ``tp.plans.gpt_sequence_parallel()``, ``sequence_parallel=True`` and
  ``tp.sync_replicated_grads(model)`` after backward (not a peer's pair; for its bytes and memory)
* ``torch``     ``torch.distributed.tensor.parallel.parallelize_module`` over
  ``init_device_mesh("cpu", (tp,))`` with the equivalent plan: ``embed.tok``
  ``RowwiseParallel(input_layouts=Replicate())`` (vocab-split embedding), per block ``attn.qkv``
  ``ColwiseParallel``, ``attn.proj`` ``RowwiseParallel``, ``mlp.fc1`` ``ColwiseParallel``,
  ``mlp.fc2`` ``RowwiseParallel``, ``head`` ``ColwiseParallel(output_layouts=Shard(-1),
  use_local_output=False)``, loss ``F.cross_entropy`` under ``loss_parallel()`` (backward inside it
  too; the logits stay split). gpt's qkv is ONE fused Linear(d, 3d) whose rows are [q; k; v];
  ColwiseParallel hands rank r the r-th contiguous 1/tp of all 3d rows (at tp = 2 rank 0 would
  get all of q and half of k), the wrong rows. So before splitting, the torch copy's qkv rows (and
  bias) are permuted to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] (q_r: the rows of rank r's heads), after
  which rank r's contiguous chunk is its heads' q, k and v, and each attention's ``heads`` is set
  to heads / tp (gpt's attention takes its width from qkv's local output).

Correctness: the step-0 loss of each system (before any update) against the unsplit model's loss
in one process (computed on every rank), max |diff| over ranks; and the last step's loss of dtrain
against torch after the same updates.

Timing: ``--warmup`` discarded steps per system, then ``--steps`` timed steps per system in
``--rounds`` rounds; each round runs every system's share between barriers, the order rotated
by one each round. A step is ``zero_grad(); forward; loss; backward; [sync]; SGD step``. The
figure is the median of rank 0's per-step times; speed = torch ms / dtrain ms (>= 1: dtrain faster).

Bytes: ``tp.tp_group_of(model).bytes_sent()`` across each timed step, per rank, against the closed
form (ring allreduce sends ``2(P-1)/P`` of its bytes, allgather / reduce-scatter ``(P-1)/P``), b
batch, s sequence, h width, L layers, fp32:

* plain: ``(4L + 2)`` allreduces of ``b s h`` (forward: attn.proj and fc2 per block, the vocab
  embedding; backward: the qkv and fc1 inputs per block, the head's input) + 3 of ``b s`` (cross
  entropy's max, sum of exponentials, target logit);
* sequence parallel: ``10L + 6`` allgathers / reduce-scatters of ``b s h`` (per block 4 in each
  direction, and qkv's and fc1's inputs gathered again in backward instead of kept; the head's
  allgather, its backward re-gather and reduce-scatter; the embedding's allreduce as two; block0's
  split, allgathered in backward) + the 3 cross-entropy allreduces + one allreduce of the replicated
  gradients summed over the sequence shards (``6h`` per block: ln1, ln2, proj and fc2 biases; ``2h``
  for ln_f).

Memory (the launch at ``--tp``, and the unsplit model in the same process as tp = 1): parameter
bytes = the storages of this rank's parameters, against ``split/tp + replicated`` (split: embed.tok,
qkv, proj.weight, fc1, fc2.weight, head; replicated: embed.pos, the norms, proj and fc2 biases);
activations = the bytes autograd saves in one forward + loss (``saved_tensors_hooks``: numel *
element_size of every packed tensor, each distinct tensor once by (address, numel, dtype),
parameters and views of them excluded; a DTensor counted by its local shard), one more step per
system after the timed ones.

Run::

    python benchmarks/tensor_parallel.py --tp 2 --out benchmarks/results/tensor_vs_dtensor_tp2.json
    python benchmarks/tensor_parallel.py --tp 4 --out benchmarks/results/tensor_vs_dtensor_tp4.json

``--out`` writes the harness's result file (:mod:`dtrain.measure.harness`): a round's figure is rank 0's
time for that round's steps of a system (barrier to barrier) per step; the ratio torch / dtrain per round;
the bar >= 1.0x. ``--json`` writes every figure above (bytes, memory, losses) as a separate file.

Timings on a shared machine are indicative; run it on a quiet one for figures.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _loopback import launch_loopback
from torch import nn

VOCAB = 256
SYSTEMS = ("dtrain", "dtrain sp", "torch")
#: parameter names (suffixes) split by the plan; every other parameter is replicated
SPLIT = (
    "embed.tok.weight",
    "attn.qkv.weight",
    "attn.qkv.bias",
    "attn.proj.weight",
    "mlp.fc1.weight",
    "mlp.fc1.bias",
    "mlp.fc2.weight",
    "head.weight",
    "head.bias",
)


def _model(args: dict[str, Any]) -> nn.Sequential:
    from dtrain.workloads.models import build_model

    torch.manual_seed(args["seed"])
    return build_model(args["model"], seq_len=args["seq_len"], vocab_size=VOCAB)


def _batches(args: dict[str, Any], count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A few fixed batches, the same on every rank, cycled through the steps."""
    g = torch.Generator().manual_seed(args["seed"] + 1)
    shape = (args["batch"], args["seq_len"])
    return [(torch.randint(VOCAB, shape, generator=g), torch.randint(VOCAB, shape, generator=g)) for _ in range(count)]


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _ptr(t: torch.Tensor) -> int:
    try:
        return int(_local(t).untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return 0


def _param_bytes(module: nn.Module) -> int:
    """Bytes of the storages of this rank's parameters (a DTensor's local shard), each storage once."""
    seen: set[int] = set()
    n = 0
    for p in module.parameters():
        st = _local(p).untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            n += st.nbytes()
    return n


class _SavedBytes:
    """numel * element_size of the tensors autograd packs in a forward, each distinct tensor once, parameters
    (and views of their storage) excluded, a DTensor by its local shard."""

    def __init__(self, module: nn.Module) -> None:
        self.params = {_ptr(p) for p in module.parameters()}
        self.seen: set[tuple[int, int, torch.dtype]] = set()
        self.total = 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        loc = _local(t)
        ptr = _ptr(loc)
        key = (loc.data_ptr() if ptr else id(loc), loc.numel(), loc.dtype)
        if ptr not in self.params and key not in self.seen:
            self.seen.add(key)
            self.total += loc.numel() * loc.element_size()
        return t

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)


# ----------------------------------------------------------------------------- the systems


def _permute_qkv(net: nn.Sequential, tp: int) -> None:
    """Reorder each fused qkv's output rows [q; k; v] to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] (x_r: rank r's heads),
    so that ColwiseParallel's contiguous chunk r is rank r's heads' q, k and v; give attention heads / tp."""
    from dtrain.workloads.models.gpt import CausalSelfAttention

    for m in net.modules():
        if isinstance(m, CausalSelfAttention):
            with torch.no_grad():
                for t in (m.qkv.weight, m.qkv.bias):
                    blocks = [b.chunk(tp, 0) for b in t.chunk(3, 0)]
                    t.copy_(torch.cat([blocks[c][r] for r in range(tp) for c in range(3)], 0))
            m.heads //= tp


class _System:
    def __init__(self, name: str, args: dict[str, Any]) -> None:
        import torch.distributed as dist

        import dtrain.tensor_parallel as tp

        self.name, self.tp = name, tp
        net = _model(args)
        self.sp = name == "dtrain sp"
        if name.startswith("dtrain"):
            plan = tp.plans.gpt_sequence_parallel() if self.sp else tp.plans.gpt
            self.model = tp.parallelize(net, plan, None, sequence_parallel=self.sp)
            self.group: Any = tp.tp_group_of(self.model)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import Replicate, Shard
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            size = dist.get_world_size()
            _permute_qkv(net, size)
            tplan: dict[str, Any] = {
                "embed.tok": RowwiseParallel(input_layouts=Replicate()),  # vocabulary-split embedding
                "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),  # for loss_parallel
            }
            for i in range(net.gpt_config.layers):  # type: ignore[union-attr]
                tplan[f"block{i}.attn.qkv"] = ColwiseParallel()
                tplan[f"block{i}.attn.proj"] = RowwiseParallel()
                tplan[f"block{i}.mlp.fc1"] = ColwiseParallel()
                tplan[f"block{i}.mlp.fc2"] = RowwiseParallel()
            self.model = parallelize_module(net, init_device_mesh("cpu", (size,)), tplan)
            self.group = None
        self.opt = torch.optim.SGD(self.model.parameters(), lr=args["lr"])

    def forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and loss (dtrain); torch's must run inside ``loss_parallel`` (see :meth:`step`)."""
        if self.group is not None:
            return self.tp.vocab_parallel_cross_entropy(self.model(x), y, self.model.head)
        logits = self.model(x)
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

    def step(self, x: torch.Tensor, y: torch.Tensor, saved: _SavedBytes | None = None) -> float:
        from contextlib import nullcontext

        from torch.distributed.tensor.parallel import loss_parallel

        self.opt.zero_grad()
        with nullcontext() if self.group is not None else loss_parallel():
            with saved.hooks() if saved is not None else nullcontext():
                loss = self.forward_loss(x, y)
            loss.backward()
        if self.sp:
            self.tp.sync_replicated_grads(self.model)
        self.opt.step()
        return float(_full(loss.detach()))

    def bytes_sent(self) -> int | None:
        return self.group.bytes_sent() if self.group is not None else None


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _worker(args: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    data = _batches(args)
    # the unsplit model in this process: the step-0 loss oracle and the tp = 1 memory baseline
    full = _model(args)
    x0, y0 = data[0]
    ref_saved = _SavedBytes(full)
    with ref_saved.hooks():
        ref_loss = F.cross_entropy(full(x0).reshape(-1, VOCAB), y0.reshape(-1))
    ref_loss.backward()
    split = sum(p.numel() * p.element_size() for n, p in full.named_parameters() if n.endswith(SPLIT))
    base = {
        "loss": float(ref_loss.detach()),
        "param_bytes": _param_bytes(full),
        "saved_bytes": ref_saved.total,
        "split_param_bytes": split,
    }
    del full

    systems = [_System(name, args) for name in args["systems"]]
    res: dict[str, Any] = {s.name: {"losses": [], "step_s": [], "bytes": []} for s in systems}
    steps = dict.fromkeys(args["systems"], 0)

    def run(s: _System, n: int, rec: dict[str, Any] | None = None) -> float:
        loss = float("nan")
        for _ in range(n):
            x, y = data[steps[s.name] % len(data)]
            b0, t0 = s.bytes_sent(), time.perf_counter()
            loss = s.step(x, y)
            if rec is not None:
                rec["step_s"].append(time.perf_counter() - t0)
                b1 = s.bytes_sent()
                rec["bytes"].append(None if b0 is None or b1 is None else b1 - b0)
            steps[s.name] += 1
        return loss

    for s in systems:
        res[s.name]["loss0"] = run(s, 1)
        run(s, args["warmup"] - 1)
        res[s.name]["param_bytes"] = _param_bytes(s.model)
    rounds = [args["steps"] // args["rounds"] + (k < args["steps"] % args["rounds"]) for k in range(args["rounds"])]
    for r, n in enumerate(rounds):
        for i in range(len(systems)):
            s = systems[(i + r) % len(systems)]
            dist.barrier()
            t0 = time.perf_counter()
            run(s, n, res[s.name])
            dist.barrier()
            res[s.name].setdefault("round_ms_per_step", []).append(1e3 * (time.perf_counter() - t0) / n)
    for s in systems:
        saved = _SavedBytes(s.model)
        x, y = data[steps[s.name] % len(data)]
        res[s.name]["last_loss"] = s.step(x, y, saved)
        steps[s.name] += 1
        res[s.name]["saved_bytes"] = saved.total
    import resource

    return {"base": base, "systems": res, "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


# ----------------------------------------------------------------------------- closed forms and report


def closed_bytes(*, b: int, s: int, h: int, layers: int, p: int, sequence_parallel: bool) -> float:
    """Bytes one rank sends per training step on the tensor-parallel group (see the module docstring)."""
    if p == 1:
        return 0.0
    act, ce = 4 * b * s * h, 4 * b * s
    allreduce, half = 2 * (p - 1) / p, (p - 1) / p
    if not sequence_parallel:
        return allreduce * ((4 * layers + 2) * act + 3 * ce)
    replicated = 4 * (6 * h * layers + 2 * h)
    return half * (10 * layers + 6) * act + allreduce * (3 * ce + replicated)


def _summarize(ranks: dict[int, dict[str, Any]], args: dict[str, Any]) -> dict[str, Any]:
    from dtrain.workloads.models.gpt import resolve_gpt_config

    p = args["tp"]
    cfg = resolve_gpt_config(args["model"], seq_len=args["seq_len"], vocab_size=VOCAB)
    base = ranks[0]["base"]
    replicated = base["param_bytes"] - base["split_param_bytes"]
    param_expected = base["split_param_bytes"] / p + replicated
    systems: dict[str, Any] = {}
    for name in args["systems"]:
        per = [ranks[r]["systems"][name] for r in range(p)]
        r0 = per[0]
        rec: dict[str, Any] = {
            "ms_median": 1e3 * statistics.median(r0["step_s"]),
            "step_ms_rank0": [1e3 * t for t in r0["step_s"]],
            "loss0_per_rank": [x["loss0"] for x in per],
            "loss0_max_diff_vs_one_process": max(abs(x["loss0"] - ranks[r]["base"]["loss"]) for r, x in enumerate(per)),
            "last_loss_per_rank": [x["last_loss"] for x in per],
            "param_bytes_per_rank": [x["param_bytes"] for x in per],
            "param_bytes_expected": param_expected,
            "saved_bytes_per_rank": [x["saved_bytes"] for x in per],
        }
        if name.startswith("dtrain"):
            closed = closed_bytes(
                b=args["batch"],
                s=args["seq_len"],
                h=cfg.d_model,
                layers=cfg.layers,
                p=p,
                sequence_parallel=name == "dtrain sp",
            )
            sent = sorted({b for x in per for b in x["bytes"]})
            rec.update(
                bytes_per_step_distinct=sent,
                bytes_closed_form=closed,
                bytes_equal_closed_form=sent == [int(closed)] and closed == int(closed),
            )
        systems[name] = rec
    last_d, last_t = systems["dtrain"]["last_loss_per_rank"], systems["torch"]["last_loss_per_rank"]
    return {
        "one_process": {
            "loss": base["loss"],
            "param_bytes": base["param_bytes"],
            "saved_bytes": base["saved_bytes"],
            "split_param_bytes": base["split_param_bytes"],
            "replicated_param_bytes": replicated,
        },
        "systems": systems,
        "speed_torch_over_dtrain": systems["torch"]["ms_median"] / systems["dtrain"]["ms_median"],
        "last_loss_max_diff_dtrain_vs_torch": max(abs(a - b) for a, b in zip(last_d, last_t)),
    }


def _print(out: dict[str, Any], args: dict[str, Any]) -> None:
    sy, p, mib = out["systems"], args["tp"], 2**20
    one = out["one_process"]
    print(
        f"\n-- step-0 loss (before any update), rank 0, and max |diff| over ranks from the unsplit model in one "
        f"process ({one['loss']:.6f}); last step ({args['warmup'] + args['steps'] + 1})"
    )
    for name, r in sy.items():
        print(
            f"  {name:<10} {r['loss0_per_rank'][0]:.6f}  diff {r['loss0_max_diff_vs_one_process']:.1e}   "
            f"last {r['last_loss_per_rank'][0]:.6f}"
        )
    print(f"  last-step |dtrain - torch| max over ranks: {out['last_loss_max_diff_dtrain_vs_torch']:.1e}")
    d, t = sy["dtrain"], sy["torch"]
    print(f"\n== tp {p}: step time (median of {args['steps']} steps, rank 0), bytes per step per rank on the tp group")
    print(f"{'tp':>3} {'dtrain ms':>9} {'torch ms':>8} {'speed':>6}  {'sent MiB':>9} {'closed MiB':>10} {'equal':>5}")
    print(
        f"{p:>3} {d['ms_median']:9.1f} {t['ms_median']:8.1f} {out['speed_torch_over_dtrain']:6.2f}  "
        f"{max(d['bytes_per_step_distinct']) / mib:9.4f} {d['bytes_closed_form'] / mib:10.4f} "
        f"{str(d['bytes_equal_closed_form']):>5}"
    )
    sp = sy.get("dtrain sp")
    if sp is not None:
        print(
            f"  (dtrain sp: {sp['ms_median']:.1f} ms, {max(sp['bytes_per_step_distinct']) / mib:.4f} MiB sent, "
            f"closed form {sp['bytes_closed_form'] / mib:.4f}, equal {sp['bytes_equal_closed_form']})"
        )
    print(
        f"\n== memory per rank (rank 0), MiB; tp = 1 is the unsplit model; expected params = split/{p} + replicated "
        f"({one['split_param_bytes'] / mib:.3f}/{p} + {one['replicated_param_bytes'] / mib:.3f})"
    )
    print(
        f"{'system':<14} {'params':>7} {'expected':>8} {'ratio':>6}  {'activations':>11} {'vs tp=1':>7} {'vs plain':>8}"
    )
    print(
        f"{'tp=1':<14} {one['param_bytes'] / mib:7.3f} {one['param_bytes'] / mib:8.3f} {1.0:6.3f}  "
        f"{one['saved_bytes'] / mib:11.3f} {1.0:7.3f}"
    )
    plain = d["saved_bytes_per_rank"][0]
    for name, r in sy.items():
        pb, sb = r["param_bytes_per_rank"][0], r["saved_bytes_per_rank"][0]
        label = f"{name} tp={p}"
        print(
            f"{label:<14} {pb / mib:7.3f} {r['param_bytes_expected'] / mib:8.3f} "
            f"{pb / r['param_bytes_expected']:6.3f}  {sb / mib:11.3f} {sb / one['saved_bytes']:7.3f} "
            f"{sb / plain:8.3f}"
        )


def main(argv: list[str] | None = None) -> int:
    from dtrain.measure.harness import Bar, Benchmark, add_result_flags, command

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2, help="processes = tensor-parallel size (default: 2)")
    ap.add_argument("--model", default="gpt-small")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step, on every rank (default: 8)")
    ap.add_argument("--steps", type=int, default=12, help="timed steps per system (default: 12)")
    ap.add_argument("--warmup", type=int, default=2, help="discarded steps per system (default: 2)")
    ap.add_argument("--rounds", type=int, default=6, help="alternating rounds the timed steps are split into")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write every figure (bytes, memory, losses) here")
    add_result_flags(ap)
    a = ap.parse_args(argv)
    if a.tp < 2:
        ap.error("--tp must be >= 2 (tp = 1 is measured in every process as the baseline)")
    if a.warmup < 1 or a.steps < 1 or a.rounds < 1:
        ap.error("--warmup, --steps and --rounds must be >= 1")
    a.rounds = min(a.rounds, a.steps)
    args = dict(vars(a), systems=list(SYSTEMS))
    print(
        f"torch {torch.__version__}, python {platform.python_version()}, {platform.machine()}, "
        f"{a.tp} processes x 1 intra-op thread, gloo on loopback, CPU"
    )
    print(
        f"{a.model} batch {a.batch} x {a.seq_len} tokens on every rank, SGD lr {a.lr}; {a.warmup} warm-up + "
        f"{a.steps} timed steps per system in {a.rounds} rotating rounds; torch loss: loss_parallel"
    )
    bench = Benchmark(
        f"tensor_vs_dtensor_tp{a.tp}",
        title=f"Tensor parallelism at tp {a.tp} against DTensor",
        family="tensor parallelism",
        workload=f"{a.model}, batch {a.batch} x {a.seq_len} tokens on every rank, SGD, {a.tp} "
        f"processes; {a.steps} timed steps a system in {a.rounds} rounds",
        metric="ms/step",
        higher_is_better=False,
        repeats=a.rounds,
        quick=a.quick,
        command=command("benchmarks/tensor_parallel.py", argv),
        notes="torch's side: parallelize_module with the equivalent Megatron plan and loss_parallel; "
        "the systems run in rotated rounds inside one launch.",
    )
    t0 = time.perf_counter()
    bench.start()
    ranks = launch_loopback(_worker, (args,), a.tp)
    bench.stop()
    out = _summarize(ranks, args)
    _print(out, args)
    per_round = {n: ranks[0]["systems"][n]["round_ms_per_step"] for n in ("dtrain", "torch")}
    bench.add_case(
        f"tp {a.tp}",
        samples={"dtrain": per_round["dtrain"], "DTensor": per_round["torch"]},
        compare=[("dtrain", "DTensor", Bar.at_least(1.0))],
    )
    wall = time.perf_counter() - t0
    rss = [ranks[r]["maxrss_mib"] for r in range(a.tp)]
    print(f"\nprocess peak RSS MiB: {' '.join(f'{x:.0f}' for x in rss)}; wall {wall:.0f}s")
    bench.report(a.out)
    if a.json:
        path = Path(a.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "versions": {
                "torch": torch.__version__,
                "python": platform.python_version(),
                "machine": platform.machine(),
            },
            "config": {k: v for k, v in args.items() if k != "json"},
            "results": out,
            "maxrss_mib_per_rank": rss,
            "wall_s": wall,
        }
        path.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {path}")
    failed = [n for n, r in out["systems"].items() if r.get("bytes_equal_closed_form") is False]
    if failed:
        print(f"bytes differ from the closed form: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
