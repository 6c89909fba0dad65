"""Checkpoint integrity: a manifest of sizes and SHA-256 per file.

Oracles: the manifest lists exactly the files a save wrote and round-trips through the
marker; one flipped byte or a truncated file is found and named; a run folder whose
newest checkpoint is damaged resumes from the previous intact one, and the resumed run's
losses equal the uninterrupted run's from that step on (as in tests/test_checkpoint.py);
a checkpoint without a manifest (written before it existed) still resumes, unverified.
"""

import json
import time

import pytest
import torch
from _helpers import dtrain_cli, read_metrics, read_summary

from dtrain.checkpoint import CheckpointError, find_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from dtrain.checkpoint.manifest import ALGORITHM, check_files, file_digest
from dtrain.workloads.models import build_model

TOL = 1e-6


def _save(root, step):
    torch.manual_seed(step)
    m = build_model("cnn")
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    return save_checkpoint(root, step, model=m, optimizer=opt, rank_state={"r": torch.randn(3)})


def _marker(path):
    return json.loads((path / "checkpoint.json").read_text())


def _flip(path, at=100):
    b = bytearray(path.read_bytes())
    b[at] ^= 0xFF
    path.write_bytes(bytes(b))


# ---------------------------------------------------------------------- one process: the manifest


def test_manifest_lists_every_file_and_round_trips(tmp_path):
    ckpt = _save(tmp_path, 3)
    info = _marker(ckpt)
    files = info["manifest"]["files"]
    assert info["manifest"]["algorithm"] == ALGORITHM == "sha256"
    assert sorted(files) == sorted(p.name for p in ckpt.iterdir() if p.name != "checkpoint.json")
    assert ".metadata" in files and "__0_0.distcp" in files
    for name, f in files.items():
        assert f["bytes"] == (ckpt / name).stat().st_size and f["sha256"] == file_digest(ckpt / name)
    assert check_files(ckpt, info, checksums=True) is None
    lines: list[str] = []
    assert find_checkpoint(tmp_path, checksums=True, report=lines.append) == ckpt
    assert len(lines) == 1 and "sha256 of" in lines[0] and "verified" in lines[0]


def test_a_flipped_byte_and_a_truncated_file_are_named(tmp_path):
    ckpt = _save(tmp_path, 3)
    data = ckpt / "__0_0.distcp"
    _flip(data)
    info = _marker(ckpt)
    assert check_files(ckpt, info, checksums=False) is None  # same size: only the checksum sees it
    bad = check_files(ckpt, info, checksums=True)
    assert bad is not None and str(data) in bad and "corrupted" in bad
    with pytest.raises(CheckpointError, match="__0_0.distcp is corrupted"):
        find_checkpoint(ckpt, checksums=True)
    data.write_bytes(data.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"__0_0.distcp has \d+ bytes, its manifest says \d+: the file is trunc"):
        load_checkpoint(ckpt, model=build_model("cnn"))  # every load compares sizes (a stat per file)
    (ckpt / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="metadata is missing"):
        find_checkpoint(ckpt)


def test_run_folder_falls_back_to_the_newest_intact_checkpoint(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    for s in (2, 5, 7):
        _save(root, s)
    _flip(root / "step_000007" / "__0_0.distcp")
    (root / "step_000005" / "__0_0.distcp").write_bytes(b"short")
    lines: list[str] = []
    assert find_checkpoint(tmp_path / "run", checksums=True, report=lines.append) == root / "step_000002"
    assert lines[0].startswith("resume: skipped step_000007:") and "corrupted" in lines[0]
    assert lines[1].startswith("resume: skipped step_000005:") and "truncated" in lines[1]
    assert "step_000002" in lines[2] and "verified" in lines[2]
    _flip(root / "step_000002" / ".metadata", at=10)
    with pytest.raises(CheckpointError, match="no intact checkpoint in .*step_000007.*step_000005.*step_000002"):
        find_checkpoint(tmp_path / "run", checksums=True)


def test_a_checkpoint_without_manifest_loads_unverified(tmp_path):
    ckpt = _save(tmp_path, 4)
    info = _marker(ckpt)
    del info["manifest"]  # as written before manifests existed
    (ckpt / "checkpoint.json").write_text(json.dumps(info))
    lines: list[str] = []
    assert find_checkpoint(tmp_path, checksums=True, report=lines.append) == ckpt
    assert lines == [f"resume: {ckpt} (step 4) was written before checkpoints had a manifest: not verified"]
    assert load_checkpoint(ckpt, model=build_model("cnn"))[0]["step"] == 4


# ---------------------------------------------------------------------- dtrain run --resume, end to end


def _dtrain(*args, timeout=240):
    return dtrain_cli("run", *args, "--no-progress", "--no-trace", "--timeout-s", "60", timeout=timeout)


def _rows(out):
    return {(r["rank"], r["step"]): r for r in read_metrics(out)}


RUN = ["--workers", "2", "--batch-size", "256", "--epochs", "2", "--max-steps", "8", "--checkpoint-every", "3"]


@pytest.mark.procs
@pytest.mark.timeout(400)
def test_dtrain_run_names_a_truncated_file_and_falls_back(tmp_path):
    a = tmp_path / "straight"
    p = _dtrain(*RUN, "--out", str(a))
    assert p.returncode == 0, p.stderr[-3000:]
    assert [s for s, _, ok in list_checkpoints(a / "checkpoints") if ok] == [3, 6, 8]
    newest = a / "checkpoints" / "step_000008"
    data = newest / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])

    # the damaged checkpoint itself: one line naming the file, before any worker starts
    t0 = time.perf_counter()
    p = _dtrain(*RUN, "--max-steps", "10", "--out", str(tmp_path / "bad"), "--resume", str(newest), timeout=60)
    took = time.perf_counter() - t0
    assert p.returncode != 0
    err = p.stderr.strip().splitlines()
    assert len(err) == 1, p.stderr
    assert str(data) in err[0] and "truncated" in err[0] and f"from the run folder {a}" in err[0]
    assert took < 20, took  # python + torch import, then the check (was: 11 s and a worker's traceback)
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()

    # the run folder: the newest intact checkpoint (step 6), saying why step 8 was skipped
    b = tmp_path / "resumed"
    p = _dtrain(*RUN, "--out", str(b), "--resume", str(a))
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"resume: skipped step_000008: {data} has" in p.stderr
    assert "step_000006 (step 6): sha256 of" in p.stderr
    assert read_summary(b)["start_step"] == 6 and read_summary(b)["steps"] == 2
    ra, rb = _rows(a), _rows(b)
    assert sorted(rb) == [(r, s) for r in (0, 1) for s in (6, 7)]
    assert all(abs(ra[k]["loss"] - rb[k]["loss"]) < TOL for k in rb)
