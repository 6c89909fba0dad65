"""Run configuration: what every run shares, plus the chosen strategy's own options.

Configuration flows one way: TOML file (:mod:`dtrain.job.files`) -> command-line overrides ->
a :class:`RunConfig` checked by :func:`dtrain.job.validate.validate` -> constructors. The
validation runs in the parent process before any worker starts, so a typo costs a second,
not a launch. This module is the schema: the fields, building a configuration from values
and the values derived from it.

:class:`RunConfig` holds what every run shares (model, data, optimizer, workers,
the run folder, ...); the strategy's options are ``options``, an instance of the
registered strategy's options dataclass (:mod:`dtrain.strategies`). In TOML they
are a table named for the strategy; the shared keys are top-level (a ``[run]``
table may wrap them)::

    strategy = "ps"
    workers = 4
    epochs = 10

    [ps]
    servers = 2
    consistency = "ssp:3"

A flat key of the chosen strategy's options (``servers = 2`` above the table, or
``--servers 2`` on the command line) still works and wins over the table; a flat
key of another strategy is an error that names the strategy it belongs to.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from dtrain.errors import ConfigError
from dtrain.registry import Strategy, StrategyOptions, get, options_for, registered
from dtrain.training.precision import PRECISIONS

if TYPE_CHECKING:
    from dtrain.workloads.data import DatasetSplit

__all__ = [
    "RunConfig",
    "OPTIMIZERS",
    "PRECISIONS",
    "LR_SCHEDULES",
    "BACKENDS",
    "DEVICES",
    "parse_straggler",
    "option_fields",
    "build_options",
    "ConfigHooks",
]

OPTIMIZERS = ("sgd", "adam", "adamw", "lars", "lamb")
NOISE_BETA = 0.99  # the noise scale's moving averages' default decay (dtrain.training.noise_scale.NoiseScale)
LR_SCHEDULES = ("constant", "cosine")
BACKENDS = ("gloo", "nccl", "mpi")
DEVICES = ("cpu", "cuda")
_GPT_SHAPE = ("layers", "d_model", "heads", "dropout")  # RunConfig fields that resize a gpt model


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


def _typed(name: str, default: Any, v: Any) -> Any:
    """``v`` checked against the type of the field's ``default`` (ConfigError naming the option)."""
    if isinstance(default, bool):
        if not isinstance(v, bool):
            raise ConfigError(f"option {name} must be true or false, got {v!r}")
        return v
    if isinstance(default, (int, float)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"option {name} must be a number, got {v!r}")
        if isinstance(default, int) and float(v) != int(v):
            raise ConfigError(f"option {name} must be an integer, got {v!r}")
        return type(default)(v)
    if isinstance(default, str) and not isinstance(v, str):
        raise ConfigError(f"option {name} must be a string, got {v!r}")
    return v


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def option_fields() -> dict[str, list[tuple[str, dataclasses.Field[Any]]]]:
    """Field name -> [(strategy, field), ...] over every registered strategy's options."""
    out: dict[str, list[tuple[str, dataclasses.Field[Any]]]] = {}
    for name, entry in registered().items():
        for f in fields(entry.options):
            out.setdefault(f.name, []).append((name, f))
    return out


def build_options(entry: Strategy, values: Mapping[str, Any]) -> StrategyOptions:
    """``entry``'s options from a mapping of its field names (ConfigError for unknown keys, bad types)."""
    known = {f.name: f for f in fields(entry.options)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"[{entry.name}] has no option(s) {', '.join(unknown)}; "
                          f"valid: {', '.join(known) or 'none'}")  # fmt: skip
    kw = {k: _typed(k, _default(known[k]), v) for k, v in values.items()}
    try:
        return entry.options(**kw)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _no_check(options: Any, cfg: RunConfig) -> None:
    return None


def _itself(cfg: RunConfig) -> RunConfig:
    return cfg


@dataclass(frozen=True)
class ConfigHooks:
    """What the configuration asks a strategy: its registry entry's hooks for this layer.

    Attributes:
        check: cross-checks against the whole run configuration (raise ConfigError);
            the options' own checks run when they are built.
        resolve: runs in the parent before anything starts; returns the configuration to
            run (``auto`` replaces itself by the planner's first choice).
        check_checkpointing: refuse ``--checkpoint-every`` / ``--resume`` where the
            strategy cannot save (ConfigError saying why).
    """

    check: Callable[[Any, RunConfig], None] = _no_check
    resolve: Callable[[RunConfig], RunConfig] = _itself
    check_checkpointing: Callable[[Any, RunConfig], None] = _no_check

    @classmethod
    def of(cls, entry: Strategy) -> ConfigHooks:
        """``entry``'s configuration hooks (the defaults when it gave none)."""
        return entry.hooks_of(cls) or cls()


