"""Check a run configuration before anything starts: :func:`validate`.

The checks that go beyond a field's own value: names against what is registered, numbers
against each other, the device (probing CUDA), the dataset (loading it, for its size), the batch
schedule, the strategy's own cross-checks (its :class:`~dtrain.config.schema.ConfigHooks`) and a
checkpoint to resume (read on disk). :func:`dtrain.job.run.run` calls it in the parent process.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from dtrain.config.schema import (
    BACKENDS,
    DEVICES,
    LR_SCHEDULES,
    NOISE_BETA,
    OPTIMIZERS,
    PRECISIONS,
    RunConfig,
    parse_straggler,
)
from dtrain.errors import ConfigError, check_choice
from dtrain.registry import get, registered
from dtrain.workloads.batch import split_batch

if TYPE_CHECKING:
    from dtrain.workloads.data import DatasetSplit

__all__ = ["validate", "trains_on"]


def trains_on(device: str) -> list[str]:
    """The registered strategies that train on ``device`` (their entries' ``devices``)."""
    return [name for name, entry in registered().items() if device in entry.devices]


def validate(cfg: RunConfig) -> RunConfig:
    """Check every option of ``cfg`` and return it; raise :class:`ConfigError` saying what to change."""
    _check_names(cfg)
    _check_numbers(cfg)
    _check_device(cfg)
    if cfg.trace_steps:
        from dtrain.trace import parse_trace_steps

        parse_trace_steps(cfg.trace_steps)
        if not cfg.trace:
            raise ConfigError(
                "--trace-steps chooses the steps of the trace, and --no-trace turns it off: drop one of them"
            )
    if cfg.straggler:
        rank, _ = parse_straggler(cfg.straggler)
        if rank >= cfg.num_processes:
            raise ConfigError(f"straggler rank {rank} is outside the {cfg.num_processes} processes")
    cfg.hooks.check(cfg.opts, cfg)
    from dtrain.training.checkpointing import check_resume

    check_resume(cfg)
    return cfg


def _check_names(cfg: RunConfig) -> None:
    from dtrain.workloads.data import DATASETS
    from dtrain.workloads.models import MODELS
    from dtrain.workloads.models.specs import is_builtin

    if is_builtin(cfg.model):
        check_choice("model", cfg.model, MODELS)
    if cfg.dataset in DATASETS:  # the user's own data is checked when it is loaded (_check_data)
        _check_task(cfg, "lm" if cfg.dataset == "pytext" else "classify")
        _check_bundled(cfg)
    check_choice("optimizer", cfg.optimizer, OPTIMIZERS)
    check_choice("lr_schedule", cfg.lr_schedule, LR_SCHEDULES)
    check_choice("precision", cfg.precision, PRECISIONS)
    from dtrain.optim.large_batch import AUTO_RULES, LR_SCALINGS

    check_choice("lr_scaling", cfg.lr_scaling, LR_SCALINGS)
    check_choice("auto_rule", cfg.auto_rule, AUTO_RULES)
    if cfg.backend and cfg.backend not in BACKENDS:
        raise ConfigError(f"backend {cfg.backend!r} is not known; choose gloo, nccl or mpi")
    check_choice("device", cfg.device, DEVICES)


def _check_device(cfg: RunConfig) -> None:
    """``--device cuda``: a GPU here, a strategy that trains on it, a backend that can carry it."""
    backend = cfg.process_backend()
    if cfg.device == "cpu":
        if backend == "nccl":
            raise ConfigError(
                "backend nccl reduces CUDA tensors, and this run trains on the CPU: add "
                "--device cuda, or use --backend gloo"
            )
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"device cuda: torch sees no CUDA device here (torch {torch.__version__}); use --device cpu")
    if "cuda" not in get(cfg.strategy).devices:
        raise ConfigError(
            f"device cuda: strategy {cfg.strategy} trains on the CPU; --device cuda takes "
            f"{' or '.join(trains_on('cuda'))}"
        )
    if cfg.cluster:
        raise ConfigError("device cuda: an emulated cluster (--cluster) runs CPU workers; drop one of the two")
    if backend == "mpi":
        raise ConfigError("device cuda: the mpi backend carries CPU tensors; use --backend gloo or nccl")
    gpus = torch.cuda.device_count()
    if backend == "nccl" and cfg.local_processes > gpus:
        raise ConfigError(
            f"backend nccl takes one GPU per process: {cfg.local_processes} processes on {gpus} "
            f"GPU(s); use --backend gloo (CUDA tensors through host memory) or fewer workers"
        )
    if cfg.noise_scale or cfg.batch_schedule == "auto":
        raise ConfigError(
            "device cuda: the noise scale (--noise-scale, --batch-schedule auto) is measured on "
            "CPU runs only; drop it or use --device cpu"
        )


