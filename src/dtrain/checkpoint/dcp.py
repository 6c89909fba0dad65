"""Save and load training state with torch's distributed checkpoint (DCP).

What a checkpoint holds, as one DCP state dict (nested keys flattened by DCP)::

    model.<fqn>                      the model's tensors (identical on every rank:
                                     DCP's planner writes each once, spread over ranks)
    optimizer.state.<fqn>.<name>     optimizer state by parameter name (momentum,
    optimizer.param_groups.<fqn>.*   Adam's moments, step counts) and hyperparameters
    scheduler                        the LR scheduler's state dict (optional)
    rank_state.rank<r>.tree          what differs per rank -- compressor residuals and
    rank_state.rank<r>.t.<i>         warm starts, RNG states, a worker's clock and data
                                     position, a server's shard: the rank's object with
                                     each tensor cut out (``tree``, pickled) and the
                                     tensors as DCP tensors; restored to the same rank

Model and optimizer go through ``torch.distributed.checkpoint.state_dict``
(``get_/set_model_state_dict``, ``get_/set_optimizer_state_dict``), so the files
are the ones a DDP or FSDP user's DCP tooling reads. A per-rank object is split
into its tensors, which DCP writes as tensors under keys that name the rank
(no pickling of large buffers, which makes a save several times slower), and
the rest of the object with slots where the tensors were, stored as a DCP byte
item. At load the tensors' shapes and dtypes come from DCP's metadata, so
nothing needs to exist beforehand; ranks never read each other's.

Steps of :func:`save_checkpoint` (collective over ``group``):

1. rank 0 prepares an empty temporary folder (:mod:`.layout`); barrier;
2. ``torch.distributed.checkpoint.save``: every rank plans its items, the
   coordinator removes duplicates, each rank writes one file, rank 0 writes
   ``.metadata``;
3. rank 0 writes the marker and renames the folder into place; barrier -- when
   the call returns on any rank the checkpoint is complete on disk.

Cost: the model and optimizer bytes once in total, each rank's blob once, plus a
few small collectives (DCP's plan gather/scatter and two barriers).

Loading unpickles the per-rank blobs (``torch.load(weights_only=False)``, as DCP
does for its byte items): load checkpoints you trust, as with ``torch.load``.
"""

from __future__ import annotations

import contextlib
import io
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtrain.checkpoint.layout import (
    CheckpointError,
    checkpoint_dir,
    commit_folder,
    find_checkpoint,
    prepare_folder,
    read_info,
    temporary_folder,
)
from dtrain.errors import CommError

__all__ = ["save_checkpoint", "load_checkpoint", "read_checkpoint", "FORMAT"]


def _dcp() -> Any:
    """torch.distributed.checkpoint, imported where a checkpoint is read or written: it loads DTensor's modules,
    about a second of every process's start-up otherwise."""
    import torch.distributed.checkpoint as dcp

    return dcp


#: version of what a checkpoint holds; bumped when the layout changes
FORMAT = 1


def _ranks(group: Any) -> tuple[int, int, bool]:
    """(rank in group, group size, whether torch.distributed is in use)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group), True
    return 0, 1, False


def _barrier(group: Any, rank: int, what: str, step: int | None) -> None:
    try:
        dist.barrier(group=group)
    except Exception as e:  # noqa: BLE001 - the backend's timeout or a lost peer
        raise CommError(rank, what, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", step=step) from e


@contextlib.contextmanager
def _single_process_quiet() -> Any:
    """DCP warns on every single-process save/load; one process is a supported case here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class _Slot:
    """Stands for the ``index``-th tensor cut out of a per-rank object."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Slot, (self.index,))


def _alias(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes two tensors one: the same elements of the same storage, seen the same way (None: empty)."""
    if t.numel() == 0 or t.untyped_storage().data_ptr() == 0:
        return None
    return (t.untyped_storage().data_ptr(), t.device, t.dtype, t.storage_offset(), tuple(t.shape), t.stride())


def _cut(obj: Any, tensors: list[torch.Tensor], seen: dict[tuple[Any, ...], int] | None = None) -> Any:
    """``obj`` with each tensor (in dicts, lists, tuples) replaced by a :class:`_Slot`; tensors appended.

    A tensor met again -- the same view of the same storage, as the two keys of a tied
    parameter in a ``state_dict()`` -- takes the first one's slot: it is written once and
    comes back as one tensor in both places.
    """
    seen = {} if seen is None else seen
    if isinstance(obj, torch.Tensor):
        key = _alias(obj)
        if key is not None and key in seen:
            return _Slot(seen[key])
        tensors.append(obj.detach())
        if key is not None:
            seen[key] = len(tensors) - 1
        return _Slot(len(tensors) - 1)
    if isinstance(obj, dict):
        return {k: _cut(v, tensors, seen) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_cut(v, tensors, seen) for v in obj)
    return obj


