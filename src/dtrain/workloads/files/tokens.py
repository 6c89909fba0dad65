"""Text and token ids: the readers of ``.txt``, ``.jsonl``, ``.bin`` and ``.npy``, and the windows a model reads.

A text becomes token ids by its UTF-8 bytes (vocabulary 256, as ``pytext``) or by a Hugging Face
``tokenizer.json`` (the ``tokenizers`` library; the vocabulary is the tokenizer's size). A ``.bin``
file is nanoGPT's: the ids one after the other, no header, in ``--token-dtype`` (uint16 by default);
a ``.npy`` file holds a 1-D integer array. Both are memory-mapped, never read whole: a window is
sliced from the map when a batch needs it, and the vocabulary (the largest id plus one) is found by
reading the file in chunks of :data:`CHUNK` ids with plain reads (which, unlike touching the map, do
not add the file to the process's resident memory).
"""

from __future__ import annotations

import functools
import json
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from dtrain.errors import ConfigError
from dtrain.workloads.files.common import Stream, optional

__all__ = [
    "TokenWindows",
    "TOKEN_DTYPES",
    "read_text",
    "read_tokens",
    "scan_ids",
    "text_stream",
    "load_tokenizer",
    "CHUNK",
    "RELEASE",
]

TOKEN_DTYPES = ("uint16", "uint32", "int32", "int64")
CHUNK = 1 << 22  # ids read at once when scanning a token file (8 MiB of uint16)
RELEASE = 2 << 20  # a window's pages are let go in aligned blocks of this many bytes (a large folio's most)


class TokenWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows of ``seq_len + 1`` tokens from ``offset``: sample ``i`` is ``(x, y)``,
    ``x`` its first ``seq_len`` tokens and ``y`` the next token at every position (int64 tensors).

    ``tokens`` is kept as given (a ``np.memmap`` stays one): ``__getitem__`` copies one window only. Of a
    memory map, it then lets the process's mapping of the pages around the window go
    (``madvise(MADV_DONTNEED)`` over the :data:`RELEASE` bytes that hold it; the file's pages stay in the
    kernel's page cache): a fault maps a whole large folio of the page cache (up to 2 MiB on a recent
    Linux), so without it every window drawn from a large file would leave hundreds of KiB resident in
    the process, and a long run most of the file.
    """

    def __init__(self, tokens: Any, seq_len: int, *, offset: int = 0) -> None:
        if seq_len < 2 or offset < 0:
            raise ValueError(f"TokenWindows needs seq_len >= 2 and offset >= 0, got {seq_len}, {offset}")
        self.tokens, self.seq_len, self.offset = tokens, seq_len, offset
        self._n = max(0, (len(tokens) - offset) // (seq_len + 1))
        self._map: mmap.mmap | None = getattr(tokens, "_mmap", None) if isinstance(tokens, np.memmap) else None
        if self._map is not None:  # where the mapping starts, to find a window's bytes in it
            self._base = np.frombuffer(self._map, dtype=np.uint8).ctypes.data

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = int(i)
        if not -self._n <= i < self._n:
            raise IndexError(f"window {i} of {self._n}")
        start = self.offset + (i % self._n) * (self.seq_len + 1)
        window = self.tokens[start : start + self.seq_len + 1]
        w = torch.from_numpy(np.array(window, dtype=np.int64))
        if self._map is not None:
            self._release(window)
        return w[:-1], w[1:]

    def _release(self, window: np.ndarray) -> None:
        m = self._map
        assert m is not None
        lo = window.ctypes.data - self._base
        first = lo // RELEASE * RELEASE
        end = min(len(m), (lo + window.nbytes) // RELEASE * RELEASE + RELEASE)
        m.madvise(mmap.MADV_DONTNEED, first, end - first)


def read_tokens(path: Path, dtype: str) -> Stream:
    """A ``.bin`` (flat ids of ``dtype``) or ``.npy`` (a 1-D integer array) file, memory-mapped."""
    if path.suffix.lower() == ".npy":
        try:
            arr = np.load(path, mmap_mode="r")
        except Exception as e:  # a bad header, a pickled object array, a truncated file
            raise ConfigError(f"dataset {path}: not a readable .npy file ({_first_line(e)})") from None
        if not isinstance(arr, np.memmap) or arr.dtype.kind not in "iu" or arr.ndim != 1:
            raise ConfigError(
                f"dataset {path}: a .npy token file holds a 1-D integer array, got "
                f"{getattr(arr, 'ndim', '?')}-D {getattr(arr, 'dtype', type(arr).__name__)}"
            )
        if len(arr) == 0:
            raise ConfigError(f"dataset {path} is empty (no token ids)")
        return Stream(
            arr,
            0,
            str(path),
            f"{path}: {len(arr)} token ids ({arr.dtype}, memory-mapped)",
            file=(str(path), int(arr.offset)),
        )
    size, item = path.stat().st_size, np.dtype(dtype).itemsize
    if size == 0:
        raise ConfigError(f"dataset {path} is empty (no token ids)")
    if size % item:
        raise ConfigError(
            f"dataset {path}: {size} bytes is not a whole number of {dtype} ids (a corrupt file, or "
            "another --token-dtype)"
        )
    try:
        mm = np.memmap(path, dtype=np.dtype(dtype), mode="r")
    except OSError as e:
        raise ConfigError(f"dataset {path}: cannot map the file ({e})") from None
    return Stream(mm, 0, str(path), f"{path}: {len(mm)} token ids ({dtype}, memory-mapped)", file=(str(path), 0))


def scan_ids(stream: Stream) -> tuple[int, int]:
    """The smallest and largest id of ``stream``, read in chunks of :data:`CHUNK` (a file by plain reads)."""
    if stream.file is None:
        arr = np.asarray(stream.tokens)
        return int(arr.min()), int(arr.max())
    name, offset = stream.file
    st = os.stat(name)
    return _scan_file(name, offset, stream.tokens.dtype.str, len(stream.tokens), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=8)
def _scan_file(name: str, offset: int, dtype: str, count: int, mtime_ns: int, size: int) -> tuple[int, int]:
    """(min, max) of ``count`` ids of ``dtype`` from byte ``offset`` of ``name`` (cached per file version:
    ``dtrain run`` loads its data more than once)."""
    dt = np.dtype(dtype)
    lo, hi = None, None
    buf = bytearray(CHUNK * dt.itemsize)
    with open(name, "rb", buffering=0) as f:
        f.seek(offset)
        left = count
        while left:
            n = f.readinto(memoryview(buf)[: min(left, CHUNK) * dt.itemsize])
            if not n:
                raise ConfigError(f"dataset {name}: the file ended before its {count} ids (truncated while read?)")
            ids = np.frombuffer(buf, dtype=dt, count=n // dt.itemsize)
            a, b = int(ids.min()), int(ids.max())
            lo, hi = a if lo is None else min(lo, a), b if hi is None else max(hi, b)
            left -= n // dt.itemsize
    assert lo is not None and hi is not None
    return lo, hi


def read_text(path: Path, *, text_field: str, tokenizer: str) -> Stream:
    """A ``.txt`` file, or the ``text_field`` of every line of a ``.jsonl`` file (joined by newlines), as
    byte tokens or ``tokenizer``'s."""
    if path.suffix.lower() == ".jsonl":
        text = "\n".join(_jsonl_texts(path, text_field))
        raw = text.encode("utf-8")
    else:
        raw = path.read_bytes()
        text = ""
    if not raw.strip():
        raise ConfigError(f"dataset {path} is empty (no text)")
    return text_stream(raw, text, str(path), tokenizer)


