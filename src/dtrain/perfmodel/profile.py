"""Model profile: what the performance model needs to know about a model, measured from it.

:func:`profile_model` walks the model's top-level children ("layers") and records,
per layer: parameters, forward and backward FLOPs (torch's
``torch.utils.flop_counter.FlopCounterMode``), the bytes of the activation it
outputs, and measured forward and backward times. Times come from hooks (forward
pre/post hooks; in backward, the gap between consecutive layers' backward hooks)
and are rescaled so that they add up to the hook-free totals measured
separately, so hook overhead does not leak into the prediction. The optimizer
step is timed too.

A profile can also be built without running anything (``measure=False``, e.g.
on the meta device for a model too large for this machine): then only
parameters, FLOPs and activation sizes are filled in, and compute time comes
from the cluster description (a device FLOP rate or a known samples/s).
"""

from __future__ import annotations

import contextlib
import inspect
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from dtrain.perfmodel import memo
from dtrain.perfmodel.pieces import model_pieces
from dtrain.perfmodel.spec import this_host

__all__ = ["LayerProfile", "ModelProfile", "profile_model"]


@dataclass(frozen=True)
class LayerProfile:
    """One top-level child of the model (times and activations at the profile's batch)."""

    name: str
    params: int
    param_bytes: int
    fwd_flops: float
    bwd_flops: float
    activation_bytes: float
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    shapes: tuple[tuple[int, ...], ...] = ()  # its trainable parameters' shapes (a compressor's layout)


@dataclass(frozen=True)
class ModelProfile:
    """A model's per-layer costs at a given per-device batch.

    Attributes:
        name: model name (matches a cluster's ``[models.NAME]`` table, if any).
        batch: samples per device the profile was taken at.
        layers: in forward order.
        optimizer_s: measured optimizer step (0 when not measured).
        input_bytes: bytes of one batch of inputs.
        host: hostname where the times were measured ("" when not measured).
        threads: intra-op threads during measurement.
        optimizer: "sgd" (with momentum), "sgd0" (no momentum) or "adam": sets optimizer state size.
    """

    name: str
    batch: int
    layers: tuple[LayerProfile, ...]
    optimizer_s: float = 0.0
    input_bytes: float = 0.0
    host: str = ""
    threads: int = 1
    optimizer: str = "sgd"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers)

    @property
    def param_bytes(self) -> int:
        return sum(layer.param_bytes for layer in self.layers)

    @property
    def fwd_flops(self) -> float:
        return sum(layer.fwd_flops for layer in self.layers)

    @property
    def bwd_flops(self) -> float:
        return sum(layer.bwd_flops for layer in self.layers)

    @property
    def fwd_s(self) -> float:
        return sum(layer.fwd_s for layer in self.layers)

    @property
    def bwd_s(self) -> float:
        return sum(layer.bwd_s for layer in self.layers)

    @property
    def activation_bytes(self) -> float:
        return sum(layer.activation_bytes for layer in self.layers)

    @property
    def measured(self) -> bool:
        return bool(self.host) and self.fwd_s + self.bwd_s > 0

    def at_batch(self, batch: int) -> ModelProfile:
        """The same model at another per-device batch: FLOPs, activations and times scale linearly.

        Linear time scaling is an approximation (small batches carry fixed
        per-layer overhead); profile at the batch you plan for when it matters.
        """
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        f = batch / self.batch
        layers = tuple(
            replace(
                layer,
                fwd_flops=layer.fwd_flops * f,
                bwd_flops=layer.bwd_flops * f,
                activation_bytes=layer.activation_bytes * f,
                fwd_s=layer.fwd_s * f,
                bwd_s=layer.bwd_s * f,
            )
            for layer in self.layers
        )
        return replace(self, batch=batch, layers=layers, input_bytes=self.input_bytes * f)

    def table(self) -> str:
        head = f"{'layer':<14}{'params':>10}{'fwd MFLOP':>11}{'bwd MFLOP':>11}{'act KiB':>9}{'fwd ms':>8}{'bwd ms':>8}"
        rows = [head]
        for ly in self.layers:
            rows.append(
                f"{ly.name[:13]:<14}{ly.params:>10}{ly.fwd_flops / 1e6:>11.2f}{ly.bwd_flops / 1e6:>11.2f}"
                f"{ly.activation_bytes / 1024:>9.1f}{ly.fwd_s * 1e3:>8.3f}{ly.bwd_s * 1e3:>8.3f}"
            )
        rows.append(
            f"{'total':<14}{self.params:>10}{self.fwd_flops / 1e6:>11.2f}{self.bwd_flops / 1e6:>11.2f}"
            f"{self.activation_bytes / 1024:>9.1f}{self.fwd_s * 1e3:>8.3f}{self.bwd_s * 1e3:>8.3f}"
        )
        return "\n".join(rows)


