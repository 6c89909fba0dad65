"""One trial of a sweep: an ordinary ``dtrain run`` of the trial's configuration, followed as it runs.

A trial is a folder ``SWEEP/trials/<trial id>/`` holding one or more *segments*, each an ordinary run
folder (``run-0``, ``run-1``, ...: configuration, metrics, summary, trace, checkpoints). A trial starts
``run-0`` with its sampled configuration; population-based training stops a trial and starts it again
from another trial's checkpoint with perturbed hyper-parameters: that is a new segment, resumed
(``--resume``) from a copy of the donor's checkpoint, so the model, the optimizer state and the
strategy's own state (error-feedback residuals, parameter-server shards) are the donor's.

:func:`run_trial` starts the segment as a separate process (``python -m dtrain.cli run``, its own
process group), reads its evaluations (:data:`dtrain.rundir.files.EVALS`) as rows appear and
hands each to ``report`` (with the segment's checkpoint of that step when the sweep checkpoints), and
stops the process when the caller stops (an early stop raises out of ``report``). It does not import Ray: the Tune side
(:mod:`dtrain.search.tune`) passes ``report`` and the checkpoint to resume from.

Each trial keeps ``trial.json``: its segments, the configuration and, for a resumed one, the donor
trial and step; the sweep's ``sweep.json`` is built from these.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtrain.errors import ConfigError, DTrainError
from dtrain.rundir.files import EVALS, METRICS, rank_metrics, read_summary

__all__ = [
    "TRIAL_FILE",
    "Limits",
    "Report",
    "run_trial",
    "trial_config",
    "read_trial",
    "meta_model",
    "model_params",
    "model_memory",
]

TRIAL_FILE = "trial.json"
DONOR_FILE = "donor.json"  # in a checkpoint handed to Tune: which trial and step it is

# report(metrics, checkpoint folder or None)
Report = Callable[[dict[str, Any], "Path | None"], None]


def trial_config(base: dict[str, Any], hp: dict[str, Any]) -> Any:
    """``base`` (a :meth:`RunConfig.to_dict`) with the trial's hyper-parameters, validated.

    Raises:
        ConfigError: the combination does not fit (heads not dividing the width, ...): the trial is
            skipped, with this message.
    """
    from dtrain.config.schema import RunConfig
    from dtrain.job.validate import validate

    return validate(RunConfig.from_mapping(base).replace(**hp))


def meta_model(cfg: Any) -> tuple[Any, Any]:
    """``cfg``'s model built on the meta device (shapes only, nothing allocated), and its dataset."""
    import torch

    from dtrain.workloads.models import make_model

    data = cfg.load_data()
    with torch.device("meta"):
        model = make_model(
            cfg.model,
            data.input_shape,
            data.num_classes,
            task=data.task,
            model_args=cfg.model_args,
            seq_len=cfg.seq_len,
            **cfg.gpt_overrides(),
        )
        return model, data


def model_params(cfg: Any) -> int:
    """Parameters of ``cfg``'s model, counted on the meta device (nothing allocated)."""
    model, _ = meta_model(cfg)
    return sum(p.numel() for p in model.parameters())


def model_memory(cfg: Any) -> float:
    """Bytes per device the planner's memory model puts on ``cfg``'s run: parameters, gradients,
    optimizer state, activations and the strategy's own buffers (:func:`memory_per_device`), for
    the run's strategy, workers and per-worker batch, profiled on the meta device (nothing allocated)."""
    from dtrain.perfmodel.compression import compression_model
    from dtrain.perfmodel.predict import memory_per_device
    from dtrain.perfmodel.profile import profile_model
    from dtrain.planning.auto import optimizer_kind
    from dtrain.registry import Choice
    from dtrain.workloads.batch import split_batch
    from dtrain.workloads.data import first_samples

    model, data = meta_model(cfg)
    b = split_batch(cfg.batch_size, cfg.opts.batch_shards(cfg.workers))[0]
    x, y = (t.to("meta") for t in first_samples(data.train, b))
    prof = profile_model(model, (x, y), name=cfg.model, measure=False, optimizer=optimizer_kind(cfg))
    spec = cfg.opts.compressor_spec()
    comp = compression_model(spec, measure=False) if spec != "none" else None
    return float(memory_per_device(prof, Choice(cfg.strategy, cfg.workers, cfg.options), comp).total)


