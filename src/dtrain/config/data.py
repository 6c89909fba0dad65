"""A run's dataset, loaded once a process: the parent's checks, the planner and the summary each ask for it.

The key is what :func:`load_run_data` reads it with (the dataset, the seed, the sizes, the file options) and the
size and modification time of the user's files, so a file written again is read again.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dtrain.workloads.data import DatasetSplit

__all__ = ["load_run_data"]

#: the fields besides ``dataset``, ``seed`` and ``seq_len`` that a user's data is read with
_FILE_FIELDS = ("text_field", "tokenizer", "token_dtype", "vocab_size", "image_size", "val_fraction", "val_dataset")
_LOADED: dict[tuple[Any, ...], DatasetSplit] = {}


def _stamp(path: str) -> tuple[Any, ...]:
    """What tells a file (or folder) read again from the one read before: its size and modification time."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return ()
    return (st.st_size, st.st_mtime_ns)


def _data_key(cfg: Any) -> tuple[Any, ...]:
    """What :func:`load_run_data` reads: the values it is loaded with, and the files' stamps."""
    files = [cfg.dataset, cfg.val_dataset, cfg.tokenizer]
    return (
        cfg.dataset,
        cfg.seed,
        cfg.samples,
        cfg.seq_len,
        *(getattr(cfg, k) for k in _FILE_FIELDS),
        *(_stamp(f) for f in files if f),
    )


def load_run_data(cfg: Any) -> DatasetSplit:
    """The dataset of ``cfg`` (a :class:`~dtrain.config.schema.RunConfig`): the bundled one by name, or the
    user's (a path or ``MODULE:FN``); the last one loaded is kept."""
    from dtrain.workloads.data import DATASETS, load_dataset

    key = _data_key(cfg)
    if key in _LOADED:
        return _LOADED[key]
    if cfg.dataset in DATASETS:
        data = load_dataset(cfg.dataset, seed=cfg.seed, samples=cfg.samples, seq_len=cfg.seq_len)
    else:
        own = {k: getattr(cfg, k) for k in _FILE_FIELDS}
        data = load_dataset(cfg.dataset, seed=cfg.seed, seq_len=cfg.seq_len, **own)
    _LOADED.clear()  # one dataset kept a process
    _LOADED[key] = data
    return data
