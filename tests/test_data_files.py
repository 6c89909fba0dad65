"""The readers of the user's own data (``--dataset PATH``), in one process: each on a small file written here,
its windows and labels against a hand computation, the validation split, the memory map, and the shards of
the real loader code at 1, 2 and 3 workers."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from dtrain.config.schema import RunConfig
from dtrain.errors import ConfigError
from dtrain.job.validate import validate
from dtrain.training.batch_control import BatchControl
from dtrain.training.evaluation import Evaluation
from dtrain.training.loaders import ShardLoaders
from dtrain.workloads.data import DatasetSplit, first_samples, load_dataset
from dtrain.workloads.files import tokens as token_files
from dtrain.workloads.files.images import ImageFolder
from dtrain.workloads.files.tokens import TokenWindows

TEXT = "".join(chr(ord("a") + (i * 7) % 26) for i in range(1000))  # 1000 bytes, a known sequence


def _windows(ids, seq_len, offset=0):
    """By hand: non-overlapping windows of seq_len + 1 ids from offset, as (x, y) lists."""
    out, w = [], seq_len + 1
    for s in range(offset, len(ids) - w + 1, w):
        out.append((list(ids[s : s + seq_len]), list(ids[s + 1 : s + w])))
    return out


def _all(ds):
    return [(x.tolist(), y.tolist()) for x, y in (ds[i] for i in range(len(ds)))]


# ---------------------------------------------------------------------- text and token ids


@pytest.mark.parametrize("seed", [0, 3])
def test_a_text_file_is_byte_windows_its_last_tenth_validating(tmp_path, seed):
    (tmp_path / "a.txt").write_text(TEXT)
    d = load_dataset(str(tmp_path / "a.txt"), seq_len=8, seed=seed)
    ids = list(TEXT.encode())
    assert d.task == "lm" and d.num_classes == 256 and d.input_shape == (8,)
    assert _all(d.train) == _windows(ids[:900], 8, offset=seed % 8)
    assert _all(d.test) == _windows(ids[900:], 8)
    assert d.train_size == (900 - seed % 8) // 9 and d.test_size == 100 // 9


def test_val_fraction_sets_the_share_of_tokens(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT)
    d = load_dataset(str(tmp_path / "a.txt"), seq_len=4, val_fraction=0.25)
    assert _all(d.test) == _windows(list(TEXT.encode())[750:], 4)


def test_jsonl_text_field_and_a_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    lines = [f"the {w} sat on the mat number {i % 5}" for i, w in enumerate(["cat", "dog", "bird"] * 20)]
    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(lines, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    with open(tmp_path / "a.jsonl", "w") as f:
        for line in lines:
            f.write(json.dumps({"body": line, "other": 1}) + "\n")
        f.write("\n")  # a blank line is skipped
    d = load_dataset(
        str(tmp_path / "a.jsonl"), seq_len=5, text_field="body", tokenizer=str(tmp_path / "tokenizer.json")
    )
    ids = tok.encode("\n".join(lines)).ids
    n_train = len(ids) - round(len(ids) * 0.1)
    assert d.num_classes == tok.get_vocab_size() and d.task == "lm"
    assert _all(d.train) == _windows(ids[:n_train], 5) and _all(d.test) == _windows(ids[n_train:], 5)
    bytes_ = load_dataset(str(tmp_path / "a.jsonl"), seq_len=5, text_field="body")  # no tokenizer: bytes
    assert bytes_.num_classes == 256 and _all(bytes_.train)[0][0] == list(b"the c")


@pytest.mark.parametrize("dtype", ["uint16", "uint32", "int32", "int64"])
def test_a_bin_token_file_is_memory_mapped(tmp_path, dtype):
    ids = (np.arange(2000) * 37 % 1009).astype(dtype)
    ids.tofile(tmp_path / "t.bin")
    d = load_dataset(str(tmp_path / "t.bin"), seq_len=16, token_dtype=dtype)
    assert isinstance(d.train, TokenWindows) and isinstance(d.train.tokens, np.memmap)
    assert isinstance(d.test.tokens, np.memmap)
    assert d.num_classes == int(ids.max()) + 1 == 1009
    assert _all(d.train) == _windows(ids[:1800].tolist(), 16) and _all(d.test) == _windows(ids[1800:].tolist(), 16)
    x, y = d.train[0]
    assert x.dtype == torch.int64 and y.dtype == torch.int64
    assert load_dataset(str(tmp_path / "t.bin"), seq_len=16, token_dtype=dtype, vocab_size=4096).num_classes == 4096


def test_the_vocabulary_scan_reads_the_file_in_bounded_chunks(tmp_path, monkeypatch):
    ids = np.random.default_rng(0).integers(0, 60000, size=10_001).astype(np.uint16)
    ids[7777] = 65000  # the largest, in neither the first nor the last chunk
    ids.tofile(tmp_path / "t.bin")
    reads = []
    real = np.frombuffer

    def counted(buf, dtype=float, count=-1, offset=0):
        if count != -1:  # the scan's reads (a memory map's base address is found with no count)
            reads.append(count)
        return real(buf, dtype=dtype, count=count, offset=offset)

    monkeypatch.setattr(token_files, "CHUNK", 1000)
    monkeypatch.setattr(token_files.np, "frombuffer", counted)
    token_files._scan_file.cache_clear()
    d = load_dataset(str(tmp_path / "t.bin"), seq_len=8)
    assert d.num_classes == 65001
    assert max(reads) == 1000 and sum(reads) == 10_001


def test_an_npy_token_file_is_memory_mapped(tmp_path):
    ids = np.arange(3000, dtype=np.int32) % 500
    np.save(tmp_path / "t.npy", ids)
    d = load_dataset(str(tmp_path / "t.npy"), seq_len=10)
    assert isinstance(d.train.tokens, np.memmap) and d.num_classes == 500
    assert _all(d.train) == _windows(ids[:2700].tolist(), 10)


def test_val_dataset_validates_on_another_file(tmp_path):
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    (np.arange(300, dtype=np.uint16) + 2000).tofile(tmp_path / "val.bin")
    d = load_dataset(str(tmp_path / "train.bin"), seq_len=9, val_dataset=str(tmp_path / "val.bin"))
    assert _all(d.train) == _windows(list(range(1000)), 9)  # all of it trains
    assert _all(d.test) == _windows(list(range(2000, 2300)), 9)
    assert d.num_classes == 2300  # the largest id of either file


# ---------------------------------------------------------------------- images, arrays, tables, functions


def _image_folder(root, per_class=6, size=12, fmt="PNG"):
    from PIL import Image

    colours = {"blue": (0, 0, 255), "green": (0, 200, 0), "red": (255, 0, 0)}
    for name, rgb in colours.items():
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (size + i, size), rgb).save(root / name / f"{i}.{fmt.lower()}", fmt)
    return sorted(colours)


def test_an_image_folder_reads_rgb_images_lazily_by_class(tmp_path):
    pytest.importorskip("PIL")
    classes = _image_folder(tmp_path / "imgs")
    from PIL import Image

    Image.new("L", (5, 5), 128).save(tmp_path / "imgs" / "red" / "grey.jpg")  # greyscale JPEG: converted to RGB
    d = load_dataset(str(tmp_path / "imgs"), image_size=8, val_fraction=0.2, seed=1)
    assert d.task == "classify" and d.num_classes == 3 and d.input_shape == (3, 8, 8)
    assert d.train_size + d.test_size == 19 and d.test_size == 4
    base = d.train.dataset
    assert isinstance(base, ImageFolder) and all(isinstance(p, str) for p, _ in base.files)  # paths, no pixels
    expect = {"blue": [0.0, 0.0, 1.0], "green": [0.0, 200 / 255, 0.0], "red": [1.0, 0.0, 0.0]}
    for i in range(len(base)):
        path, label = base.files[i]
        x, y = base[i]
        assert x.shape == (3, 8, 8) and x.dtype == torch.float32 and 0 <= x.min() and x.max() <= 1
        assert int(y) == label and path.split("/")[-2] == classes[label]
        if not path.endswith("grey.jpg"):
            assert x.mean(dim=(1, 2)).tolist() == pytest.approx(expect[classes[label]], abs=1e-6)
        else:
            assert torch.allclose(x[0], x[1]) and torch.allclose(x[1], x[2])


def test_an_image_folder_validates_on_another_with_the_same_classes(tmp_path):
    pytest.importorskip("PIL")
    _image_folder(tmp_path / "train", per_class=4)
    _image_folder(tmp_path / "val", per_class=2)
    d = load_dataset(str(tmp_path / "train"), image_size=6, val_dataset=str(tmp_path / "val"))
    assert (d.train_size, d.test_size, d.num_classes) == (12, 6, 3)
    assert sorted(int(d.test[i][1]) for i in range(6)) == [0, 0, 1, 1, 2, 2]
    (tmp_path / "val" / "red").rename(tmp_path / "val" / "yellow")
    with pytest.raises(ConfigError, match="has the classes blue, green, yellow"):
        load_dataset(str(tmp_path / "train"), image_size=6, val_dataset=str(tmp_path / "val"))


def test_npz_split_is_deterministic_by_seed_and_disjoint(tmp_path):
    x = np.random.default_rng(0).normal(size=(50, 2, 3)).astype(np.float32)
    y = np.arange(50) % 4
    np.savez(tmp_path / "a.npz", x=x, y=y)
    d = load_dataset(str(tmp_path / "a.npz"), seed=5)
    assert d.input_shape == (2, 3) and d.num_classes == 4 and (d.train_size, d.test_size) == (45, 5)
    tr, te = set(d.train.indices), set(d.test.indices)
    assert not tr & te and tr | te == set(range(50))
    again, other = load_dataset(str(tmp_path / "a.npz"), seed=5), load_dataset(str(tmp_path / "a.npz"), seed=6)
    assert again.test.indices == d.test.indices and other.test.indices != d.test.indices
    i = d.test.indices[0]
    xs, ys = d.test[0]
    assert torch.equal(xs, torch.from_numpy(x[i])) and int(ys) == y[i]
    assert load_dataset(str(tmp_path / "a.npz"), val_fraction=0.3).test_size == 15


def test_parquet_text_tokens_and_features(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["hello world", "second row"], "n": [1, 2]}), tmp_path / "text.parquet")
    d = load_dataset(str(tmp_path / "text.parquet"), seq_len=3, val_fraction=0.3)
    ids = list(b"hello world\nsecond row")
    assert d.task == "lm" and _all(d.train) == _windows(ids[: len(ids) - round(len(ids) * 0.3)], 3)

    rows = [[i, i + 1, i + 2] for i in range(0, 60, 3)]
    pq.write_table(pa.table({"input_ids": rows}), tmp_path / "ids.parquet")
    d = load_dataset(str(tmp_path / "ids.parquet"), seq_len=5)
    assert d.num_classes == 60 and _all(d.train) == _windows(list(range(54)), 5)

    f1, f2 = np.arange(20, dtype=np.float64), np.arange(20, dtype=np.int64) * 2
    pq.write_table(
        pa.table({"f1": f1, "name": [str(i) for i in range(20)], "f2": f2, "label": np.arange(20) % 2}),
        tmp_path / "feat.parquet",
    )
    d = load_dataset(str(tmp_path / "feat.parquet"), val_fraction=0.25)
    assert d.input_shape == (2,) and d.num_classes == 2 and d.test_size == 5
    i = d.train.indices[3]
    x, y = d.train[3]
    assert x.tolist() == [f1[i], f2[i]] and int(y) == i % 2


def _save_to_disk(folder, table):
    """The layout ``datasets``' ``save_to_disk`` writes: Arrow IPC stream files named in state.json."""
    import pyarrow as pa

    folder.mkdir(parents=True)
    half = table.num_rows // 2
    names = []
    for k, part in enumerate([table.slice(0, half), table.slice(half)]):
        names.append(f"data-0000{k}-of-00002.arrow")
        with pa.OSFile(str(folder / names[-1]), "wb") as sink, pa.ipc.new_stream(sink, part.schema) as w:
            w.write_table(part)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names], "_split": None}))
    (folder / "dataset_info.json").write_text("{}")