@dataclass(frozen=True)
class RunConfig:
    """Everything one ``dtrain run`` needs. Field names are the TOML keys and CLI flags.

    Attributes are grouped: what to train, how to distribute it, and the run
    itself. ``options`` is the strategy's own options (default: its defaults).
    """

    # --- what to train
    model: str = "cnn"  # cnn | mlp | gpt | gpt-tiny | gpt-small | gpt-medium
    dataset: str = "digits"  # digits | synthetic | pytext
    samples: int = 4096  # synthetic dataset size
    seq_len: int = 64  # pytext windows and the gpt's context (tokens)
    layers: int = 0  # gpt blocks (0: the preset's)
    d_model: int = 0  # gpt width (0: the preset's)
    heads: int = 0  # gpt attention heads (0: the preset's)
    dropout: float = 0.0  # gpt dropout (0: none, so runs are deterministic)
    epochs: int = 10
    batch_size: int = 64  # global: summed over workers
    lr: float = 0.05
    momentum: float = 0.9
    optimizer: str = "sgd"  # sgd | adam | adamw | lars | lamb
    lr_schedule: str = "constant"  # constant | cosine (decay to 0 over the run's steps)
    lr_scaling: str = "none"  # none | linear | sqrt: lr x (global batch / base_batch), or its square root
    base_batch: int = 0  # the global batch --lr was tuned for (0: the run's first global batch)
    warmup_steps: int = 0  # gradual warmup to the scaled rate over N steps (Goyal et al.)
    warmup_epochs: float = 0.0  # the same in epochs (of the first epoch's steps)
    batch_schedule: str = ""  # "0:256,5:512" (epoch: global batch), or auto (grow toward the noise scale)
    max_batch: int = 0  # auto batch schedule: the largest global batch (0: a quarter of the training set)
    auto_every: int = 0  # auto batch schedule: decide every N steps (0: at the start of each epoch)
    auto_rule: str = "noise"  # auto: double while B_simple >= 2B (noise), or weighed by the step's time (time)
    noise_scale: bool = False  # log the gradient noise scale B_simple every step (dp; McCandlish et al.)
    noise_beta: float = NOISE_BETA  # the noise scale's moving averages' decay (memory ~1/(1-beta) steps)
    precision: str = "fp32"  # fp32 | bf16 | fp16 (autocast compute, fp32 master weights, fp16: loss scaling)
    weight_decay: float = 0.0
    seed: int = 0
    max_steps: int = 0  # stop after this many steps (0: no limit)
    target: float = 0.0  # stop when the metric reaches it: accuracy >= target, or validation loss <= target
    eval_every: int = 0  # evaluate every N steps (0: after each epoch)
    eval_samples: int = 0  # evaluate on the first N test samples / validation windows (0: all)
    # --- how to distribute it
    strategy: str = "dp"  # a registered strategy: dp | ddp (torch's, the peer) | ps | auto | ...
    workers: int = 4
    straggler: str = ""  # RANK:FACTOR
    cluster: str = ""  # emulated cluster name (dtrain cluster up)
    backend: str = ""  # gloo | nccl | mpi (default: nccl for --device cuda with a GPU per process, else gloo)
    device: str = "cpu"  # cpu | cuda (dp, ddp: each process on GPU local_rank mod the GPUs)
    # --- the run itself
    out: str = ""  # run folder (default: runs/<timestamp>-<strategy>)
    overwrite: bool = False  # replace an earlier run in --out (without it: refused)
    timeout_s: float = 300.0
    trace: bool = True  # trace.json (Chrome trace); --no-trace to skip
    trace_steps: str = ""  # trace only steps FIRST-LAST (e.g. 20-40; default: all, up to 100k events a rank)
    tensorboard: bool = False  # the evaluating rank's scalars as TensorBoard events in RUN/tensorboard
    progress: bool = True
    checkpoint_every: int = 0  # save a checkpoint every N steps and at the end (0: never)
    resume: str = ""  # a checkpoint folder, or a run folder (its latest complete checkpoint)
    skip_nonfinite: int = 0  # skip up to N steps whose loss or gradients are not finite (0: stop at the first)
    max_restarts: int = 0  # when a process dies, restart all from the newest checkpoint, up to N times
    min_workers: int = 0  # with max_restarts: a restart drops the failed worker while this many remain (0: never)
    extra: dict[str, Any] = field(default_factory=dict)
    options: StrategyOptions | None = None  # the strategy's (default: its defaults)

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", options_for(self.strategy, self.options))
        if self.batch_schedule and self.batch_schedule != "auto":  # its epoch-0 batch is the run's first
            from dtrain.training.large_batch import parse_batch_schedule

            object.__setattr__(self, "batch_size", parse_batch_schedule(self.batch_schedule)[0][1])

    # ------------------------------------------------------------------ building

    @property
    def entry(self) -> Strategy:
        """The registered strategy this run uses."""
        return get(self.strategy)

    @property
    def hooks(self) -> ConfigHooks:
        """What the configuration asks this run's strategy (:class:`ConfigHooks`)."""
        return ConfigHooks.of(self.entry)

    @property
    def opts(self) -> StrategyOptions:
        """The strategy's options (never None after construction)."""
        assert self.options is not None
        return self.options

    @classmethod
    def shared_fields(cls) -> list[dataclasses.Field[Any]]:
        """The fields every run shares (all but ``extra`` and ``options``)."""
        return [f for f in fields(cls) if f.name not in ("extra", "options")]

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> RunConfig:
        """Build from TOML-shaped values: shared keys, ``extra``, and the strategy's table.

        Unknown keys are an error naming them; a flat key of the chosen strategy's
        options goes into its options (and wins over its table).
        """
        shared = {f.name: f for f in cls.shared_fields()}
        strategy = values.get("strategy", "dp")
        if not isinstance(strategy, str):
            raise ConfigError(f"option strategy must be a string, got {strategy!r}")
        entry = get(strategy)
        table = values.get(strategy, {})
        if not isinstance(table, Mapping):
            raise ConfigError(f"[{strategy}] must be a table of options, got {table!r}")
        opts = dict(table)
        everywhere = option_fields()
        kw: dict[str, Any] = {}
        for k, v in values.items():
            if k in shared:
                kw[k] = _typed(k, _default(shared[k]), v)
            elif k == "extra" or k == strategy:
                continue
            elif any(s == strategy for s, _ in everywhere.get(k, [])):
                opts[k] = v
            elif k in everywhere:
                owners = sorted({s for s, _ in everywhere[k]} | ({k} if k in registered() else set()))
                raise ConfigError(f"option {k} belongs to strategy {' / '.join(owners)} ([{owners[0]}] in TOML); "
                                  f"this run's strategy is {strategy}")  # fmt: skip
            elif k in registered():
                raise ConfigError(f"[{k}] holds options of strategy {k}; this run's strategy is {strategy}")
            else:
                mine = (name for name, owners in everywhere.items() if any(s == strategy for s, _ in owners))
                valid = sorted([*shared, *mine])
                raise ConfigError(f"unknown option(s) {k}; valid options: {', '.join(valid)}")
        extra = values.get("extra", {})
        if not isinstance(extra, Mapping):
            raise ConfigError(f"[extra] must be a table, got {extra!r}")
        return cls(**kw, extra=dict(extra), options=build_options(entry, opts))

    @classmethod
    def make(cls, **values: Any) -> RunConfig:
        """Keyword shorthand for :meth:`from_mapping`: ``RunConfig.make(strategy="ps", servers=2)``."""
        return cls.from_mapping(values)

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with ``changes`` (shared keys, the strategy's option names, or ``options``).

        Changing ``strategy`` starts from the new strategy's default options.
        """
        if "options" in changes:
            opts = changes.pop("options")
            base = dataclasses.replace(self, strategy=changes.pop("strategy", self.strategy), options=opts)
            return base.replace(**changes) if changes else base
        d = self.to_dict()
        if changes.get("strategy", self.strategy) != self.strategy:
            d.pop(self.strategy, None)
        return self.from_mapping({**d, **changes})

    def to_dict(self) -> dict[str, Any]:
        """TOML-shaped: shared keys, ``extra``, and the options as a table named for the strategy."""
        d = {f.name: getattr(self, f.name) for f in self.shared_fields()}
        d["extra"] = dict(self.extra)
        d[self.strategy] = self.opts.to_table()
        return d

    # ------------------------------------------------------------------ derived values

    @property
    def num_processes(self) -> int:
        """Processes one run starts (the strategy's, e.g. workers plus servers for the parameter server)."""
        return self.opts.processes(self.workers)

    @property
    def global_batch(self) -> int:
        """Samples a step trains on: ``batch_size // shards`` per shard, times the shards
        (:mod:`dtrain.workloads.batch`)."""
        from dtrain.workloads.batch import split_batch

        return split_batch(self.batch_size, self.opts.batch_shards(self.workers))[1]

    def process_backend(self) -> str:
        """The process group's backend: ``--backend``, else NCCL where every process has a GPU of its own
        (``--device cuda``, no more processes than GPUs), else gloo (which carries CUDA tensors through host
        memory, so several processes can share one GPU)."""
        if self.backend:
            return self.backend
        if self.device == "cuda":
            import torch
            import torch.distributed as dist

            if dist.is_nccl_available() and self.local_processes <= torch.cuda.device_count():
                return "nccl"
        return "gloo"

    @property
    def local_processes(self) -> int:
        """The processes on this machine: all of them, or a node's share in a job on several
        (``DTRAIN_LOCAL_PROCESSES``, which ``dtrain run --nnodes`` sets)."""
        return int(os.environ.get("DTRAIN_LOCAL_PROCESSES") or self.num_processes)

    def gpt_overrides(self) -> dict[str, Any]:
        """The gpt shape flags that were set (0 means the preset's value)."""
        return {k: getattr(self, k) for k in _GPT_SHAPE if getattr(self, k)}

    def load_data(self) -> DatasetSplit:
        """This run's dataset (every process loads it; small and deterministic)."""
        from dtrain.workloads.data import load_dataset

        return load_dataset(self.dataset, seed=self.seed, samples=self.samples, seq_len=self.seq_len)
