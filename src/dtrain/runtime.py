"""Process-level set-up: ``dtrain.init()`` and the rank queries.

``init`` reads the environment that torchrun (``torch.distributed.run``) sets --
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT -- and starts the
default process group. Without that environment it is a no-op world of one, so a
script written for dtrain runs unchanged as a plain ``python script.py``.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

__all__ = ["init", "rank", "world_size", "local_rank", "local_world_size", "barrier", "shutdown", "default_backend"]


def default_backend() -> str:
    """NCCL when CUDA is usable, else gloo."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def init(backend: str | None = None, timeout_s: float = 300.0) -> None:
    """Start the default process group from torchrun's environment (idempotent).

    Args:
        backend: "gloo", "nccl" or "mpi" (default: NCCL with CUDA, else gloo).
        timeout_s: timeout of collectives on the default group (default: 300).
    """
    if dist.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return  # a world of one; rank() == 0, world_size() == 1
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(local_rank())
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size())))


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
