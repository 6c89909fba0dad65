"""The user's own data: ``--dataset PATH`` (or ``MODULE:FN``), the reader chosen from the path.

=================================  ==========================================================================
``--dataset``                      read as
=================================  ==========================================================================
``FILE.txt``                       text: byte tokens (vocabulary 256), or ``--tokenizer tokenizer.json``
``FILE.jsonl``                     text: each line's ``text`` field (``--text-field NAME``), joined by newlines
``FILE.bin``                       token ids, nanoGPT's flat memmap (``--token-dtype``, default uint16)
``FILE.npy``                       token ids, a 1-D integer array (``np.load(mmap_mode="r")``)
``FOLDER/`` of class subfolders    images: PNG/JPEG, one subfolder per class (sorted names are the class ids)
``FILE.npz``                       arrays ``x`` and ``y``: one integer label per sample (or token windows)
``FILE.parquet``                   a table (below)
``FOLDER/`` with ``state.json``    a Hugging Face ``datasets`` folder (``save_to_disk``), read as a table
``MODULE:FN``, ``FILE.py:FN``      ``FN()`` returns a torch ``Dataset``, or ``(train, validation)``
=================================  ==========================================================================

A table (Parquet, or the Arrow files of a ``save_to_disk`` folder) is text when it has the text column
(``--text-field``, default ``text``), token ids when it has a list column ``input_ids`` (the rows
joined into one stream), and otherwise a classification set: the ``label`` column is the class, every
other numeric column a feature (one float vector a sample, for ``--model mlp``).

Text and token ids are a *stream*: samples are non-overlapping windows of ``seq_len + 1`` tokens
(:class:`~dtrain.workloads.files.tokens.TokenWindows`; the task "lm", as for ``pytext``), the last
``--val-fraction`` of the tokens for validation. Everything else is a set of *samples* (the task
"classify"), split at random (by ``--seed``) into training and ``--val-fraction`` validation
samples. ``--val-dataset PATH`` (a path of the same kind) is the validation set instead: the whole of
``--dataset`` then trains. A token file is memory-mapped and never read whole; its vocabulary is its
largest id plus one, found by reading the file in chunks (or ``--vocab-size``). Images are read one by
one when a batch needs them.

Every problem is a :class:`~dtrain.errors.ConfigError` of one line naming the file: ``dtrain run``
loads the data in its parent process, before any worker starts. The optional readers need the ``hf``
extra (``pip install 'dtrain[hf]'``: tokenizers, Pillow, pyarrow).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dtrain.errors import ConfigError
from dtrain.workloads.files.common import Parts, Samples, Stream, split_samples
from dtrain.workloads.files.tokens import TOKEN_DTYPES, TokenWindows, read_text, read_tokens, scan_ids

__all__ = ["FileOptions", "load_files", "read_source", "TOKEN_DTYPES", "SUFFIXES"]

SUFFIXES = (".txt", ".jsonl", ".bin", ".npy", ".npz", ".parquet")


@dataclass(frozen=True)
class FileOptions:
    """How to read the user's data (the ``RunConfig`` fields of the same names).

    Attributes:
        seed: the random split of a sample set, and the offset ``seed % seq_len`` of the training windows.
        seq_len: tokens a window feeds the model (a window holds ``seq_len + 1``).
        text_field: the text of a ``.jsonl`` line or a table's text column.
        tokenizer: a Hugging Face ``tokenizer.json`` for text ("" : byte tokens).
        token_dtype: the ids' type in a ``.bin`` file.
        image_size: images are resized to ``image_size x image_size``.
        val_fraction: the share of the data held out for validation (without ``val_dataset``).
        val_dataset: a path (of the same kind) to validate on instead.
        vocab_size: the vocabulary of token ids (0: the largest id plus one).
    """

    seed: int = 0
    seq_len: int = 64
    text_field: str = "text"
    tokenizer: str = ""
    token_dtype: str = "uint16"
    image_size: int = 32
    val_fraction: float = 0.1
    val_dataset: str = ""
    vocab_size: int = 0

    def __post_init__(self) -> None:
        if self.token_dtype not in TOKEN_DTYPES:
            raise ConfigError(f"token_dtype {self.token_dtype!r} is not known; choose one of {', '.join(TOKEN_DTYPES)}")
        if self.seq_len < 2:
            raise ConfigError(f"seq_len must be >= 2, got {self.seq_len}")
        if self.image_size < 1:
            raise ConfigError(f"image_size must be >= 1, got {self.image_size}")
        if self.vocab_size < 0:
            raise ConfigError(f"vocab_size must be >= 0, got {self.vocab_size}")
        if not self.text_field:
            raise ConfigError("text_field must name a field")
        if not (0 < self.val_fraction < 1 or (self.val_dataset and self.val_fraction == 0)):
            raise ConfigError(f"val_fraction must be in (0, 1) (0 only with --val-dataset), got {self.val_fraction:g}")


def read_source(spec: str, opts: FileOptions) -> Stream | Samples:
    """The data ``spec`` names, read by the reader its path (or ``:FN``) chooses; nothing split yet."""
    try:
        return _read(spec, opts)
    except OSError as e:  # a file the readers reach but cannot open or read (permissions, a device error)
        raise ConfigError(f"dataset {spec}: cannot read {e.filename or 'it'} ({e.strerror or e})") from None


def _read(spec: str, opts: FileOptions) -> Stream | Samples:
    path = Path(spec)
    if ":" in spec and not path.exists():
        from dtrain.workloads.files.user import read_user

        return read_user(spec, opts)
    if not path.exists():
        raise ConfigError(
            f"dataset {spec!r} does not exist; choose one of digits, synthetic, pytext (bundled) "
            "or give the path of your data"
        )
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            from dtrain.workloads.files.tables import read_arrow_folder

            return read_arrow_folder(path, opts)
        from dtrain.workloads.files.images import read_image_folder

        return read_image_folder(path, opts.image_size)
    suffix = path.suffix.lower()
    if suffix in (".txt", ".jsonl"):
        return read_text(path, text_field=opts.text_field, tokenizer=opts.tokenizer)
    if suffix in (".bin", ".npy"):
        return read_tokens(path, opts.token_dtype)
    if suffix == ".npz":
        from dtrain.workloads.files.tables import read_npz

        return read_npz(path)
    if suffix == ".parquet":
        from dtrain.workloads.files.tables import read_parquet

        return read_parquet(path, opts)
    raise ConfigError(
        f"dataset {spec}: unknown extension {path.suffix or '(none)'!r}; dtrain reads "
        f"{', '.join(SUFFIXES)}, a folder of images by class, a save_to_disk folder, "
        "or MODULE:FN"
    )


def load_files(spec: str, opts: FileOptions) -> Parts:
    """The user's data as a train/validation split (the parts of a :class:`~dtrain.workloads.data.DatasetSplit`).

    Raises:
        ConfigError: the path is missing, unreadable, of an unknown kind, empty, or its validation set does
            not match it (one line, naming the file).
    """
    train = read_source(spec, opts)
    val = read_source(opts.val_dataset, opts) if opts.val_dataset else None
    if val is None and isinstance(train, Samples) and train.validation is not None:
        val = train.validation  # FN() gave (train, validation), or a save_to_disk folder its own split
    if isinstance(train, Stream):
        if val is not None and not isinstance(val, Stream):
            raise ConfigError(f"val_dataset {opts.val_dataset}: {spec} is text or token ids; validate on the same kind")
        return _split_stream(spec, train, val, opts)
    if val is not None and not isinstance(val, Samples):
        raise ConfigError(f"val_dataset {opts.val_dataset}: {spec} holds labelled samples; validate on the same kind")
    return split_samples(spec, train, val, opts.val_fraction, opts.seed)


def _split_stream(spec: str, train: Stream, val: Stream | None, opts: FileOptions) -> Parts:
    """Windows of the training stream and of the validation one (or of the stream's last ``val_fraction``)."""
    n, window = len(train.tokens), opts.seq_len + 1
    if val is None:
        n_train = n - max(1, round(n * opts.val_fraction))
        tr_tokens, va_tokens = train.tokens[:n_train], train.tokens[n_train:]
    else:
        tr_tokens, va_tokens = train.tokens, val.tokens
    tr = TokenWindows(tr_tokens, opts.seq_len, offset=opts.seed % opts.seq_len)
    va = TokenWindows(va_tokens, opts.seq_len)
    if len(tr) == 0:
        raise ConfigError(
            f"dataset {spec} has no training window of seq_len + 1 = {window} tokens "
            f"({len(tr_tokens)} training tokens); use a shorter --seq-len or more data"
        )
    if len(va) == 0:
        where = opts.val_dataset or f"the last {opts.val_fraction:g} of {spec}"
        raise ConfigError(
            f"dataset {spec}: the validation set ({where}, {len(va_tokens)} tokens) holds no "
            f"window of seq_len + 1 = {window} tokens; use a larger --val-fraction or a shorter "
            "--seq-len"
        )
    vocab = _vocabulary(spec, train, val, opts.vocab_size)
    what = train.what + (f"; validation {val.what}" if val else f"; the last {opts.val_fraction:g} validates")
    return Parts(tr, va, (opts.seq_len,), vocab, task="lm", source=what)


def _vocabulary(spec: str, train: Stream, val: Stream | None, given: int) -> int:
    """The vocabulary: a tokenizer's (or 256 bytes), ``--vocab-size``, else the largest id seen plus one."""
    streams = [s for s in (train, val) if s is not None]
    known = max(s.vocab for s in streams)
    if given:
        if known and given < known:
            raise ConfigError(f"vocab_size {given} is smaller than {spec}'s vocabulary ({known})")
        return given
    if known:
        return known
    lo, hi = 0, 0
    for s in streams:
        a, b = scan_ids(s)
        if a < 0:
            raise ConfigError(f"dataset {s.name} holds a negative token id ({a})")
        lo, hi = min(lo, a), max(hi, b)
    return hi + 1
