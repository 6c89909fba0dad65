"""dtrain.ShardedDataParallel (ZeRO stages 1-3) beside torch's and DeepSpeed's sharding: time, bytes, memory.

One launch of ``--nprocs`` processes (``dtrain.launch.agent.launch``, MASTER_ADDR 127.0.0.1, gloo on
loopback, CPU, one intra-op thread each). Inside it every system below is built from the same
seed (``_models.build(--model, seq_len, vocab_size=256)``: dtrain's gpt-small, or ``hf-llama-small``, a
transformers Llama dtrain did not write), trained with Adam
(``--lr``, torch's defaults otherwise) on the same per-rank batches (``--batch-size`` global,
split over the ranks), loss = cross entropy over ``logits.reshape(-1, vocab)``; ``--systems`` picks some:

* ``dtrain dp``     ``dtrain.DataParallel`` (stage 0, reference row)
* ``dtrain z1/z2/z3`` ``dtrain.ShardedDataParallel(shard="optimizer"|"gradients"|"parameters")``,
  Adam over ``dp.parameters()`` (this rank's flat shards)
* ``torch ddp``     ``DistributedDataParallel`` (reference row)
* ``torch ddp+zero`` DDP with ``torch.distributed.optim.ZeroRedundancyOptimizer(Adam)``: ZeRO-1, its
  usual use. torch has no stage-2-only form, so it is stage 2's torch peer as well.
* ``torch fsdp2``   ``torch.distributed.fsdp.fully_shard`` on each ``block*`` child (a transformers model's
  decoder layers), then on the root (embed, ln_f and head fall in the root's group): ZeRO-3
* ``deepspeed z1/z2/z3`` where ``import deepspeed`` works (``--deepspeed auto``): ``deepspeed.initialize``
  with ``zero_optimization.stage`` 1/2/3 and its defaults, fp32, ``Adam`` with ``torch_adam: true,
  adam_w_mode: false`` (``torch.optim.Adam``; DeepSpeed's "Adam" is AdamW with weight decay 0.01
  unless told), ``gradient_clipping: 0`` (its default clips at 1.0), on its CPU accelerator over the
  existing gloo group

Timing: ``--warmup`` discarded steps per system, then ``--steps`` timed steps per system in
``--rounds`` rounds; each round runs every system's share of steps between barriers, the order of
the systems rotated by one each round so that a slow spell of a shared machine hits all alike. A
step is ``zero_grad(); loss.backward(); step()`` (DeepSpeed: ``engine.backward``, ``engine.step``);
dtrain's stages 1-2 allgather the stepped shards in the next forward, so a timed step holds one
reduce-scatter and one allgather as the peers' do. The figure is the median of rank 0's per-step
times; speed = peer ms / dtrain ms (>= 1: dtrain faster).

Bytes: ``step_stats()["bytes_sent"]`` of dtrain's last timed step, per rank, against the closed
form of a ring, with ``Psi_pad`` = the sum of the units' padded sizes: one allreduce
(reduce-scatter + allgather) ``2 (P-1)/P * 4 Psi_pad`` for stages 1-2 (and ``4 Psi`` for
DataParallel's buckets), ``3 (P-1)/P * 4 Psi_pad`` for stage 3 (an allgather in the forward, one in
the backward, a reduce-scatter).

Losses: the local loss of the first two warm-up steps on every rank (the second after one update;
same init, same batches) and of the last step, each beside its largest difference from ``dtrain dp``.

Memory (dtrain, after the ``--warmup`` steps, i.e. after ``optimizer.step()`` with the gradients
still held): stages 1-3 from ``dp.memory_stats(opt)``; stage 0 counts the unique storages of the
parameters, their ``.grad`` (views into DataParallel's buckets) with the bucket buffers, and Adam's
state. Closed forms for ``Psi`` float32 parameters, Adam and ``N`` ranks (ZeRO paper, sec. 5):
``16 Psi``, ``8 Psi + 8 Psi/N``, ``4 Psi + 12 Psi/N``, ``16 Psi/N`` + the gathered units in flight.
For stage 3 the measured figure adds ``gathered_peak`` (the most unit bytes held gathered at once
so far) to the bytes held after the step, and its closed form adds the two largest adjacent units
(the unit computing and the one prefetched beside it). Activations: the bytes autograd saves for
backward in one forward (tensor storages once each, parameters excluded), per rank, one more step
per system; unchanged by ZeRO.

Run::

    python benchmarks/sharded.py                       # 4 processes, gpt-small, every system
    python benchmarks/sharded.py --steps 6 --rounds 2  # shorter
    python benchmarks/sharded.py --deepspeed off --out benchmarks/results/sharded_vs_torch.json
    python benchmarks/sharded.py --model hf-llama-small --nprocs 2 --seq-len 128 --deepspeed off \
        --systems 'dtrain dp,dtrain z3,torch ddp,torch fsdp2' \
        --out benchmarks/results/sharded_vs_torch_hf_llama_small.json

``--out`` writes the harness's result file (:mod:`dtrain.measure.harness`): a round's figure is rank 0's
time for that round's steps of a system (barrier to barrier) per step; the ratio peer / dtrain per round;
the bar >= 1.0x. ``--json`` writes every figure above (bytes, memory, losses) as a separate file.
    PYTHONPATH=/tmp/dslib python benchmarks/sharded.py # with DeepSpeed installed out of the venv

Timings on a shared machine are indicative; run it on a quiet one for figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _loopback import launch_loopback, pin_to_core
from _models import HF_MODELS, LANGUAGE, blocks, build
from torch import nn

VOCAB = 256
DTRAIN = {"dtrain dp": None, "dtrain z1": "optimizer", "dtrain z2": "gradients", "dtrain z3": "parameters"}
TORCH = ("torch ddp", "torch ddp+zero", "torch fsdp2")
DEEPSPEED = ("deepspeed z1", "deepspeed z2", "deepspeed z3")
UNITS_NOTE = (
    " dtrain's units are its defaults (what --strategy dp --shard parameters uses): the embedding, each "
    "decoder layer, the final norm and the head."
)
#: (dtrain system, its peer, what the peer is)
PAIRS = (
    ("dtrain dp", "torch ddp", "stage 0: DDP"),
    ("dtrain z1", "torch ddp+zero", "stage 1: ZeroRedundancyOptimizer"),
    ("dtrain z2", "torch ddp+zero", "stage 2: torch has none; ZeRO-1"),
    ("dtrain z3", "torch fsdp2", "stage 3: FSDP2"),
    ("dtrain z1", "deepspeed z1", "stage 1: DeepSpeed"),
    ("dtrain z2", "deepspeed z2", "stage 2: DeepSpeed"),
    ("dtrain z3", "deepspeed z3", "stage 3: DeepSpeed"),
)


def _deepspeed_version() -> str | None:
    try:
        import deepspeed
    except Exception:  # noqa: BLE001 - any import failure means "not available here"
        return None
    return str(deepspeed.__version__)


# ----------------------------------------------------------------------------- data and counting


def _model(args: dict[str, Any]) -> nn.Module:
    torch.manual_seed(args["seed"])
    return build(args["model"], seq_len=args["seq_len"], vocab_size=VOCAB)


def _loss(output: Any, y: torch.Tensor) -> torch.Tensor:
    from dtrain.workloads.models import logits_of

    return F.cross_entropy(logits_of(output).reshape(-1, VOCAB), y.reshape(-1))


def _batches(args: dict[str, Any], rank: int, world: int, count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's ``batch / world`` samples of a few fixed global batches, cycled through the steps."""
    g = torch.Generator().manual_seed(args["seed"] + 1)
    b, s = args["batch_size"], args["seq_len"]
    local = b // world
    out = []
    for _ in range(count):
        x, y = torch.randint(VOCAB, (b, s), generator=g), torch.randint(VOCAB, (b, s), generator=g)
        out.append((x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]))
    return out


