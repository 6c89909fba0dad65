"""Options shared by strategies that compress gradients."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dtrain.errors import ConfigError
from dtrain.registry import StrategyOptions

if TYPE_CHECKING:
    from dtrain.compress.base import Compressor
    from dtrain.config.schema import RunConfig

__all__ = ["CompressedOptions", "check_fp16_exchange"]


@dataclass(frozen=True)
class CompressedOptions(StrategyOptions):
    """A gradient compressor (``--compression``) and its error feedback.

    Attributes:
        compression: compressor spec, e.g. ``topk:0.01``, ``qsgd:16``, ``powersgd:2`` (default: none).
        error_feedback: error feedback for biased compressors (default: on).
    """

    compression: str = field(
        default="none", metadata={"help": "gradient compressor, e.g. topk:0.01, qsgd:16, powersgd:2 (default: none)"}
    )
    error_feedback: bool = field(
        default=True, metadata={"help": "error feedback for biased compressors (default: on; --no-error-feedback: off)"}
    )

    def __post_init__(self) -> None:
        if self.compressor_spec() != "none":
            from dtrain.compress import from_spec

            try:
                from_spec(self.compression, error_feedback=self.error_feedback)
            except ValueError as e:
                raise ConfigError(str(e)) from None

    def compressor_spec(self) -> str:
        return "none" if self.compression in ("", "none") else self.compression

    def build_compressor(self, momentum: float) -> Compressor | None:
        """The compressor (None without one). Sign-type compressors take SGD's ``momentum`` into
        their error feedback (``from_spec``'s ``momentum``); the optimizer then has none."""
        if self.compressor_spec() == "none":
            return None
        from dtrain.compress import from_spec

        return from_spec(self.compression, error_feedback=self.error_feedback, momentum=momentum)

    def checkpoint_keys(self) -> dict[str, Any]:
        return {"error_feedback": self.error_feedback} if self.compressor_spec() != "none" else {}

    def approximation(self) -> str:
        comp = self.compressor_spec()
        return "" if comp == "none" else f"approximate: {comp} gradients"

    def _comp_label(self) -> str:
        comp = self.compressor_spec()
        return "" if comp == "none" else f" {comp}"


def check_fp16_exchange(o: CompressedOptions, cfg: RunConfig) -> None:
    """fp16 skips overflowing steps after the exchange: refuse what takes a gradient in before the check
    (a stateful compressor's error feedback, an engine applying buckets as they arrive)."""
    if getattr(o, "overlap", "backward") == "forward":
        raise ConfigError(
            "--precision fp16 cannot skip an overflowing step under --overlap forward (each bucket "
            "is applied as soon as it is averaged); use --overlap backward or --precision bf16"
        )
    if o.compressor_spec() not in ("none", "fp16", "bf16"):
        raise ConfigError(
            f"--precision fp16 with --compression {o.compression}: an overflowing step (inf/nan "
            "gradients, skipped) would stay in the compressor's state; use --precision bf16 (no "
            "overflow, no loss scaling) or no compressor"
        )
