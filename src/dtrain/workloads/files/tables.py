"""Arrays and tables: ``.npz`` (arrays ``x`` and ``y``), Parquet, and a Hugging Face ``save_to_disk`` folder.

A ``.npz`` file's ``y`` is one integer label per sample (a classification set, ``x`` its inputs of
any shape), or, with ``x`` and ``y`` integer arrays of one shape ``(N, L)``, token windows (``y`` the
next tokens of ``x``). Tables are read with pyarrow (a ``save_to_disk`` folder holds Arrow IPC stream
files named in its ``state.json``; the ``datasets`` library is not needed) and choose by their
columns, in this order:

1. the text column (``--text-field``, default ``text``): the rows' texts joined by newlines, as text;
2. ``input_ids`` (a list of ids a row): the rows' ids one after the other, as a token stream;
3. ``label`` with numeric feature columns: a classification set, one float32 vector a row of the
   other numeric columns (in the table's order).

A folder written by ``DatasetDict.save_to_disk`` (``dataset_dict.json``) trains on its ``train``
split and validates on its ``validation`` (else ``test``) split unless ``--val-dataset`` is given.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from dtrain.errors import ConfigError
from dtrain.workloads.files.common import Samples, Stream, optional
from dtrain.workloads.files.tokens import text_stream

__all__ = ["read_npz", "read_parquet", "read_arrow_folder", "from_table"]


def read_npz(path: Path) -> Samples | Stream:
    """Arrays ``x`` and ``y`` of an ``.npz`` file (read into memory)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in ("x", "y") if k not in z.files]
            if missing:
                raise ConfigError(f"dataset {path}: an .npz file holds arrays x and y; it has {', '.join(z.files)}")
            x, y = z["x"], z["y"]
    except ConfigError:
        raise
    except Exception as e:  # a bad zip, a truncated array, an object array
        raise ConfigError(f"dataset {path}: not a readable .npz file ({str(e).strip() or type(e).__name__})") from None
    if len(x) != len(y):
        raise ConfigError(f"dataset {path}: x holds {len(x)} samples and y {len(y)}")
    if len(x) == 0:
        raise ConfigError(f"dataset {path} is empty")
    ints = x.dtype.kind in "iu" and y.dtype.kind in "iu"
    if ints and x.ndim == 2 and x.shape == y.shape:  # ready-made token windows
        vocab = int(max(x.max(), y.max())) + 1
        ds = TensorDataset(torch.from_numpy(x.astype(np.int64)), torch.from_numpy(y.astype(np.int64)))
        return Samples(ds, (x.shape[1],), vocab, "lm", f"{path}: {len(x)} token windows of {x.shape[1]}")
    if y.ndim != 1 or y.dtype.kind not in "iu":
        raise ConfigError(
            f"dataset {path}: y must hold one integer class label a sample, got shape {y.shape} {y.dtype}"
        )
    return _classes(str(path), x.astype(np.float32), y)


def read_parquet(path: Path, opts: Any) -> Samples | Stream:
    """A Parquet file, by its columns (the module's docstring)."""
    pq = optional("pyarrow.parquet", "pyarrow", f"the Parquet file {path}")
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow's ArrowInvalid / OSError for a file that is not Parquet
        raise ConfigError(f"dataset {path}: not a readable Parquet file ({_line(e)})") from None
    return from_table(table, str(path), opts)


def read_arrow_folder(folder: Path, opts: Any) -> Samples | Stream:
    """A ``Dataset.save_to_disk`` folder (or a ``DatasetDict``'s: its train split, with its validation)."""
    optional("pyarrow", "pyarrow", f"the saved dataset {folder}")
    if (folder / "dataset_dict.json").is_file():
        splits = _json(folder / "dataset_dict.json").get("splits", [])
        if "train" not in splits:
            raise ConfigError(f"dataset {folder}: the saved DatasetDict has no train split (splits: {splits})")
        train = read_arrow_folder(folder / "train", opts)
        held = next((s for s in ("validation", "test") if s in splits), None)
        if held is None or opts.val_dataset or not isinstance(train, Samples):
            return train
        val = read_arrow_folder(folder / held, opts)
        if not isinstance(val, Samples):
            return train
        return Samples(
            train.dataset,
            train.input_shape,
            max(train.num_classes, val.num_classes),
            train.task,
            train.what,
            validation=val,
        )
    return from_table(_arrow_table(folder), str(folder), opts)


