"""Helpers shared by the test files (imported as ``from _helpers import ...``; tests/conftest.py puts
this folder on the path). Spawning processes lives in ``_dist.py``.

- :func:`max_diff`: the largest elementwise difference of two lists of tensors (or arrays).
- :func:`train_steps`: the plain single-process reference: one cross-entropy step per batch.
- :func:`dtrain_cli`, :func:`read_metrics`, :func:`read_summary`: ``python -m dtrain.cli`` in a
  subprocess and the run folder it writes; :func:`dtrain_runs`: several runs, two at a time.
- :class:`FakeClock`: time that moves only when the test says, for code that takes a clock or a sleep.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import _warm
import torch
from _patience import patient
from torch import nn

__all__ = [
    "FakeClock",
    "max_diff",
    "train_steps",
    "two_phase_residuals",
    "dtrain_cli",
    "dtrain_runs",
    "read_metrics",
    "read_summary",
]


class FakeClock:
    """A clock for code under test: ``clock()`` reads it, ``clock.sleep(s)`` (which the code may
    call instead of ``time.sleep``) and ``clock.advance(s)`` move it; ``sleeps`` lists the sleeps."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def advance(self, s: float) -> None:
        self.now += s

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def max_diff(a: Iterable[Any], b: Iterable[Any]) -> float:
    """``max |x - y|`` over the pairs of two equally long sequences of tensors (numpy arrays and
    lists are converted: results that crossed a process boundary are often numpy)."""
    a, b = list(a), list(b)
    assert len(a) == len(b), f"{len(a)} tensors against {len(b)}"
    return max(float((torch.as_tensor(x).detach() - torch.as_tensor(y).detach()).abs().max()) for x, y in zip(a, b))


def train_steps(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]
) -> None:
    """Train ``model``: per ``(x, y)``, zero the gradients, cross-entropy backward, step.

    ``optimizer`` None: the model steps itself (``DataParallel(overlap="forward")``), so only backward.
    """
    for x, y in batches:
        if optimizer is not None:
            optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if optimizer is not None:
            optimizer.step()


def two_phase_residuals(comps: list[Any], key: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What error feedback keeps back in the two-phase compressed allreduce of ``n`` elements under
    ``key`` over ``len(comps)`` ranks: per rank the worker residuals of every chunk it sent
    (``KEY#j``), and the residual each owner kept of the chunk it combined (``KEY#r/agg``), as float64."""
    from dtrain.comm.sparse import chunk_bounds

    p = len(comps)
    b = chunk_bounds(n, p)
    worker = torch.zeros(p, n, dtype=torch.float64)
    server = torch.zeros(n, dtype=torch.float64)
    for r, c in enumerate(comps):
        for j in range(p):
            worker[r, b[j] : b[j + 1]] = c.residual(f"{key}#{j}").double()
        server[b[r] : b[r + 1]] = c.residual(f"{key}#{r}/agg").double()
    return worker, server


def dtrain_cli(
    *args: str, timeout: float = 240, env: dict[str, str] | None = None, cold: bool = False
) -> subprocess.CompletedProcess[str]:
    """``python -m dtrain.cli ARGS`` with a hard timeout; stdout and stderr captured as text.

    Run from the warm interpreter (``_warm``: forked, with torch and dtrain imported); ``cold``: in a
    fresh ``python -m dtrain.cli`` (for what the command's own start-up does; every command with
    ``DTRAIN_TESTS_COLD=1``). ``timeout`` is for this machine's usual speed (``_patience``)."""
    timeout = patient(timeout)
    if not (cold or _warm.COLD):
        return _warm.run(list(args), timeout=timeout, env=env)
    return subprocess.run(
        [sys.executable, "-m", "dtrain.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def dtrain_runs(
    root: Path, common: list[str], runs: dict[str, list[str]], timeout: float = 240, at_once: int = 2
) -> dict[str, tuple[Path, str]]:
    """``dtrain run COMMON FLAGS --out ROOT/NAME`` for each ``NAME: FLAGS`` of ``runs``, ``at_once`` at a
    time, each within ``timeout`` seconds and exiting 0: name -> (run folder, stdout and stderr)."""
    import time

    timeout = patient(timeout)
    todo, running, out = list(runs), {}, {}
    try:
        while todo or running:
            while todo and len(running) < at_once:
                name = todo.pop(0)
                argv = ["run", *common, *runs[name], "--out", str(root / name)]
                p: Any = (
                    subprocess.Popen(
                        [sys.executable, "-m", "dtrain.cli", *argv],
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        text=True,
                    )
                    if _warm.COLD
                    else _warm.WarmProcess(argv, merge=True)
                )
                running[name] = (p, time.monotonic())
            name = next(iter(running))
            p, t0 = running.pop(name)
            text, _ = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - t0)))
            assert p.returncode == 0, f"{name}: {text[-3000:]}"
            out[name] = (root / name, text)
    finally:
        for q, _ in running.values():
            q.kill()
            q.wait(timeout=60)
    return out


def read_metrics(out: Path) -> list[dict[str, Any]]:
    """The rows of a run folder's ``metrics.jsonl``."""
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def read_summary(out: Path) -> dict[str, Any]:
    """A run folder's ``summary.json``."""
    return dict(json.loads((out / "summary.json").read_text()))


def mean_losses(out: Path) -> dict[int, float]:
    """Per step, the mean of every rank's row loss: the global batch's loss when the ranks' shards are equal
    (each shard counted as often as ranks share it)."""
    rows: dict[int, list[float]] = {}
    for r in read_metrics(out):
        rows.setdefault(r["step"], []).append(r["loss"])
    return {k: sum(v) / len(v) for k, v in rows.items()}
