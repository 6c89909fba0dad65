"""Mixed precision (``--precision fp32 | bf16 | fp16``) for every strategy.

Micikevicius et al. 2018, "Mixed Precision Training" (ICLR, arXiv:1710.03740): compute in 16 bits,
keep float32 master weights, and for fp16 scale the loss so small gradients do not flush to zero.
dtrain stands on torch's pieces: :func:`torch.autocast` runs the forward (and so the backward) of the
model in the compute precision while the parameters, the optimizer and its state stay float32, and
:class:`torch.amp.GradScaler` keeps fp16's dynamic loss scale (x2 after ``growth_interval`` clean
steps, x0.5 after an overflow).

What dtrain adds is the agreement: ranks that share a step (a data-parallel group, the stages of a
pipeline, the shards of a tensor-parallel layer) must all skip a step that overflowed on any of them,
or their replicas part ways. :class:`LossScaler` subclasses GradScaler at the hook torch's own
``ShardedGradScaler`` uses (``_unscale_grads_``): after this rank's gradients are unscaled and checked,
the engine's ``agree`` (one flag all-reduce where ranks share a step; a parameter-server worker or a
decentralized replica decides alone) gives every rank the same verdict, and the scale moves the same
way everywhere. A step that overflows is skipped (no optimizer step; the loop's metrics row says
``"overflow": true``); one that overflows when the scale is already at ``min_scale`` stops the run with
:class:`LossScaleCollapsed` naming the step and the scale (DeepSpeed's ``min_loss_scale`` rule), instead
of skipping steps forever.

Gradients travel in the compute precision: the strategies' gradient exchange gets the 16-bit cast
compressor (:mod:`dtrain.compress.quantize`) unless ``--compression`` names another
(:meth:`Precision.wire`); torch DDP gets its own fp16/bf16 comm hook; pipeline activations and
tensor-parallel partial sums are autocast's outputs, 16-bit already. Two exceptions: a parameter-server
worker pushes after its step's check, so its gradients are already unscaled and fp16 would flush the
small ones to zero -- under fp16 they travel as bf16 (fp32's range); and ZeRO (``--shard``)
reduce-scatters 16-bit gradients but allgathers its float32 parameter shards (the master weights).

From Python::

    prec = dtrain.optim.precision.Precision("fp16")
    scaler = dtrain.optim.precision.LossScaler(list(model.parameters()), rank=dtrain.rank())  # agreed over the world
    with prec.autocast():
        loss = loss_fn(ddp_model(x), y)
    scaler.scale_loss(loss).backward()
    if not scaler.unscale(step):  # no rank overflowed
        opt.step()
    scaler.advance()
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from dtrain.errors import DTrainError

__all__ = ["PRECISIONS", "Precision", "LossScaler", "LossScaleCollapsed"]

PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class LossScaleCollapsed(DTrainError):
    """fp16 loss scaling gave up: a step overflowed with the scale already at its minimum.

    Attributes: ``rank``, ``step``, ``scale`` (the scale at that step).
    """

    def __init__(self, rank: int, step: int, scale: float, message: str) -> None:
        self.rank, self.step, self.scale = rank, step, scale
        super().__init__(message)


@dataclass(frozen=True)
class Precision:
    """A run's compute precision.

    Attributes:
        name: ``fp32`` (no autocast), ``bf16`` or ``fp16`` (autocast; fp16 also scales the loss).
        device_type: autocast's device type (``cpu`` or ``cuda``).
    """

    name: str = "fp32"
    device_type: str = "cpu"

    def __post_init__(self) -> None:
        if self.name not in PRECISIONS:
            raise ValueError(f"precision {self.name!r} is not known; choose one of: {', '.join(PRECISIONS)}")

    @property
    def dtype(self) -> torch.dtype | None:
        """The compute dtype (None: float32, no autocast)."""
        return _DTYPES.get(self.name)

    @property
    def scales_loss(self) -> bool:
        return self.name == "fp16"

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """The compute precision for the ops inside (nothing under fp32)."""
        if self.dtype is None:
            yield
            return
        with torch.autocast(self.device_type, dtype=self.dtype):
            yield

    def wire(self, compression: str, unscaled: bool = False) -> str:
        """The compressor spec gradients travel with: ``compression`` if one is named, else the compute
        precision's 16-bit cast (``fp16`` / ``bf16``; ``bf16`` for fp16 gradients already ``unscaled``,
        which fp16's range would flush to zero), else ``none``."""
        if compression not in ("", "none") or self.dtype is None:
            return compression or "none"
        return "bf16" if unscaled else self.name


