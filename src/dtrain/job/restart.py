"""Elastic restarts (``dtrain run --max-restarts N``): where a restarted attempt resumes, and what is said.

torch's elastic agent (:func:`dtrain.launch.agent.launch` with ``max_restarts``) stops every worker when
one fails and starts them all again; the new workers see ``TORCHELASTIC_RESTART_COUNT`` > 0. Then:

1. every worker resumes from the run folder's newest complete checkpoint whose files match its
   manifest (checksums compared, as ``--resume RUN`` does): :func:`resume_after_restart`. Before
   the first checkpoint, the checkpoint the run itself resumed from (``--resume``), else step 0.
   Every rank finds the same one: the agent starts the new attempt only once every worker of the
   failed one has exited, so nothing writes to ``checkpoints/`` while they look.
2. each worker drops its rows of the steps it will train again from its metrics file before it
   opens it, so the merged metrics hold one row per step and rank, from the attempt that finished
   the step; the failed attempt's ``error.rankN.txt`` is kept as ``error.rankN.attemptK.txt``.
   The trace (``trace.json``) is the last attempt's: a rank's trace file is written when it ends.
3. in the launcher, :class:`RestartLog` prints one line per restart -- ``dtrain: rank 2 died (SIGKILL)
   at step 37; restarting (1 of 3) from the checkpoint at step 30`` -- and adds the list to the
   summary (``restarts``); the step is one more than the last step the rank wrote a metrics row for
   (steps completed, as checkpoints count them).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtrain.checkpoint.layout import CHECKPOINTS_DIR, CheckpointError, find_checkpoint, read_info
from dtrain.rundir.files import RANK_METRICS, rank_metrics

if TYPE_CHECKING:
    from dtrain.config.schema import RunConfig
    from dtrain.launch.agent import Restart

__all__ = ["restart_count", "restart_checkpoint", "resume_after_restart", "RestartLog"]

RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"  # set by torch's agent in every worker: 0, then 1, 2, ...


def restart_count() -> int:
    """How many times the job's workers have been restarted (0: the first start): torch's agent's count, or
    the rendezvous round (``DTRAIN_ROUND``) where that is more -- a node that joins a running job on several
    (a node started again after it was lost) has an agent of its own that restarted nothing, in a later round."""
    try:
        return max(int(os.environ.get(RESTART_ENV, "0")), int(os.environ.get("DTRAIN_ROUND", "0")))
    except ValueError:
        return 0


def restart_checkpoint(cfg: RunConfig, out_dir: str | Path) -> Path | None:
    """The checkpoint a restarted attempt resumes from: the run folder's newest intact one, else
    ``--resume``'s (the run's own start), else None (step 0)."""
    root = Path(out_dir) / CHECKPOINTS_DIR
    if root.is_dir():
        with contextlib.suppress(CheckpointError):  # none complete (or only damaged ones) yet: --resume's or none
            return find_checkpoint(root, checksums=True)
    return Path(cfg.resume) if cfg.resume else None


def _step_of(ckpt: Path | None) -> int:
    return int(read_info(ckpt)["step"]) if ckpt is not None else 0


def resume_after_restart(cfg: RunConfig, out_dir: str | Path, rank: int) -> RunConfig:
    """In a worker: ``cfg`` unchanged on the first start; after a restart, ``cfg`` resuming from
    :func:`restart_checkpoint`, with this rank's metrics rows of the steps it trains again dropped."""
    attempt = restart_count()
    if attempt == 0:
        return cfg
    out = Path(out_dir)
    ckpt = restart_checkpoint(cfg, out)
    _drop_rows(out / rank_metrics(rank), _step_of(ckpt))
    _keep_error(out, rank, attempt - 1)
    changes: dict[str, Any] = {"resume": str(ckpt) if ckpt is not None else ""}
    world = int(os.environ.get("WORLD_SIZE", cfg.num_processes))
    if world != cfg.num_processes:  # --min-workers: this attempt runs on fewer workers (the servers stay)
        changes["workers"] = world - (cfg.num_processes - cfg.workers)
    return cfg.replace(**changes)


def _keep_error(out: Path, rank: int, attempt: int) -> None:
    """The failed attempt's error file, kept under its attempt's number (not taken for the next one's)."""
    error = out / f"error.rank{rank}.txt"
    if error.is_file():
        error.replace(out / f"error.rank{rank}.attempt{attempt}.txt")


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line cut short when the process was killed
            continue
    return rows


