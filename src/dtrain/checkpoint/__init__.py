"""Checkpoint and resume on torch's distributed checkpoint (DCP).

::

    from dtrain.checkpoint import save_checkpoint, load_checkpoint

    # every rank, e.g. every 100 steps (a collective)
    save_checkpoint("runs/x/checkpoints", step, model=model, optimizer=opt,
                    rank_state={"engine": dp.compressor_state_dict()})
    # every rank, when resuming: model and optimizer in place, this rank's blob back
    info, mine = load_checkpoint("runs/x", model=model, optimizer=opt)
    dp.load_compressor_state_dict(mine["engine"])

* :mod:`.layout` -- folders, the completion marker, atomic commit by rename,
  finding the latest complete checkpoint;
* :mod:`.dcp` -- what is saved and how (model/optimizer through DCP's
  ``state_dict`` helpers, one blob per rank for state that differs per rank);
* :mod:`.manifest` -- the size and SHA-256 of every file, checked before a load;
* :mod:`.rng` -- a process's random number generators, captured and restored.

``dtrain run --checkpoint-every N`` / ``--resume PATH`` is :mod:`dtrain.training.checkpointing`.
"""

from __future__ import annotations

from dtrain.checkpoint.dcp import load_checkpoint, read_checkpoint, save_checkpoint
from dtrain.checkpoint.layout import (
    CHECKPOINTS_DIR,
    MARKER,
    CheckpointError,
    find_checkpoint,
    list_checkpoints,
    read_info,
)

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "read_checkpoint",
    "find_checkpoint",
    "list_checkpoints",
    "read_info",
    "CheckpointError",
    "CHECKPOINTS_DIR",
    "MARKER",
]
