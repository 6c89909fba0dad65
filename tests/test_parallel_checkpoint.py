"""Checkpoints of model-parallel runs: pipeline, tensor and hybrid (resume and restarts for every
strategy).

A pipeline stage saves its own layers' parameters and optimizer state under the whole model's names (DCP writes
every rank's keys), its RNGs, and the cut. A tensor/hybrid rank saves its slices and its optimizer's state as its
own (one set per rank, as Megatron-LM's per-rank checkpoint files). Real runs (``python -m dtrain.cli``, gloo on
loopback):

- a run resumed from its step-10 checkpoint ends as the uninterrupted run: every (step, rank)'s loss from
  step 10 on equal (pipeline 1f1b and interleaved with two chunks a rank, tensor tp2, hybrid dp2 x pp2), and
  for pipelines every tensor of the last checkpoint;
- the resumed pipeline cuts the model where the checkpoint did (``--balance time`` profiles anew otherwise);
- 2bw (deferred backwards and two weight versions between steps), another ``--chunks`` or another mesh are
  refused before any process starts, naming why.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _helpers import dtrain_cli, read_summary

from dtrain.checkpoint import read_checkpoint, save_checkpoint
from dtrain.config.schema import RunConfig
from dtrain.errors import DTrainError
from dtrain.job.validate import validate
from dtrain.strategies.pipeline import PipelineAdapter, PipelineOptions

RUN = [
    "run",
    "--strategy",
    "pipeline",
    "--workers",
    "2",
    "--epochs",
    "2",
    "--max-steps",
    "30",
    "--batch-size",
    "24",
    "--microbatches",
    "4",
    "--checkpoint-every",
    "10",
    "--no-progress",
    "--no-trace",
]


def _losses(out: Path) -> dict[tuple[int, int], float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {(int(r["step"]), int(r["rank"])): float(r["loss"]) for r in rows}


@pytest.mark.procs
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "flags", [["--schedule", "1f1b"], ["--schedule", "interleaved", "--chunks", "2"]], ids=["1f1b", "interleaved"]
)
def test_a_resumed_pipeline_run_ends_as_the_uninterrupted_one(tmp_path, flags):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    p = dtrain_cli(*RUN, *flags, "--out", str(whole), timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    ckpt = whole / "checkpoints" / "step_000010"
    p = dtrain_cli(*RUN, *flags, "--resume", str(ckpt), "--out", str(resumed), timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]

    a, b = _losses(whole), _losses(resumed)
    assert sorted(b) == [(s, r) for s in range(10, 30) for r in range(2)]
    assert max(abs(a[k] - b[k]) for k in b) <= 1e-6
    got, want = read_checkpoint(resumed / "checkpoints" / "step_000030"), read_checkpoint(ckpt.parent / "step_000030")
    assert set(got["model"]) == set(want["model"]) and len(want["model"]) > 4  # every stage's layers in one
    for name, t in want["model"].items():
        assert torch.equal(got["model"][name], t), name
    assert read_summary(resumed)["metric"] == pytest.approx(read_summary(whole)["metric"], abs=1e-9)


def test_a_resumed_pipeline_cuts_the_model_where_its_checkpoint_did(tmp_path):
    root = tmp_path / "checkpoints"
    ckpt = save_checkpoint(root, 10, model=torch.nn.Linear(2, 2), info={"step": 10, "cut": [6, 3]})

    def engine(resume: Path | None, balance: str) -> PipelineAdapter:
        me = SimpleNamespace(ckpt=SimpleNamespace(resume_from=resume), o=PipelineOptions(balance=balance))
        return me  # type: ignore[return-value]

    assert PipelineAdapter._balance(engine(ckpt, "time")) == [6, 3]  # not profiled anew
    assert PipelineAdapter._balance(engine(None, "time")) == "time"
    assert PipelineAdapter._balance(engine(None, "4,5")) == [4, 5]


@pytest.mark.procs
@pytest.mark.parametrize(
    "extra, words",
    [
        (
            ["--schedule", "2bw", "--checkpoint-every", "10"],
            "checkpoints of a pipeline run with --schedule 2bw are not supported: between steps it holds a batch's "
            "deferred backwards",
        ),
    ],
)
def test_a_pipeline_checkpoint_that_cannot_hold_is_refused_before_any_process(tmp_path, extra, words):
    out = tmp_path / "r"
    p = dtrain_cli(
        "run", "--strategy", "pipeline", "--workers", "2", "--max-steps", "4", *extra, "--out", str(out), timeout=60
    )
    assert p.returncode == 2 and words in p.stderr, p.stderr[-2000:]
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_resuming_a_pipeline_checkpoint_with_other_chunks_is_refused_naming_them(tmp_path):
    first = tmp_path / "first"
    p = dtrain_cli(*RUN, "--max-steps", "10", "--out", str(first), timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    cfg = RunConfig.make(
        strategy="pipeline",
        workers=2,
        epochs=2,
        max_steps=30,
        batch_size=24,
        microbatches=4,
        schedule="interleaved",
        chunks=2,
        resume=str(first / "checkpoints" / "step_000010"),
    )
    with pytest.raises(
        DTrainError, match="it was saved with schedule='1f1b', chunks=1; this run has schedule='interleaved', chunks=2"
    ):
        validate(cfg)


GPT = [
    "run",
    "--model",
    "gpt-tiny",
    "--dataset",
    "pytext",
    "--epochs",
    "1",
    "--max-steps",
    "20",
    "--checkpoint-every",
    "10",
    "--no-progress",
    "--no-trace",
]


@pytest.mark.procs
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "mesh",
    [
        pytest.param(["--strategy", "tensor", "--workers", "2"], id="tp2"),
        pytest.param(  # slow tier: the default one resumes pipelines and the tp2 case, and refuses a foreign mesh
            ["--strategy", "hybrid", "--workers", "4", "--dp", "2", "--pp", "2"], id="dp2xpp2", marks=pytest.mark.slow
        ),
    ],
)
def test_a_resumed_tensor_or_hybrid_run_ends_as_the_uninterrupted_one(tmp_path, mesh):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    p = dtrain_cli(*GPT, *mesh, "--out", str(whole), timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    p = dtrain_cli(
        *GPT, *mesh, "--resume", str(whole / "checkpoints" / "step_000010"), "--out", str(resumed), timeout=240
    )
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = _losses(whole), _losses(resumed)
    ranks = int(mesh[3])
    assert sorted(b) == [(s, r) for s in range(10, 20) for r in range(ranks)]
    assert max(abs(a[k] - b[k]) for k in b) <= 1e-6
    assert read_summary(resumed)["metric"] == pytest.approx(read_summary(whole)["metric"], rel=1e-6)


@pytest.mark.procs
def test_a_hybrid_checkpoint_resumes_only_on_its_own_mesh(tmp_path):
    root = tmp_path / "run"
    p = dtrain_cli(
        *GPT,
        "--strategy",
        "hybrid",
        "--workers",
        "2",
        "--dp",
        "2",
        "--max-steps",
        "10",
        "--out",
        str(root),
        timeout=240,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    cfg = RunConfig.make(
        strategy="hybrid",
        workers=2,
        dp=1,
        tp=2,
        model="gpt-tiny",
        dataset="pytext",
        epochs=1,
        max_steps=20,
        resume=str(root / "checkpoints" / "step_000010"),
    )
    with pytest.raises(DTrainError, match="it was saved with dp=2, tp=1; this run has dp=1, tp=2"):
        validate(cfg)