def _drop_rows(path: Path, step: int) -> None:
    """Keep the rows of ``path`` before ``step`` (and those without a step); rewritten atomically."""
    if not path.is_file():
        return
    kept = [r for r in _rows(path) if not isinstance(r.get("step"), int) or r["step"] < step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    tmp.replace(path)


def _last_step(out: Path, rank: int) -> int:
    """Steps completed by ``rank`` by its metrics rows (one more than its last row's step); a rank
    without rows (a server, or one that died before its first step): the furthest of any rank."""

    def done(rows: list[dict[str, Any]]) -> int:
        return max((int(r["step"]) + 1 for r in rows if isinstance(r.get("step"), int)), default=0)

    return done(_rows(out / rank_metrics(rank))) or max((done(_rows(p)) for p in out.glob(RANK_METRICS)), default=0)


class RestartLog:
    """The launcher's ``on_restart``: one line per restart on stderr, and the summary's ``restarts``.

    Args:
        cfg: the run's configuration (its ``resume``, the run's own start).
        out_dir: the run folder.
        say: where the line goes (default: stderr, prefixed ``dtrain:``).
    """

    def __init__(self, cfg: RunConfig, out_dir: str | Path, say: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.out = Path(out_dir)
        self.say = say or (lambda line: print(f"dtrain: {line}", file=sys.stderr, flush=True))
        self.entries: list[dict[str, Any]] = []
        self.workers = cfg.workers  # the training workers of the attempt under way
        start = _step_of(Path(cfg.resume)) if cfg.resume else 0
        self.world_sizes: list[dict[str, int]] = [{"from_step": start, "workers": cfg.workers}]

    def __call__(self, restart: Restart) -> int:
        """Say what failed and where the run goes on; return the processes the next attempt starts."""
        step = _last_step(self.out, restart.rank)
        ckpt = restart_checkpoint(self.cfg, self.out)
        frm = _step_of(ckpt)
        cause = restart.cause()
        entry: dict[str, Any] = {"attempt": restart.attempt, "rank": restart.rank}
        code = restart.exitcodes[restart.rank]
        entry.update({"signal": cause} if code < 0 else {"exitcode": code})
        entry.update(step=step, resumed_from=frm)
        others = {str(r): restart.cause(r) for r in restart.exitcodes if r != restart.rank}
        if others:  # failed after it (a peer's death makes the others' collectives fail)
            entry["also_failed"] = others
        on = self._scale_down(restart.rank, frm)
        entry["workers"] = self.workers
        self.entries.append(entry)
        verb = "died" if code < 0 else "failed"
        where = f"the checkpoint at step {frm}" if ckpt is not None else "step 0 (no complete checkpoint yet)"
        self.say(
            f"rank {restart.rank} {verb} ({cause}) at step {step}; restarting ({restart.attempt} of "
            f"{restart.max_restarts}) from {where}{on}"
        )
        return self.cfg.opts.processes(self.workers)

    def _scale_down(self, failed: int, frm: int) -> str:
        """``--min-workers``: leave the failed worker out while that many remain (its host is taken as lost);
        the words for the restart line ("" when the count stays). The ranks of the strategy's other processes
        (a parameter server's servers) come first and are always restarted."""
        others = self.cfg.num_processes - self.cfg.workers
        if not self.cfg.min_workers or failed < others or self.workers - 1 < self.cfg.min_workers:
            return ""
        was, self.workers = self.workers, self.workers - 1
        for r in range(self.cfg.opts.processes(self.workers), self.cfg.opts.processes(was)):
            # no process of the next attempt has rank r: its rows of the steps trained again go here
            _drop_rows(self.out / rank_metrics(r), frm)
            _keep_error(self.out, r, len(self.entries))
        self.world_sizes.append({"from_step": frm, "workers": self.workers})
        return f" on {self.workers} workers (was {was}; --min-workers {self.cfg.min_workers})"

    def shrank_to(self, processes: int, workers: int) -> None:
        """A job on several nodes went on without a lost node (``--nnodes MIN:MAX``): its last attempt ran
        ``processes`` processes, ``workers`` of them training, from the last restart's checkpoint. The rows the
        lost ranks wrote of the steps trained again are dropped; ``world_sizes`` records the change."""
        frm = int(self.entries[-1].get("resumed_from") or 0) if self.entries else 0
        for r in range(processes, self.cfg.num_processes):
            _drop_rows(self.out / rank_metrics(r), frm)
        self.world_sizes.append({"from_step": frm, "workers": workers})

    def add_to(self, summary: dict[str, Any], results: dict[int, dict[str, Any]]) -> None:
        """Add ``restarts`` to a finished run's summary; its ``steps`` then count the whole run (from the
        run's own start to the end, as an uninterrupted run's), not only the last attempt's. ``wall_s``
        covers every attempt; ``train_s``, ``samples_per_s`` and the metric history are the last attempt's,
        whose first step and step count ``last_attempt`` states."""
        if not self.entries:
            return
        summary["restarts"] = self.entries
        if len(self.world_sizes) > 1:  # --min-workers: the workers from each step on
            summary["world_sizes"] = self.world_sizes
        workers = [r for r in results.values() if r.get("role") == "worker"]
        start = _step_of(Path(self.cfg.resume)) if self.cfg.resume else 0
        summary["steps"] = max(int(w.get("start_step", 0)) + int(w["steps"]) for w in workers) - start
        first = min(int(w.get("start_step", 0)) for w in workers)
        summary["last_attempt"] = {"from_step": first, "steps": max(int(w["steps"]) for w in workers)}
        if self.cfg.resume:
            summary["start_step"] = start