def _storage_bytes(tensors: Any, seen: set[int]) -> int:
    """Bytes of the storages of ``tensors`` not in ``seen`` (which it extends): each storage once."""
    n = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        st = t.untyped_storage()
        if st.nbytes() == 0 or st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        n += st.nbytes()
    return n


def _ptr(t: torch.Tensor) -> int:
    """``t``'s storage address; 0 where it has no plain storage (a DTensor, a freed or meta tensor)."""
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return 0


class _SavedBytes:
    """Bytes of the storages autograd saves in a forward, each once, parameters' storages excluded."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.seen: set[int] = set()
        self.total = 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_leaf and t.requires_grad:
            return t
        ptr = _ptr(t)
        params = {_ptr(p) for p in self.module.parameters()}  # now: stage 3 and FSDP2 gather them anew
        if ptr and ptr not in self.seen and ptr not in params:
            self.seen.add(ptr)
            self.total += t.untyped_storage().nbytes()
        return t

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)


# ----------------------------------------------------------------------------- the systems


class _System:
    """One data-parallel system on this rank: ``step(x, y)`` runs a batch and the Adam update."""

    def __init__(self, name: str, args: dict[str, Any]) -> None:
        import torch.distributed as dist

        import dtrain

        self.name, self.engine, self.dp = name, None, None
        net = _model(args)
        lr = args["lr"]
        if name in DTRAIN:
            shard = DTRAIN[name]
            if shard is None:
                self.dp = dtrain.DataParallel(net, algorithm=args["algorithm"])
            else:
                self.dp = dtrain.ShardedDataParallel(
                    net, shard=shard, algorithm=args["algorithm"], overlap=args["overlap"]
                )
            self.model: Any = self.dp
            self.opt: Any = torch.optim.Adam(self.dp.parameters(), lr=lr)
        elif name in ("torch ddp", "torch ddp+zero"):
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.model = DDP(net)
            if name == "torch ddp":
                self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)
            else:
                from torch.distributed.optim import ZeroRedundancyOptimizer

                self.opt = ZeroRedundancyOptimizer(self.model.parameters(), optimizer_class=torch.optim.Adam, lr=lr)
        elif name == "torch fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for block in blocks(net):
                fully_shard(block, mesh=mesh)
            fully_shard(net, mesh=mesh)
            self.model, self.opt = net, torch.optim.Adam(net.parameters(), lr=lr)
        elif name in DEEPSPEED:
            import deepspeed

            cfg = {
                "train_micro_batch_size_per_gpu": args["batch_size"] // dist.get_world_size(),
                "gradient_accumulation_steps": 1,
                "steps_per_print": 10**9,
                "gradient_clipping": 0.0,
                "optimizer": {"type": "Adam", "params": {"lr": lr, "torch_adam": True, "adam_w_mode": False}},
                "zero_optimization": {"stage": int(name[-1])},
            }
            self.engine, self.opt, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
            self.model = self.engine
            torch.set_num_threads(1)
        else:
            raise ValueError(f"unknown system {name!r}")
        self.net = net

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        if self.engine is not None:
            loss = _loss(self.engine(x), y)
            self.engine.backward(loss)
            self.engine.step()
            return float(loss.detach())
        self.opt.zero_grad()
        loss = _loss(self.model(x), y)
        loss.backward()
        self.opt.step()
        return float(loss.detach())

    def bytes_sent(self) -> int | None:
        return int(self.dp.step_stats()["bytes_sent"]) if self.dp is not None else None

    def memory(self) -> dict[str, int] | None:
        """dtrain only: model-state bytes this rank holds now, by kind."""
        if self.dp is None:
            return None
        if DTRAIN[self.name] is not None:
            return dict(self.dp.memory_stats(self.opt))
        seen: set[int] = set()
        params = list(self.net.parameters())
        buckets = [b.flat for b in getattr(getattr(self.dp, "_reducer", None), "_buckets", [])]
        return {
            "params": _storage_bytes(params, seen),
            "grads": _storage_bytes([*(p.grad for p in params), *buckets], seen),
            "optimizer": _storage_bytes([v for s in self.opt.state.values() for v in s.values()], seen),
            "gathered_peak": 0,
        }

    def close(self) -> None:
        if self.dp is not None:
            self.dp.close()


def _worker(args: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    torch.set_num_threads(1)
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)  # DeepSpeed's deprecated collective names
    warnings.filterwarnings("ignore", message=".*returned a view tensor")  # FSDP2 root: logits are used read-only
    rank, world = dist.get_rank(), dist.get_world_size()
    if args["pin"]:
        pin_to_core(rank)
    data = _batches(args, rank, world)
    systems = [_System(name, args) for name in args["systems"]]
    res: dict[str, Any] = {s.name: {"losses": [], "step_s": [], "round_s": []} for s in systems}
    steps = dict.fromkeys(args["systems"], 0)

    def run(s: _System, n: int, rec: dict[str, Any] | None = None) -> float:
        loss = float("nan")
        for _ in range(n):
            x, y = data[steps[s.name] % len(data)]
            t0 = time.perf_counter()
            loss = s.step(x, y)
            if rec is not None:
                rec["step_s"].append(time.perf_counter() - t0)
            steps[s.name] += 1
        return loss

    for s in systems:
        res[s.name]["losses"] = [run(s, 1) for _ in range(2)]
        run(s, args["warmup"] - 2)
        res[s.name]["memory"] = s.memory()  # after --warmup steps: Adam's state exists, gradients still held
    for r, n in enumerate(_round_steps(args)):
        for i in range(len(systems)):
            s = systems[(i + r) % len(systems)]
            dist.barrier()
            t0 = time.perf_counter()
            run(s, n, res[s.name])
            dist.barrier()
            res[s.name]["round_s"].append(time.perf_counter() - t0)
    for s in systems:
        res[s.name]["bytes_sent"] = s.bytes_sent()
        saved = _SavedBytes(s.net)
        with saved.hooks():
            res[s.name]["last_loss"] = run(s, 1)
        res[s.name]["saved_bytes"] = saved.total
    units = None
    for s in systems:
        if s.dp is not None and DTRAIN[s.name] is not None:
            units = [(u.name, u.numel, u.padded) for u in s.dp.units]
    for s in systems:
        s.close()
    import resource

    return {
        "systems": res,
        "units": units,
        "threads": torch.get_num_threads(),
        "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _round_steps(args: dict[str, Any]) -> list[int]:
    """The timed steps of each round (``--steps`` split as evenly as can be over ``--rounds``)."""
    return [args["steps"] // args["rounds"] + (k < args["steps"] % args["rounds"]) for k in range(args["rounds"])]


# ----------------------------------------------------------------------------- closed forms and report


def _closed_bytes(name: str, psi: int, psi_pad: int, p: int) -> float:
    shard = DTRAIN[name]
    if shard is None:
        return 2 * (p - 1) / p * 4 * psi
    return (3 if shard == "parameters" else 2) * (p - 1) / p * 4 * psi_pad


def _closed_memory(name: str, psi: int, n: int, units: list[tuple[str, int, int]]) -> float:
    shard = DTRAIN[name]
    if shard is None:
        return 16 * psi
    if shard == "optimizer":
        return 8 * psi + 8 * psi / n
    if shard == "gradients":
        return 4 * psi + 12 * psi / n
    pads = [pad for _, _, pad in units]
    in_flight = max(sum(pads[i : i + 2]) for i in range(max(1, len(pads) - 1)))
    return 16 * psi / n + 4 * in_flight


def _summarize(ranks: dict[int, dict[str, Any]], args: dict[str, Any]) -> dict[str, Any]:
    p = args["nprocs"]
    units = ranks[0]["units"]
    psi = sum(n for _, n, _ in units)
    psi_pad = sum(pad for _, _, pad in units)
    systems: dict[str, Any] = {}
    for name in args["systems"]:
        per = [ranks[r]["systems"][name] for r in range(p)]
        r0 = per[0]
        rec: dict[str, Any] = {
            "ms_median": 1e3 * statistics.median(r0["step_s"]),
            "ms_mean_rounds": 1e3 * sum(r0["round_s"]) / args["steps"],
            "step_ms_rank0": [1e3 * t for t in r0["step_s"]],
            "losses_per_rank": [x["losses"] for x in per],
            "last_loss_per_rank": [x["last_loss"] for x in per],
            "saved_mib_per_rank": [x["saved_bytes"] / 2**20 for x in per],
        }
        if name in DTRAIN:
            closed = _closed_bytes(name, psi, psi_pad, p)
            sent = [x["bytes_sent"] for x in per]
            rec.update(bytes_sent_per_rank=sent, bytes_closed_form=closed, bytes_ratio=max(sent) / closed)
            mem = [x["memory"] for x in per]
            held = [m["params"] + m["grads"] + m["optimizer"] + m["gathered_peak"] for m in mem]
            cm = _closed_memory(name, psi, p, units)
            rec.update(
                memory_per_rank=mem,
                model_state_bytes_per_rank=held,
                memory_closed_form=cm,
                memory_ratio_per_rank=[h / cm for h in held],
            )
        systems[name] = rec
    ref, last = systems["dtrain dp"]["losses_per_rank"], systems["dtrain dp"]["last_loss_per_rank"]
    for rec in systems.values():
        rec["loss_max_diff_vs_dtrain_dp"] = max(
            abs(a - b) for xs, ys in zip(rec["losses_per_rank"], ref) for a, b in zip(xs, ys)
        )
        rec["last_loss_max_diff_vs_dtrain_dp"] = max(abs(a - b) for a, b in zip(rec["last_loss_per_rank"], last))
    pairs = []
    for dt, peer, what in PAIRS:
        if dt in systems and peer in systems:
            speed = systems[peer]["ms_median"] / systems[dt]["ms_median"]
            pairs.append({"dtrain": dt, "peer": peer, "what": what, "speed": speed})
    return {"psi": psi, "psi_padded": psi_pad, "units": units, "systems": systems, "pairs": pairs}


def _print(out: dict[str, Any], args: dict[str, Any]) -> None:
    sy, p, mib = out["systems"], args["nprocs"], 2**20
    print(
        f"\n== step time (median of {args['steps']} steps, rank 0) and bytes per step per rank; "
        f"Psi {out['psi']:,}, Psi_pad {out['psi_padded']:,}"
    )
    print(
        f"{'dtrain':<10} {'ms':>7}  {'peer':<15} {'ms':>7} {'speed':>6}  {'MiB sent':>8} {'closed':>7} "
        f"{'ratio':>6}  peer is"
    )
    for pr in out["pairs"]:
        d, q = sy[pr["dtrain"]], sy[pr["peer"]]
        print(
            f"{pr['dtrain']:<10} {d['ms_median']:7.0f}  {pr['peer']:<15} {q['ms_median']:7.0f} {pr['speed']:6.2f}  "
            f"{max(d['bytes_sent_per_rank']) / mib:8.2f} {d['bytes_closed_form'] / mib:7.2f} "
            f"{d['bytes_ratio']:6.3f}  {pr['what']}"
        )
    n_last = args["warmup"] + args["steps"] + 1
    print(
        f"\n-- losses, rank 0: step 1, step 2 (after one update); max |diff| vs dtrain dp over ranks and both; "
        f"the same for step {n_last}"
    )
    for name, r in sy.items():
        ls = " ".join(f"{x:.6f}" for x in r["losses_per_rank"][0])
        print(
            f"  {name:<15} {ls}   {r['loss_max_diff_vs_dtrain_dp']:.1e}   step {n_last}: "
            f"{r['last_loss_per_rank'][0]:.6f} {r['last_loss_max_diff_vs_dtrain_dp']:.1e}"
        )
    print(
        f"\n== model-state memory per rank after {args['warmup']} steps, MiB (N = {p}; measured = params + grads "
        f"+ optimizer [+ gathered_peak, stage 3])"
    )
    print(
        f"{'system':<10} {'params':>7} {'grads':>7} {'adam':>7} {'gathered':>8} {'measured':>8} {'closed':>7} "
        f"{'ratio':>6}  closed form"
    )
    forms = {
        "dtrain dp": "16Psi",
        "dtrain z1": "8Psi+8Psi/N",
        "dtrain z2": "4Psi+12Psi/N",
        "dtrain z3": "16Psi/N+2 units",
    }
    for name in DTRAIN:
        if name not in sy:
            continue
        r = sy[name]
        m, held = r["memory_per_rank"][0], r["model_state_bytes_per_rank"]
        ratios = r["memory_ratio_per_rank"]
        print(
            f"{name:<10} {m['params'] / mib:7.2f} {m['grads'] / mib:7.2f} {m['optimizer'] / mib:7.2f} "
            f"{m['gathered_peak'] / mib:8.2f} {held[0] / mib:8.2f} {r['memory_closed_form'] / mib:7.2f} "
            f"{ratios[0]:6.3f}  {forms[name]}  (ratio over ranks {min(ratios):.3f}-{max(ratios):.3f})"
        )
    print("\n-- activations: MiB autograd saves in one forward, per rank (parameters excluded)")
    for name, r in sy.items():
        print(f"  {name:<15} " + " ".join(f"{x:6.2f}" for x in r["saved_mib_per_rank"]))


def main(argv: list[str] | None = None) -> int:
    from dtrain.measure.harness import Bar, Benchmark, add_result_flags, command

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nprocs", type=int, default=4, help="processes = data-parallel ranks (default: 4)")
    ap.add_argument(
        "--model",
        default="gpt-small",
        choices=LANGUAGE,
        help="dtrain's gpt-small (default) or a model dtrain did not write (hf-llama-small)",
    )
    ap.add_argument(
        "--systems", default="", help="comma-separated, among them dtrain dp and a ZeRO stage (default: every one)"
    )
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16, help="global batch, split over the ranks (default: 16)")
    ap.add_argument("--algorithm", default="ring", help="dtrain's collectives: ring or native (default: ring)")
    ap.add_argument("--overlap", default="backward", help="dtrain stages 1-2: backward or forward")
    ap.add_argument(
        "--deepspeed",
        default="auto",
        choices=("auto", "off"),
        help="auto: add DeepSpeed ZeRO 1-3 when it imports (default: auto)",
    )
    ap.add_argument("--steps", type=int, default=12, help="timed steps per system (default: 12)")
    ap.add_argument("--warmup", type=int, default=2, help="discarded steps per system (default: 2)")
    ap.add_argument("--rounds", type=int, default=6, help="rotating rounds the timed steps are split into")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pin", action="store_true", help="pin each rank's threads to a core of its own (every system)")
    ap.add_argument("--json", default=None, help="also write every figure (bytes, memory, losses) here")
    add_result_flags(ap)
    a = ap.parse_args(argv)
    if a.batch_size % a.nprocs:
        ap.error(f"--nprocs {a.nprocs} must divide --batch-size {a.batch_size}")
    if a.warmup < 2 or a.steps < 1 or a.rounds < 1:
        ap.error("--warmup must be >= 2 (the losses compared are the first two) and --steps, --rounds >= 1")
    a.rounds = min(a.rounds, a.steps)
    ds = _deepspeed_version() if a.deepspeed == "auto" else None
    systems = [*DTRAIN, *TORCH, *(DEEPSPEED if ds else ())]
    if a.systems:
        chosen = [x for x in a.systems.split(",") if x]
        bad = [x for x in chosen if x not in systems]
        if bad:
            ap.error(f"unknown system(s) {bad}; choose from {','.join(systems)}")
        if "dtrain dp" not in chosen or not any(DTRAIN.get(x) for x in chosen):
            ap.error("--systems must hold dtrain dp (the losses' reference) and a ZeRO stage (the units)")
        systems = [x for x in systems if x in chosen]
    args = dict(vars(a), systems=systems)
    print(
        f"torch {torch.__version__}, deepspeed {ds or 'not used'}, python {platform.python_version()}, "
        f"{platform.machine()}, {a.nprocs} processes x 1 intra-op thread, gloo on loopback, CPU"
    )
    print(
        f"{a.model} seq_len {a.seq_len}, global batch {a.batch_size} ({a.batch_size // a.nprocs} per rank), "
        f"Adam lr {a.lr}; dtrain algorithm={a.algorithm} overlap={a.overlap}; {a.warmup} warm-up + {a.steps} "
        f"timed steps per system in {a.rounds} rotating rounds"
    )
    user = a.model in HF_MODELS  # a model dtrain did not write: its own result file
    bench = Benchmark(
        "sharded_vs_torch" + (f"_{a.model.replace('-', '_')}" if user else ""),
        title="ZeRO stages against torch's sharding" + (f", {a.model}" if user else ""),
        family="sharded data parallelism",
        workload=f"{a.model}, seq_len {a.seq_len}, global batch {a.batch_size}, Adam, {a.nprocs} "
        f"processes; {a.steps} timed steps a system in {a.rounds} rounds",
        metric="ms/step",
        higher_is_better=False,
        repeats=a.rounds,
        quick=a.quick,
        command=command("benchmarks/sharded.py", argv),
        notes="Every system in one launch, built from the same seed; each round runs every system's "
        "steps between barriers in a rotated order. Peers: stage 0 DDP, stage 1 DDP with "
        "ZeroRedundancyOptimizer, stage 2 the same (torch has no stage-2-only form), stage 3 "
        f"FSDP2 (fully_shard on each {'decoder layer' if user else 'block'}, then the root)."
        + (UNITS_NOTE if user else "")
        + (" Each rank's threads pinned to a core of its own (--pin), every system alike." if a.pin else ""),
    )
    t0 = time.perf_counter()
    bench.start()
    ranks = launch_loopback(_worker, (args,), a.nprocs)
    bench.stop()
    out = _summarize(ranks, args)
    _print(out, args)
    per_round = {
        name: [1e3 * t / n for t, n in zip(ranks[0]["systems"][name]["round_s"], _round_steps(args))]
        for name in args["systems"]
    }
    for dt, peer, what in PAIRS:
        if dt in per_round and peer in per_round:
            bench.add_case(
                what.split(":")[0],
                samples={dt: per_round[dt], peer: per_round[peer]},
                compare=[(dt, peer, Bar.at_least(1.0))],
            )
    wall = time.perf_counter() - t0
    rss = [ranks[r]["maxrss_mib"] for r in range(a.nprocs)]
    print(
        f"\nprocess peak RSS MiB (all systems in one process): {' '.join(f'{x:.0f}' for x in rss)}; "
        f"intra-op threads at the end {ranks[0]['threads']}; wall {wall:.0f}s"
    )
    bench.report(a.out)
    if not a.json:
        return 0
    path = Path(a.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "versions": {
            "torch": torch.__version__,
            "deepspeed": ds,
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
