"""Run configuration: what every run shares, plus the chosen strategy's own options.

Configuration flows one way: TOML file (:mod:`dtrain.config.files`) -> command-line overrides ->
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

from dtrain.config.values import build_options, option_fields, parse_straggler, sort_values, typed_field
from dtrain.errors import ConfigError
from dtrain.optim.precision import PRECISIONS
from dtrain.registry import Strategy, StrategyOptions, get, options_for

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
_TABLES = ("model_args", "extra", "options")  # RunConfig fields that are TOML tables, not flags
_GPT_SHAPE = ("layers", "d_model", "heads", "dropout")  # RunConfig fields that resize a gpt model


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
    model: str = field(
        default="cnn",
        metadata={
            "help": "cnn | mlp (classifiers) | gpt-tiny | gpt-small | gpt-medium | "
            "gpt (gpt-small's shape, resized by --layers --d-model --heads); or your own: FILE.py:FN / "
            "MODULE:FN (FN(**model_args) returns an nn.Module), hf:TYPE (a transformers architecture, "
            "e.g. hf:gpt2, hf:llama, built from its config with random weights), hf:DIR (a folder with "
            "config.json and its weights) (default: cnn)"
        },
    )
    # model_args: a table (TOML [model_args], --model-arg KEY=VALUE), not a flag of its own (see shared_fields)
    model_args: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": "keyword arguments of a "
            "FILE.py:FN / MODULE:FN model, or fields of an hf: model's transformers "
            "configuration (or of dtrain's own models' options)"
        },
    )
    loss: str = field(
        default="",
        metadata={
            "help": "MODULE:FN or FILE.py:FN: FN(output, target) -> the scalar loss, "
            "for a model whose output is not logits (default: cross entropy over classes, or over every "
            "position of token windows)"
        },
    )
    dataset: str = field(
        default="digits",
        metadata={
            "help": "digits (scikit-learn's 1,797 8x8 digits) | synthetic (a "
            "random teacher's labels, --samples) | pytext (the Python documentation text shipped with "
            "CPython, pydoc_data.topics: about 465 KB of English as byte tokens, 90% train / 10% "
            "validation; for gpt models) | your own data, the reader chosen from the path: text "
            "(.txt, .jsonl), token ids (.bin, .npy, memory-mapped), a folder of images with one "
            "subfolder per class, .npz (x, y), .parquet, a save_to_disk folder, or MODULE:FN / "
            "FILE.py:FN returning a torch Dataset or (train, validation) (default: digits)"
        },
    )
    samples: int = field(default=4096, metadata={"help": "the synthetic dataset's size (default: 4096)"})
    seq_len: int = field(default=64, metadata={"help": "tokens per pytext window and the gpt's context (default: 64)"})
    # --- the user's own data (--dataset PATH): dtrain.workloads.files
    text_field: str = field(
        default="text", metadata={"help": "the text of each .jsonl line, or a table's text column (default: text)"}
    )
    tokenizer: str = field(
        default="",
        metadata={
            "help": "a Hugging Face tokenizer.json for text files (the "
            "tokenizers library; the vocabulary is its size) (default: byte tokens, vocabulary 256)"
        },
    )
    token_dtype: str = field(
        default="uint16",
        metadata={
            "help": "the ids' type in a .bin token file: uint16 (nanoGPT's) | uint32 | int32 | int64 (default: uint16)"
        },
    )
    vocab_size: int = field(
        default=0,
        metadata={"help": "the vocabulary of a token-id file (default: 0, its largest id plus one, read in chunks)"},
    )
    image_size: int = field(
        default=32, metadata={"help": "images of an image folder are resized to SIZE x SIZE (default: 32)"}
    )
    val_fraction: float = field(
        default=0.1,
        metadata={
            "help": "the share of your data held out for validation: the "
            "last tokens of text or token ids, samples drawn by --seed otherwise (default: 0.1)"
        },
    )
    val_dataset: str = field(
        default="",
        metadata={
            "help": "validate on this path (the same kind as --dataset) "
            "instead; all of --dataset then trains (default: none)"
        },
    )
    layers: int = field(default=0, metadata={"help": "gpt blocks (default: 0, the preset's)"})
    d_model: int = field(default=0, metadata={"help": "gpt width (default: 0, the preset's)"})
    heads: int = field(default=0, metadata={"help": "gpt attention heads (default: 0, the preset's)"})
    dropout: float = field(default=0.0, metadata={"help": "gpt dropout (default: 0, none: runs are deterministic)"})
    epochs: int = field(default=10, metadata={"help": "passes over the training set (default: 10)"})
    batch_size: int = field(default=64, metadata={"help": "global batch size, summed over workers (default: 64)"})
    lr: float = field(default=0.05, metadata={"help": "learning rate (default: 0.05)"})
    momentum: float = field(default=0.9, metadata={"help": "SGD momentum (default: 0.9)"})
    optimizer: str = field(
        default="sgd",
        metadata={"help": "sgd | adam | adamw | lars (You et al. 2017) | lamb (You et al. 2019) (default: sgd)"},
    )
    lr_schedule: str = field(
        default="constant",
        metadata={
            "help": "learning rate over the run: constant, or cosine "
            "from --lr down to 0 at the last step (default: constant)"
        },
    )
    lr_scaling: str = field(
        default="none",
        metadata={
            "help": "scale --lr with the global batch: linear (lr x B / base "
            "batch, Goyal et al. 2017), sqrt, or none (default: none)"
        },
    )
    base_batch: int = field(
        default=0, metadata={"help": "the global batch --lr was tuned for (default: 0, the run's first global batch)"}
    )
    warmup_steps: int = field(
        default=0,
        metadata={
            "help": "gradual warmup over N steps (--warmup-epochs E: E times "
            "the first epoch's steps): from --lr to the scaled rate (Goyal et al.), or from near 0 "
            "without scaling (default: 0)"
        },
    )
    warmup_epochs: float = field(default=0.0, metadata={"help": "the warmup in epochs instead (default: 0)"})
    batch_schedule: str = field(
        default="",
        metadata={
            "help": 'grow the global batch: "0:256,5:512" (from epoch: '
            "batch), or auto (double it while the measured gradient noise scale exceeds it; dp) "
            "(default: none)"
        },
    )
    max_batch: int = field(
        default=0,
        metadata={
            "help": "the largest batch --batch-schedule auto grows to (default: 0, a quarter of the training set)"
        },
    )
    auto_every: int = field(
        default=0,
        metadata={
            "help": "--batch-schedule auto decides every N steps, inside epochs "
            "too (default: 0, at the start of each epoch)"
        },
    )
    auto_rule: str = field(
        default="noise",
        metadata={
            "help": "--batch-schedule auto doubles the batch while the noise "
            "scale exceeds twice it (noise), or while the noise scale times the step's fixed time over "
            "its batch's compute time does (time: the batch that reaches a loss soonest; McCandlish et "
            "al.'s step count times the step time) (default: noise)"
        },
    )
    noise_scale: bool = field(
        default=False,
        metadata={
            "help": "log the gradient noise scale B_simple every step "
            "(McCandlish et al. 2018; dp, 2+ workers; one extra scalar all-reduce) (default: off)"
        },
    )
    noise_beta: float = field(
        default=NOISE_BETA,
        metadata={
            "help": "the decay of the noise scale's moving averages of "
            "|G|^2 and tr(Sigma), a memory of about 1/(1-BETA) steps: a long one lags where |G|^2 "
            "falls fast, early in training (default: 0.99)"
        },
    )
    precision: str = field(
        default="fp32",
        metadata={
            "help": "compute precision: fp32, or bf16 / fp16 under torch "
            "autocast with float32 master weights; fp16 scales the loss (dynamic, the overflow skip "
            "agreed by every rank of a step); gradients travel in 16 bits (default: fp32)"
        },
    )
    weight_decay: float = field(default=0.0, metadata={"help": "the optimizer's weight decay (default: 0)"})
    grad_accum: int = field(
        default=1,
        metadata={
            "help": "gradient accumulation: each optimizer step runs forward "
            "and backward on N micro-batches of the per-worker batch / N, each loss divided by N, and "
            "the gradients are exchanged once (--batch-size stays the samples per optimizer step) "
            "(default: 1)"
        },
    )
    clip_grad_norm: float = field(
        default=0.0,
        metadata={
            "help": "clip the gradient to global 2-norm MAX before the "
            "optimizer step, as torch.nn.utils.clip_grad_norm_ on the global batch's averaged "
            "gradient (after fp16 unscaling); each metrics row records the norm before "
            "clipping as grad_norm (default: 0, off)"
        },
    )
    seed: int = field(
        default=0, metadata={"help": "seed of the data, the model's initialization and the sampling (default: 0)"}
    )
    max_steps: int = field(default=0, metadata={"help": "stop after this many steps (default: 0, no limit)"})
    target: float = field(
        default=0.0,
        metadata={
            "help": "stop when the metric reaches it: test accuracy >= TARGET, or "
            "a language model's validation loss (nats/token) <= TARGET; the run's summary records "
            "time_to_target_s (default: 0, no target)"
        },
    )
    eval_every: int = field(default=0, metadata={"help": "evaluate every N steps (default: 0, after each epoch)"})
    eval_samples: int = field(
        default=0, metadata={"help": "evaluate on the first N test samples or validation windows (default: 0, all)"}
    )
    # --- how to distribute it
    strategy: str = field(
        default="dp", metadata={"help": "how to distribute: one of the registered strategies (default: dp)"}
    )
    workers: int = field(default=4, metadata={"help": "worker processes (default: 4)"})
    straggler: str = field(
        default="",
        metadata={
            "help": "RANK:FACTOR: that rank's own work per step (data, forward, "
            "backward) takes FACTOR times its usual time (median of its last 50 steps); communication "
            "is not slowed"
        },
    )
    cluster: str = field(
        default="", metadata={"help": "run on an emulated cluster made by `dtrain cluster up --name NAME`"}
    )
    backend: str = field(
        default="",
        metadata={
            "help": "the process group's backend: gloo | nccl | mpi (default: nccl "
            "for --device cuda with a GPU per process, else gloo)"
        },
    )
    device: str = field(
        default="cpu",
        metadata={
            "help": "cpu, or cuda: each worker on GPU (local rank mod the GPUs); "
            "dp and ddp. NCCL where every worker has a GPU of its own, else gloo, whose collectives carry "
            "CUDA tensors through host memory (so 4 workers can share one GPU) (default: cpu)"
        },
    )
    # --- the run itself
    out: str = field(
        default="",
        metadata={
            "help": "run folder (default: runs/<timestamp>-<strategy>); one that holds "
            "files is refused unless --overwrite"
        },
    )
    overwrite: bool = field(
        default=False,
        metadata={
            "help": "replace the earlier run in --out: everything in that folder is deleted first (default: off)"
        },
    )
    timeout_s: float = field(
        default=300.0,
        metadata={
            "help": "seconds a collective, a message or a wait between "
            "ranks may block before the run stops (default: 300)"
        },
    )
    trace: bool = field(
        default=True,
        metadata={"help": "write trace.json, a Chrome trace of every rank's steps (default: on; --no-trace to skip)"},
    )
    trace_steps: str = field(
        default="",
        metadata={"help": "trace only steps FIRST-LAST, e.g. 20-40 (default: all steps, up to 100,000 events a rank)"},
    )
    tensorboard: bool = field(
        default=False,
        metadata={
            "help": "write the evaluating rank's per-step loss, lr, "
            "samples/s (loss scale, noise scale when present) and each evaluation's metric as "
            "TensorBoard event files in RUN/tensorboard (needs the tensorboard package) (default: "
            "off)"
        },
    )
    progress: bool = field(default=True, metadata={"help": "a progress bar on the terminal (default: on)"})
    checkpoint_every: int = field(
        default=0,
        metadata={"help": "save a checkpoint to RUN/checkpoints every N steps and at the end (default: 0, never)"},
    )
    resume: str = field(
        default="",
        metadata={
            "help": "continue from a checkpoint folder, or a run folder's newest "
            "intact checkpoint (its files checked against the checkpoint's manifest)"
        },
    )
    skip_nonfinite: int = field(
        default=0,
        metadata={
            "help": "skip up to N steps whose loss or gradients are not "
            "finite, on every rank that shares the step (no optimizer step); the next one stops "
            "the run (default: 0, stop at the first)"
        },
    )
    max_restarts: int = field(
        default=0,
        metadata={
            "help": "when a process dies, restart every process from the run "
            "folder's newest complete checkpoint, up to N times (torch's elastic agent; needs "
            "--checkpoint-every) (default: 0, the run fails)"
        },
    )
    min_workers: int = field(
        default=0,
        metadata={
            "help": "with --max-restarts: a restart leaves out the worker that "
            "failed (its host taken as lost, as Horovod's elastic mode blacklists it) while at least "
            "N workers remain, and the run goes on with fewer from the newest checkpoint, resharded; "
            "the global batch stays (it must divide over every count from N up) (default: 0, "
            "restart on every worker)"
        },
    )
    extra: dict[str, Any] = field(default_factory=dict)
    options: StrategyOptions | None = None  # the strategy's (default: its defaults)

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", options_for(self.strategy, self.options))
        if self.batch_schedule and self.batch_schedule != "auto":  # its epoch-0 batch is the run's first
            from dtrain.optim.large_batch import parse_batch_schedule

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
        """The fields every run shares that are flags and top-level keys (all but the tables ``model_args``,
        ``extra`` and ``options``)."""
        return [f for f in fields(cls) if f.name not in _TABLES]

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> RunConfig:
        """Build from TOML-shaped values: shared keys, ``extra``, and the strategy's table.

        Unknown keys are an error naming them; a flat key of the chosen strategy's
        options goes into its options (and wins over its table).
        """
        strategy = values.get("strategy", "dp")
        if not isinstance(strategy, str):
            raise ConfigError(f"option strategy must be a string, got {strategy!r}")
        entry = get(strategy)
        kw, opts = sort_values(values, {f.name: f for f in cls.shared_fields()}, strategy, _TABLES)
        extra = values.get("extra", {})
        if not isinstance(extra, Mapping):
            raise ConfigError(f"[extra] must be a table, got {extra!r}")
        model_args = values.get("model_args", {})
        if not isinstance(model_args, Mapping):
            raise ConfigError(f"[model_args] must be a table of the model's keyword arguments, got {model_args!r}")
        return cls(**kw, model_args=dict(model_args), extra=dict(extra), options=build_options(entry, opts))

    @classmethod
    def make(cls, **values: Any) -> RunConfig:
        """Keyword shorthand for :meth:`from_mapping`: ``RunConfig.make(strategy="ps", servers=2)``."""
        return cls.from_mapping(values)

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with ``changes`` (shared keys, the strategy's option names, or ``options``).

        Changing ``strategy`` starts from the new strategy's default options; a key ``model_args.KEY`` sets
        one model argument (a sweep's search key).
        """
        dotted = {k: changes.pop(k) for k in [k for k in changes if k.startswith("model_args.")]}
        if dotted:
            args = dict(changes.pop("model_args", self.model_args))
            args.update({k[len("model_args.") :]: v for k, v in dotted.items()})
            changes["model_args"] = args
        if "options" in changes:
            opts = changes.pop("options")
            base = dataclasses.replace(self, strategy=changes.pop("strategy", self.strategy), options=opts)
            return base.replace(**changes) if changes else base
        if changes.get("strategy", self.strategy) != self.strategy:  # the new strategy's defaults: parsed whole
            d = self.to_dict()
            d.pop(self.strategy, None)
            return self.from_mapping({**d, **changes})
        changes.pop("strategy", None)
        return self._changed(changes)

    def _changed(self, changes: dict[str, Any]) -> RunConfig:
        """:meth:`replace` of the same strategy: only the changed values are checked, the rest kept as parsed
        (what :meth:`from_mapping` of the whole would give; a key of another strategy or none goes through it
        for its message)."""
        shared = {f.name: f for f in self.shared_fields()}
        kw: dict[str, Any] = {}
        opts: dict[str, Any] = {}
        for k, v in changes.items():
            if k in shared:
                kw[k] = typed_field(shared[k], v)
            elif k in ("model_args", "extra"):
                if not isinstance(v, Mapping):
                    return self.from_mapping({**self.to_dict(), **changes})
                kw[k] = dict(v)
            else:
                opts[k] = v
        if opts:
            if set(opts) - {f.name for f in fields(self.entry.options)}:
                return self.from_mapping({**self.to_dict(), **changes})
            kw["options"] = build_options(self.entry, {**self.opts.to_table(), **opts})
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict[str, Any]:
        """TOML-shaped: shared keys, ``extra``, and the options as a table named for the strategy."""
        d = {f.name: getattr(self, f.name) for f in self.shared_fields()}
        d["model_args"] = dict(self.model_args)
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
        """This run's dataset (every process loads it: a bundled set is small and deterministic, the user's
        own is read lazily, a token file memory-mapped); loaded once a process (:mod:`dtrain.config.data`)."""
        from dtrain.config.data import load_run_data

        return load_run_data(self)