def _check_task(cfg: RunConfig, task: str) -> None:
    """A language model trains on text (``task`` "lm"), a classifier on images; gpt flags need a gpt model."""
    from dtrain.workloads.models import is_language_model
    from dtrain.workloads.models.specs import is_builtin

    if not is_builtin(cfg.model):  # a user's model takes the data's task: its checks are check_model's
        given = [f"--{k.replace('_', '-')}" for k in cfg.gpt_overrides()]
        if given:
            raise ConfigError(
                f"{', '.join(given)} shape(s) dtrain's gpt models; for model {cfg.model} give its "
                "own arguments with --model-arg KEY=VALUE"
            )
        return
    lm, text = is_language_model(cfg.model), task == "lm"
    if lm and not text:
        raise ConfigError(
            f"model {cfg.model} is a language model; use --dataset pytext, or text or token ids "
            f"of your own ({cfg.dataset} holds labelled samples)"
        )
    if text and not lm:
        raise ConfigError(f"dataset {cfg.dataset} is text; use a language model: --model gpt-tiny, gpt-small, ...")
    if not lm:
        given = [f"--{k.replace('_', '-')}" for k in cfg.gpt_overrides()]
        if given:
            raise ConfigError(f"{', '.join(given)} shape(s) a gpt model; model {cfg.model} has no such option")


def _check_target(cfg: RunConfig, lm: bool) -> None:
    """``--target``: a validation loss for token windows, an accuracy for labelled samples."""
    if lm and cfg.target < 0:
        raise ConfigError(f"target is a validation loss (nats per token) for {cfg.model}; got {cfg.target}")
    if not lm and not 0 <= cfg.target <= 1:
        raise ConfigError(f"target is a test accuracy in (0, 1] for {cfg.model}; got {cfg.target}")