def test_a_save_to_disk_folder_and_a_dataset_dict(tmp_path):
    pa = pytest.importorskip("pyarrow")
    _save_to_disk(tmp_path / "one", pa.table({"input_ids": [[i, i + 1] for i in range(0, 100, 2)]}))
    d = load_dataset(str(tmp_path / "one"), seq_len=4)
    assert _all(d.train) == _windows(list(range(90)), 4) and d.num_classes == 100

    root = tmp_path / "dict"
    _save_to_disk(root / "train", pa.table({"a": np.arange(30.0), "label": np.arange(30) % 3}))
    _save_to_disk(root / "validation", pa.table({"a": np.arange(6.0) + 100, "label": np.arange(6) % 3}))
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "validation"]}))
    d = load_dataset(str(root))
    assert (d.train_size, d.test_size, d.num_classes) == (30, 6, 3)  # its own validation split
    assert first_samples(d.test, 6)[0].flatten().tolist() == [100.0, 101.0, 102.0, 103.0, 104.0, 105.0]


def test_a_function_returns_a_dataset_or_train_and_validation(tmp_path, monkeypatch):
    (tmp_path / "mydata.py").write_text(
        "import torch\n"
        "from torch.utils.data import TensorDataset\n"
        "def one():\n"
        "    return TensorDataset(torch.randn(40, 5), torch.arange(40) % 7)\n"
        "def two():\n"
        "    return one(), TensorDataset(torch.randn(8, 5), torch.arange(8) % 7)\n"
        "def windows():\n"
        "    x = torch.arange(200).view(20, 10) % 33\n"
        "    return TensorDataset(x, (x + 1) % 33)\n"
    )
    d = load_dataset(f"{tmp_path / 'mydata.py'}:one")
    assert (d.train_size, d.test_size, d.num_classes, d.input_shape, d.task) == (36, 4, 7, (5,), "classify")
    monkeypatch.syspath_prepend(str(tmp_path))
    d = load_dataset("mydata:two")
    assert (d.train_size, d.test_size) == (40, 8)
    d = load_dataset("mydata:windows")
    assert d.task == "lm" and d.num_classes == 33 and d.input_shape == (10,)


