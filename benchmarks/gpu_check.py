"""What dtrain does on a CUDA machine: the GPT workload's step time and dtrain's CUDA code paths.

Parts, each guarded so that one failure does not hide the others:

1. Versions: torch, CUDA, NCCL, the GPU.
2. The GPT workload on the GPU: median training step (forward, cross entropy over
   every position, backward, Adam step) of ``gpt-small`` and ``gpt-medium`` on
   pytext windows, fp32 and under bf16 autocast, with CUDA synchronisation
   around each timed step and the warm-up discarded; the same steps on the
   machine's CPU for the smallest shape (GPU speed-up = CPU s / GPU s); and the
   gradient bytes per step beside the time a 4-worker ring allreduce of them
   takes at 100 Mbit/s and 1 Gbit/s (``2(P-1)/P * n / B``), as the
   communication/compute ratio that decides a strategy.
3. dtrain's CUDA code paths:
   (a) one process, backend NCCL, world size 1: ``dtrain.comm.allreduce`` on a
       CUDA tensor with every algorithm against ``dist.all_reduce`` of a copy;
   (b) ``dtrain.DataParallel`` on gpt-tiny (CUDA, one rank), overlap backward and
       forward, 10 SGD steps against the plain model's same 10 steps;
   (c) two processes on the one GPU: gloo with CUDA tensors through
       ``dtrain.comm.allreduce`` (the public entry) and through
       ``allreduce_over`` (which skips the entry's device check, so the
       transport's point-to-point meets the CUDA tensor), one process pair per
       algorithm so that a crash of one does not hide the next; and NCCL with two
       ranks on one GPU, which NCCL is expected to refuse.

Run (from the repository root)::

    PYTHONPATH=src python3 benchmarks/gpu_check.py
    PYTHONPATH=src python3 benchmarks/gpu_check.py --json out.json --reps 20

Needs a CUDA GPU; without one it prints the versions and stops.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import faulthandler
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

ALGORITHMS = ("native", "ring", "tree", "recursive_doubling", "rabenseifner", "hierarchical")
RESULTS: dict[str, Any] = {"failures": []}


# ----------------------------------------------------------------------------- printing


def section(title: str) -> None:
    print(f"\n{'=' * 8} {title} {'=' * max(0, 70 - len(title))}", flush=True)


def table(headers: list[str], rows: list[list[Any]]) -> None:
    """A Markdown table, so the log pastes into BENCHMARKS.md as is."""

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            if v == 0:
                return "0"
            if abs(v) >= 100:
                return f"{v:,.0f}"
            if abs(v) >= 1:
                return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
            return f"{v:.3g}"
        return str(v)

    print("| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers))
    for r in rows:
        print("| " + " | ".join(fmt(v) for v in r) + " |")
    sys.stdout.flush()


def short_error(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0][:400] if lines else ''}"


def guarded(name: str, fn: Callable[[], Any]) -> Any:
    t0 = time.perf_counter()
    try:
        return fn()
    except BaseException as e:  # noqa: BLE001 - report everything, keep going
        if isinstance(e, KeyboardInterrupt):
            raise
        print(f"!! {name} FAILED after {time.perf_counter() - t0:.1f}s: {short_error(e)}", flush=True)
        traceback.print_exc()
        sys.stdout.flush()
        RESULTS["failures"].append({"part": name, "error": short_error(e)})
        return None
    finally:
        print(f"-- {name}: {time.perf_counter() - t0:.1f}s", flush=True)


# ----------------------------------------------------------------------------- part 1


def part_versions() -> bool:
    section("1. versions")
    cuda = torch.cuda.is_available()
    nccl: Any = None
    try:
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version()) if cuda else None
    except Exception as e:  # noqa: BLE001
        nccl = f"unavailable ({short_error(e)})"
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda (torch built with)": torch.version.cuda,
        "cuda available": cuda,
        "nccl": nccl,
        "nccl backend available": dist.is_nccl_available(),
        "gloo backend available": dist.is_gloo_available(),
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpu count": torch.cuda.device_count() if cuda else 0,
        "gpu memory GiB": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
        "capability": ".".join(map(str, torch.cuda.get_device_capability(0))) if cuda else None,
        "cpu cores (affinity)": len(os.sched_getaffinity(0)),
        "fp32 matmul TF32 allowed": torch.backends.cuda.matmul.allow_tf32,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    table(["item", "value"], [[k, v] for k, v in info.items()])
    RESULTS["versions"] = info
    return cuda


# ----------------------------------------------------------------------------- part 2


def _batches(x: torch.Tensor, y: torch.Tensor, B: int, n: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    N = x.shape[0]
    for i in range(n):
        idx = torch.arange(i * B, (i + 1) * B) % N
        out.append((x[idx].to(device), y[idx].to(device)))
    return out


def time_train_steps(
    name: str, B: int, S: int, x: torch.Tensor, y: torch.Tensor, *, device: str, bf16: bool, warm: int, reps: int
) -> dict[str, Any]:
    """Median wall time of one training step (synchronised on CUDA), warm-up discarded."""
    from dtrain.workloads.models import build_model

    torch.manual_seed(0)
    model = build_model(name, vocab_size=256, seq_len=S).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=3e-4)
    batches = _batches(x, y, B, warm + reps, device)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i, (xb, yb) in enumerate(batches):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if bf16:
            with torch.autocast(device_type="cuda" if cuda else "cpu", dtype=torch.bfloat16):
                out = model(xb)
                loss = F.cross_entropy(out.flatten(0, 1), yb.flatten())
        else:
            out = model(xb)
            loss = F.cross_entropy(out.flatten(0, 1), yb.flatten())
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        if i >= warm:
            times.append(t1 - t0)
            losses.append(loss.item())
    params = sum(p.numel() for p in model.parameters())
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    med = statistics.median(times)
    return {
        "model": name,
        "B": B,
        "S": S,
        "device": device,
        "bf16": bf16,
        "median_s": med,
        "min_s": min(times),
        "tokens_per_s": B * S / med,
        "params": params,
        "grad_bytes": grad_bytes,
        "last_loss": losses[-1],
        "peak_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
        "reps": len(times),
    }


def part_gpt(args: argparse.Namespace) -> None:
    section("2. GPT training step on the GPU (and CPU for the smallest shape)")
    from dtrain.workloads.data import load_dataset

    shapes = [(8, 64), (64, 256)]
    models = ("gpt-small", "gpt-medium")
    data = {}
    for S in sorted({s for _, s in shapes}):
        tr = load_dataset("pytext", seq_len=S).train
        data[S] = tr.tensors
        print(f"pytext seq_len={S}: {tr.tensors[0].shape[0]} training windows")
    gpu_rows: list[dict[str, Any]] = []
    for name in models:
        for B, S in shapes:
            for bf16 in (False, True):
                r = guarded(
                    f"gpu {name} B={B} S={S} {'bf16' if bf16 else 'fp32'}",
                    lambda name=name, B=B, S=S, bf16=bf16: time_train_steps(
                        name, B, S, *data[S], device="cuda", bf16=bf16, warm=args.warmup, reps=args.reps
                    ),
                )
                if r:
                    gpu_rows.append(r)
                    torch.cuda.empty_cache()
    RESULTS["gpu_steps"] = gpu_rows

    cpu_rows: list[dict[str, Any]] = []
    torch.set_num_threads(args.cpu_threads)
    B0, S0 = shapes[0]
    for name in models:
        r = guarded(
            f"cpu {name} B={B0} S={S0} fp32 ({args.cpu_threads} threads)",
            lambda name=name: time_train_steps(
                name, B0, S0, *data[S0], device="cpu", bf16=False, warm=args.cpu_warmup, reps=args.cpu_reps
            ),
        )
        if r:
            cpu_rows.append(r)
    RESULTS["cpu_steps"] = cpu_rows

    def gpu(name: str, B: int, S: int, bf16: bool) -> dict[str, Any] | None:
        for r in gpu_rows:
            if (r["model"], r["B"], r["S"], r["bf16"]) == (name, B, S, bf16):
                return r
        return None

    print("\nGPU step times (median of timed steps; bf16 = torch.autocast(cuda, bfloat16), params and Adam in fp32):")
    rows = []
    for name in models:
        for B, S in shapes:
            f, b = gpu(name, B, S, False), gpu(name, B, S, True)
            if not f and not b:
                continue
            rows.append(
                [
                    name,
                    f"{B}x{S}",
                    f"{f['median_s'] * 1e3:.2f}" if f else "-",
                    f"{b['median_s'] * 1e3:.2f}" if b else "-",
                    f"{f['median_s'] / b['median_s']:.2f}" if f and b else "-",
                    f"{f['tokens_per_s']:,.0f}" if f else "-",
                    f"{b['tokens_per_s']:,.0f}" if b else "-",
                    f"{f['peak_mib']:.0f}" if f else "-",
                    f"{f['last_loss']:.3f}" if f else "-",
                ]
            )
    table(
        [
            "model",
            "B x S",
            "fp32 ms",
            "bf16 ms",
            "fp32/bf16",
            "fp32 tok/s",
            "bf16 tok/s",
            "peak MiB fp32",
            "loss (last)",
        ],
        rows,
    )

    print(f"\nCPU ({args.cpu_threads} threads, fp32) against the GPU, B x S = {B0}x{S0}:")
    rows = []
    for c in cpu_rows:
        f, b = gpu(c["model"], B0, S0, False), gpu(c["model"], B0, S0, True)
        rows.append(
            [
                c["model"],
                f"{c['median_s'] * 1e3:.1f}",
                f"{c['tokens_per_s']:,.0f}",
                f"{f['median_s'] * 1e3:.2f}" if f else "-",
                f"{f['median_s'] / c['median_s']:.4f}" if f else "-",
                f"{c['median_s'] / f['median_s']:.1f}" if f else "-",
                f"{c['median_s'] / b['median_s']:.1f}" if b else "-",
            ]
        )
    table(
        ["model", "CPU ms", "CPU tok/s", "GPU fp32 ms", "GPU/CPU time", "speed-up fp32", "speed-up bf16 vs CPU fp32"],
        rows,
    )

    print("\nGradients per step and a 4-worker ring allreduce of them, 2(P-1)/P*n/B, against the GPU step:")
    P = 4
    rows = []
    comm = []
    for name in models:
        for B, S in shapes:
            f, b = gpu(name, B, S, False), gpu(name, B, S, True)
            ref = f or b
            if not ref:
                continue
            n = ref["grad_bytes"]
            t100 = 2 * (P - 1) / P * n / (100e6 / 8)
            t1g = 2 * (P - 1) / P * n / (1e9 / 8)
            entry = {
                "model": name,
                "B": B,
                "S": S,
                "params": ref["params"],
                "grad_bytes": n,
                "allreduce_100mbit_s": t100,
                "allreduce_1gbit_s": t1g,
            }
            comm.append(entry)
            rows.append(
                [
                    name,
                    f"{B}x{S}",
                    f"{ref['params']:,}",
                    f"{n / 2**20:.1f}",
                    f"{t100:.2f}",
                    f"{t1g:.3f}",
                    f"{t100 / f['median_s']:,.0f}" if f else "-",
                    f"{t1g / f['median_s']:,.0f}" if f else "-",
                    f"{t1g / b['median_s']:,.0f}" if b else "-",
                ]
            )
    table(
        [
            "model",
            "B x S",
            "params",
            "grad MiB",
            "100 Mbit s",
            "1 Gbit s",
            "100M / fp32 step",
            "1G / fp32 step",
            "1G / bf16 step",
        ],
        rows,
    )
    RESULTS["allreduce_estimate"] = comm


# ----------------------------------------------------------------------------- part 3a, 3b


def _free_port() -> int:
    from dtrain.launch.agent import free_port

    return free_port()


def part_nccl_one_rank() -> None:
    section("3a. dtrain.comm.allreduce over NCCL, one process (world size 1)")
    import dtrain
    from dtrain.comm import get_transport

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
    )
    t0 = time.perf_counter()
    dtrain.init(backend="nccl", timeout_s=60)
    print(
        f"dtrain.init(backend='nccl'): initialised={dist.is_initialized()}, backend={dist.get_backend()}, "
        f"world={dist.get_world_size()}, {time.perf_counter() - t0:.2f}s"
    )
    rows, out = [], []
    n = 1 << 20
    for a in ALGORITHMS:
        for op in ("sum", "avg"):
            row: dict[str, Any] = {"algorithm": a, "op": op}
            try:
                torch.manual_seed(1)
                t = torch.randn(n, device="cuda")
                ref = t.clone()
                w = dist.all_reduce(ref, op=dist.ReduceOp.SUM, async_op=True)
                w.wait(timeout=datetime.timedelta(seconds=60))
                torch.cuda.synchronize()
                before = get_transport().stats.snapshot()
                t1 = time.perf_counter()
                res = dtrain.comm.allreduce(t, op=op, algorithm=a, timeout=60)
                torch.cuda.synchronize()
                dt = time.perf_counter() - t1
                after = get_transport().stats - before
                row.update(
                    ok=True,
                    same_object=res is t,
                    device=str(res.device),
                    equal=bool(torch.equal(res, ref)),
                    max_abs_diff=float((res - ref).abs().max()),
                    ms=dt * 1e3,
                    messages=after.messages,
                    bytes_sent=after.bytes_sent,
                )
            except Exception as e:  # noqa: BLE001
                row.update(ok=False, error=short_error(e))
                traceback.print_exc()
            out.append(row)
            rows.append(
                [
                    a,
                    op,
                    "ok" if row["ok"] else "ERROR",
                    row.get("device", "-"),
                    row.get("equal", "-"),
                    row.get("max_abs_diff", "-"),
                    f"{row['ms']:.3f}" if "ms" in row else "-",
                    row.get("messages", "-"),
                    row.get("bytes_sent", "-"),
                    row.get("error", ""),
                ]
            )
    table(
        [
            "algorithm",
            "op",
            "result",
            "device",
            "equal to dist.all_reduce",
            "max |diff|",
            "ms",
            "messages",
            "bytes sent",
            "error",
        ],
        rows,
    )
    RESULTS["nccl_one_rank"] = out


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def part_data_parallel() -> None:
    section("3b. dtrain.DataParallel on CUDA, one rank (NCCL), gpt-tiny, 10 SGD steps")
    import dtrain
    from dtrain.workloads.data import load_dataset
    from dtrain.workloads.models import build_model

    if not dist.is_initialized():
        print("torch.distributed not initialised (3a skipped or failed): DataParallel runs as a world of one")
    S, B, steps = 64, 16, 10
    x, y = load_dataset("pytext", seq_len=S).train.tensors
    batches = _batches(x, y, B, steps, "cuda")
    torch.manual_seed(0)
    base = build_model("gpt-tiny", vocab_size=256, seq_len=S).cuda()

    def loss_of(m: Any, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(xb).flatten(0, 1), yb.flatten())

    def train(m: Any, opt: torch.optim.Optimizer | None) -> tuple[list[float], list[float]]:
        """10 steps; ``opt`` None: the engine steps the optimizer (overlap="forward")."""
        times, losses = [], []
        for xb, yb in batches:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if opt is not None:
                opt.zero_grad()
            loss = loss_of(m, xb, yb)
            loss.backward()
            if opt is not None:
                opt.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
        return times, losses

    ref = copy.deepcopy(base)
    ref_times, ref_losses = train(ref, _sgd(ref.parameters()))
    ref_ms = statistics.median(ref_times[2:]) * 1e3
    print(f"plain model: loss {ref_losses[0]:.4f} -> {ref_losses[-1]:.4f}, median step {ref_ms:.2f} ms (steps 3-10)")

    rows, out = [], []
    for algorithm, overlap in (("ring", "backward"), ("ring", "forward"), ("native", "backward")):
        row: dict[str, Any] = {"algorithm": algorithm, "overlap": overlap}
        try:
            m = copy.deepcopy(base)
            if overlap == "forward":
                dp = dtrain.DataParallel(
                    m, algorithm=algorithm, overlap="forward", optimizer_factory=_sgd, timeout_s=60
                )
                dopt = None
            else:
                dp = dtrain.DataParallel(m, algorithm=algorithm, overlap="backward", timeout_s=60)
                dopt = _sgd(dp.parameters())
            times, losses = train(dp, dopt)
            dp.synchronize()
            torch.cuda.synchronize()
            with torch.no_grad():
                diff = max(float((p - q).abs().max()) for p, q in zip(dp.module.parameters(), ref.parameters()))
            loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
            stats = dp.step_stats()
            ms = statistics.median(times[2:]) * 1e3
            row.update(
                ok=True,
                max_param_diff=diff,
                max_loss_diff=loss_diff,
                median_ms=ms,
                ratio=ms / ref_ms,
                buckets=len(dp.buckets),
                step_stats=stats,
                repr=repr(dp).split(", module=")[0],
            )
            dp.close()
        except Exception as e:  # noqa: BLE001
            row.update(ok=False, error=short_error(e))
            traceback.print_exc()
        out.append(row)
        st = row.get("step_stats") or {}
        rows.append(
            [
                algorithm,
                overlap,
                "ok" if row["ok"] else "ERROR",
                row.get("max_param_diff", "-"),
                row.get("max_loss_diff", "-"),
                f"{row['median_ms']:.2f}" if "median_ms" in row else "-",
                f"{row['ratio']:.2f}" if "ratio" in row else "-",
                row.get("buckets", "-"),
                ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in st.items()) or "-",
                row.get("error", ""),
            ]
        )
        if row.get("repr"):
            print(row["repr"])
    table(
        [
            "algorithm",
            "overlap",
            "result",
            "max |param diff| vs plain",
            "max |loss diff|",
            "median step ms",
            "DP / plain",
            "buckets",
            "step_stats()",
            "error",
        ],
        rows,
    )
    RESULTS["data_parallel"] = {"plain_median_ms": ref_ms, "runs": out}


# ----------------------------------------------------------------------------- part 3c (child processes)


def _record(path: str, rank: int, test: str, **kw: Any) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"rank": rank, "test": test, **kw}) + "\n")
        f.flush()


def _pair_worker(rank: int, world: int, port: int, mode: str, path: str) -> None:
    """One of two processes on the one GPU; appends one JSON line per test to ``path``."""
    faulthandler.enable()
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        GLOO_SOCKET_IFNAME="lo",
    )
    torch.cuda.set_device(0)
    backend = "nccl" if mode == "nccl" else "gloo"
    try:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
        _record(path, rank, "init", ok=True, backend=backend)
    except Exception as e:  # noqa: BLE001
        _record(path, rank, "init", ok=False, backend=backend, error=short_error(e))
        return
    n = 4096

    def fresh(device: str) -> tuple[torch.Tensor, torch.Tensor]:
        base = torch.arange(n, dtype=torch.float32)
        t = (base + 1000.0 * rank).to(device)
        expect = 2 * base + 1000.0 * sum(range(world))
        return t, expect

    def check(test: str, fn: Callable[[torch.Tensor], Any], device: str) -> None:
        t, expect = fresh(device)
        t0 = time.perf_counter()
        try:
            res = fn(t)
            res = t if res is None else res
            if device == "cuda":
                torch.cuda.synchronize()
            got = res.cpu()
            _record(
                path,
                rank,
                test,
                ok=True,
                device=str(res.device),
                correct=bool(torch.allclose(got, expect)),
                s=time.perf_counter() - t0,
            )
        except Exception as e:  # noqa: BLE001
            _record(path, rank, test, ok=False, error=short_error(e), s=time.perf_counter() - t0)

    try:
        if mode == "nccl":

            def nccl_allreduce(t: torch.Tensor) -> None:
                w = dist.all_reduce(t, async_op=True)
                w.wait(timeout=datetime.timedelta(seconds=30))

            check("dist.all_reduce nccl cuda", nccl_allreduce, "cuda")
            import dtrain.comm as comm

            check(
                "dtrain.comm.allreduce ring nccl cuda",
                lambda t: comm.allreduce(t, op="sum", algorithm="ring", timeout=20),
                "cuda",
            )
        elif mode == "api":
            import dtrain.comm as comm

            check(
                "dtrain.comm.allreduce ring gloo cpu (control)",
                lambda t: comm.allreduce(t, op="sum", algorithm="ring", timeout=20),
                "cpu",
            )
            check("dist.all_reduce gloo cuda", lambda t: dist.all_reduce(t), "cuda")
            for a in ALGORITHMS:
                check(
                    f"dtrain.comm.allreduce {a} gloo cuda",
                    lambda t, a=a: comm.allreduce(t, op="sum", algorithm=a, timeout=20),
                    "cuda",
                )
        elif mode.startswith("over:"):
            a = mode.split(":", 1)[1]
            from dtrain.comm import TorchTransport, allreduce_over

            check(
                f"allreduce_over {a} gloo cuda (no device check)",
                lambda t: allreduce_over(TorchTransport(None, timeout=20), t, "sum", a),
                "cuda",
            )
        _record(path, rank, "done", ok=True)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def part_two_processes(deadline_s: float, only: str = "") -> None:
    section("3c. two processes on the one GPU: gloo with CUDA tensors, and NCCL with two ranks")
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="gpu_check_")
    modes = ["api", *[f"over:{a}" for a in ALGORITHMS], "nccl"]
    if only:
        modes = [m for m in modes if m in {x.strip() for x in only.split(",")}]
    procs: dict[str, list[Any]] = {}
    paths: dict[str, str] = {}
    t0 = time.perf_counter()
    for mode in modes:
        port = _free_port()
        paths[mode] = os.path.join(tmp, mode.replace(":", "_") + ".jsonl")
        procs[mode] = []
        for r in range(2):
            p = ctx.Process(target=_pair_worker, args=(r, 2, port, mode, paths[mode]), daemon=True)
            p.start()
            procs[mode].append(p)
    end = t0 + deadline_s
    for ps in procs.values():
        for p in ps:
            p.join(max(0.1, end - time.perf_counter()))
    killed: list[str] = []
    for mode, ps in procs.items():
        for r, p in enumerate(ps):
            if p.is_alive():
                killed.append(f"{mode} rank {r}")
                p.kill()
                p.join(5)
    print(
        f"all pairs finished or were killed after {time.perf_counter() - t0:.1f}s (deadline {deadline_s:.0f}s); "
        f"killed: {killed or 'none'}"
    )

    def exit_text(code: int | None) -> str:
        if code is None:
            return "still running"
        if code < 0:
            return f"killed by signal {-code}"
        return f"exit {code}"

    rows, out = [], []
    for mode in modes:
        recs: list[dict[str, Any]] = []
        if os.path.exists(paths[mode]):
            with open(paths[mode]) as f:
                recs = [json.loads(ln) for ln in f if ln.strip()]
        codes = [exit_text(p.exitcode) for p in procs[mode]]
        tests = [t for t in dict.fromkeys(r["test"] for r in recs) if t != "done"]
        for test in tests:
            per = {r["rank"]: r for r in recs if r["test"] == test}
            res = []
            for rank in range(2):
                r = per.get(rank)
                if r is None:
                    res.append("no record (process died or hung here)")
                elif r.get("ok"):
                    extra = f", correct={r['correct']}" if "correct" in r else ""
                    res.append(f"ok{extra}")
                else:
                    res.append(f"ERROR {r.get('error', '')}")
            rows.append([mode, test, res[0], res[1]])
            out.append({"mode": mode, "test": test, "records": per})
        done = {r["rank"] for r in recs if r["test"] == "done"}
        rows.append(
            [
                mode,
                "process exit",
                f"{codes[0]}{'' if 0 in done else ' (not done)'}",
                f"{codes[1]}{'' if 1 in done else ' (not done)'}",
            ]
        )
        out.append({"mode": mode, "exit": codes, "done": sorted(done)})
    table(["pair", "test", "rank 0", "rank 1"], rows)
    RESULTS["two_processes"] = out


# ----------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--warmup", type=int, default=5, help="GPU warm-up steps, discarded (default: 5)")
    ap.add_argument("--reps", type=int, default=20, help="GPU timed steps (default: 20)")
    ap.add_argument("--cpu-warmup", type=int, default=2)
    ap.add_argument("--cpu-reps", type=int, default=5)
    ap.add_argument("--cpu-threads", type=int, default=16)
    ap.add_argument("--pair-deadline", type=float, default=150.0, help="seconds for all the 2-process pairs")
    ap.add_argument("--pairs", default="", help="only these pairs of part 3c, e.g. nccl,over:ring (default: all)")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: gpt, nccl1, dp, pairs")
    ap.add_argument("--json", default="", help="also write every figure to this JSON file")
    args = ap.parse_args()
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    t_all = time.perf_counter()
    faulthandler.enable()

    cuda = guarded("versions", part_versions)
    if not cuda:
        print("no CUDA device: nothing more to check")
        return 1
    if "gpt" not in skip:
        guarded("gpt workload", lambda: part_gpt(args))
    torch.set_num_threads(min(16, len(os.sched_getaffinity(0))))
    if "nccl1" not in skip:
        guarded("nccl one rank", part_nccl_one_rank)
    if "dp" not in skip:
        guarded("data parallel", part_data_parallel)
    if dist.is_initialized():
        guarded("destroy process group", dist.destroy_process_group)
    if "pairs" not in skip:
        guarded("two processes", lambda: part_two_processes(args.pair_deadline, args.pairs))

    section("summary")
    print(f"total {time.perf_counter() - t_all:.1f}s; failed parts: {len(RESULTS['failures'])}")
    for f in RESULTS["failures"]:
        print(f"  {f['part']}: {f['error']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(RESULTS, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