def _paste(obj: Any, tensors: dict[int, torch.Tensor]) -> Any:
    if isinstance(obj, _Slot):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _paste(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_paste(v, tensors) for v in obj)
    return obj


def _pack(obj: Any) -> dict[str, Any]:
    tensors: list[torch.Tensor] = []
    tree = _cut(obj, tensors)
    buf = io.BytesIO()
    torch.save(tree, buf)
    out: dict[str, Any] = {"tree": buf.getvalue()}
    if tensors:
        out["t"] = {str(i): t for i, t in enumerate(tensors)}
    return out


def _unpack(packed: dict[str, Any]) -> Any:
    raw = packed["tree"]
    tree = torch.load(io.BytesIO(raw.getvalue() if isinstance(raw, io.BytesIO) else raw), weights_only=False)
    return _paste(tree, {int(i): t for i, t in packed.get("t", {}).items()})


def _rank_slots(ckpt: Path, rank: int) -> dict[str, Any]:
    """Empty tensors for rank ``rank``'s cut-out tensors, shaped from the checkpoint's metadata."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(ckpt)).read_metadata()
    prefix = f"rank_state.rank{rank}.t."
    slots = {
        k[len(prefix) :]: torch.empty(tuple(m.size), dtype=m.properties.dtype)
        for k, m in md.state_dict_metadata.items()
        if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)
    }
    out: dict[str, Any] = {"tree": b""}
    if slots:
        out["t"] = slots
    return out


def _model_optimizer_state(model: nn.Module | None, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state: dict[str, Any] = {}
    if optimizer is not None and model is None:
        raise ValueError(
            "saving or loading an optimizer needs its model too (optimizer state is keyed by parameter name)"
        )
    if model is not None:
        state["model"] = get_model_state_dict(model)
    if optimizer is not None:
        assert model is not None
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    return state


def save_checkpoint(
    root: str | Path,
    step: int,
    *,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    rank_state: Any = None,
    info: dict[str, Any] | None = None,
    group: Any = None,
    sharded: dict[str, Any] | None = None,
) -> Path:
    """Write a checkpoint of ``step`` under ``root`` (e.g. ``RUN/checkpoints``); every rank of ``group`` calls it.

    Args:
        root: the folder that holds the checkpoints; this one becomes
            ``root/step_<step>`` (6 digits).
        step: the training step the state belongs to (steps completed).
        model: the model (unwrapped: pass ``ddp.module``), or None.
        optimizer: its optimizer, or None.
        scheduler: an LR scheduler (anything with ``state_dict``), or None.
        rank_state: any picklable object of this rank (tensors inside are fine);
            restored to the same rank by :func:`load_checkpoint`.
        info: JSON-serialisable facts about the run, stored in the marker
            (what :func:`dtrain.checkpoint.find_checkpoint` users read without
            loading); rank 0's is used.
        group: the ranks that save together (default: the default group; without
            torch.distributed, a world of one). A gloo group for CPU state.
        sharded: a state dict whose DTensors each rank holds a part of (a sharded
            engine's segments, :func:`dtrain.sharded.state.sharded_state`); each rank
            writes its own part, and :func:`load_checkpoint` reshards it onto any
            number of ranks (default: None).

    Returns:
        The complete checkpoint folder.

    Raises:
        CommError: a rank failed or timed out during the save (the group's
            timeout); names the rank, the operation and the step. No complete
            checkpoint is left behind in that case.
    """
    rank, world, distributed = _ranks(group)
    root = Path(root)
    op = f"checkpoint save to {root}"
    if rank == 0:
        prepare_folder(root, step)
    if distributed:
        _barrier(group, rank, op, step)
    tmp = temporary_folder(root, step)
    state = _model_optimizer_state(model, optimizer)
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    if sharded is not None:
        state["sharded"] = sharded
    state["rank_state"] = {f"rank{rank}": _pack(rank_state)}
    try:
        with _single_process_quiet():
            _dcp().save(state, checkpoint_id=tmp, process_group=group, no_dist=not distributed)
    except Exception as e:  # noqa: BLE001 - DCP wraps every rank's failure in one exception
        raise CommError(rank, op, f"{type(e).__name__}: {str(e).strip()[:500]}", step=step) from e
    final = checkpoint_dir(root, step)
    if rank == 0:
        meta = dict(info or {})
        meta.update(
            step=int(step),
            world_size=world,
            format=FORMAT,
            saved_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
            torch=torch.__version__,
            has=sorted(k for k in state if k != "rank_state"),
        )
        final = commit_folder(tmp, meta)
    if distributed:
        _barrier(group, rank, op, step)
    return final


def _blob_rank(ckpt: Path, info: dict[str, Any], rank: int, world: int, reshard: bool, blob_rank: int | None) -> int:
    """The saved rank whose per-rank blob this rank loads (its own, unless the job is resharded), checked."""
    saved_world = int(info["world_size"])
    if blob_rank is None or not reshard:
        blob_rank = rank % saved_world if reshard else rank
    if not 0 <= blob_rank < saved_world:
        raise CheckpointError(
            f"rank {rank}: {ckpt} has no per-rank state of rank {blob_rank} (saved by {saved_world} processes)"
        )
    if saved_world != world and not reshard:
        raise CheckpointError(
            f"{ckpt} was saved by {info['world_size']} processes; this job has {world}. Per-rank state (compressor "
            f"residuals, a worker's clock, a server's shard) belongs to one rank each: resume with the same numbers "
            f"of workers and servers"
        )
    return blob_rank


def _check_holds(ckpt: Path, info: dict[str, Any], **wanted: Any) -> None:
    """Refuse to load what the checkpoint holds no state of (each of ``wanted`` that is not None)."""
    has = set(info.get("has", ()))
    for name, obj in wanted.items():
        if obj is not None and has and name not in has:
            has_text = ", ".join(sorted(has)) or "per-rank state only"
            raise CheckpointError(f"{ckpt} holds no {name} state (it has: {has_text})")


def load_checkpoint(
    path: str | Path,
    *,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    group: Any = None,
    sharded: dict[str, Any] | None = None,
    reshard: bool = False,
    blob_rank: int | None = None,
) -> tuple[dict[str, Any], Any]:
    """Restore what :func:`save_checkpoint` wrote; every rank of ``group`` calls it.

    The model and optimizer are loaded in place (the optimizer's hyperparameters
    too, as ``torch.optim.Optimizer.load_state_dict`` does); the rank's own blob
    is returned, not applied -- its owner knows what to do with it.

    Args:
        path: a checkpoint folder, or a run/``checkpoints`` folder (its latest
            complete checkpoint; see :func:`dtrain.checkpoint.find_checkpoint`).
        model / optimizer / scheduler: what to restore (None: skip).
        sharded: :func:`save_checkpoint`'s ``sharded``, laid out for this job's ranks;
            loaded in place (DCP reshards) (default: None).
        reshard: the job may have another number of ranks than the checkpoint; each
            rank then takes the per-rank blob of rank ``rank % saved ranks``
            (default: False).
        blob_rank: under ``reshard``, the saved rank whose blob this rank takes instead, where
            ranks have roles (a parameter server's servers keep their own, its workers cycle
            over the saved workers) (default: None: the rule above).
        group: as for :func:`save_checkpoint`; must have the checkpoint's size.

    Returns:
        ``(info, rank_state)``: the marker's contents, and this rank's blob.

    Raises:
        CheckpointError: no complete checkpoint at ``path``, a different number
            of ranks, or the checkpoint lacks what was asked for.
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    ckpt = find_checkpoint(path)
    info = read_info(ckpt)
    rank, world, distributed = _ranks(group)
    blob_rank = _blob_rank(ckpt, info, rank, world, reshard, blob_rank)
    _check_holds(ckpt, info, model=model, optimizer=optimizer, scheduler=scheduler, sharded=sharded)
    state = _model_optimizer_state(model, optimizer)
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    if sharded is not None:
        state["sharded"] = sharded
    state["rank_state"] = {f"rank{blob_rank}": _rank_slots(ckpt, blob_rank)}
    try:
        with _single_process_quiet():
            _dcp().load(state, checkpoint_id=ckpt, process_group=group, no_dist=not distributed)
    except Exception as e:  # noqa: BLE001 - missing keys, shape mismatches, unreadable files
        raise CheckpointError(f"rank {rank}: cannot load {ckpt}: {type(e).__name__}: {str(e).strip()[:800]}") from e
    if model is not None:
        set_model_state_dict(model, state["model"])
    if optimizer is not None:
        assert model is not None
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    return info, _unpack(state["rank_state"][f"rank{blob_rank}"])


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """Everything in a checkpoint, read in this one process (for inspection and tests).

    Returns:
        ``{"info": ..., "model": {fqn: tensor}, "optimizer": {...}, "scheduler": ...,
        "rank_state": {rank: object}}`` (keys present as saved).
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt = find_checkpoint(path)
    buf = io.BytesIO()
    with _single_process_quiet():
        dcp_to_torch_save(ckpt, buf)  # type: ignore[arg-type]  # torch.save takes a file object
    buf.seek(0)
    full: dict[str, Any] = torch.load(buf, weights_only=False)
    blobs = full.pop("rank_state", {})
    full["rank_state"] = {int(k[len("rank") :]): _unpack(v) for k, v in blobs.items()}
    full["info"] = read_info(ckpt)
    return full