# ---------------------------------------------------------------------- sharding, resume, evaluation


def _cfg(dataset, **kw):
    return RunConfig.make(dataset=dataset, **{"model": "mlp", "workers": 1, "batch_size": 6, "epochs": 2, **kw})


def _steps(cfg, data, workers, start_batch=0, epoch=0):
    """Each step's global batch: the samples of every shard's batch of the step, from the real loaders."""
    cfg = cfg.replace(workers=workers)
    loaders = ShardLoaders(cfg, data, BatchControl(cfg, data).plan)
    shards = [list(loaders.loader(r, workers, epoch, start_batch)) for r in range(workers)]
    assert len({len(s) for s in shards}) == 1
    return [torch.cat([s[k][0].flatten(1) for s in shards]) for k in range(len(shards[0]))]


def _as_set(batch):
    return sorted(map(tuple, batch.tolist()))


@pytest.mark.parametrize("kind", ["images", "tokens"])
def test_every_world_size_trains_the_same_global_batch_and_a_resume_restarts_at_the_next_one(tmp_path, kind):
    if kind == "images":
        pytest.importorskip("PIL")
        _image_folder(tmp_path / "imgs", per_class=7, size=4)
        path, kw = str(tmp_path / "imgs"), {"image_size": 4}
    else:
        np.arange(3000, dtype=np.uint16).tofile(tmp_path / "t.bin")
        path, kw = str(tmp_path / "t.bin"), {"seq_len": 8, "model": "gpt-tiny"}
    cfg = _cfg(path, **kw)
    data = cfg.load_data()
    one = _steps(cfg, data, 1)
    assert len(one) == data.train_size // 6 >= 3
    for w in (2, 3):
        steps = _steps(cfg, data, w)
        assert [_as_set(b) for b in steps] == [_as_set(b) for b in one]
        for epoch in (1,):  # another epoch, another order, still the same at every width
            assert [_as_set(b) for b in _steps(cfg, data, w, epoch=epoch)] == [
                _as_set(b) for b in _steps(cfg, data, 1, epoch=epoch)
            ]
        # resumed after 2 steps: the next batches are exactly the uninterrupted run's
        resumed = _steps(cfg, data, w, start_batch=2)
        assert [b.tolist() for b in resumed] == [b.tolist() for b in steps[2:]]
    assert _as_set(_steps(cfg, data, 1, epoch=1)[0]) != _as_set(one[0])


