"""Checkpoint save/load time: dtrain's atomic, per-rank save beside bare DCP and rank-0 ``torch.save``.

Every process holds the same model and SGD-with-momentum state, and (like a rank
with error feedback) a per-rank residual as large as the model. Three ways to
save it, timed on every rank (the slowest rank counts), median of ``--reps``
after one warm-up:

* ``dtrain`` -- :func:`dtrain.checkpoint.save_checkpoint`: DCP save of model and
  optimizer plus one blob per rank, into a temporary folder, marker, rename;
* ``dcp`` -- ``torch.distributed.checkpoint.save`` of the same state dict
  (model, optimizer, per-rank residual under per-rank keys) into a plain folder:
  the peer, without the atomic commit and the blob serialisation;
* ``torch.save@0`` -- the DDP habit: rank 0 saves model + optimizer with
  ``torch.save`` (no per-rank state at all; shown for scale), then a barrier.

Loads are timed the same way: ``load_checkpoint`` against DCP's recipe
(``dcp.load`` into ``get_*_state_dict``, then ``set_*_state_dict``). Ratios are
against ``dcp``.

Run::

    python benchmarks/checkpoint.py [--workers 4] [--hidden 1024] [--reps 5] [--dir /tmp/ckpt_bench]
    python benchmarks/checkpoint.py --hidden -1        # gpt-small
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def _slowest(dt: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([dt])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _bench(root: str, hidden: int, reps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from dtrain.checkpoint import load_checkpoint, save_checkpoint
    from dtrain.workloads.models import build_model

    rank = dist.get_rank()
    torch.manual_seed(0)
    if hidden < 0:  # gpt-small (its vocabulary at the default 10 classes; the blocks are what weigh)
        model = build_model("gpt-small")
        x = torch.randint(0, 10, (4, 16))
    else:
        model = build_model("mlp", hidden=(hidden, hidden, hidden)) if hidden else build_model("cnn")
        x = torch.randn(4, 1, 8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(x).sum().backward()
    opt.step()
    residual = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    base = Path(root)

    def run_dtrain(i: int) -> None:
        save_checkpoint(base / "dtrain", i, model=model, optimizer=opt, rank_state={"residuals": residual})

    def run_dcp(i: int) -> None:
        sd = {
            "model": get_model_state_dict(model),
            "optimizer": get_optimizer_state_dict(model, opt),
            f"rank{rank}": residual,
        }
        dcp.save(sd, checkpoint_id=base / "dcp" / str(i))

    def run_torch(i: int) -> None:
        if rank == 0:
            (base / "torch").mkdir(parents=True, exist_ok=True)
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, base / "torch" / f"{i}.pt")
        dist.barrier()

    def load_dtrain(i: int) -> None:
        load_checkpoint(base / "dtrain", model=model, optimizer=opt)

    def load_dcp(i: int) -> None:
        sd = {
            "model": get_model_state_dict(model),
            "optimizer": get_optimizer_state_dict(model, opt),
            f"rank{rank}": residual,
        }
        dcp.load(sd, checkpoint_id=base / "dcp" / "0")
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optimizer"])

    out: dict[str, Any] = {"model_mb": nbytes / 2**20}
    # interleaved rounds so that load drift hits every method alike
    methods = {"dtrain": run_dtrain, "dcp": run_dcp, "torch.save@0": run_torch}
    times: dict[str, list[float]] = {k: [] for k in [*methods, "load dtrain", "load dcp"]}
    for i in range(reps + 1):
        for name, fn in [*methods.items(), ("load dtrain", load_dtrain), ("load dcp", load_dcp)]:
            dist.barrier()
            t0 = time.perf_counter()
            fn(i)
            dt = _slowest(time.perf_counter() - t0)
            if i:  # the first round is warm-up
                times[name].append(dt)
    out.update({k: statistics.median(v) for k, v in times.items()})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument(
        "--hidden",
        type=int,
        nargs="+",
        default=[0, 1024],
        help="MLP hidden width(s); 0 means the default CNN, -1 gpt-small (default: 0 1024)",
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/dtrain_ckpt_bench")
    ns = ap.parse_args(argv)
    import torch

    from dtrain.launch.agent import launch

    print(
        f"torch {torch.__version__}, python {sys.version.split()[0]}, {ns.workers} processes, gloo, "
        f"median of {ns.reps} (slowest rank), files under {ns.dir}"
    )
    print(
        f"{'model':>10}{'MiB':>8}{'dtrain s':>10}{'dcp s':>9}{'torch.save@0 s':>16}{'dtrain/dcp':>12}"
        f"{'load dtrain s':>15}{'load dcp s':>12}{'ratio':>7}"
    )
    for h in ns.hidden:
        shutil.rmtree(ns.dir, ignore_errors=True)
        res = launch(_bench, (ns.dir, h, ns.reps), nprocs=ns.workers)[0]
        name = "gpt-small" if h < 0 else f"mlp{h}x3" if h else "cnn"
        print(
            f"{name:>10}{res['model_mb']:>8.1f}{res['dtrain']:>10.3f}{res['dcp']:>9.3f}{res['torch.save@0']:>16.3f}"
            f"{res['dtrain'] / res['dcp']:>12.2f}{res['load dtrain']:>15.3f}{res['load dcp']:>12.3f}"
            f"{res['load dtrain'] / res['load dcp']:>7.2f}"
        )
    shutil.rmtree(ns.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