def _check_numbers(cfg: RunConfig) -> None:
    if cfg.workers < 1:
        raise ConfigError(f"workers must be >= 1, got {cfg.workers}")
    if cfg.epochs < 1:
        raise ConfigError(f"epochs must be >= 1, got {cfg.epochs}")
    shards = cfg.opts.batch_shards(cfg.workers)
    if cfg.batch_size < shards:
        raise ConfigError(f"batch_size is global ({cfg.batch_size}) and must be at least workers ({cfg.workers})")
    # a batch that does not divide is trained as batch // shards per shard (global_batch)
    if not cfg.lr > 0:
        raise ConfigError(f"lr must be > 0, got {cfg.lr}")
    if not 0 <= cfg.momentum < 1:
        raise ConfigError(f"momentum must be in [0, 1), got {cfg.momentum}")
    if cfg.timeout_s <= 0:
        raise ConfigError(f"timeout_s must be > 0, got {cfg.timeout_s}")
    if cfg.max_steps < 0:
        raise ConfigError(f"max_steps must be >= 0, got {cfg.max_steps}")
    if cfg.samples < 16:
        raise ConfigError(f"samples must be >= 16, got {cfg.samples}")
    for k in (
        "eval_every",
        "eval_samples",
        "layers",
        "d_model",
        "heads",
        "skip_nonfinite",
        "base_batch",
        "warmup_steps",
        "warmup_epochs",
        "max_batch",
        "auto_every",
        "max_restarts",
        "min_workers",
    ):
        if getattr(cfg, k) < 0:
            raise ConfigError(f"{k} must be >= 0, got {getattr(cfg, k)}")
    if cfg.seq_len < 2:
        raise ConfigError(f"seq_len must be >= 2, got {cfg.seq_len}")
    if not 0 <= cfg.dropout < 1:
        raise ConfigError(f"dropout must be in [0, 1), got {cfg.dropout}")
    if not 0 <= cfg.noise_beta < 1:
        raise ConfigError(f"noise_beta must be in [0, 1), got {cfg.noise_beta:g}")
    if cfg.model.startswith("gpt"):
        from dtrain.workloads.models.gpt import resolve_gpt_config

        try:
            resolve_gpt_config(cfg.model, **cfg.gpt_overrides(), seq_len=cfg.seq_len)
        except ValueError as e:
            raise ConfigError(f"model {cfg.model}: {e}") from None
    data = _check_data(cfg)
    size = data.train_size
    if cfg.batch_size > size:
        raise ConfigError(
            f"batch_size {cfg.batch_size} is larger than the training set ({size} samples of "
            f"{cfg.dataset}): it holds less than one global batch"
        )
    _check_target(cfg, data.task == "lm")
    from dtrain.job.model_check import check_model

    check_model(cfg, data)
    _check_large_batch(cfg, size)
    _check_step(cfg)


def _check_step(cfg: RunConfig) -> None:
    """``--grad-accum`` and ``--clip-grad-norm``: their values, the micro-batch, and whether the strategy can."""
    n, clip = cfg.grad_accum, cfg.clip_grad_norm
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"grad_accum must be an integer >= 1 (micro-steps per optimizer step), got {n!r}")
    if not (clip >= 0 and math.isfinite(clip)):
        raise ConfigError(f"clip_grad_norm must be >= 0 (0: no clipping), got {clip:g}")
    shards = cfg.opts.batch_shards(cfg.workers)
    if n > 1:
        why = cfg.opts.refuses_grad_accum(cfg.workers)
        if why:
            raise ConfigError(f"--grad-accum {n}: strategy {cfg.strategy} {why}")
        if cfg.batch_schedule == "auto":
            raise ConfigError(
                f"--grad-accum {n} with --batch-schedule auto: the grown batch is not checked to "
                "split into micro-batches; drop one of them"
            )
        batches = [cfg.batch_size]
        if cfg.batch_schedule:
            from dtrain.optim.large_batch import parse_batch_schedule

            batches = [b for _, b in parse_batch_schedule(cfg.batch_schedule)]
        for b in batches:
            per = split_batch(b, shards)[0]
            if per % n:
                raise ConfigError(
                    f"--grad-accum {n}: the per-worker batch of {per} (--batch-size {b} over {shards} "
                    f"shard{'s' if shards > 1 else ''}) does not split into {n} equal micro-batches; "
                    f"use --batch-size a multiple of {shards * n}"
                )
    if clip > 0:
        why = cfg.opts.refuses_clip_grad_norm(cfg.workers)
        if why:
            raise ConfigError(f"--clip-grad-norm {clip:g}: strategy {cfg.strategy} {why}")
        if cfg.noise_scale or cfg.batch_schedule == "auto":
            raise ConfigError(
                f"--clip-grad-norm {clip:g}: the noise scale (--noise-scale, --batch-schedule auto) "
                "is measured on the unclipped gradient the optimizer would apply; drop one of them"
            )


