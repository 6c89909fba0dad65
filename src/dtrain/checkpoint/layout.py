"""Where checkpoints live on disk, and how a save becomes visible all at once.

A run folder holds its checkpoints in ``checkpoints/``, one folder per saved step::

    RUN/checkpoints/step_000120/
        checkpoint.json      the marker: written last, holds the checkpoint's info
        .metadata            torch.distributed.checkpoint's index of the data
        __0_0.distcp ...     the data, one file per writing rank

A save is atomic (the classic write-then-rename commit):

1. rank 0 empties ``RUN/checkpoints/.tmp-step_000120`` (left over by a crash) and
   every rank writes its part into it;
2. once every rank is done, rank 0 hashes every file into a manifest (size and
   SHA-256 per file, :mod:`.manifest`), writes it with the marker ``checkpoint.json`` into the
   temporary folder (to a temporary name, fsynced, then renamed), fsyncs the
   folder, and renames the folder to ``step_000120`` -- one ``rename(2)``, atomic
   on a POSIX file system -- then fsyncs ``checkpoints/``.

So a folder named ``step_*`` that holds the marker is complete; anything else (a
``.tmp-*`` folder, a ``step_*`` folder without the marker) is the remains of an
interrupted save and is never resumed from. :func:`find_checkpoint` resolves a
``--resume`` path: a checkpoint folder, a ``checkpoints/`` folder or a run folder
(the latter two mean their latest complete checkpoint, by step, whose files match
its manifest: a newer one with a truncated or corrupted file is skipped, with a
line saying why).

Cost: SHA-256 of every file (about 0.5 ms per MB), two ``fsync`` of small files and
three of folders per save, on rank 0.
Processes on several machines need a shared file system, as torch's own
distributed checkpoint does.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dtrain.checkpoint.manifest import build_manifest, check_files, describe
from dtrain.errors import ConfigError

__all__ = [
    "CheckpointError",
    "CHECKPOINTS_DIR",
    "MARKER",
    "step_name",
    "checkpoint_dir",
    "list_checkpoints",
    "find_checkpoint",
    "read_info",
    "prepare_folder",
    "temporary_folder",
    "commit_folder",
]

#: subfolder of a run folder that holds its checkpoints
CHECKPOINTS_DIR = "checkpoints"
#: the file whose presence marks a checkpoint as complete (it holds the checkpoint's info)
MARKER = "checkpoint.json"
_STEP = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp-"


class CheckpointError(ConfigError):
    """A checkpoint is missing, incomplete, or does not fit the run that wants to resume from it."""


def step_name(step: int) -> str:
    """Folder name of the checkpoint of ``step`` (``step_000120``)."""
    if step < 0:
        raise ValueError(f"a checkpoint step must be >= 0, got {step}")
    return f"step_{step:06d}"


def checkpoint_dir(root: str | Path, step: int) -> Path:
    """The folder the checkpoint of ``step`` gets under ``root`` (a ``checkpoints/`` folder)."""
    return Path(root) / step_name(step)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        with contextlib.suppress(OSError):  # some file systems cannot sync a directory
            os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def prepare_folder(root: str | Path, step: int) -> Path:
    """Step 1 (rank 0): an empty temporary folder for the checkpoint of ``step``; returns it."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{_TMP_PREFIX}{step_name(step)}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def temporary_folder(root: str | Path, step: int) -> Path:
    """The path :func:`prepare_folder` creates (for the ranks that do not create it)."""
    return Path(root) / f"{_TMP_PREFIX}{step_name(step)}"