def _layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    children = list(model.named_children())
    return children if children else [("model", model)]


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(v) for v in x)
    if isinstance(x, dict):
        return sum(_nbytes(v) for v in x.values())
    return 0


def _default_loss(out: torch.Tensor, target: Any) -> torch.Tensor:
    if target is None:
        return out.float().pow(2).mean()
    from dtrain.workloads.models import task_loss

    return task_loss(out, target)


def profile_model(
    model: nn.Module,
    sample_batch: Any,
    *,
    name: str = "model",
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    measure: bool = True,
    repeats: int = 10,
    warmup: int = 3,
    threads: int | None = 1,
    optimizer: str = "sgd",
) -> ModelProfile:
    """Profile ``model`` on one batch.

    Steps: (1) count forward and backward FLOPs per layer with ``FlopCounterMode``
    (separately, so ``mm`` in backward is not mistaken for forward); (2) record each
    layer's output activation size; (3) when ``measure``, time ``repeats`` hook-free
    forward+backward passes (median) and ``repeats`` hooked passes for the per-layer
    split, then time the optimizer step.

    Args:
        model: the model (its "layers": its children, or the pieces :mod:`~dtrain.perfmodel.pieces` finds).
        sample_batch: ``(inputs, targets)`` or just inputs; the batch size is the
            first dimension of the inputs.
        name: profile name (matches a cluster's ``[models.NAME]``).
        loss_fn: ``loss_fn(output, target)`` (default: cross entropy, or mean square
            of the output without targets).
        measure: time the passes (False: FLOPs and sizes only; works on the meta device).
        repeats / warmup: timed and untimed passes (default: 10 / 3).
        threads: intra-op threads while timing (default: 1, what each worker gets
            when several share a machine; None: leave as is).
        optimizer: "sgd" (momentum), "sgd0" or "adam" (optimizer state size and timing).

    Returns:
        The :class:`ModelProfile`.
    """
    if isinstance(sample_batch, (tuple, list)) and len(sample_batch) == 2:
        x, target = sample_batch
    else:
        x, target = sample_batch, None
    loss_fn = loss_fn or _default_loss
    pieces = model_pieces(model, x)  # a module with a list of blocks: the pieces a pipeline and a plan cut
    layers, extra = pieces if pieces is not None else (_layers(model), {})
    batch = int(x.shape[0]) if isinstance(x, torch.Tensor) and x.dim() > 0 else 1
    profiles = _count_layers(model, x, target, loss_fn, layers)
    extra = {**extra, **_gpt_shape(model, x)}
    prof = ModelProfile(
        name=name, batch=batch, layers=profiles, input_bytes=float(_nbytes(x)), optimizer=optimizer, extra=extra
    )
    if not measure:
        return prof
    at = threads or torch.get_num_threads()  # the threads the times are taken at
    loss_name = f"{getattr(loss_fn, '__module__', '')}.{getattr(loss_fn, '__qualname__', repr(loss_fn))}"
    key = memo.digest(
        [_identity(model, sample_batch), batch, at, optimizer, repeats, warmup, torch.__version__, loss_name]
    )
    kept = memo.recall("profiles", key)
    if kept is not None:  # measured by an earlier plan on this machine (inside memo.kept_in only)
        with contextlib.suppress(KeyError, TypeError, ValueError):  # one not of this form: measured again
            return _with_times(prof, kept)
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        prof = _measure(model, x, target, loss_fn, prof, layers, repeats, warmup, optimizer)
    finally:
        torch.set_num_threads(old_threads)
    memo.remember("profiles", key, _times(prof))
    return prof