def text_stream(raw: bytes, text: str, name: str, tokenizer: str) -> Stream:
    """The tokens of a text (``raw``, its UTF-8; ``text`` the same decoded, or "" to decode here)."""
    if not tokenizer:
        ids = np.frombuffer(raw, dtype=np.uint8)
        return Stream(ids, 256, name, f"{name}: {len(ids)} byte tokens")
    tok = load_tokenizer(tokenizer)
    if not text:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"dataset {name} is not UTF-8 text ({e}); a tokenizer reads text") from None
    ids = np.asarray(tok.encode(text).ids, dtype=np.int64)
    if len(ids) == 0:
        raise ConfigError(f"dataset {name}: the tokenizer {tokenizer} makes no token of it")
    vocab = int(tok.get_vocab_size())
    return Stream(ids, vocab, name, f"{name}: {len(ids)} tokens of {tokenizer} (vocabulary {vocab})")


def load_tokenizer(path: str) -> Any:
    """A Hugging Face ``tokenizer.json`` (the ``tokenizers`` library)."""
    tokenizers = optional("tokenizers", "tokenizers", f"--tokenizer {path}")
    if not Path(path).is_file():
        raise ConfigError(f"tokenizer {path!r} does not exist")
    try:
        return tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # the library raises its own exception types for a bad file
        raise ConfigError(f"tokenizer {path}: not a readable tokenizer.json ({_first_line(e)})") from None


def _jsonl_texts(path: Path, field: str) -> list[str]:
    texts = []
    with open(path, encoding="utf-8", errors="strict") as f:
        try:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"dataset {path} line {number}: not JSON ({e.msg})") from None
                value = row.get(field) if isinstance(row, dict) else None
                if not isinstance(value, str):
                    raise ConfigError(
                        f"dataset {path} line {number} has no {field!r} text field"
                        + ("" if field != "text" else " (name another with --text-field)")
                    )
                texts.append(value)
        except UnicodeDecodeError as e:
            raise ConfigError(f"dataset {path} is not UTF-8 text ({e})") from None
    return texts


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]