@dataclass(frozen=True)
class Limits:
    """What a trial's configuration must fit before it starts; 0 is no limit.

    Attributes:
        max_params: the model's parameters (:func:`model_params`).
        memory_limit: bytes per device by the planner's memory model (:func:`model_memory`).
    """

    max_params: int = 0
    memory_limit: float = 0.0

    def check(self, cfg: Any, entry: dict[str, Any]) -> None:
        """Record ``cfg``'s parameters (and, under a memory limit, its bytes per device) in ``entry``.

        Raises:
            ConfigError: over a limit, naming both figures.
        """
        from dtrain.perfmodel.units import format_bytes

        entry["params"] = n = model_params(cfg)
        if self.max_params and n > self.max_params:
            raise ConfigError(f"{n:,} parameters, over the sweep's --max-params {self.max_params:,}")
        if self.memory_limit:
            entry["memory"] = need = model_memory(cfg)
            if need > self.memory_limit:
                raise ConfigError(
                    f"needs {format_bytes(need)} per device by the planner's memory model, over the "
                    f"sweep's --memory-limit {format_bytes(self.memory_limit)}"
                )


def read_trial(folder: Path) -> dict[str, Any]:
    """A trial folder's ``trial.json`` (empty when the trial never started)."""
    p = folder / TRIAL_FILE
    return json.loads(p.read_text()) if p.is_file() else {}


def _write_trial(folder: Path, record: dict[str, Any]) -> None:
    tmp = folder / f".{TRIAL_FILE}.tmp"
    tmp.write_text(json.dumps(record, indent=1, default=str))
    os.replace(tmp, folder / TRIAL_FILE)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """The segment's process gets SIGTERM when the trial's process dies (an actor killed outright)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _rows(path: Path, proc: subprocess.Popen[bytes], poll_s: float = 0.1) -> Iterator[dict[str, Any]]:
    """The rows of ``path`` as they are appended, until ``proc`` has exited and every row is read."""
    offset, partial = 0, ""
    while True:
        done = proc.poll() is not None
        chunk = ""
        if path.is_file():
            with path.open(encoding="utf-8") as f:
                f.seek(offset)
                chunk = f.read()
                offset = f.tell()
        lines = (partial + chunk).split("\n")
        partial = lines.pop()
        for line in lines:
            if line.strip():
                yield json.loads(line)
        if done:
            return
        time.sleep(poll_s)


def _checkpoint_of(run: Path, step: int, proc: subprocess.Popen[bytes], timeout_s: float) -> Path | None:
    """The segment's complete checkpoint of ``step`` (written just after its evaluation), once it is there."""
    from dtrain.checkpoint.layout import checkpoint_dir

    folder = checkpoint_dir(run / "checkpoints", step)
    deadline = time.monotonic() + timeout_s
    while not (folder / "checkpoint.json").is_file():
        if proc.poll() is not None and not (folder / "checkpoint.json").is_file():
            return None
        if time.monotonic() > deadline:
            raise DTrainError(f"the checkpoint of step {step} did not appear in {folder.parent} within {timeout_s:g}s")
        time.sleep(0.05)
    return folder


def _mark(ckpt: Path, trial: str, run: str, step: int, value: float) -> Path:
    """Write into a checkpoint handed to Tune which trial, segment and step it is, and the metric there."""
    (ckpt / DONOR_FILE).write_text(json.dumps({"trial": trial, "run": run, "step": step, "value": value}))
    return ckpt