def _gpt_shape(model: nn.Module, x: Any) -> dict[str, Any]:
    """A profile's ``extra``: of a GPT on token batches, the shape tensor parallelism splits (``{"gpt": ...}``)."""
    gcfg = getattr(model, "gpt_config", None)
    if gcfg is None or not isinstance(x, torch.Tensor) or x.dim() != 2:
        return {}
    shape = {"layers": gcfg.layers, "hidden": gcfg.d_model, "heads": gcfg.heads, "vocab": gcfg.vocab_size}
    return {"gpt": {**shape, "seq": int(x.shape[1])}}


def _times(prof: ModelProfile) -> dict[str, Any]:
    """What :func:`_with_times` puts back: a measured profile's times, as the memo keeps them."""
    return {
        "fwd": [ly.fwd_s for ly in prof.layers],
        "bwd": [ly.bwd_s for ly in prof.layers],
        "optimizer_s": prof.optimizer_s,
        "host": prof.host,
        "threads": prof.threads,
    }


def _identity(model: nn.Module, sample_batch: Any) -> list[Any]:
    """What a profile's times depend on, for :mod:`~dtrain.perfmodel.memo`: the model's class (its source, where
    there is one) and structure, its parameters' shapes and types, and the batch's shapes and types."""
    cls = type(model)
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        source = ""

    def shapes(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return [list(v.shape), str(v.dtype)]
        if isinstance(v, (list, tuple)):
            return [shapes(e) for e in v]
        return type(v).__name__

    params = [[n, list(p.shape), str(p.dtype), p.requires_grad] for n, p in model.named_parameters()]
    return [f"{cls.__module__}.{cls.__qualname__}", source, repr(model), params, shapes(sample_batch)]


def _with_times(prof: ModelProfile, kept: dict[str, Any]) -> ModelProfile:
    """``prof`` (counted) with the times a kept profile measured."""
    times = zip(prof.layers, kept["fwd"], kept["bwd"], strict=True)
    layers = tuple(replace(ly, fwd_s=float(f), bwd_s=float(b)) for ly, f, b in times)
    return replace(
        prof,
        layers=layers,
        optimizer_s=float(kept["optimizer_s"]),
        host=str(kept["host"]),
        threads=int(kept["threads"]),
    )


def _count_layers(
    model: nn.Module,
    x: Any,
    target: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    layers: list[tuple[str, nn.Module]],
) -> tuple[LayerProfile, ...]:
    """Steps (1) and (2) of :func:`profile_model`: each layer's parameters, FLOPs and output activation.

    FLOPs per layer, forward and backward counted apart (backward ops are attributed
    to modules only when the forward ran inside the same counter, so count forward
    alone, then forward+backward, and subtract). Leaves the model's gradients unset.
    """
    fwd_counter, all_counter = FlopCounterMode(display=False), FlopCounterMode(display=False)
    acts: dict[str, int] = {}
    handles = [m.register_forward_hook(lambda _m, _i, o, n=n: acts.__setitem__(n, _nbytes(o))) for n, m in layers]
    try:
        with torch.no_grad(), fwd_counter:
            model(x)
        with all_counter:
            loss_fn(model(x), target).backward()
    finally:
        for h in handles:
            h.remove()
    model.zero_grad(set_to_none=True)
    root = type(model).__name__
    fwd_counts, all_counts = fwd_counter.get_flop_counts(), all_counter.get_flop_counts()

    def flops(counts: dict[str, dict[Any, int]], lname: str) -> float:
        key = root if lname == "model" else f"{root}.{lname}"
        return float(sum(counts.get(key, {}).values()))

    profiles = []
    for lname, m in layers:
        params = [p for p in m.parameters() if p.requires_grad]
        profiles.append(
            LayerProfile(
                name=lname,
                params=sum(p.numel() for p in params),
                param_bytes=sum(p.numel() * p.element_size() for p in params),
                fwd_flops=flops(fwd_counts, lname),
                bwd_flops=max(0.0, flops(all_counts, lname) - flops(fwd_counts, lname)),
                activation_bytes=float(acts.get(lname, 0)),
                shapes=tuple(tuple(p.shape) for p in params),
            )
        )
    return tuple(profiles)


def _measure(
    model: nn.Module,
    x: Any,
    target: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    prof: ModelProfile,
    layers: list[tuple[str, nn.Module]],
    repeats: int,
    warmup: int,
    optimizer: str,
) -> ModelProfile:
    def once() -> tuple[float, float]:
        t0 = time.perf_counter()
        loss = loss_fn(model(x), target)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        model.zero_grad(set_to_none=False)
        return t1 - t0, t2 - t1

    for _ in range(warmup):
        once()
    plain = [once() for _ in range(repeats)]
    fwd_total = statistics.median(p[0] for p in plain)
    bwd_total = statistics.median(p[1] for p in plain)

    # per-layer split from hooks; backward per layer = gap between consecutive layers' hooks
    n = len(layers)
    fwd_split = [[0.0] * n for _ in range(repeats)]
    bwd_split = [[0.0] * n for _ in range(repeats)]
    rec: dict[str, float] = {}
    handles = []
    for i, (_, m) in enumerate(layers):
        handles.append(m.register_forward_pre_hook(lambda *_a, i=i: rec.__setitem__(f"f{i}", time.perf_counter())))
        handles.append(m.register_forward_hook(lambda *_a, i=i: rec.__setitem__(f"F{i}", time.perf_counter())))
        handles.append(m.register_full_backward_hook(lambda *_a, i=i: rec.__setitem__(f"B{i}", time.perf_counter())))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "full backward hook firing on outputs" for the first layer
            for r in range(repeats + 1):
                rec.clear()
                loss = loss_fn(model(x), target)
                tb = time.perf_counter()
                loss.backward()
                te = time.perf_counter()
                model.zero_grad(set_to_none=False)
                if r == 0:
                    continue  # the first hooked pass is a warm-up
                prev = tb
                for i in reversed(range(n)):
                    end = rec.get(f"B{i}", prev) if i > 0 else te
                    bwd_split[r - 1][i] = max(0.0, end - prev)
                    prev = max(prev, end)
                for i in range(n):
                    fwd_split[r - 1][i] = max(0.0, rec.get(f"F{i}", 0.0) - rec.get(f"f{i}", 0.0))
    finally:
        for h in handles:
            h.remove()
    fwd_med = [statistics.median(fwd_split[r][i] for r in range(repeats)) for i in range(n)]
    bwd_med = [statistics.median(bwd_split[r][i] for r in range(repeats)) for i in range(n)]
    fs = sum(fwd_med) or 1.0
    bs = sum(bwd_med) or 1.0
    layers_out = tuple(
        replace(ly, fwd_s=fwd_total * fwd_med[i] / fs, bwd_s=bwd_total * bwd_med[i] / bs)
        for i, ly in enumerate(prof.layers)
    )
    opt_s = _time_optimizer(model, optimizer, repeats, warmup)
    return replace(prof, layers=layers_out, optimizer_s=opt_s, host=this_host(), threads=torch.get_num_threads())


def _time_optimizer(model: nn.Module, optimizer: str, repeats: int, warmup: int) -> float:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return 0.0
    saved = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    if optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(params, lr=0.0)
    else:
        opt = torch.optim.SGD(params, lr=0.0, momentum=0.0 if optimizer == "sgd0" else 0.9)
    times = []
    for r in range(warmup + repeats):
        t0 = time.perf_counter()
        opt.step()
        if r >= warmup:
            times.append(time.perf_counter() - t0)
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.copy_(s)
            p.grad = None
    return statistics.median(times)
