"""``dtrain run --strategy hybrid`` on a transformers Llama dtrain did not write (grouped-query attention, 2 layers,
width 64): dp 2 x pp 2 (the pipeline cut between its decoder layers) learns; pp 2 x tp 2 (each stage split by the
derived plan) gives a one-process run's every step's loss (``slow``). Fewer blocks than stages, and heads the tp
size does not divide, are refused before any process starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from _helpers import dtrain_cli, dtrain_runs, mean_losses, read_metrics, read_summary
from test_user_models_run import LLAMA, TEXT

pytest.importorskip("transformers")

COMMON = [*LLAMA, *TEXT, "--epochs", "1", "--no-progress", "--no-trace", "--batch-size", "8"]


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_dp2_pp2_trains_a_transformers_llama_and_it_learns(tmp_path: Path) -> None:
    flags = ["--strategy", "hybrid", "--workers", "4", "--dp", "2", "--pp", "2", "--microbatches", "2"]
    ((out, text),) = dtrain_runs(tmp_path, COMMON, {"dp2pp2": [*flags, "--max-steps", "12"]}, timeout=280).values()
    losses = mean_losses(out)
    assert sorted(losses) == list(range(12)), text[-2000:]
    first, last = sum(losses[s] for s in range(3)) / 3, sum(losses[s] for s in range(9, 12)) / 3
    assert last < first - 1.0, (first, last, text[-2000:])
    last_rows = [r for r in read_metrics(out) if r["step"] == 11]
    assert len(last_rows) == 4 and all(r["pp_bytes"] > 0 and r["dp_bytes"] > 0 for r in last_rows), last_rows
    assert all(r["tp_bytes"] == 0 for r in last_rows)
    assert read_summary(out)["strategy"] == "hybrid"


@pytest.mark.procs
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pp2_tp2_on_a_transformers_llama_equals_one_process(tmp_path: Path) -> None:
    mesh = ["--strategy", "hybrid", "--workers", "4", "--pp", "2", "--tp", "2", "--microbatches", "2"]
    runs = dtrain_runs(tmp_path, [*COMMON, "--max-steps", "4"], {"one": ["--workers", "1"], "mesh": mesh}, timeout=500)
    (one, _), (got_out, text) = runs["one"], runs["mesh"]
    assert "tensor-parallel plan auto" in text and "model.layers.*.self_attn.o_proj  rowwise" in text, text[-3000:]
    got, want = mean_losses(got_out), mean_losses(one)
    assert sorted(got) == sorted(want) == [0, 1, 2, 3], text[-2000:]
    for step in want:  # float32 sums in another order: the tolerance of tests/test_hybrid_run.py
        assert got[step] == pytest.approx(want[step], rel=1e-5), (step, got, want)
    assert read_summary(got_out)["metric"] == pytest.approx(read_summary(one)["metric"], rel=1e-5)
    last_rows = [r for r in read_metrics(got_out) if r["step"] == 3]
    assert all(r["pp_bytes"] > 0 and r["tp_bytes"] > 0 and r["dp_bytes"] == 0 for r in last_rows), last_rows


def _config(**extra: object) -> object:
    from dtrain.config.files import parse_model_args
    from dtrain.config.schema import RunConfig

    args = parse_model_args([a for a in LLAMA if "=" in a])
    values: dict[str, object] = dict(
        strategy="hybrid", model="hf:llama", model_args=args, dataset="pytext", seq_len=16, batch_size=8
    )
    return RunConfig.make(**{**values, **extra})


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            dict(workers=3, pp=3, microbatches=1),
            r"hybrid: model\.layers of model hf:llama \(LlamaForCausalLM, blocks LlamaDecoderLayer\): 2 blocks to "
            r"cut between, fewer than the 3 stages of --pp 3",
        ),
        (
            dict(workers=6, pp=2, tp=3, microbatches=1),
            r"'model\.layers\.0\.self_attn': 4 attention heads do not divide over tensor-parallel size 3",
        ),
        (
            dict(workers=4, tp=4, microbatches=1),
            r"'model\.layers\.0\.self_attn': 2 key/value heads do not divide over tensor-parallel size 4",
        ),
        (dict(workers=4, pp=2, tp=2, balance="1,2"), r"hybrid: balance 1,2 must give 2 positive block counts"),
        (dict(workers=4, pp=2, tp=2, sequence_parallel=True), r"--sequence-parallel with --pp 2 covers dtrain's"),
    ],
    ids=["blocks", "heads", "kv-heads", "balance", "sequence-parallel"],
)
def test_a_bad_mesh_of_a_users_model_is_refused_before_any_process_starts(
    extra: dict[str, object], message: str
) -> None:
    from dtrain.errors import ConfigError
    from dtrain.job.validate import validate

    with pytest.raises(ConfigError, match=message):
        validate(_config(**extra))  # type: ignore[arg-type]


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_dtrain_run_refuses_more_stages_than_blocks_with_exit_code_2(tmp_path: Path) -> None:
    out = tmp_path / "r"
    p = dtrain_cli("run", *COMMON, "--strategy", "hybrid", "--workers", "3", "--pp", "3", "--out", str(out))
    assert p.returncode == 2, p.stdout + p.stderr
    assert "2 blocks to cut between, fewer than the 3 stages of --pp 3" in p.stderr, p.stderr[-2000:]
    assert not (out / "metrics.jsonl").exists()
