"""A checkpoint's manifest: the size and SHA-256 of every file, so damage is found before a load.

The manifest is stored in the checkpoint's marker (``checkpoint.json``, key
``"manifest"``), which rank 0 writes after every rank's files are on disk and
before the folder is renamed into place (:func:`dtrain.checkpoint.layout.commit_folder`)::

    "manifest": {"algorithm": "sha256",
                 "files": {".metadata": {"bytes": 2301, "sha256": "9f0c..."},
                           "__0_0.distcp": {"bytes": 71424, "sha256": "a41e..."}, ...}}

So a checkpoint whose marker exists has a manifest of exactly the files that were
written; :func:`check_files` compares the folder against it:

1. every listed file exists and has the listed size (one ``stat`` per file: cheap,
   done by every load; finds a truncated or missing file);
2. with ``checksums=True``, every file's SHA-256 matches (reads every byte: done once,
   in the parent, before a resumed run starts; finds a flipped byte).

Cost: SHA-256 reads each file once at save (from the page cache: the files were
just written) and once at resume, well under a millisecond per MB on one core with the
CPU's SHA instructions. Checkpoints written before manifests existed have none: they
load unverified (:func:`describe` says so).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["ALGORITHM", "file_digest", "build_manifest", "check_files", "describe"]

#: the checksum of every file (``hashlib`` name); sha256: the one ``sha256sum`` checks too
ALGORITHM = "sha256"
_CHUNK = 4 << 20


def file_digest(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def build_manifest(folder: str | Path, *, exclude: Iterable[str] = ()) -> dict[str, Any]:
    """The manifest of every regular file in ``folder`` (not recursive) except ``exclude``."""
    skip = set(exclude)
    files = {
        p.name: {"bytes": p.stat().st_size, ALGORITHM: file_digest(p)}
        for p in sorted(Path(folder).iterdir())
        if p.is_file() and p.name not in skip
    }
    return {"algorithm": ALGORITHM, "files": files}


def check_files(folder: str | Path, info: dict[str, Any], *, checksums: bool = True) -> str | None:
    """What is wrong with ``folder``'s files against the manifest in its marker ``info``, or None.

    The answer names the file (``.../step_000006/__1_0.distcp has 700 bytes, its manifest
    says 71424: the file is truncated``). A marker without a manifest (a checkpoint from
    before manifests) gives None: nothing to check against.
    """
    manifest = info.get("manifest")
    if not isinstance(manifest, dict):
        return None
    folder = Path(folder)
    files = manifest.get("files", {})
    algorithm = manifest.get("algorithm", ALGORITHM)
    for name, want in files.items():
        p = folder / name
        if not p.is_file():
            return f"{p} is missing (listed in the checkpoint's manifest)"
        size = p.stat().st_size
        if size != want["bytes"]:
            why = "truncated" if size < want["bytes"] else "longer than written"
            return f"{p} has {size} bytes, its manifest says {want['bytes']}: the file is {why}"
    if checksums and algorithm == ALGORITHM:
        for name, want in files.items():
            p = folder / name
            if file_digest(p) != want[ALGORITHM]:
                return f"{p} is corrupted: its {ALGORITHM} differs from the checkpoint's manifest"
    return None


def describe(folder: str | Path, info: dict[str, Any], *, checksums: bool) -> str:
    """One line on how far ``folder`` was verified (for the resume message)."""
    manifest = info.get("manifest")
    if not isinstance(manifest, dict):
        return f"{folder} (step {info['step']}) was written before checkpoints had a manifest: not verified"
    files = manifest.get("files", {})
    mb = sum(int(f["bytes"]) for f in files.values()) / 1e6
    how = f"{manifest.get('algorithm', ALGORITHM)} of" if checksums else "sizes of"
    return f"{folder} (step {info['step']}): {how} {len(files)} files ({mb:.1f} MB) verified"