def _check_bundled(cfg: RunConfig) -> None:
    """The options that read the user's own data, given with a bundled dataset."""
    defaults = RunConfig()
    given = [
        k
        for k in ("text_field", "tokenizer", "token_dtype", "vocab_size", "image_size", "val_fraction", "val_dataset")
        if getattr(cfg, k) != getattr(defaults, k)
    ]
    if given:
        flags = ", ".join(f"--{k.replace('_', '-')}" for k in given)
        raise ConfigError(f"{flags} read(s) your own data (--dataset PATH); dataset {cfg.dataset} is bundled")


def _check_data(cfg: RunConfig) -> DatasetSplit:
    """Load the data (the user's: every reader's problem is a ConfigError naming the file) and return it."""
    from dtrain.workloads.data import DATASETS

    data = cfg.load_data()
    if cfg.dataset not in DATASETS:
        _check_task(cfg, data.task)
        if cfg.model == "cnn" and len(data.input_shape) != 3:
            raise ConfigError(
                f"model cnn takes images (C, H, W); dataset {cfg.dataset} has samples of shape "
                f"{data.input_shape}: use --model mlp"
            )
    if data.train_size == 0 or data.test_size == 0:
        raise ConfigError(
            f"dataset {cfg.dataset} is empty ({data.train_size} training, {data.test_size} validation samples)"
        )
    return data


def _check_large_batch(cfg: RunConfig, size: int) -> None:
    """Warmup, the batch schedule and the noise scale (:mod:`dtrain.optim.large_batch`)."""
    if cfg.warmup_steps and cfg.warmup_epochs:
        raise ConfigError(f"give warmup_steps ({cfg.warmup_steps}) or warmup_epochs ({cfg.warmup_epochs:g}), not both")
    shards = cfg.opts.batch_shards(cfg.workers)
    if cfg.batch_schedule == "auto":
        if not cfg.opts.measures_noise_scale(cfg.workers):
            raise ConfigError(
                "batch_schedule auto grows the batch toward the gradient noise scale that plain "
                "data parallelism measures: use --strategy dp (no --shard) with 2 or more workers"
            )
        if cfg.max_batch and (cfg.max_batch > size or cfg.max_batch % shards):
            raise ConfigError(
                f"max_batch {cfg.max_batch} must be a multiple of the {shards} workers and at "
                f"most the training set ({size} samples)"
            )
        if cfg.batch_size % shards:
            raise ConfigError(
                f"batch_schedule auto doubles the batch: batch_size {cfg.batch_size} must be a "
                f"multiple of the {shards} workers"
            )
    elif cfg.auto_every or cfg.auto_rule != "noise":
        given = f"--auto-every {cfg.auto_every}" if cfg.auto_every else f"--auto-rule {cfg.auto_rule}"
        raise ConfigError(
            f"{given} tells --batch-schedule auto when and how to grow the batch; add --batch-schedule auto or drop it"
        )
    elif cfg.batch_schedule:
        from dtrain.optim.large_batch import parse_batch_schedule

        for epoch, batch in parse_batch_schedule(cfg.batch_schedule):
            if batch % shards:
                raise ConfigError(
                    f"batch_schedule: the batch {batch} (from epoch {epoch}) does not divide "
                    f"into the {shards} workers' shards; use a multiple of {shards}"
                )
            if batch > size:
                raise ConfigError(
                    f"batch_schedule: the batch {batch} (from epoch {epoch}) is larger than "
                    f"the training set ({size} samples)"
                )
            cfg.hooks.check(cfg.opts, dataclasses.replace(cfg, batch_schedule="", batch_size=batch))
    if cfg.noise_beta != NOISE_BETA and not (cfg.noise_scale or cfg.batch_schedule == "auto"):
        raise ConfigError(
            f"noise_beta {cfg.noise_beta:g} sets how the noise scale is averaged; add --noise-scale "
            "or --batch-schedule auto, or drop it"
        )
    if cfg.noise_scale and not cfg.opts.measures_noise_scale(cfg.workers):
        raise ConfigError(
            "noise_scale compares each worker's gradient with their average: use --strategy dp "
            "(no --shard) with 2 or more workers"
        )
