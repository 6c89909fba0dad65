"""Gradient compression: quantizers, sparsifiers, low rank, error feedback.

Build one from a spec string (what ``--compression`` takes)::

    c = dtrain.compress.from_spec("topk:0.01")        # ErrorFeedback(TopK(ratio=0.01))
    c = dtrain.compress.from_spec("qsgd:16")          # unbiased: no error feedback
    c = dtrain.compress.from_spec("sign", error_feedback=False)

Spec names are the keys of :data:`REGISTRY`; ``NAME:ARG`` passes one argument.
"""

from __future__ import annotations

from typing import Callable

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
    "compressed_allreduce",
]


def _no_arg(cls: Callable[[], Compressor], name: str) -> Callable[[str | None], Compressor]:
    def make(arg: str | None) -> Compressor:
        if arg is not None:
            raise ConfigError(f"compressor {name!r} takes no argument, got {name}:{arg}")
        return cls()

    return make


def _with(cls: Callable[..., Compressor], name: str, param: str, conv: Callable[[str], object]) -> Callable[[str | None], Compressor]:
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
    if arg in (None, ""):
        return SignSGD()
    if arg in ("mv", "majority"):
        return SignSGD(majority_vote=True)
    raise ConfigError(f"compressor 'sign' takes no argument or 'mv' (majority vote), got sign:{arg}")


#: name -> factory(argument string or None). One dict; the CLI's --compression reads it.
REGISTRY: dict[str, Callable[[str | None], Compressor]] = {
    "none": _no_arg(Identity, "none"),
    "fp16": _no_arg(FP16, "fp16"),
    "bf16": _no_arg(BF16, "bf16"),
    "qsgd": _with(QSGD, "qsgd", "levels", int),  # qsgd:LEVELS (default 16)
    "terngrad": _no_arg(TernGrad, "terngrad"),
    "sign": _sign,  # sign, or sign:mv for majority vote
    "onebit": _no_arg(OneBit, "onebit"),
    "topk": _with(TopK, "topk", "ratio", float),  # topk:RATIO (default 0.01)
    "randomk": _with(RandomK, "randomk", "ratio", float),  # randomk:RATIO (default 0.01)
    "threshold": _with(Threshold, "threshold", "value", float),  # threshold:VALUE (default 1e-3)
    "powersgd": _with(PowerSGD, "powersgd", "rank", int),  # powersgd:RANK (default 2)
}


def from_spec(spec: "str | Compressor | None", *, error_feedback: bool = True) -> Compressor:
    """Build a compressor from ``"NAME"`` or ``"NAME:ARG"`` (e.g. ``"topk:0.01"``).

    Args:
        spec: a registry name with optional argument, an existing compressor
            (returned as is), or ``None`` (same as ``"none"``).
        error_feedback: wrap biased compressors in error feedback (default: True).

    Raises:
        ConfigError: unknown name or bad argument; the message lists the names.
    """
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
        comp = ErrorFeedback(comp)
    return comp


def __getattr__(name: str) -> object:
    # compressed_allreduce pulls in the collectives; import it only when asked for
    if name == "compressed_allreduce":
        from dtrain.compress.reduce import compressed_allreduce

        return compressed_allreduce
    raise AttributeError(f"module 'dtrain.compress' has no attribute {name!r}")
