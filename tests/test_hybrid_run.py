"""``dtrain run --strategy tensor`` and ``--strategy hybrid`` through the CLI: the same losses and metric as one
process, bytes per mesh dimension in the metrics, and bad meshes refused before any process starts. The
library's oracles are in tests/test_tensor_parallel_dist.py and tests/test_hybrid_dist.py."""

from __future__ import annotations

import pytest
from _helpers import dtrain_cli, mean_losses, read_metrics, read_summary

pytestmark = pytest.mark.procs  # every test here starts processes

COMMON = [
    "--model",
    "gpt-tiny",
    "--dataset",
    "pytext",
    "--epochs",
    "1",
    "--max-steps",
    "6",
    "--batch-size",
    "8",
    "--eval-samples",
    "16",
    "--no-progress",
    "--no-trace",
    "--seq-len",
    "16",
]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "one"
    p = dtrain_cli("run", *COMMON, "--workers", "1", "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    return out


@pytest.mark.parametrize(
    "flags, dims",
    [
        (["--strategy", "tensor", "--workers", "2"], {"tp"}),
        (["--strategy", "tensor", "--workers", "2", "--sequence-parallel"], {"tp"}),
        (["--strategy", "hybrid", "--workers", "4", "--dp", "2", "--pp", "1", "--tp", "2"], {"tp", "dp"}),
        (
            ["--strategy", "hybrid", "--workers", "4", "--dp", "1", "--pp", "2", "--tp", "2", "--microbatches", "2"],
            {"tp", "pp"},
        ),
    ],
)
def test_tensor_and_hybrid_runs_train_like_one_process(tmp_path, single, flags, dims):
    out = tmp_path / "r"
    p = dtrain_cli("run", *COMMON, *flags, "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = mean_losses(single), mean_losses(out)
    assert sorted(a) == sorted(b) == list(range(6))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5), step
    assert read_summary(out)["metric"] == pytest.approx(read_summary(single)["metric"], rel=1e-5)
    last = [r for r in read_metrics(out) if r["step"] == 5]
    for name in ("tp", "pp", "dp"):
        assert all((r[f"{name}_bytes"] > 0) == (name in dims) for r in last), (name, last)
    # the batch is counted once per step, not once per rank
    s = read_summary(out)
    assert s["samples_per_s"] == pytest.approx(6 * 8 / s["train_s"], rel=0.01)


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--strategy", "hybrid", "--workers", "4", "--dp", "2", "--pp", "2", "--tp", "2"],
            "= 8 processes, but --workers",
        ),
        (["--strategy", "tensor", "--workers", "3"], "4 attention heads do not divide over tensor-parallel size 3"),
        (["--strategy", "tensor", "--workers", "2", "--model", "cnn", "--dataset", "digits"], "has no plan"),
        (["--strategy", "hybrid", "--workers", "2", "--dp", "2", "--sequence-parallel"], "needs tensor parallelism"),
        (
            [
                "--strategy",
                "hybrid",
                "--workers",
                "2",
                "--dp",
                "2",
                "--compression",
                "topk:0.1",
                "--checkpoint-every",
                "2",
            ],
            "checkpoints of a hybrid run with --compression topk:0.1 are not supported",
        ),
        (["--strategy", "hybrid", "--workers", "4", "--dp", "4", "--microbatches", "4"], "does not divide into 4"),
    ],
)
def test_bad_meshes_are_refused_before_any_process_starts(tmp_path, flags, message):
    out = tmp_path / "x"
    p = dtrain_cli("run", *COMMON, *flags, "--out", str(out))
    assert p.returncode != 0
    assert message in p.stderr, p.stderr[-2000:]
    assert not (out / "metrics.jsonl").exists()


def test_a_hybrid_run_compresses_its_dp_allreduce(tmp_path):
    exact, half = tmp_path / "exact", tmp_path / "fp16"
    mesh = ["--strategy", "hybrid", "--workers", "4", "--dp", "2", "--tp", "2"]
    for out, comp in ((exact, "none"), (half, "fp16")):
        p = dtrain_cli("run", *COMMON, *mesh, "--compression", comp, "--out", str(out))
        assert p.returncode == 0, p.stderr[-3000:]
    a, b = mean_losses(exact), mean_losses(half)
    assert b[5] < b[0] and b[5] == pytest.approx(a[5], rel=1e-2)  # learns, as the exact run does
    dp = {
        name: [r["dp_bytes"] for r in read_metrics(out) if r["step"] == 5] for name, out in (("a", exact), ("b", half))
    }
    assert all(x == pytest.approx(y / 2, rel=0.01) for x, y in zip(dp["b"], dp["a"])), dp  # 16-bit gradients
    assert read_summary(half)["strategy"] == "hybrid"
