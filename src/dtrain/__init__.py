"""dtrain: distributed training strategies for PyTorch under one API.

Names are re-exported lazily so that ``import dtrain`` stays cheap and a
sub-package is imported only when used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # runtime
    "init": "dtrain.runtime",
    "rank": "dtrain.runtime",
    "world_size": "dtrain.runtime",
    "local_rank": "dtrain.runtime",
    "local_world_size": "dtrain.runtime",
    "barrier": "dtrain.runtime",
    "shutdown": "dtrain.runtime",
    # strategies
    "DataParallel": "dtrain.data_parallel",
    "ShardedDataParallel": "dtrain.sharded",
    "ParameterServer": "dtrain.param_server",
    "LocalSGD": "dtrain.decentralized",
    "EASGD": "dtrain.decentralized",
    "Gossip": "dtrain.decentralized",
    "Topology": "dtrain.decentralized",
    "Pipeline": "dtrain.pipeline",
    "hybrid": "dtrain.hybrid_parallel.engine",
    "Hybrid": "dtrain.hybrid_parallel.engine",
    "PipelineError": "dtrain.pipeline",
    "Mesh": "dtrain.hybrid_parallel.mesh",
    # a whole run, as `dtrain run` does it
    "run": "dtrain.job.api",
    # planning
    "plan": "dtrain.planning",
    # checkpoints
    "save_checkpoint": "dtrain.checkpoint",
    "load_checkpoint": "dtrain.checkpoint",
    # errors
    "DTrainError": "dtrain.errors",
    "ConfigError": "dtrain.errors",
    "CommError": "dtrain.errors",
    "CommTimeoutError": "dtrain.errors",
    "ModelMismatchError": "dtrain.errors",
    "NonFiniteError": "dtrain.errors",
}
# sub-packages and modules by their public name (a few live deeper in the tree than their name says)
_SUBPACKAGES: dict[str, str] = {
    **{
        n: f"dtrain.{n}"
        for n in (
            "comm",
            "compress",
            "perfmodel",
            "planning",
            "strategies",
            "cluster",
            "param_server",
            "data_parallel",
            "checkpoint",
            "decentralized",
            "pipeline",
            "sharded",
            "tensor_parallel",
            "optim",
            "training",
            "job",
            "workloads",
            "observe",
            "measure",
            "hybrid_parallel",
            "config",
            "launch",
        )
    },
    "precision": "dtrain.optim.precision",
    "large_batch": "dtrain.optim.large_batch",
    "models": "dtrain.models",  # dtrain.workloads.models under its public name
}

__all__ = sorted([*_EXPORTS, *_SUBPACKAGES, "__version__"])


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in _SUBPACKAGES:
        return importlib.import_module(_SUBPACKAGES[name])
    raise AttributeError(f"module 'dtrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