@pytest.mark.parametrize("n", [10, 101, 1000])
def test_shard_order_is_distributed_samplers_order(n):
    from torch.utils.data import DistributedSampler

    from dtrain.training.loaders import ShardOrder

    ds = TensorDataset(torch.arange(n))
    for w in (1, 2, 3):
        for r in range(w):
            for epoch in (0, 4):
                want = DistributedSampler(ds, w, r, shuffle=True, seed=3, drop_last=True)
                got = ShardOrder(ds, num_replicas=w, rank=r, shuffle=True, seed=3, drop_last=True)
                want.set_epoch(epoch)
                got.set_epoch(epoch)
                assert list(got) == list(want) and len(got) == len(want)


def _rss_file_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_drawn_windows_leave_no_file_pages_resident(tmp_path):
    """A window's pages are let go once it is copied: 400 windows drawn at random from a 64 MiB file (each in
    its own part of it) leave no more than a few MiB of the file mapped in the process, where a fault alone
    maps 64 KiB to 2 MiB around each."""
    np.random.default_rng(0).integers(0, 256, size=32 << 20, dtype=np.uint16).tofile(tmp_path / "t.bin")
    d = load_dataset(str(tmp_path / "t.bin"), seq_len=64)
    before = _rss_file_kib()
    picks = np.random.default_rng(1).permutation(d.train_size)[:400]
    tokens = np.fromfile(tmp_path / "t.bin", dtype=np.uint16, count=int(picks.max() + 1) * 65)
    for i in picks:
        x, y = d.train[int(i)]
        assert x.tolist() == tokens[i * 65 : i * 65 + 64].tolist() and int(y[-1]) == tokens[i * 65 + 64]
    assert _rss_file_kib() - before < 4096


