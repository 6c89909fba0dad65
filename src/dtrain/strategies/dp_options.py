"""The strategy options of ``dp`` (:class:`DPOptions`, ZeRO with ``--shard``) and ``ddp`` (:class:`DDPOptions`):
the registry's :class:`~dtrain.registry.StrategyOptions`, a run's ``[dp]`` / ``[ddp]`` table and flags. What
the engines themselves take is :mod:`dtrain.data_parallel.tunables` and :mod:`dtrain.sharded.arguments`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dtrain.data_parallel.tunables import ALGORITHMS, OVERLAPS, SHARD_ALGORITHMS, SHARDS
from dtrain.errors import ConfigError, check_choice
from dtrain.registry import StrategyOptions
from dtrain.strategies._common import CompressedOptions

__all__ = ["DPOptions", "DDPOptions", "STATELESS_WIRE"]

# compressors without per-rank state: a plain dp checkpoint with them resumes on any number of workers
STATELESS_WIRE = ("none", "fp16", "bf16")


@dataclass(frozen=True)
class DPOptions(CompressedOptions):
    """Options of ``--strategy dp`` (:class:`dtrain.DataParallel`).

    Attributes:
        algorithm: allreduce algorithm of each bucket (default: ring).
        bucket_mb: bucket size in MiB (default: 25, DDP's).
        overlap: "backward" (DDP-style) or "forward" (priority scheduling) (default: backward).
    """

    algorithm: str = field(default="ring", metadata={"choices": ALGORITHMS, "help": "allreduce algorithm"})
    bucket_mb: float = field(default=25.0, metadata={"help": "gradient bucket size in MiB (default: 25.0)"})
    overlap: str = field(
        default="backward",
        metadata={
            "choices": OVERLAPS,
            "help": "overlap communication with backward, or with the next forward (priority)",
        },
    )
    shard: str = field(
        default="none",
        metadata={
            "choices": SHARDS,
            "help": "ZeRO sharding: optimizer (stage 1), gradients (2), parameters (3) (default: none)",
        },
    )

    def __post_init__(self) -> None:
        check_choice("algorithm", self.algorithm, ALGORITHMS)
        check_choice("overlap", self.overlap, OVERLAPS)
        check_choice("shard", self.shard, SHARDS)
        if self.bucket_mb <= 0:
            raise ConfigError(f"bucket_mb must be > 0, got {self.bucket_mb}")
        super().__post_init__()
        if self.shard != "none":
            if self.algorithm not in SHARD_ALGORITHMS:
                raise ConfigError(
                    f"--shard {self.shard} reduce-scatters and allgathers with {' or '.join(SHARD_ALGORITHMS)}; "
                    f"--algorithm {self.algorithm} has no sharded form (use --algorithm ring)"
                )
            if self.compressor_spec() != "none":
                raise ConfigError(
                    f"--shard {self.shard} does not take --compression {self.compression}: "
                    "a sharded engine reduce-scatters exact gradients; drop one of the two"
                )

    @property
    def sharded(self) -> bool:
        return self.shard != "none"

    def checkpoint_keys(self) -> dict[str, Any]:
        keys = super().checkpoint_keys()
        if keys:
            keys["bucket_mb"] = self.bucket_mb  # the bucket layout keys the compressor state
        if self.sharded:
            keys["shard"] = self.shard  # a sharded checkpoint holds segments, not a model state dict
        return keys

    def measures_noise_scale(self, workers: int) -> bool:
        return not self.sharded and workers >= 2  # the reducer sees each worker's gradient before averaging

    def reshards(self) -> bool:
        # ZeRO: DCP reshards the segments. Plain dp: every rank holds the same model and optimizer state,
        # so any number of workers can take them, unless a compressor keeps per-rank state (residuals)
        return self.sharded or self.compression in STATELESS_WIRE

    def refuses_grad_accum(self, workers: int) -> str:
        return ""  # no_sync: the micro-steps before the last do not communicate

    def refuses_clip_grad_norm(self, workers: int) -> str:
        if self.overlap == "forward" and not self.sharded:
            return (
                "applies each bucket as soon as it is averaged (--overlap forward), before the global norm "
                "of every bucket exists; use --overlap backward"
            )
        return ""

    def label(self, workers: int) -> str:
        ov = "" if self.overlap == "backward" else " fwd-overlap"
        zero = f" zero-{SHARDS.index(self.shard)}" if self.sharded else ""
        return f"dp {self.algorithm} {self.bucket_mb:g}MiB{ov}{zero}{self._comp_label()}"


@dataclass(frozen=True)
class DDPOptions(StrategyOptions):
    """Options of ``--strategy ddp`` (torch's DistributedDataParallel).

    Attributes:
        bucket_mb: DDP's ``bucket_cap_mb`` (default: 25).
    """

    bucket_mb: float = field(default=25.0, metadata={"help": "gradient bucket size in MiB (default: 25.0)"})

    def __post_init__(self) -> None:
        if self.bucket_mb <= 0:
            raise ConfigError(f"bucket_mb must be > 0, got {self.bucket_mb}")

    # what the performance model reads of a data-parallel strategy
    @property
    def algorithm(self) -> str:
        return "native"

    @property
    def overlap(self) -> str:
        return "backward"

    def refuses_grad_accum(self, workers: int) -> str:
        return ""  # torch's no_sync()

    def refuses_clip_grad_norm(self, workers: int) -> str:
        return ""

    def label(self, workers: int) -> str:
        return f"torch DDP {self.bucket_mb:g}MiB"
