"""Gradient compression: quantizers, sparsifiers, low rank, error feedback.

Build one from a spec string (what ``--compression`` takes)::

    c = dtrain.compress.from_spec("topk:0.01")        # ErrorFeedback(TopK(ratio=0.01))
    c = dtrain.compress.from_spec("qsgd:16")          # unbiased: no error feedback
    c = dtrain.compress.from_spec("sign", error_feedback=False)

Spec names are the keys of :data:`REGISTRY`; ``NAME:ARG`` passes one argument.
The engines read their ``compression=`` argument with :func:`resolve` (a spec, a
compressor or None; ``"none"`` gives None or :class:`Identity`, as the engine needs).
``randomk:0.01`` is RandomK scaled to be unbiased; ``randomk:0.01:memory`` is
rand-k unscaled with error feedback (Stich et al. 2018).

Momentum: ``from_spec("sign", momentum=0.9)`` moves SGD's momentum into the error
feedback of the compressors that need it before them (sign, sign:mv, onebit);
the result's ``momentum`` is then 0.9 and the optimizer must use momentum 0::

    c = dtrain.compress.from_spec("sign", momentum=0.9)
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9 if not c.momentum else 0.0)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, overload

from dtrain.compress.base import Compressor, Identity, TensorMeta
from dtrain.compress.feedback import ErrorFeedback
from dtrain.compress.lowrank import PowerSGD
from dtrain.compress.quantize import BF16, FP16, QSGD, OneBit, SignSGD, TernGrad
from dtrain.compress.sparsify import RandomK, SparseCompressor, Threshold, TopK
from dtrain.errors import ConfigError

__all__ = [
    "Compressor",
    "Identity",
    "TensorMeta",
    "FP16",
    "BF16",
    "QSGD",
    "TernGrad",
    "SignSGD",
    "OneBit",
    "SparseCompressor",
    "TopK",
    "RandomK",
    "Threshold",
    "PowerSGD",
    "ErrorFeedback",
    "REGISTRY",
    "from_spec",
    "resolve",
    "compressed_allreduce",
]


def _no_arg(cls: Callable[[], Compressor], name: str) -> Callable[[str | None], Compressor]:
    def make(arg: str | None) -> Compressor:
        if arg is not None:
            raise ConfigError(f"compressor {name!r} takes no argument, got {name}:{arg}")
        return cls()

    return make


def _with(
    cls: Callable[..., Compressor], name: str, param: str, conv: Callable[[str], object]
) -> Callable[[str | None], Compressor]:
    def make(arg: str | None) -> Compressor:
        if arg is None:
            return cls()
        try:
            value = conv(arg)
        except ValueError:
            raise ConfigError(f"compressor {name!r}: {param} must be a {conv.__name__}, got {arg!r}") from None
        return cls(**{param: value})

    return make


def _sign(arg: str | None) -> Compressor:
    words = [w for w in (arg or "").split(":") if w]
    mv = any(w in ("mv", "majority") for w in words)
    scale = "mean" if "mean" in words else "rms"
    if any(w not in ("mv", "majority", "mean", "rms") for w in words):
        raise ConfigError(
            f"compressor 'sign' takes no argument, 'mv' (majority vote) and/or 'mean' (scale), got sign:{arg}"
        )
    return SignSGD(majority_vote=mv, scale=scale)


def _onebit(arg: str | None) -> Compressor:
    if arg not in (None, "", "rms", "mean"):
        raise ConfigError(
            f"compressor 'onebit' takes no argument or 'mean' (the paper's reconstruction values), got onebit:{arg}"
        )
    return OneBit(scale=arg or "rms")


def _randomk(arg: str | None) -> Compressor:
    ratio, _, kind = (arg or "").partition(":")
    if ratio in ("memory", "unbiased") and not kind:
        ratio, kind = "", ratio
    try:
        r = float(ratio) if ratio else 0.01
    except ValueError:
        raise ConfigError(f"compressor 'randomk': ratio must be a float, got {ratio!r}") from None
    if kind not in ("", "unbiased", "memory"):
        raise ConfigError(f"compressor 'randomk' takes RATIO, RATIO:unbiased or RATIO:memory, got randomk:{arg}")
    return RandomK(ratio=r, scale=kind != "memory")


#: name -> factory(argument string or None). One dict; the CLI's --compression reads it.
REGISTRY: dict[str, Callable[[str | None], Compressor]] = {
    "none": _no_arg(Identity, "none"),
    "fp16": _no_arg(FP16, "fp16"),
    "bf16": _no_arg(BF16, "bf16"),
    "qsgd": _with(QSGD, "qsgd", "levels", int),  # qsgd:LEVELS (default 16)
    "terngrad": _no_arg(TernGrad, "terngrad"),
    "sign": _sign,  # sign, sign:mv (majority vote); :mean for the mean-magnitude scale
    "onebit": _onebit,  # onebit; onebit:mean for the paper's reconstruction values
    "topk": _with(TopK, "topk", "ratio", float),  # topk:RATIO (default 0.01)
    "randomk": _randomk,  # randomk:RATIO[:unbiased] scaled by n/k (default 0.01); randomk:RATIO:memory unscaled + EF
    "threshold": _with(Threshold, "threshold", "value", float),  # threshold:VALUE (default 1e-3)
    "powersgd": _with(PowerSGD, "powersgd", "rank", int),  # powersgd:RANK (default 2)
}


def from_spec(spec: str | Compressor | None, *, error_feedback: bool = True, momentum: float = 0.0) -> Compressor:
    """Build a compressor from ``"NAME"`` or ``"NAME:ARG"`` (e.g. ``"topk:0.01"``).

    Args:
        spec: a registry name with optional argument, an existing compressor
            (returned as is), or ``None`` (same as ``"none"``).
        error_feedback: wrap biased compressors in error feedback (default: True).
        momentum: the SGD momentum the training uses (default: 0). Compressors
            that need momentum before them (``momentum_first``: sign, sign:mv,
            onebit) get it in their error feedback, and the result's
            :attr:`~Compressor.momentum` is then > 0: build the optimizer with
            ``momentum=0`` (``dtrain run`` does). Others ignore it and leave
            momentum to the optimizer.

    Raises:
        ConfigError: unknown name or bad argument; the message lists the names.
    """
    if not isinstance(momentum, (int, float)) or not 0.0 <= float(momentum) < 1.0:
        raise ConfigError(f"momentum must be in [0, 1) (the optimizer's SGD momentum), got {momentum!r}")
    if isinstance(spec, Compressor):
        return spec
    if spec is None:
        spec = "none"
    if not isinstance(spec, str):
        raise ConfigError(f"compression must be a spec string like 'topk:0.01', got {type(spec).__name__}")
    name, _, arg = spec.strip().partition(":")
    name = name.lower()
    if name not in REGISTRY:
        raise ConfigError(f"unknown compressor {name!r}; choose one of: {', '.join(sorted(REGISTRY))}")
    try:
        comp = REGISTRY[name](arg if arg else None)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"bad compression spec {spec!r}: {e}") from e
    if error_feedback and comp.biased:
        comp = ErrorFeedback(comp, momentum=float(momentum) if comp.momentum_first else 0.0)
    return comp


@overload
def resolve(compression: object, *, none_is_off: Literal[False], what: str = ...) -> Compressor: ...
@overload
def resolve(compression: object, *, none_is_off: bool, what: str = ...) -> Compressor | None: ...
def resolve(compression: object, *, none_is_off: bool, what: str = "compression") -> Compressor | None:
    """An engine's ``compression=`` argument as a compressor: the one place every engine resolves it.

    Args:
        compression: a spec string (built by :func:`from_spec`: error feedback for biased
            compressors, no momentum), a :class:`Compressor` (returned as is), or None.
        none_is_off: what None and ``"none"`` give: None (the engine then reduces exactly, with
            no compressor: DataParallel, hybrid) or :class:`Identity` (the parameter server).
        what: the argument's name, for the error.

    Raises:
        ConfigError: anything else, or a bad spec.
    """
    if compression is None or (isinstance(compression, str) and compression.strip().lower() == "none"):
        return None if none_is_off else Identity()
    if not isinstance(compression, (str, Compressor)):
        raise ConfigError(
            f"{what} must be a spec string like 'topk:0.01', a dtrain.compress.Compressor or None, "
            f"got {type(compression).__name__}"
        )
    return from_spec(compression)


def __getattr__(name: str) -> object:
    # compressed_allreduce pulls in the collectives; import it only when asked for
    if name == "compressed_allreduce":
        from dtrain.compress.reduce import compressed_allreduce

        return compressed_allreduce
    raise AttributeError(f"module 'dtrain.compress' has no attribute {name!r}")
