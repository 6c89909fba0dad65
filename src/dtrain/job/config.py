"""Run configuration: what every run shares, plus the chosen strategy's own options.

Configuration flows one way: TOML file -> command-line overrides -> a validated
:class:`RunConfig` -> constructors. :meth:`RunConfig.validate` runs in the parent
process before any worker starts, so a typo costs a second, not a launch.

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
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtrain.errors import ConfigError
from dtrain.job.files import read_toml
from dtrain.strategies.base import Strategy, StrategyOptions, get, options_for, registered
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
    "load_toml",
    "dump_toml",
    "parse_straggler",
    "option_fields",
    "build_options",
]

OPTIMIZERS = ("sgd", "adam", "adamw", "lars", "lamb")
NOISE_BETA = 0.99  # the noise scale's moving averages' default decay (dtrain.training.noise_scale.NoiseScale)
LR_SCHEDULES = ("constant", "cosine")
BACKENDS = ("gloo", "nccl", "mpi")
DEVICES = ("cpu", "cuda")
CUDA_STRATEGIES = ("dp", "ddp")  # the strategies that train on --device cuda
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


@dataclass(frozen=True)
class RunConfig:
    """Everything one ``dtrain run`` needs. Field names are the TOML keys and CLI flags.

    Attributes are grouped: what to train, how to distribute it, and the run
    itself. ``options`` is the strategy's own options (default: its defaults).
    """

    # --- what to train
    model: str = field(default="cnn", metadata={"help": "cnn | mlp (classifiers) | gpt-tiny | gpt-small | gpt-medium | "
                       "gpt (gpt-small's shape, resized by --layers --d-model --heads) (default: cnn)"})
    dataset: str = field(default="digits", metadata={"help": "digits (scikit-learn's 1,797 8x8 digits) | synthetic (a "
                         "random teacher's labels, --samples) | pytext (the Python documentation text shipped with "
                         "CPython, pydoc_data.topics: about 465 KB of English as byte tokens, 90% train / 10% "
                         "validation; for gpt models) (default: digits)"})
    samples: int = field(default=4096, metadata={"help": "the synthetic dataset's size (default: 4096)"})
    seq_len: int = field(default=64, metadata={"help": "tokens per pytext window and the gpt's context (default: 64)"})
    layers: int = field(default=0, metadata={"help": "gpt blocks (default: 0, the preset's)"})
    d_model: int = field(default=0, metadata={"help": "gpt width (default: 0, the preset's)"})
    heads: int = field(default=0, metadata={"help": "gpt attention heads (default: 0, the preset's)"})
    dropout: float = field(default=0.0, metadata={"help": "gpt dropout (default: 0, none: runs are deterministic)"})
    epochs: int = field(default=10, metadata={"help": "passes over the training set (default: 10)"})
    batch_size: int = field(default=64, metadata={"help": "global batch size, summed over workers (default: 64)"})
    lr: float = field(default=0.05, metadata={"help": "learning rate (default: 0.05)"})
    momentum: float = field(default=0.9, metadata={"help": "SGD momentum (default: 0.9)"})
    optimizer: str = field(default="sgd", metadata={"help": "sgd | adam | adamw | lars (You et al. 2017) | lamb (You "
                           "et al. 2019) (default: sgd)"})
    lr_schedule: str = field(default="constant", metadata={"help": "learning rate over the run: constant, or cosine "
                             "from --lr down to 0 at the last step (default: constant)"})
    lr_scaling: str = field(default="none", metadata={"help": "scale --lr with the global batch: linear (lr x B / base "
                            "batch, Goyal et al. 2017), sqrt, or none (default: none)"})
    base_batch: int = field(default=0, metadata={"help": "the global batch --lr was tuned for (default: 0, the run's "
                            "first global batch)"})
    warmup_steps: int = field(default=0, metadata={"help": "gradual warmup over N steps: from --lr to the scaled rate "
                              "(Goyal et al.), or from near 0 without scaling (default: 0)"})
    warmup_epochs: float = field(default=0.0, metadata={"help": "the warmup in epochs instead (of the first epoch's "
                                 "steps) (default: 0)"})
    batch_schedule: str = field(default="", metadata={"help": 'grow the global batch: "0:256,5:512" (from epoch: '
                                "batch), or auto (double it while the measured gradient noise scale exceeds it; dp) "
                                "(default: none)"})
    max_batch: int = field(default=0, metadata={"help": "the largest batch --batch-schedule auto grows to (default: 0, "
                           "a quarter of the training set)"})
    auto_every: int = field(default=0, metadata={"help": "--batch-schedule auto decides every N steps, inside epochs "
                            "too (default: 0, at the start of each epoch)"})
    auto_rule: str = field(default="noise", metadata={"help": "--batch-schedule auto doubles the batch while the noise "
                           "scale exceeds twice it (noise), or while the noise scale times the step's fixed time over "
                           "its batch's compute time does (time: the batch that reaches a loss soonest; McCandlish et "
                           "al.'s step count times the step time) (default: noise)"})
    noise_scale: bool = field(default=False, metadata={"help": "log the gradient noise scale B_simple every step "
                              "(McCandlish et al. 2018; dp, 2+ workers; one extra scalar all-reduce) (default: off)"})
    noise_beta: float = field(default=NOISE_BETA, metadata={"help": "the decay of the noise scale's moving averages of "
                              "|G|^2 and tr(Sigma), a memory of about 1/(1-BETA) steps: a long one lags where |G|^2 "
                              "falls fast, early in training (default: 0.99)"})
    precision: str = field(default="fp32", metadata={"help": "compute precision: fp32, or bf16 / fp16 under torch "
                           "autocast with float32 master weights; fp16 scales the loss (dynamic, the overflow skip "
                           "agreed by every rank of a step); gradients travel in 16 bits (default: fp32)"})
    weight_decay: float = field(default=0.0, metadata={"help": "the optimizer's weight decay (default: 0)"})
    seed: int = field(default=0, metadata={"help": "seed of the data, the model's initialization and the sampling "
                      "(default: 0)"})
    max_steps: int = field(default=0, metadata={"help": "stop after this many steps (default: 0, no limit)"})
    target: float = field(default=0.0, metadata={"help": "stop when the metric reaches it: test accuracy >= TARGET, or "
                          "a language model's validation loss (nats/token) <= TARGET; summary.json records "
                          "time_to_target_s (default: 0, no target)"})
    eval_every: int = field(default=0, metadata={"help": "evaluate every N steps (default: 0, after each epoch)"})
    eval_samples: int = field(default=0, metadata={"help": "evaluate on the first N test samples or validation windows "
                              "(default: 0, all)"})
    # --- how to distribute it
    strategy: str = field(default="dp", metadata={"help": "how to distribute: one of the registered strategies "
                          "(default: dp)"})
    workers: int = field(default=4, metadata={"help": "worker processes (default: 4)"})
    straggler: str = field(default="", metadata={"help": "RANK:FACTOR: that rank's own work per step (data, forward, "
                           "backward) takes FACTOR times its usual time (median of its last 50 steps); communication "
                           "is not slowed"})
    cluster: str = field(default="", metadata={"help": "run on an emulated cluster made by `dtrain cluster up --name "
                         "NAME`"})
    backend: str = field(default="", metadata={"help": "the process group's backend: gloo | nccl | mpi (default: nccl "
                         "for --device cuda with a GPU per process, else gloo)"})
    device: str = field(default="cpu", metadata={"help": "cpu, or cuda: each worker on GPU (local rank mod the GPUs); "
                        "dp and ddp. NCCL where every worker has a GPU of its own, else gloo, whose collectives carry "
                        "CUDA tensors through host memory (so 4 workers can share one GPU) (default: cpu)"})
    # --- the run itself
    out: str = field(default="", metadata={"help": "run folder (default: runs/<timestamp>-<strategy>); one that holds "
                     "files is refused unless --overwrite"})
    overwrite: bool = field(default=False, metadata={"help": "replace the earlier run in --out: everything in that "
                            "folder is deleted first (default: off)"})
    timeout_s: float = field(default=300.0, metadata={"help": "seconds a collective, a message or a wait between "
                             "ranks may block before the run stops (default: 300)"})
    trace: bool = field(default=True, metadata={"help": "write trace.json, a Chrome trace of every rank's steps "
                        "(default: on; --no-trace to skip)"})
    trace_steps: str = field(default="", metadata={"help": "trace only steps FIRST-LAST, e.g. 20-40 (default: all "
                             "steps, up to 100,000 events a rank)"})
    tensorboard: bool = field(default=False, metadata={"help": "write the evaluating rank's per-step loss, lr, "
                              "samples/s (loss scale, noise scale when present) and each evaluation's metric as "
                              "TensorBoard event files in RUN/tensorboard (needs the tensorboard package) (default: "
                              "off)"})
    progress: bool = field(default=True, metadata={"help": "a progress bar on the terminal (default: on)"})
    checkpoint_every: int = field(default=0, metadata={"help": "save a checkpoint to RUN/checkpoints every N steps and "
                                  "at the end (default: 0, never)"})
    resume: str = field(default="", metadata={"help": "continue from a checkpoint folder, or a run folder's newest "
                        "intact checkpoint (its files checked against the checkpoint's manifest)"})
    skip_nonfinite: int = field(default=0, metadata={"help": "skip up to N steps whose loss or gradients are not "
                                "finite, on every rank that shares the step (no optimizer step); the next one stops "
                                "the run (default: 0, stop at the first)"})
    max_restarts: int = field(default=0, metadata={"help": "when a process dies, restart every process from the run "
                              "folder's newest complete checkpoint, up to N times (torch's elastic agent; needs "
                              "--checkpoint-every) (default: 0, the run fails)"})
    min_workers: int = field(default=0, metadata={"help": "with --max-restarts: a restart leaves out the worker that "
                             "failed (its host taken as lost, as Horovod's elastic mode blacklists it) while at least "
                             "N workers remain, and the run goes on with fewer from the newest checkpoint, resharded; "
                             "the global batch stays (it must divide over every count from N up) (default: 0, "
                             "restart on every worker)"})
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

    # ------------------------------------------------------------------ validation

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

    def _check_names(self) -> None:
        from dtrain.workloads.data import DATASETS
        from dtrain.workloads.models import MODELS

        def choose(name: str, value: str, choices: tuple[str, ...]) -> None:
            if value not in choices:
                raise ConfigError(f"{name} {value!r} is not known; choose one of: {', '.join(choices)}")

        choose("model", self.model, MODELS)
        choose("dataset", self.dataset, DATASETS)
        self._check_task()
        choose("optimizer", self.optimizer, OPTIMIZERS)
        choose("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        choose("precision", self.precision, PRECISIONS)
        from dtrain.training.large_batch import AUTO_RULES, LR_SCALINGS

        choose("lr_scaling", self.lr_scaling, LR_SCALINGS)
        choose("auto_rule", self.auto_rule, AUTO_RULES)
        if self.backend and self.backend not in BACKENDS:
            raise ConfigError(f"backend {self.backend!r} is not known; choose gloo, nccl or mpi")
        choose("device", self.device, DEVICES)

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

    def _check_device(self) -> None:
        """``--device cuda``: a GPU here, a strategy that trains on it, a backend that can carry it."""
        backend = self.process_backend()
        if self.device == "cpu":
            if backend == "nccl":
                raise ConfigError("backend nccl reduces CUDA tensors, and this run trains on the CPU: add "
                                  "--device cuda, or use --backend gloo")  # fmt: skip
            return
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("device cuda: torch sees no CUDA device here "
                              f"(torch {torch.__version__}); use --device cpu")  # fmt: skip
        if self.strategy not in CUDA_STRATEGIES:
            raise ConfigError(f"device cuda: strategy {self.strategy} trains on the CPU; --device cuda takes "
                              f"{' or '.join(CUDA_STRATEGIES)}")  # fmt: skip
        if self.cluster:
            raise ConfigError("device cuda: an emulated cluster (--cluster) runs CPU workers; drop one of the two")
        if backend == "mpi":
            raise ConfigError("device cuda: the mpi backend carries CPU tensors; use --backend gloo or nccl")
        gpus = torch.cuda.device_count()
        if backend == "nccl" and self.local_processes > gpus:
            raise ConfigError(f"backend nccl takes one GPU per process: {self.local_processes} processes on {gpus} "
                              f"GPU(s); use --backend gloo (CUDA tensors through host memory) or fewer workers")
        if self.noise_scale or self.batch_schedule == "auto":
            raise ConfigError("device cuda: the noise scale (--noise-scale, --batch-schedule auto) is measured on "
                              "CPU runs only; drop it or use --device cpu")

    def _check_task(self) -> None:
        """A language model trains on text, a classifier on images; gpt flags need a gpt model."""
        from dtrain.workloads.models import is_language_model

        lm, text = is_language_model(self.model), self.dataset == "pytext"
        if lm and not text:
            raise ConfigError(f"model {self.model} is a language model; use --dataset pytext")
        if text and not lm:
            raise ConfigError("dataset pytext is text; use a language model: --model gpt-tiny, gpt-small, ...")
        if not lm:
            given = [f"--{k.replace('_', '-')}" for k in self.gpt_overrides()]
            if given:
                raise ConfigError(f"{', '.join(given)} shape(s) a gpt model; model {self.model} has no such option")
        if lm and self.target < 0:
            raise ConfigError(f"target is a validation loss (nats per token) for {self.model}; got {self.target}")
        if not lm and not 0 <= self.target <= 1:
            raise ConfigError(f"target is a test accuracy in (0, 1] for {self.model}; got {self.target}")

    def gpt_overrides(self) -> dict[str, Any]:
        """The gpt shape flags that were set (0 means the preset's value)."""
        return {k: getattr(self, k) for k in _GPT_SHAPE if getattr(self, k)}

    def load_data(self) -> DatasetSplit:
        """This run's dataset (every process loads it; small and deterministic)."""
        from dtrain.workloads.data import load_dataset

        return load_dataset(self.dataset, seed=self.seed, samples=self.samples, seq_len=self.seq_len)

    def _check_numbers(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"workers must be >= 1, got {self.workers}")
        if self.epochs < 1:
            raise ConfigError(f"epochs must be >= 1, got {self.epochs}")
        shards = self.opts.batch_shards(self.workers)
        if self.batch_size < shards:
            raise ConfigError(
                f"batch_size is global ({self.batch_size}) and must be at least workers ({self.workers})"
            )
        # a batch that does not divide is trained as batch // shards per shard (global_batch)
        if not self.lr > 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.max_steps < 0:
            raise ConfigError(f"max_steps must be >= 0, got {self.max_steps}")
        if self.samples < 16:
            raise ConfigError(f"samples must be >= 16, got {self.samples}")
        for k in ("eval_every", "eval_samples", "layers", "d_model", "heads", "skip_nonfinite", "base_batch",
                  "warmup_steps", "warmup_epochs", "max_batch", "auto_every", "max_restarts",
                  "min_workers"):
            if getattr(self, k) < 0:
                raise ConfigError(f"{k} must be >= 0, got {getattr(self, k)}")
        if self.seq_len < 2:
            raise ConfigError(f"seq_len must be >= 2, got {self.seq_len}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        if not 0 <= self.noise_beta < 1:
            raise ConfigError(f"noise_beta must be in [0, 1), got {self.noise_beta:g}")
        if self.model.startswith("gpt"):
            from dtrain.workloads.models.gpt import resolve_gpt_config

            try:
                resolve_gpt_config(self.model, **self.gpt_overrides(), seq_len=self.seq_len)
            except ValueError as e:
                raise ConfigError(f"model {self.model}: {e}") from None
        size = len(self.load_data().train)
        if self.batch_size > size:
            raise ConfigError(f"batch_size {self.batch_size} is larger than the training set ({size} samples)")
        self._check_large_batch(size)

    def _check_large_batch(self, size: int) -> None:
        """Warmup, the batch schedule and the noise scale (:mod:`dtrain.training.large_batch`)."""
        if self.warmup_steps and self.warmup_epochs:
            raise ConfigError(f"give warmup_steps ({self.warmup_steps}) or warmup_epochs ({self.warmup_epochs:g}), "
                              "not both")  # fmt: skip
        shards = self.opts.batch_shards(self.workers)
        if self.batch_schedule == "auto":
            if not self.opts.measures_noise_scale(self.workers):
                raise ConfigError(
                    "batch_schedule auto grows the batch toward the gradient noise scale that plain "
                    "data parallelism measures: use --strategy dp (no --shard) with 2 or more workers"
                )
            if self.max_batch and (self.max_batch > size or self.max_batch % shards):
                raise ConfigError(f"max_batch {self.max_batch} must be a multiple of the {shards} workers and at "
                                  f"most the training set ({size} samples)")  # fmt: skip
            if self.batch_size % shards:
                raise ConfigError(f"batch_schedule auto doubles the batch: batch_size {self.batch_size} must be a "
                                  f"multiple of the {shards} workers")  # fmt: skip
        elif self.auto_every or self.auto_rule != "noise":
            given = f"--auto-every {self.auto_every}" if self.auto_every else f"--auto-rule {self.auto_rule}"
            raise ConfigError(f"{given} tells --batch-schedule auto when and how to grow the batch; add "
                              "--batch-schedule auto or drop it")  # fmt: skip
        elif self.batch_schedule:
            from dtrain.training.large_batch import parse_batch_schedule

            for epoch, batch in parse_batch_schedule(self.batch_schedule):
                if batch % shards:
                    raise ConfigError(f"batch_schedule: the batch {batch} (from epoch {epoch}) does not divide "
                                      f"into the {shards} workers' shards; use a multiple of {shards}")  # fmt: skip
                if batch > size:
                    raise ConfigError(f"batch_schedule: the batch {batch} (from epoch {epoch}) is larger than "
                                      f"the training set ({size} samples)")  # fmt: skip
                self.entry.check(self.opts, dataclasses.replace(self, batch_schedule="", batch_size=batch))
        if self.noise_beta != NOISE_BETA and not (self.noise_scale or self.batch_schedule == "auto"):
            raise ConfigError(f"noise_beta {self.noise_beta:g} sets how the noise scale is averaged; add --noise-scale "
                              "or --batch-schedule auto, or drop it")  # fmt: skip
        if self.noise_scale and not self.opts.measures_noise_scale(self.workers):
            raise ConfigError("noise_scale compares each worker's gradient with their average: use --strategy dp "
                              "(no --shard) with 2 or more workers")  # fmt: skip

    def validate(self) -> RunConfig:
        """Check every option; raise :class:`ConfigError` saying what to change."""
        self._check_names()
        self._check_numbers()
        self._check_device()
        if self.trace_steps:
            from dtrain.observe.trace import parse_trace_steps

            parse_trace_steps(self.trace_steps)
            if not self.trace:
                raise ConfigError("--trace-steps chooses the steps of the trace, and --no-trace turns it off: "
                                  "drop one of them")
        if self.straggler:
            rank, _ = parse_straggler(self.straggler)
            if rank >= self.num_processes:
                raise ConfigError(f"straggler rank {rank} is outside the {self.num_processes} processes")
        self.entry.check(self.opts, self)
        from dtrain.checkpoint.training import check_resume

        check_resume(self)
        return self


# ---------------------------------------------------------------------- TOML


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a run config file; a top-level ``[run]`` table (with strategy tables beside it) is unwrapped."""
    data = read_toml(path, "config file")
    run = data.get("run")
    if isinstance(run, dict):
        data = {**{k: v for k, v in data.items() if k != "run"}, **run}
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
    tables = {"extra": d.pop("extra"), cfg.strategy: d.pop(cfg.strategy)}
    for k, v in d.items():
        lines.append(f"{k} = {_toml_value(v)}")
    for name, table in tables.items():
        if table or name == cfg.strategy:
            lines += ["", f"[{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"
