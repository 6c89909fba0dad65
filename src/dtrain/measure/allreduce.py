"""``dtrain bench allreduce``: every allreduce algorithm side by side with the backend's own.

Usage::

    dtrain bench allreduce [--workers 4] [--sizes 4KB,64KB,1MB,16MB,64MB]
                           [--algorithms all] [--iters 10] [--warmup 2]
    python -m dtrain.measure.allreduce --workers 4 --sizes 16MB,64MB --algorithms native,ring

What it does, in the launched workers (``dtrain.launch.agent.launch``):

1. Fits the alpha-beta model to a ping-pong between ranks 0 and 1 (alpha: the
   median one-way time of 4 bytes; beta: the least-squares slope of the median
   one-way times of 64 KiB .. 4 MiB above alpha) and measures gamma as this
   machine's rate of in-place float32 addition.
2. For each size: ``warmup`` untimed rounds, then ``iters`` timed rounds; a
   round runs every algorithm once (round robin, so drifting machine load hits
   all alike), each started after a barrier from the same input. A run's time
   is the slowest rank's; the table shows the median.
3. Checks every algorithm's result against ``native`` on the same input.

Columns: time, algbw = bytes / time, busbw = algbw·2(P-1)/P (the rate each link
carries in a bandwidth-optimal allreduce, comparable across P), busbw as a
ratio of native's, and the alpha-beta-gamma prediction of
:func:`dtrain.comm.cost.allreduce_time` with the fitted parameters. Sizes use
binary units (1KB = 1024 bytes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from dtrain.errors import ConfigError
from dtrain.perfmodel.units import parse_bytes

__all__ = ["BenchConfig", "check_timing", "main", "parse_size", "format_size"]


def parse_size(text: str) -> int:
    """A size in whole bytes, read as every size in dtrain is (:func:`dtrain.perfmodel.units.parse_bytes`:
    ``"64KiB"`` is 65,536 bytes, ``"64KB"`` 64,000; a bare number is bytes)."""
    return int(parse_bytes(text))


def format_size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:g} {unit}" if v == int(v) else f"{v:.2f} {unit}"
    return f"{n} B"


def check_timing(sizes: tuple[int, ...], iters: int, warmup: int) -> None:
    """The options every timing benchmark shares: float32 sizes, timed and warm-up rounds."""
    if iters < 1:
        raise ConfigError(f"--iters must be >= 1, got {iters}")
    if warmup < 0:
        raise ConfigError(f"--warmup must be >= 0, got {warmup}")
    if not sizes or any(s < 4 or s % 4 for s in sizes):
        raise ConfigError(f"--sizes must be whole float32 counts (multiples of 4 bytes, >= 4), got {sizes}")


@dataclass(frozen=True)
class BenchConfig:
    """Options of one benchmark run (see the module docstring)."""

    workers: int = 4
    sizes: tuple[int, ...] = (4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)
    algorithms: tuple[str, ...] = ("native", "ring", "tree", "recursive_doubling", "rabenseifner", "hierarchical")
    iters: int = 10
    warmup: int = 2
    piece_bytes: int = 1 << 20
    max_pieces: int = 2  # as dtrain.comm.cost.RING_MAX_PIECES (not imported: it pulls in torch)
    window: int = 2
    node_size: int | None = None
    timeout: float = 120.0

    def __post_init__(self) -> None:
        from dtrain.comm.allreduce import ALGORITHMS, AllreduceOptions

        if self.workers < 1:
            raise ConfigError(f"--workers must be >= 1, got {self.workers}")
        check_timing(self.sizes, self.iters, self.warmup)
        bad = [a for a in self.algorithms if a not in ALGORITHMS]
        if bad or not self.algorithms:
            raise ConfigError(f"unknown algorithm(s) {bad}; choose from {', '.join(ALGORITHMS)} or 'all'")
        if self.node_size is not None and self.node_size < 1:
            raise ConfigError(f"--node-size must be >= 1, got {self.node_size}")
        AllreduceOptions(piece_bytes=self.piece_bytes, max_pieces=self.max_pieces, window=self.window)


# ----------------------------------------------------------------------------- worker side


def _pingpong_fit(rank: int, reps: int = 15) -> tuple[float, float]:
    """Alpha and beta from median one-way ping-pong times between ranks 0 and 1.

    alpha is the one-way time of a 4-byte message; beta the least-squares slope,
    through that intercept, of the larger messages (64 KiB .. 4 MiB) -- more
    robust on a loaded machine than a free two-parameter fit.
    """
    import torch
    import torch.distributed as dist

    sizes = [4, 4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]
    points = []
    for nbytes in sizes:
        buf = torch.zeros(nbytes // 4)
        times = []
        for i in range(reps + 3):
            if rank == 0:
                t0 = time.perf_counter()
                dist.send(buf, 1)
                dist.recv(buf, 1)
                if i >= 3:
                    times.append((time.perf_counter() - t0) / 2)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
        if rank == 0:
            points.append((nbytes, statistics.median(times)))
    if rank != 0:
        return 0.0, 0.0
    alpha = points[0][1]
    big = [(n, t - alpha) for n, t in points if n >= 64 << 10]
    beta = max(0.0, sum(n * t for n, t in big) / sum(n * n for n, _ in big))
    return alpha, beta


def _gamma() -> float:
    """Seconds per byte of an in-place float32 add (the reduction the algorithms do)."""
    import torch

    a, b = torch.ones(1 << 22), torch.ones(1 << 22)
    times = []
    for i in range(12):
        t0 = time.perf_counter()
        a.add_(b)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) / (a.numel() * a.element_size())


def _worker(cfg: BenchConfig) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    from dtrain.comm.allreduce import AllreduceOptions, allreduce

    rank, P = dist.get_rank(), dist.get_world_size()
    alpha, beta = _pingpong_fit(rank) if P > 1 else (0.0, 0.0)
    gamma = _gamma()
    fit = torch.tensor([alpha, beta, gamma], dtype=torch.float64)
    dist.broadcast(fit, 0)
    opts = AllreduceOptions(
        piece_bytes=cfg.piece_bytes, max_pieces=cfg.max_pieces, window=cfg.window, node_size=cfg.node_size
    )
    rows = []
    for nbytes in cfg.sizes:
        numel = nbytes // 4
        src = torch.randn(numel, generator=torch.Generator().manual_seed(1000 + rank))
        ref = src.clone()
        allreduce(ref, "sum", "native", timeout=cfg.timeout)
        scale = src.abs()
        allreduce(scale, "sum", "native", timeout=cfg.timeout)
        buf = torch.empty_like(src)
        times: dict[str, list[float]] = {alg: [] for alg in cfg.algorithms}
        ok = torch.ones(len(cfg.algorithms))
        # round robin over the algorithms, so a change in machine load hits all alike
        for i in range(cfg.warmup + cfg.iters):
            for a, alg in enumerate(cfg.algorithms):
                buf.copy_(src)
                dist.barrier()
                t0 = time.perf_counter()
                allreduce(buf, "sum", alg, timeout=cfg.timeout, options=opts)
                dt = time.perf_counter() - t0
                if i >= cfg.warmup:
                    times[alg].append(dt)
                if i == 0 and numel:
                    # float32 sums in another order: within P·eps·sum|x| of the exact one, as native is
                    excess = (buf - ref).abs().sub_(2 * P * 1.2e-7 * scale).max().item()
                    ok[a] = 1.0 if excess <= 0.0 else 0.0
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        for a, alg in enumerate(cfg.algorithms):
            slowest = torch.tensor(times[alg], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            rows.append(
                {
                    "bytes": nbytes,
                    "algorithm": alg,
                    "time_s": statistics.median(slowest.tolist()),
                    "correct": bool(ok[a].item() == 1.0),
                }
            )
    if rank != 0:
        return None
    return {
        "torch": torch.__version__,
        "backend": str(dist.get_backend()),
        "world_size": P,
        "threads": torch.get_num_threads(),
        "alpha": float(fit[0]),
        "beta": float(fit[1]),
        "gamma": float(fit[2]),
        "rows": rows,
        "config": asdict(cfg),
    }


# ----------------------------------------------------------------------------- driver side


def _table(res: dict[str, Any], cfg: BenchConfig) -> str:
    from dtrain.comm.cost import LinkCost, allreduce_time

    P = res["world_size"]
    link = LinkCost(res["alpha"], res["beta"], res["gamma"])
    native = {r["bytes"]: r["time_s"] for r in res["rows"] if r["algorithm"] == "native"}
    bw = f"{1 / res['beta'] / 1e9:.2f} GB/s" if res["beta"] > 0 else "inf GB/s"
    lines = [
        f"dtrain bench allreduce: torch {res['torch']}, backend {res['backend']}, world size {P}, "
        f"{res['threads']} intra-op thread(s)/worker, float32, ring piece {format_size(cfg.piece_bytes)} "
        f"(<= {cfg.max_pieces}/segment), window {cfg.window}, node_size {cfg.node_size or 'LOCAL_WORLD_SIZE'}",
        f"alpha-beta fit (ping-pong rank 0<->1): alpha {res['alpha'] * 1e6:.1f} us, beta {res['beta'] * 1e9:.3f} ns/B "
        f"({bw}); gamma (local add) {res['gamma'] * 1e9:.3f} ns/B",
        f"median of {cfg.iters} timed runs after {cfg.warmup} warm-up; time = slowest rank; "
        "busbw = algbw*2(P-1)/P; vs_native = busbw / native busbw",
        "",
        f"{'size':>10}  {'algorithm':<19} {'time_ms':>9} {'algbw_GB/s':>11} {'busbw_GB/s':>11} "
        f"{'vs_native':>9} {'model_ms':>9}  ok",
    ]
    for r in res["rows"]:
        n, t, alg = r["bytes"], r["time_s"], r["algorithm"]
        algbw = n / t / 1e9
        busbw = algbw * 2 * (P - 1) / P
        ratio = native[n] / t if n in native else float("nan")
        pred = allreduce_time(
            alg, P, n, link, node_size=cfg.node_size, piece_bytes=cfg.piece_bytes, max_pieces=cfg.max_pieces
        )
        lines.append(
            f"{format_size(n):>10}  {alg:<19} {t * 1e3:9.3f} {algbw:11.3f} {busbw:11.3f} "
            f"{ratio:9.2f} {pred * 1e3:9.3f}  {'yes' if r['correct'] else 'NO'}"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    from dtrain.comm.allreduce import ALGORITHMS

    ap = argparse.ArgumentParser(
        prog="dtrain bench allreduce",
        description="Time every allreduce algorithm next to the backend's own (native) on local workers.",
    )
    ap.add_argument("--workers", type=int, default=4, help="worker processes (default: 4)")
    ap.add_argument(
        "--sizes",
        default="4KiB,64KiB,1MiB,16MiB,64MiB",
        help="comma-separated sizes: 64KiB = 65,536 bytes, 64KB = 64,000",
    )
    ap.add_argument("--algorithms", default="all", help=f"comma-separated, from {', '.join(ALGORITHMS)}, or 'all'")
    ap.add_argument("--iters", type=int, default=10, help="timed runs per case (default: 10)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed runs first (default: 2)")
    ap.add_argument("--piece", default="1MiB", help="ring piece size (default: 1MiB)")
    ap.add_argument("--max-pieces", type=int, default=2, help="ring: at most this many pieces per segment (default: 2)")
    ap.add_argument("--window", type=int, default=2, help="receives the ring posts ahead (default: 2)")
    ap.add_argument("--node-size", type=int, default=None, help="hierarchical: ranks per node (default: all local)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds any wait may block (default: 120)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the raw results as JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table; return a process exit code."""
    from dtrain.comm.allreduce import ALGORITHMS
    from dtrain.launch.agent import launch

    ns = _parser().parse_args(argv)
    try:
        algs = (
            tuple(ALGORITHMS)
            if ns.algorithms.strip() == "all"
            else tuple(a.strip() for a in ns.algorithms.split(",") if a.strip())
        )
        if "native" not in algs:
            algs = ("native", *algs)  # the peer every ratio is taken against
        cfg = BenchConfig(
            workers=ns.workers,
            sizes=tuple(parse_size(s) for s in ns.sizes.split(",") if s.strip()),
            algorithms=algs,
            iters=ns.iters,
            warmup=ns.warmup,
            piece_bytes=parse_size(ns.piece),
            max_pieces=ns.max_pieces,
            window=ns.window,
            node_size=ns.node_size,
            timeout=ns.timeout,
        )
    except ConfigError as e:
        print(f"dtrain bench allreduce: error: {e}", file=sys.stderr)
        return 2
    res = launch(_worker, (cfg,), nprocs=cfg.workers)[0]
    print(_table(res, cfg))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if all(r["correct"] for r in res["rows"]) else 1


if __name__ == "__main__":
    from dtrain.measure import allreduce as _self  # so workers unpickle dtrain.measure.allreduce._worker

    sys.exit(_self.main(sys.argv[1:]))