def commit_folder(tmp: Path, info: dict[str, Any]) -> Path:
    """Step 2 (rank 0, after every rank wrote its part): write the marker with the files' manifest and
    rename; returns the final folder.

    An existing checkpoint of the same step (a resumed run saving into the folder it
    resumed from) is replaced: it is renamed aside first and deleted after the
    new one is in place, so some complete checkpoint of that step exists at every
    moment except between two renames.
    """
    step = int(info["step"])
    final = tmp.parent / step_name(step)
    info = {**info, "manifest": build_manifest(tmp, exclude=(MARKER, MARKER + ".part"))}
    _write_durable(tmp / MARKER, json.dumps(info, indent=2, sort_keys=True) + "\n")
    _fsync_dir(tmp)
    old = None
    if final.exists():
        old = tmp.parent / f"{_TMP_PREFIX}old-{final.name}"
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(tmp.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def read_info(path: str | Path) -> dict[str, Any]:
    """The info (``checkpoint.json``) of a complete checkpoint folder."""
    p = Path(path)
    marker = p / MARKER
    if not marker.is_file():
        raise CheckpointError(
            f"{p} is not a complete checkpoint (no {MARKER}): its save was interrupted or it is not a "
            "checkpoint folder; resume from an earlier one or from the run folder (its latest complete checkpoint)"
        )
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{marker} cannot be read: {e}") from None
    if not isinstance(info, dict) or "step" not in info or "world_size" not in info:
        raise CheckpointError(f"{marker} is not a dtrain checkpoint marker (needs 'step' and 'world_size')")
    return info


def list_checkpoints(root: str | Path) -> list[tuple[int, Path, bool]]:
    """``(step, folder, complete)`` of every ``step_*`` folder under ``root``, by step."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for d in root.iterdir():
        m = _STEP.match(d.name)
        if m and d.is_dir():
            out.append((int(m.group(1)), d, (d / MARKER).is_file()))
    return sorted(out)


def _damaged(p: Path, bad: str) -> CheckpointError:
    hint = "resume from an earlier checkpoint"
    if p.parent.name == CHECKPOINTS_DIR:
        hint += f", or from the run folder {p.parent.parent} (its newest intact checkpoint)"
    return CheckpointError(f"resume: {bad}; {hint}")


def find_checkpoint(path: str | Path, *, checksums: bool = False, report: Callable[[str], None] | None = None) -> Path:
    """Resolve a ``--resume`` path to a complete checkpoint folder whose files match its manifest.

    Args:
        path: a checkpoint folder (``.../step_000120``), a ``checkpoints/``
            folder, or a run folder; the latter two mean their newest complete
            checkpoint that passes the check (newer damaged ones are skipped).
        checksums: also compare every file's SHA-256 with the manifest (reads
            every byte); without it only the sizes are compared (a ``stat`` each).
        report: called with one line per skipped checkpoint (why) and one for
            the checkpoint taken (how far it was verified), if given.

    Raises:
        CheckpointError: the path does not exist, names an incomplete or damaged
            checkpoint (the message names the file), or holds no intact one.
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"resume: {str(p)!r} does not exist; give a checkpoint folder or a run folder")
    if not p.is_dir():
        raise CheckpointError(f"resume: {str(p)!r} is a file; give a checkpoint folder or a run folder")
    if (p / MARKER).is_file():
        info = read_info(p)
        bad = check_files(p, info, checksums=checksums)
        if bad is not None:
            raise _damaged(p, bad)
        if report is not None:
            report(f"resume: {describe(p, info, checksums=checksums)}")
        return p
    if _STEP.match(p.name) or p.name.startswith(_TMP_PREFIX):
        read_info(p)  # raises: an interrupted save
    for root in (p / CHECKPOINTS_DIR, p):
        found = list_checkpoints(root)
        complete = [d for _, d, ok in found if ok]
        skipped: list[str] = []
        for d in reversed(complete):
            try:
                info = read_info(d)
                bad = check_files(d, info, checksums=checksums)
            except CheckpointError as e:
                bad = str(e)
            if bad is None:
                if report is not None:
                    for line in skipped:
                        report(f"resume: skipped {line}")
                    report(f"resume: {describe(d, info, checksums=checksums)}")
                return d
            skipped.append(f"{d.name}: {bad}")
        if skipped:
            raise CheckpointError(f"resume: no intact checkpoint in {root}: " + "; ".join(skipped))
        if found:
            names = ", ".join(d.name for _, d, _ in found)
            raise CheckpointError(
                f"resume: {root} holds only incomplete checkpoints ({names}; no {MARKER}): every save there was "
                "interrupted"
            )
    raise CheckpointError(
        f"resume: no checkpoint in {p} (looked for {CHECKPOINTS_DIR}/step_*/{MARKER}); run with "
        "--checkpoint-every N to write some"
    )
