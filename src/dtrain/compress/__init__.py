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
from dtrain.errors import ConfigError

__all__ = [
    "Compressor",
    "Identity",
    "TensorMeta",
    "REGISTRY",
    "from_spec",
]


def _no_arg(cls: Callable[[], Compressor], name: str) -> Callable[[str | None], Compressor]:
    def make(arg: str | None) -> Compressor:
        if arg is not None:
            raise ConfigError(f"compressor {name!r} takes no argument, got {name}:{arg}")
        return cls()

    return make


#: name -> factory(argument string or None). One dict; the CLI's --compression reads it.
REGISTRY: dict[str, Callable[[str | None], Compressor]] = {
    "none": _no_arg(Identity, "none"),
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
        from dtrain.compress.feedback import ErrorFeedback

        comp = ErrorFeedback(comp)
    return comp