def _world_verdict(bad: bool) -> list[int]:
    """The ranks of the default group that found their step bad (this rank's verdict without a group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # the guard's flag all-reduce (run time: no import cycle)
        ranks: list[int] = importlib.import_module("dtrain.optim.guard").flagged_ranks(bad)
        return ranks
    return [0] if bad else []


class LossScaler(torch.amp.GradScaler):
    """fp16 dynamic loss scaling whose overflow verdict the ranks sharing a step agree on.

    ``params``: the parameters whose gradients this rank applies (a sharded engine: its shards);
    ``agree(bad) -> ranks``: the engine's agreement (:class:`dtrain.training.loop.SkipsSteps`); default:
    one flag all-reduce over the default group (:func:`dtrain.optim.guard.flagged_ranks`), or this
    rank's own verdict without a process group.

    Per step: ``scale_loss(loss).backward()``; after the exchange :meth:`unscale` (gradients / scale,
    then the agreed verdict: the ranks that overflowed, [] for none); the engine steps or skips; then
    :meth:`advance` moves the scale.
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        agree: Callable[[bool], list[int]] | None = None,
        *,
        rank: int = 0,
        device: str = "cpu",
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
    ) -> None:
        super().__init__(device, init_scale=init_scale, growth_interval=growth_interval)
        # GradScaler creates its scale tensor in the first scale(); a whole-step engine (pipeline, tensor,
        # hybrid) never calls it -- it multiplies its loss by loss_scale itself -- and unscale_ would then fail
        self.scale(torch.zeros((), device=device))
        # a rank without gradients (a parameter-free pipeline stage, 2bw's first step) still takes part in
        # the agreement: a parameter whose gradient is always zero keeps GradScaler's bookkeeping non-empty
        self._anchor = torch.nn.Parameter(torch.zeros(1, device=device))
        self._holder = torch.optim.SGD([*params, self._anchor], lr=0.0)  # never stepped: unscale_'s list
        self._agree, self.rank, self.min_scale = agree or _world_verdict, rank, min_scale
        self.overflowed: list[int] = []

    @property
    def loss_scale(self) -> float:
        """The current scale."""
        return float(self.get_scale())

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the scale (GradScaler's ``scale``)."""
        out = self.scale(loss)
        assert isinstance(out, torch.Tensor)
        return out

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        per_device: dict[torch.device, torch.Tensor] = super()._unscale_grads_(
            optimizer, inv_scale, found_inf, allow_fp16
        )
        bad = any(float(v) > 0 for v in per_device.values())
        self.overflowed = self._agree(bad)
        for v in per_device.values():
            v.fill_(1.0 if self.overflowed else 0.0)
        return per_device

    def unscale(self, step: int) -> list[int]:
        """Divide this rank's gradients by the scale and agree on overflow; the ranks that overflowed.

        Raises:
            LossScaleCollapsed: the step overflowed and the scale cannot fall further.
        """
        self._anchor.grad = torch.zeros_like(self._anchor)
        self.unscale_(self._holder)
        if self.overflowed and self.loss_scale * self._backoff_factor < self.min_scale:
            raise LossScaleCollapsed(
                self.rank,
                step,
                self.loss_scale,
                f"rank {self.rank}: fp16 loss scaling collapsed at step {step}: the gradients overflowed "
                f"(inf/nan, on rank(s) {self.overflowed}) with the loss scale already at {self.loss_scale:g} (minimum "
                f"{self.min_scale:g}); every step overflows, so training cannot go on in fp16. Lower --lr, "
                "clip the gradients, or use --precision bf16 (same range as fp32) or fp32",
            )
        return self.overflowed

    def advance(self) -> None:
        """After the step (applied or skipped): grow or back off the scale."""
        self.update()
