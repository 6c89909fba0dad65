"""``dtrain run --dataset PATH`` from the command line: 2 workers learn the user's text beyond its byte unigram
entropy and its images above chance, every format trains, a resumed run continues exactly, and each bad input
is one line and exit status 2 before any worker starts. Every format's run, the resumed runs and the missing
packages are ``slow`` (CI runs them); the learning and the bad inputs run in the default suite."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from _helpers import dtrain_cli, dtrain_runs, read_metrics, read_summary

from dtrain.workloads.data import unigram_entropy

pytestmark = pytest.mark.procs

QUIET = ["--no-progress", "--no-trace", "--timeout-s", "60"]


def _text(n_words: int, seed: int = 0) -> str:
    """Words of a small vocabulary in a fixed grammar: far more predictable than its byte frequencies."""
    rng = np.random.default_rng(seed)
    subjects, verbs, objects = ["the cat", "a dog", "my bird"], ["sat on", "ran to", "saw"], ["the mat", "a tree"]
    parts = [
        f"{subjects[rng.integers(3)]} {verbs[rng.integers(3)]} {objects[rng.integers(2)]}." for _ in range(n_words // 5)
    ]
    return " ".join(parts)


def _images(root: Path, per_class: int = 24, size: int = 8) -> None:
    """Three classes of noisy squares, each of its own colour."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for name, rgb in {"blue": (30, 30, 220), "green": (30, 200, 30), "red": (220, 30, 30)}.items():
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = np.clip(np.array(rgb) + rng.normal(0, 40, size=(size, size, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.png")


# ---------------------------------------------------------------------- learning


@pytest.mark.timeout(300)
def test_a_text_file_is_learned_beyond_its_byte_unigram_entropy(tmp_path):
    text = _text(6000)
    (tmp_path / "c.txt").write_text(text)
    out = tmp_path / "run"
    p = dtrain_cli(
        "run",
        "--model",
        "gpt-tiny",
        "--dataset",
        str(tmp_path / "c.txt"),
        "--workers",
        "2",
        "--batch-size",
        "16",
        "--seq-len",
        "32",
        "--optimizer",
        "adam",
        "--lr",
        "0.003",
        "--max-steps",
        "60",
        "--epochs",
        "5",
        "--out",
        str(out),
        *QUIET,
        timeout=240,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    raw = text.encode()
    val = torch.tensor(list(raw[len(raw) - round(len(raw) * 0.1) :]))
    entropy = unigram_entropy(val)
    summary = read_summary(out)
    assert summary["val_loss"] < entropy - 0.3, (summary["val_loss"], entropy)


@pytest.mark.timeout(300)
def test_an_image_folder_is_learned_above_chance(tmp_path):
    pytest.importorskip("PIL")
    _images(tmp_path / "imgs")
    out = tmp_path / "run"
    p = dtrain_cli(
        "run",
        "--model",
        "cnn",
        "--dataset",
        str(tmp_path / "imgs"),
        "--image-size",
        "8",
        "--val-fraction",
        "0.25",
        "--workers",
        "2",
        "--batch-size",
        "8",
        "--lr",
        "0.05",
        "--epochs",
        "4",
        "--out",
        str(out),
        *QUIET,
        timeout=240,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert read_summary(out)["test_accuracy"] > 0.8  # chance: 1/3 (18 validation images)


# ---------------------------------------------------------------------- every format trains


def _formats(root: Path) -> dict[str, list[str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(1)
    ids = rng.integers(0, 200, size=4000)
    ids.astype(np.uint32).tofile(root / "t.bin")
    np.save(root / "t.npy", ids.astype(np.int32))
    np.savez(root / "a.npz", x=rng.normal(size=(200, 1, 8, 8)).astype(np.float32), y=rng.integers(0, 4, 200))
    with open(root / "a.jsonl", "w") as f:
        for i in range(200):
            f.write(json.dumps({"content": f"line {i}: " + _text(10, seed=i)}) + "\n")
    pq.write_table(
        pa.table({"input_ids": [list(map(int, ids[i : i + 40])) for i in range(0, 4000, 40)]}), root / "ids.parquet"
    )
    saved = root / "saved"
    saved.mkdir()
    table = pa.table({"f1": rng.normal(size=200), "f2": rng.normal(size=200), "label": rng.integers(0, 3, 200)})
    with pa.OSFile(str(saved / "data-00000-of-00001.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    lm = ["--model", "gpt-tiny", "--seq-len", "16"]
    return {
        "bin": [*lm, "--dataset", str(root / "t.bin"), "--token-dtype", "uint32"],
        "npy": [*lm, "--dataset", str(root / "t.npy")],
        "npz": ["--model", "cnn", "--dataset", str(root / "a.npz")],
        "jsonl": [*lm, "--dataset", str(root / "a.jsonl"), "--text-field", "content"],
        "parquet": [*lm, "--dataset", str(root / "ids.parquet")],
        "save_to_disk": ["--model", "mlp", "--dataset", str(saved)],
    }


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_format_trains_a_few_steps(tmp_path):
    pytest.importorskip("pyarrow")
    runs = _formats(tmp_path)
    common = ["--workers", "2", "--batch-size", "8", "--max-steps", "3", *QUIET]
    done = dtrain_runs(tmp_path / "runs", common, runs, timeout=400)
    for name, (out, text) in done.items():
        s = read_summary(out)
        assert s["steps"] == 3, (name, text[-2000:])
        rows = read_metrics(out)
        assert {r["rank"] for r in rows} == {0, 1} and all(math.isfinite(r["loss"]) for r in rows), name
        metric = s.get("val_loss", s.get("test_accuracy"))
        assert metric is not None and math.isfinite(metric), name


# ---------------------------------------------------------------------- resume


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("kind", ["tokens", "images"])
def test_a_resumed_run_equals_the_straight_one_from_the_checkpoint_on(tmp_path, kind):
    if kind == "tokens":
        # 12 samples a step, 4 steps an epoch: 1122 tokens, the last 112 validating, 59 training windows
        np.random.default_rng(2).integers(0, 300, size=66 * 17).astype(np.uint16).tofile(tmp_path / "t.bin")
        data = ["--model", "gpt-tiny", "--seq-len", "16", "--dataset", str(tmp_path / "t.bin")]
    else:
        pytest.importorskip("PIL")
        _images(tmp_path / "imgs", per_class=22)  # 66 images: 59 train, 4 steps an epoch
        data = ["--model", "cnn", "--dataset", str(tmp_path / "imgs"), "--image-size", "8"]
    run = [
        *data,
        "--workers",
        "2",
        "--batch-size",
        "12",
        "--epochs",
        "2",
        "--max-steps",
        "8",
        "--checkpoint-every",
        "3",
        *QUIET,
    ]
    a, b = tmp_path / "straight", tmp_path / "resumed"
    p = dtrain_cli("run", *run, "--out", str(a), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    p = dtrain_cli("run", *run, "--out", str(b), "--resume", str(a / "checkpoints" / "step_000003"), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert read_summary(b)["start_step"] == 3
    ra = {(r["rank"], r["step"]): r for r in read_metrics(a)}
    rb = {(r["rank"], r["step"]): r for r in read_metrics(b)}
    assert sorted(rb) == sorted((r, s) for r in (0, 1) for s in range(3, 8))
    assert all(abs(ra[k]["loss"] - rb[k]["loss"]) < 1e-5 and ra[k]["epoch"] == rb[k]["epoch"] for k in rb)
    assert {rb[(0, s)]["epoch"] for s in range(3, 8)} == {0, 1}  # it resumed mid-epoch and crossed into the next
    assert len({ra[(0, s)]["loss"] for s in range(8)}) == 8  # the losses differ step to step: a real check


# ---------------------------------------------------------------------- bad input


def _bad_inputs(root: Path) -> dict[str, tuple[list[str], str]]:
    from PIL import Image

    (root / "ok.txt").write_text(_text(2000))
    (root / "empty.txt").write_text("")
    (root / "short.txt").write_text("only a few bytes of text here, " * 4)
    (root / "bad.npy").write_bytes(b"\x93NUMPY garbage, not an array")
    (root / "a.jsonl").write_text('{"text": "fine"}\n{"text": "fine too"}\n{"body": "no text"}\n')
    (root / "imgs" / "a").mkdir(parents=True)
    (root / "imgs" / "b").mkdir()
    Image.new("RGB", (4, 4)).save(root / "imgs" / "a" / "0.png")
    Image.new("RGB", (4, 4)).save(root / "imgs" / "b" / "0.png")
    (root / "imgs" / "b" / "1.png").write_bytes(b"not a png at all")
    (root / "a.csv").write_text("x,y\n1,2\n")
    np.arange(100, dtype=np.uint16).tofile(root / "t.bin")
    lm = ["--model", "gpt-tiny"]
    return {
        "missing": ([*lm, "--dataset", str(root / "nope.txt")], f"dataset '{root / 'nope.txt'}' does not exist"),
        "empty": ([*lm, "--dataset", str(root / "empty.txt")], f"dataset {root / 'empty.txt'} is empty"),
        "below-one-batch": (
            [*lm, "--dataset", str(root / "short.txt"), "--seq-len", "8", "--batch-size", "64"],
            "batch_size 64 is larger than the training set (12 samples",
        ),
        "corrupt": ([*lm, "--dataset", str(root / "bad.npy")], f"dataset {root / 'bad.npy'}: not a readable .npy"),
        "jsonl-field": (
            [*lm, "--dataset", str(root / "a.jsonl")],
            f"dataset {root / 'a.jsonl'} line 3 has no 'text' text field",
        ),
        "image": (
            ["--model", "cnn", "--dataset", str(root / "imgs")],
            f"image {root / 'imgs' / 'b' / '1.png'}: Pillow cannot read it",
        ),
        "extension": ([*lm, "--dataset", str(root / "a.csv")], "unknown extension '.csv'"),
        "token-dtype": (
            [*lm, "--dataset", str(root / "t.bin"), "--token-dtype", "float8"],
            "token_dtype 'float8' is not known; choose one of uint16, uint32, int32, int64",
        ),
        "bundled-with-file-flags": (
            ["--dataset", "digits", "--tokenizer", "x.json"],
            "--tokenizer read(s) your own data",
        ),
    }


BAD = [
    "missing",
    "empty",
    "below-one-batch",
    "corrupt",
    "jsonl-field",
    "image",
    "extension",
    "token-dtype",
    "bundled-with-file-flags",
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", BAD)
def test_bad_data_is_one_line_and_exit_2_before_any_worker(tmp_path, case):
    pytest.importorskip("PIL")
    args, words = _bad_inputs(tmp_path)[case]
    out = tmp_path / "run"
    p = dtrain_cli("run", *args, "--workers", "2", "--out", str(out), *QUIET, timeout=90)
    assert p.returncode == 2, p.stderr[-2000:]
    errors = [line for line in p.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and words in errors[0], p.stderr[-2000:]
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_missing_hf_package_is_one_line_saying_how_to_install_it(tmp_path):
    """A fresh ``python -m dtrain.cli`` whose path finds stand-ins of tokenizers, Pillow and pyarrow that
    fail to import, as when they are not installed."""
    stubs = tmp_path / "stubs"
    for name in ("tokenizers", "PIL", "pyarrow"):
        (stubs / name).mkdir(parents=True)
        (stubs / name / "__init__.py").write_text(f"raise ImportError('no module named {name}')\n")
    (tmp_path / "a.txt").write_text(_text(2000))
    (tmp_path / "tok.json").write_text("{}")
    (tmp_path / "a.parquet").write_bytes(b"PAR1")
    (tmp_path / "imgs" / "a").mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(stubs), *sys.path])}
    cases = [
        (
            ["--model", "gpt-tiny", "--dataset", str(tmp_path / "a.txt"), "--tokenizer", str(tmp_path / "tok.json")],
            "needs the tokenizers package",
        ),
        (["--model", "cnn", "--dataset", str(tmp_path / "imgs")], "needs the Pillow package"),
        (["--model", "mlp", "--dataset", str(tmp_path / "a.parquet")], "needs the pyarrow package"),
    ]
    for args, words in cases:
        p = dtrain_cli("run", *args, "--out", str(tmp_path / "run"), *QUIET, env=env, cold=True, timeout=120)
        assert p.returncode == 2, p.stderr[-2000:]
        errors = [line for line in p.stderr.splitlines() if "error:" in line]
        assert len(errors) == 1 and words in errors[0] and "pip install 'dtrain[hf]'" in errors[0], p.stderr