def test_evaluation_reads_a_memory_mapped_set_in_chunks(tmp_path):
    (np.arange(5000) % 97).astype(np.uint16).tofile(tmp_path / "t.bin")
    cfg = _cfg(str(tmp_path / "t.bin"), model="gpt-tiny", seq_len=8)
    data = cfg.load_data()
    from dtrain.workloads.models import build_model, task_loss

    torch.manual_seed(0)
    model = build_model("gpt-tiny", data.input_shape, data.num_classes)
    got = Evaluation(cfg, data).evaluate(model)
    x = torch.stack([data.test[i][0] for i in range(data.test_size)])
    y = torch.stack([data.test[i][1] for i in range(data.test_size)])
    with torch.no_grad():
        want = float(task_loss(model(x), y))
    assert got == pytest.approx(want, rel=1e-5)
    part = Evaluation(cfg.replace(eval_samples=10), data).evaluate(model)
    with torch.no_grad():
        assert part == pytest.approx(float(task_loss(model(x[:10]), y[:10])), rel=1e-5)


def test_a_dataset_split_takes_any_sized_dataset():
    ds = TensorDataset(torch.zeros(3, 2), torch.zeros(3))
    d = DatasetSplit(ds, TokenWindows(np.arange(30), 4), (2,), 2)
    assert d.train_size == 3 and d.test_size == 6

    class Unsized(torch.utils.data.Dataset):
        def __getitem__(self, i):
            return i

    with pytest.raises(TypeError, match="length"):
        DatasetSplit(ds, Unsized(), (2,), 2)


# ---------------------------------------------------------------------- bad input, in one process


def test_a_missing_optional_package_says_how_to_install_it(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / "t.json").write_text("{}")
    np.savez(tmp_path / "a.npz", x=np.zeros((4, 2)), y=np.zeros(4, dtype=int))
    (tmp_path / "a.parquet").write_bytes(b"PAR1")
    (tmp_path / "imgs" / "a").mkdir(parents=True)
    for module, args in [
        ("tokenizers", dict(dataset=str(tmp_path / "a.txt"), tokenizer=str(tmp_path / "t.json"))),
        ("PIL", dict(dataset=str(tmp_path / "imgs"))),
        ("pyarrow", dict(dataset=str(tmp_path / "a.parquet"))),
    ]:
        with monkeypatch.context() as m:
            for name in [k for k in sys.modules if k == module or k.startswith(module + ".")]:
                m.delitem(sys.modules, name)
            m.setitem(sys.modules, module, None)  # import raises ImportError
            from dtrain.workloads.files import images

            images._scan.cache_clear()
            with pytest.raises(ConfigError, match=r"pip install 'dtrain\[hf\]'"):
                validate(_cfg(**args, model="gpt-tiny" if "a.txt" in args["dataset"] else "mlp"))


def test_an_unreadable_file_is_named(tmp_path, monkeypatch):
    """A file the reader cannot read (here every read refused, as for a file without read permission)."""
    (tmp_path / "a.txt").write_text(TEXT)
    import pathlib

    def refused(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(pathlib.Path, "read_bytes", refused)
    with pytest.raises(ConfigError, match=r"dataset .*a\.txt: cannot read .*a\.txt \(Permission denied\)"):
        load_dataset(str(tmp_path / "a.txt"))
