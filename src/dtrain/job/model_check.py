"""Check the user's model (and ``--loss``) against the data before any process starts: :func:`check_model`.

For a function or transformers model (``FILE.py:FN``, ``MODULE:FN``, ``hf:...``), in order:

1. the spec itself: the file, module and function exist, transformers is installed, the model arguments are the
   function's or the configuration's;
2. its size, counted on the meta device (nothing allocated): every local process builds the whole model in
   float32 first, so ``4 bytes x parameters x processes`` above the memory this machine has free is refused
   with the count, before anything could get the machine's out-of-memory killer to end the run;
3. one forward on two training samples of the dataset, seeded as the workers seed it: the model takes the
   data's samples, its logits cover the data's classes or vocabulary, and the loss is a finite scalar.

Each failure is one :class:`~dtrain.errors.ConfigError` naming the thing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dtrain.errors import ConfigError

if TYPE_CHECKING:
    from dtrain.config.schema import RunConfig
    from dtrain.workloads.data import DatasetSplit

__all__ = ["check_model", "available_memory"]

_FREE_SHARE = 0.9  # of MemAvailable a run's models may take


def available_memory() -> int:
    """Bytes of memory this machine has free for new allocations (``MemAvailable`` of ``/proc/meminfo``)."""
    import os

    try:
        with open("/proc/meminfo") as f:
            avail = next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), None)
    except OSError:  # no /proc (not Linux)
        avail = None
    if avail is not None:
        return avail
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))  # free pages, without the page cache


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _check_size(cfg: RunConfig, data: DatasetSplit) -> None:
    from dtrain.workloads.models.specs import parameter_count

    n = parameter_count(
        cfg.model,
        cfg.model_args,
        task=data.task,
        input_shape=tuple(data.input_shape),
        num_classes=data.num_classes,
        seq_len=cfg.seq_len,
    )
    if n is None:
        return
    procs = cfg.local_processes
    need, free = 4 * n * procs, available_memory()
    if need > _FREE_SHARE * free:
        raise ConfigError(
            f"model {cfg.model} has {n:,} parameters (counted on the meta device): {procs} "
            f"process(es) building it in float32 take {_gib(need)}, and this machine has "
            f"{_gib(free)} free; make it smaller with --model-arg (e.g. num_hidden_layers, "
            "hidden_size) or run fewer processes per machine"
        )


def _sample(data: DatasetSplit, n: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    from dtrain.workloads.data import first_samples

    return first_samples(data.train, n)


def _check_forward(cfg: RunConfig, data: DatasetSplit) -> None:
    from dtrain.workloads.models import logits_of, make_model, run_loss

    torch.manual_seed(cfg.seed)
    model = make_model(
        cfg.model,
        tuple(data.input_shape),
        data.num_classes,
        task=data.task,
        model_args=cfg.model_args,
        seq_len=cfg.seq_len,
    )
    x, y = _sample(data)
    try:
        out = model(x)
    except Exception as e:
        raise ConfigError(
            f"model {cfg.model} cannot take the dataset's samples (a batch of shape "
            f"{tuple(x.shape)}, {x.dtype}): {type(e).__name__}: {e}"
        ) from None
    if not cfg.loss:
        try:
            logits = logits_of(out)
        except TypeError as e:
            raise ConfigError(f"model {cfg.model}: {e}") from None
        classes = logits.shape[-1] if logits.dim() else 0
        if classes < data.num_classes:
            what = "token ids up to" if data.task == "lm" else "labels up to"
            raise ConfigError(
                f"model {cfg.model} gives {classes} logits a position, and the dataset has "
                f"{what} {data.num_classes - 1}: the ids must lie below the model's "
                f"vocabulary or classes ({classes})"
            )
    try:
        loss = run_loss(cfg)(out, y)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(
            f"the loss of model {cfg.model} on the dataset's samples fails: {type(e).__name__}: {e}"
        ) from None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.dim() > 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ConfigError(f"loss {cfg.loss or 'cross entropy'} returned {shape}, not a scalar tensor")
    if not torch.isfinite(loss.detach()).all():
        raise ConfigError(
            f"loss {cfg.loss or 'cross entropy'} of model {cfg.model} is {float(loss)} on the dataset's first samples"
        )


def check_model(cfg: RunConfig, data: DatasetSplit) -> None:
    """Every check of a user's model and loss (module docstring); dtrain's own models pass through."""
    from dtrain.workloads.models import run_loss
    from dtrain.workloads.models.specs import is_builtin

    if cfg.loss:
        run_loss(cfg)  # the file and function exist
    if is_builtin(cfg.model):
        if cfg.loss:
            _check_forward(cfg, data)
        return
    _check_size(cfg, data)
    _check_forward(cfg, data)