def _go(path: Path, step: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(str(step))
    os.replace(tmp, path)


def _trained_to(run: Path) -> int:
    """The steps a segment's rank 0 finished (its metrics rows), wherever it stopped."""
    last = -1
    for name in (rank_metrics(0), METRICS):
        with contextlib.suppress(OSError):
            for line in (run / name).read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    row = json.loads(line)
                    if row.get("rank", 0) == 0:
                        last = max(last, int(row["step"]))
    return last + 1


def _tail(path: Path, lines: int = 6) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


class _Segment:
    """One segment of a trial: its record in ``trial.json``, its run folder, its process."""

    def __init__(
        self, folder: Path, hp: dict[str, Any], report: Report, metric: str, checkpoints: bool, limits: Limits
    ) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.report, self.metric, self.checkpoints = folder, report, metric, checkpoints
        self.limits = limits
        self.record = read_trial(folder) or {"segments": []}
        self.index = len(self.record["segments"])
        self.run = folder / f"run-{self.index}"
        self.entry: dict[str, Any] = {"run": self.run.name, "hp": hp, "started": time.time()}
        self.record["segments"].append(self.entry)
        self.log, self.go = folder / f"{self.run.name}.log", folder / f"{self.run.name}.go"

    def save(self, **changes: Any) -> None:
        self.entry.update(changes)
        _write_trial(self.folder, self.record)

    def tell(self, step: int, value: float, epoch: Any, train_s: Any, ckpt: Path | None) -> None:
        """Record an evaluation and hand it (with its checkpoint) to the scheduler."""
        self.entry.setdefault("evals", []).append({"step": step, "epoch": epoch, "train_s": train_s, "value": value})
        self.save()
        if ckpt is not None:
            _mark(ckpt, self.folder.name, self.run.name, step, value)
        self.report({self.metric: value, "step": step, "epoch": epoch, "train_s": train_s, "segment": self.index}, ckpt)

    def config(self, base: dict[str, Any], hp: dict[str, Any], resume: Path | None) -> Any:
        """The segment's checked configuration (resuming a copy of ``resume``); None: nothing left to train."""
        from dtrain.training.checkpointing import train_steps

        changes: dict[str, Any] = dict(out=str(self.run), progress=False)
        if self.checkpoints:
            changes["checkpoint_every"] = base["eval_every"]
        try:
            cfg = trial_config({**base, **changes}, hp)
            self.limits.check(cfg, self.entry)
            if resume is None:
                return cfg
            donor = json.loads((resume / DONOR_FILE).read_text()) if (resume / DONOR_FILE).is_file() else {}
            self.entry["from"] = donor
            if int(donor.get("step", 0)) >= train_steps(cfg):  # a trial paused after its last step: it is done
                self.save(fate="finished", steps=int(donor["step"]), metric=float(donor["value"]))
                self.tell(int(donor["step"]), float(donor["value"]), None, None, resume)
                return None
            start = self.folder / f"from-{self.index}"
            shutil.rmtree(start, ignore_errors=True)
            shutil.copytree(resume, start)
            return trial_config({**base, **changes, "resume": str(start)}, hp)
        except ConfigError as e:
            self.save(fate="skipped", error=str(e))
            raise

    def start(self, cfg: Any) -> subprocess.Popen[bytes]:
        from dtrain.config.files import dump_toml
        from dtrain.training.loop import HOLD_ENV

        self.save()
        cfg_file = self.folder / f"{self.run.name}.toml"
        cfg_file.write_text(dump_toml(cfg))
        _go(self.go, -1)
        with self.log.open("wb") as out:
            return subprocess.Popen(
                [sys.executable, "-m", "dtrain.cli", "run", str(cfg_file)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
                env={**os.environ, HOLD_ENV: str(self.go)},
            )

    def follow(self, proc: subprocess.Popen[bytes], deadline: float) -> int:
        """Report each evaluation as it appears, holding the run until the scheduler has it; the exit code."""
        for row in _rows(self.run / EVALS, proc):
            if time.monotonic() > deadline:
                raise DTrainError(f"trial {self.folder.name}: {self.run.name} ran past its time")
            step = int(row["step"])
            ckpt = _checkpoint_of(self.run, step, proc, timeout_s=120.0) if self.checkpoints else None
            self.tell(step, row["value"], row["epoch"], row["train_s"], ckpt)
            _go(self.go, step)  # the scheduler has seen it: the run goes on
        return proc.wait(timeout=max(1.0, deadline - time.monotonic()))

    def finish(self) -> dict[str, Any]:
        """After a clean exit: the run's own last evaluation (with its last checkpoint), if not reported yet."""
        from dtrain.checkpoint.layout import checkpoint_dir

        summary = read_summary(self.run)
        last = int(summary.get("start_step") or 0) + int(summary["steps"])
        if not self.entry.get("evals") or self.entry["evals"][-1]["step"] < last:
            ckpt = checkpoint_dir(self.run / "checkpoints", last)  # a trial paused here resumes as done
            has = self.checkpoints and (ckpt / "checkpoint.json").is_file()
            self.tell(last, summary["metric"], None, summary.get("train_s"), ckpt if has else None)
        self.save(fate="finished", steps=last, metric=summary.get("metric"))
        return self.entry


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """End the segment's process group: SIGTERM (the run stops its workers), SIGKILL after 20 s."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_trial(
    folder: Path,
    base: dict[str, Any],
    hp: dict[str, Any],
    report: Report,
    *,
    metric: str,
    resume: Path | None = None,
    checkpoints: bool = False,
    timeout_s: float = 3600.0,
    limits: Limits = Limits(),
    node: str = "",
) -> dict[str, Any]:
    """Run the trial's next segment in ``folder`` until it ends, reporting every evaluation.

    Args:
        folder: the trial's folder (created).
        base: the sweep's run configuration (:meth:`RunConfig.to_dict`); ``eval_every`` set.
        hp: the trial's hyper-parameters (keys of the configuration).
        report: called with ``{metric: value, "step", "epoch", "train_s", "segment"}`` per evaluation,
            and the segment's checkpoint of that step when ``checkpoints``; it raises to stop the trial.
            The run waits at each evaluation until ``report`` returns.
        metric: the run's metric to report (``test_accuracy``, ``val_loss``).
        resume: a checkpoint folder to start from (population-based training's exploit): copied into
            the trial's folder, its ``donor.json`` naming the trial, step and metric it came from.
        checkpoints: checkpoint at every evaluation and hand each checkpoint to ``report``.
        timeout_s: the longest a segment may run.
        limits: a trial whose configuration is over them is skipped before it starts.
        node: where the segment runs (the Ray node's address), recorded.

    Returns:
        The segment's record (as in ``trial.json``).

    Raises:
        ConfigError: the trial's combination does not fit (recorded as skipped).
        DTrainError: the segment failed (the last lines of its output in the message).
    """
    seg = _Segment(folder, hp, report, metric, checkpoints, limits)
    if node:
        seg.entry["node"] = node
    cfg = seg.config(base, hp, resume)
    if cfg is None:
        return seg.entry
    proc = seg.start(cfg)
    try:
        code = seg.follow(proc, time.monotonic() + timeout_s)
    except BaseException:
        seg.entry["fate"] = "stopped"
        raise
    finally:
        _stop(proc)
        seg.save(trained_to=_trained_to(seg.run))
    if code != 0:
        seg.save(fate="failed", error=f"exit code {code}: {_tail(seg.log)}")
        raise DTrainError(f"trial {folder.name}: {seg.run.name} failed with exit code {code}:\n{_tail(seg.log)}")
    return seg.finish()
