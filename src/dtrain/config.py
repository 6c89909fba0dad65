"""Run configuration: one frozen dataclass, read from TOML and the command line.

Configuration flows one way: TOML file -> command-line overrides -> a validated
:class:`RunConfig` -> constructors. :meth:`RunConfig.validate` runs in the parent
process before any worker starts, so a typo costs a second, not a launch.

TOML keys are the field names below (a flat table; ``[run]`` may wrap them)::

    workers = 4
    strategy = "dp"
    algorithm = "ring"
    epochs = 10
    batch_size = 64
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from dtrain.errors import ConfigError

__all__ = [
    "RunConfig",
    "STRATEGIES",
    "ALGORITHMS",
    "OVERLAPS",
    "OPTIMIZERS",
    "LR_SCHEDULES",
    "load_toml",
    "dump_toml",
    "parse_straggler",
]

# Registries the CLI accepts; tests check they match the implementations' own.
STRATEGIES = ("dp", "ddp", "ps", "auto")
ALGORITHMS = ("native", "ring", "tree", "recursive_doubling", "rabenseifner", "hierarchical")
OVERLAPS = ("backward", "forward")
OPTIMIZERS = ("sgd", "adam")
LR_SCHEDULES = ("constant", "cosine")


def parse_straggler(spec: str) -> tuple[int, float]:
    """Parse ``"RANK:FACTOR"`` (e.g. ``"2:4"``: worker rank 2 runs 4x slower)."""
    try:
        r, f = spec.split(":")
        rank, factor = int(r), float(f)
    except ValueError:
        raise ConfigError(f"straggler must be RANK:FACTOR, e.g. 1:4; got {spec!r}") from None
    if rank < 0 or factor < 1.0:
        raise ConfigError(f"straggler rank must be >= 0 and factor >= 1; got {spec!r}")
    return rank, factor


@dataclass(frozen=True)
class RunConfig:
    """Everything one ``dtrain run`` needs. Field names are the TOML keys and CLI flags.

    Attributes are grouped: what to train, how to distribute it, and the run itself.
    """

    # --- what to train
    model: str = "cnn"  # cnn | mlp
    dataset: str = "digits"  # digits | synthetic
    samples: int = 4096  # synthetic dataset size
    epochs: int = 10
    batch_size: int = 64  # global: summed over workers
    lr: float = 0.05
    momentum: float = 0.9
    optimizer: str = "sgd"  # sgd | adam
    lr_schedule: str = "constant"  # constant | cosine (decay to 0 over the run's steps)
    weight_decay: float = 0.0
    seed: int = 0
    max_steps: int = 0  # stop after this many steps (0: no limit)
    # --- how to distribute it
    strategy: str = "dp"  # dp | ddp (torch's, the peer) | ps | auto
    workers: int = 4
    algorithm: str = "ring"
    bucket_mb: float = 25.0
    overlap: str = "backward"  # backward | forward (priority scheduling)
    compression: str = "none"  # e.g. topk:0.01, qsgd:16, powersgd:2
    error_feedback: bool = True
    servers: int = 1  # parameter server: ranks 0..servers-1 serve
    consistency: str = "bsp"  # bsp | asp | ssp:S | softsync:K | backup:B
    staleness_lr: bool = False
    straggler: str = ""  # RANK:FACTOR
    cluster: str = ""  # emulated cluster name (dtrain cluster up)
    backend: str = ""  # gloo | nccl | mpi (default: nccl with CUDA, else gloo)
    # --- the run itself
    out: str = ""  # run folder (default: runs/<timestamp>-<strategy>)
    timeout_s: float = 300.0
    trace: bool = True  # trace.json (Chrome trace); --no-trace to skip
    progress: bool = True
    checkpoint_every: int = 0  # save a checkpoint every N steps and at the end (0: never)
    resume: str = ""  # a checkpoint folder, or a run folder (its latest complete checkpoint)
    extra: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ building

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "RunConfig":
        """Build from a mapping of field names (unknown keys are an error naming them)."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ConfigError(
                f"unknown option(s) {', '.join(unknown)}; valid options: {', '.join(sorted(names))}"
            )
        kw: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in values:
                continue
            v = values[f.name]
            default = f.default if f.default is not dataclasses.MISSING else None
            if isinstance(default, bool) and not isinstance(v, bool):
                raise ConfigError(f"option {f.name} must be true or false, got {v!r}")
            if isinstance(default, (int, float)) and not isinstance(default, bool):
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise ConfigError(f"option {f.name} must be a number, got {v!r}")
                if isinstance(default, int) and not isinstance(default, bool) and float(v) != int(v):
                    raise ConfigError(f"option {f.name} must be an integer, got {v!r}")
                v = type(default)(v)
            if isinstance(default, str) and not isinstance(v, str):
                raise ConfigError(f"option {f.name} must be a string, got {v!r}")
            kw[f.name] = v
        return cls(**kw)

    def replace(self, **changes: Any) -> "RunConfig":
        return self.from_mapping({**self.to_dict(), **changes})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------ validation

    @property
    def num_processes(self) -> int:
        """Processes one run starts: workers, plus servers for the parameter server."""
        return self.workers + (self.servers if self.strategy == "ps" else 0)

    def validate(self) -> "RunConfig":
        """Check every option; raise :class:`ConfigError` saying what to change."""
        from dtrain.data import DATASETS
        from dtrain.models import MODELS

        def choose(name: str, value: str, choices: tuple[str, ...]) -> None:
            if value not in choices:
                raise ConfigError(f"{name} {value!r} is not known; choose one of: {', '.join(choices)}")

        choose("model", self.model, MODELS)
        choose("dataset", self.dataset, DATASETS)
        choose("strategy", self.strategy, STRATEGIES)
        choose("algorithm", self.algorithm, ALGORITHMS)
        choose("overlap", self.overlap, OVERLAPS)
        choose("optimizer", self.optimizer, OPTIMIZERS)
        choose("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        if self.workers < 1:
            raise ConfigError(f"workers must be >= 1, got {self.workers}")
        if self.epochs < 1:
            raise ConfigError(f"epochs must be >= 1, got {self.epochs}")
        if self.batch_size < self.workers:
            raise ConfigError(
                f"batch_size is global ({self.batch_size}) and must be at least workers ({self.workers})"
            )
        if self.batch_size % self.workers:
            raise ConfigError(
                f"batch_size {self.batch_size} is not divisible by workers {self.workers}; "
                f"use a multiple, e.g. {self.workers * max(1, self.batch_size // self.workers)}"
            )
        if not self.lr > 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.bucket_mb <= 0:
            raise ConfigError(f"bucket_mb must be > 0, got {self.bucket_mb}")
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.max_steps < 0:
            raise ConfigError(f"max_steps must be >= 0, got {self.max_steps}")
        if self.samples < 16:
            raise ConfigError(f"samples must be >= 16, got {self.samples}")
        train_size = self.samples if self.dataset == "synthetic" else 1437  # digits: 80% of 1797
        if self.batch_size > train_size:
            raise ConfigError(
                f"batch_size {self.batch_size} is larger than the training set ({train_size} samples)"
            )
        if self.backend and self.backend not in ("gloo", "nccl", "mpi"):
            raise ConfigError(f"backend {self.backend!r} is not known; choose gloo, nccl or mpi")
        if self.strategy == "ps":
            if self.servers < 1:
                raise ConfigError(f"the parameter server needs servers >= 1, got {self.servers}")
            from dtrain.param_server.consistency import parse_consistency

            try:
                parse_consistency(self.consistency, staleness_lr=self.staleness_lr).check_workers(self.workers)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if self.straggler:
            rank, _ = parse_straggler(self.straggler)
            if rank >= self.num_processes:
                raise ConfigError(f"straggler rank {rank} is outside the {self.num_processes} processes")
        if self.compression not in ("", "none"):
            from dtrain.compress import from_spec

            try:
                from_spec(self.compression, error_feedback=self.error_feedback)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if self.resume and self.strategy == "ps" and self.lr_schedule != "constant":
            raise ConfigError(
                f"resume under the parameter server supports lr_schedule 'constant' only (the servers do not "
                f"restore the schedule's position yet); got {self.lr_schedule!r}: resume with --lr-schedule constant"
            )
        from dtrain.checkpoint.training import check_resume

        check_resume(self)
        return self


# ---------------------------------------------------------------------- TOML


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a run config file; a top-level ``[run]`` table is unwrapped."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from None
    if set(data) == {"run"} and isinstance(data["run"], dict):
        data = data["run"]
    return data


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def dump_toml(cfg: RunConfig) -> str:
    """The resolved configuration as TOML that :func:`load_toml` reads back."""
    lines = ["# dtrain run configuration (resolved); rerun with: dtrain run config.toml"]
    d = cfg.to_dict()
    extra = d.pop("extra")
    for k, v in d.items():
        lines.append(f"{k} = {_toml_value(v)}")
    if extra:
        lines.append("")
        lines.append("[extra]")
        for k, v in extra.items():
            lines.append(f"{k} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"
