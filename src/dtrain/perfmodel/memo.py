"""Measurements kept between processes: a second ``dtrain plan`` reads what the first measured.

The planner measures two things each time it ranks: the model's profile at each per-device batch
(:func:`~dtrain.perfmodel.profile.profile_model`, tens of seconds for gpt-small: timed forward and backward
passes per batch) and each compressed collective's traffic and CPU time
(:func:`~dtrain.perfmodel._traffic.compressed_traffic`, the collective run on threads). Neither changes
between two plans on the same machine, so inside :func:`kept_in` both are looked up in, and added to, one
JSON file a kind in a folder (the planner passes the calibration cache, one folder a host):
``profiles.json`` and ``traffic.json``, each a map from the digest of what was measured (the model's
structure and parameter shapes, the input's shape, batch, threads, optimizer, torch's version; the
collective's spec, world and sizes) to the measurement. Outside :func:`kept_in` nothing is read or written:
:mod:`dtrain.perfmodel` stays pure for its other callers. Delete the folder to measure afresh.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["kept_in", "recall", "remember", "digest"]

_folder: Path | None = None


@contextlib.contextmanager
def kept_in(folder: Path) -> Iterator[None]:
    """Within the block, measurements are looked up in and added to ``folder`` (created on the first write)."""
    global _folder
    old, _folder = _folder, folder
    try:
        yield
    finally:
        _folder = old


def digest(key: Any) -> str:
    """A stable digest of ``key`` (JSON-able: strings, numbers, lists)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _read(kind: str) -> dict[str, Any]:
    if _folder is None:
        return {}
    try:
        found = json.loads((_folder / f"{kind}.json").read_text())
    except (OSError, ValueError):  # none yet, or unreadable: measured again and rewritten
        return {}
    return found if isinstance(found, dict) else {}


def recall(kind: str, key: str) -> Any | None:
    """The measurement of ``kind`` kept under ``key`` (a :func:`digest`), or None (none, or not in
    :func:`kept_in`)."""
    return _read(kind).get(key)


def remember(kind: str, key: str, value: Any) -> None:
    """Keep ``value`` (JSON-able) under ``key``; written whole to a temporary file, then renamed, so a
    reader never sees half of it (two planners at once: the last write wins)."""
    if _folder is None:
        return
    found = _read(kind)
    found[key] = value
    with contextlib.suppress(OSError):  # a cache that cannot be written costs the next plan time, nothing else
        _folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=_folder, prefix=f".{kind}-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(found, f)
        os.replace(tmp, _folder / f"{kind}.json")