def _arrow_table(folder: Path) -> Any:
    import pyarrow as pa

    state = _json(folder / "state.json")
    names = [f.get("filename", "") for f in state.get("_data_files", [])]
    if not names:
        raise ConfigError(f"dataset {folder}: state.json names no data file (_data_files)")
    tables = []
    for name in names:
        p = folder / name
        if not p.is_file():
            raise ConfigError(f"dataset {folder}: state.json names {name}, which is missing")
        try:
            with pa.memory_map(str(p)) as src:
                tables.append(pa.ipc.open_stream(src).read_all())
        except Exception as e:  # not an Arrow IPC stream
            raise ConfigError(f"dataset {p}: not a readable Arrow file ({_line(e)})") from None
    return pa.concat_tables(tables)


def from_table(table: Any, name: str, opts: Any) -> Samples | Stream:
    """A table's samples or tokens, by its columns (the module's docstring)."""
    import pyarrow as pa

    cols = table.column_names
    if table.num_rows == 0:
        raise ConfigError(f"dataset {name} is empty (no rows)")
    if opts.text_field in cols:
        texts = table.column(opts.text_field).to_pylist()
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise ConfigError(f"dataset {name} row {bad}: the {opts.text_field!r} column holds no text there")
        text = "\n".join(texts)
        return text_stream(text.encode("utf-8"), text, name, opts.tokenizer)
    if "input_ids" in cols:
        column = table.column("input_ids").combine_chunks()
        if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
            raise ConfigError(f"dataset {name}: the input_ids column must hold a list of ids a row, got {column.type}")
        ids = column.flatten().to_numpy(zero_copy_only=False)
        if ids.dtype.kind not in "iu" or len(ids) == 0:
            raise ConfigError(f"dataset {name}: input_ids must hold integer ids, got {ids.dtype} ({len(ids)} ids)")
        return Stream(ids, 0, name, f"{name}: {len(ids)} token ids from {table.num_rows} rows")
    if "label" not in cols:
        raise ConfigError(
            f"dataset {name}: a table needs a {opts.text_field!r} column (text), input_ids (tokens) "
            f"or label (classes); it has {', '.join(cols)}"
        )
    feats = [c for c in cols if c != "label" and _numeric(table.schema.field(c).type)]
    if not feats:
        raise ConfigError(f"dataset {name}: a label column and no numeric feature column ({', '.join(cols)})")
    x = np.stack([table.column(c).to_numpy(zero_copy_only=False).astype(np.float32) for c in feats], axis=1)
    y = table.column("label").to_numpy(zero_copy_only=False)
    if y.dtype.kind not in "iu":
        raise ConfigError(f"dataset {name}: the label column must hold integer classes, got {y.dtype}")
    return _classes(name, x, y, f" ({len(feats)} features: {', '.join(feats[:4])}{', ...' if len(feats) > 4 else ''})")


def _classes(name: str, x: np.ndarray, y: np.ndarray, note: str = "") -> Samples:
    if int(y.min()) < 0:
        raise ConfigError(f"dataset {name}: class labels must be >= 0, got {int(y.min())}")
    if np.isnan(x).any():
        raise ConfigError(f"dataset {name}: the inputs hold NaN")
    classes = int(y.max()) + 1
    ds = TensorDataset(torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y.astype(np.int64)))
    return Samples(ds, tuple(x.shape[1:]), max(2, classes), "classify", f"{name}: {len(x)} samples{note}")


def _numeric(t: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t))


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"dataset {path}: not readable JSON ({_line(e)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"dataset {path}: not a JSON object")
    return data


def _line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]
