"""``dtrain run --strategy dp --shard ...`` (ZeRO 1-3) through the CLI: the same losses as unsharded dp, bytes per
step equal to the closed form, memory per rank in the summary, a stage-3 checkpoint written by 4 workers resumed on
2 and 3, and bad input refused before any process starts. The engine's oracles are in tests/test_sharded_dist.py."""

from __future__ import annotations

import pytest
from _helpers import dtrain_cli, mean_losses, read_metrics, read_summary

pytestmark = pytest.mark.procs  # every test here starts processes

# a batch of 48 divides over 2, 3 and 4 workers: the global batch, and so the loss curve, is the same on each
COMMON = ["--epochs", "1", "--no-progress", "--no-trace", "--batch-size", "48", "--max-steps", "8"]


def _losses(out) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out) if r["rank"] == 0}


def _cnn_padded(world: int) -> int:
    """Elements of every unit's padded flat buffer for dtrain run's CNN (a unit per child holding parameters)."""
    from dtrain.sharded._flat_units import plan_units
    from dtrain.workloads.data import load_dataset
    from dtrain.workloads.models import build_model

    ds = load_dataset("digits")
    model = build_model("cnn", tuple(ds.input_shape), ds.num_classes)
    return sum(u.padded for u in plan_units(model, None, world))


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp") / "dp"
    p = dtrain_cli("run", *COMMON, "--workers", "4", "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    return out


@pytest.mark.parametrize("shard, factor", [("optimizer", 2), ("gradients", 2), ("parameters", 3)])
def test_a_sharded_run_trains_like_dp_and_sends_the_closed_form(tmp_path, baseline, shard, factor):
    out = tmp_path / shard
    p = dtrain_cli("run", *COMMON, "--workers", "4", "--shard", shard, "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = _losses(baseline), _losses(out)
    assert sorted(a) == sorted(b) == list(range(8))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5), step
    assert read_summary(out)["metric"] == pytest.approx(read_summary(baseline)["metric"], abs=1e-9)
    # ring reduce-scatter + allgather: (P-1) segments of s = padded/P float32 each, per unit; stage 3 gathers twice
    closed = factor * 3 * _cnn_padded(4) // 4 * 4
    rows = [r for r in read_metrics(out) if 1 <= r["step"] <= 6]  # step 0 has no allgather of stepped shards yet
    assert {r["bytes_sent"] for r in rows} == {closed}, (closed, {r["bytes_sent"] for r in rows})
    mem = read_summary(out)["memory_per_rank"]
    assert sorted(mem) == ["0", "1", "2", "3"]
    assert all(m["optimizer"] > 0 and m["activations"] > 0 and m["model_state"] > 0 for m in mem.values())


def test_a_stage3_checkpoint_of_4_workers_resumes_on_2_and_3(tmp_path):
    full = tmp_path / "full"
    flags = [*COMMON, "--shard", "parameters", "--optimizer", "adam", "--lr", "0.002"]
    p = dtrain_cli("run", *flags, "--workers", "4", "--checkpoint-every", "4", "--out", str(full))
    assert p.returncode == 0, p.stderr[-3000:]
    want = mean_losses(full)
    ckpt = full / "checkpoints" / "step_000004"
    assert (ckpt / "checkpoint.json").exists()
    for workers in ("2", "3"):
        out = tmp_path / f"on{workers}"
        p = dtrain_cli("run", *flags, "--workers", workers, "--resume", str(ckpt), "--out", str(out))
        assert p.returncode == 0, p.stderr[-3000:]
        got = mean_losses(out)
        assert sorted(got) == [4, 5, 6, 7]
        for step, loss in got.items():
            assert loss == pytest.approx(want[step], rel=1e-5), (workers, step)
        assert read_summary(out)["start_step"] == 4
        assert read_summary(out)["metric"] == pytest.approx(read_summary(full)["metric"], abs=1e-9)


def test_plain_dp_with_per_rank_compressor_state_still_refuses_another_worker_count(tmp_path):
    # (plain dp without such state resumes on any count that keeps the global batch: test_checkpoint.py)
    run = tmp_path / "a"
    topk = ["--compression", "topk:0.01"]  # error feedback: each rank's residuals
    p = dtrain_cli("run", *COMMON, *topk, "--workers", "2", "--checkpoint-every", "4", "--out", str(run))
    assert p.returncode == 0, p.stderr[-3000:]
    p = dtrain_cli("run", *COMMON, *topk, "--workers", "3", "--resume", str(run), "--out", str(tmp_path / "b"))
    assert p.returncode != 0 and "workers=2" in p.stderr, p.stderr[-2000:]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--shard", "gradients", "--algorithm", "tree"], "has no sharded form"),
        (["--shard", "parameters", "--compression", "topk:0.01"], "does not take --compression"),
        (["--shard", "everything"], "invalid choice: 'everything'"),
        (["--strategy", "ps", "--shard", "gradients"], "shard"),
    ],
)
def test_bad_sharding_input_is_refused_before_any_process_starts(tmp_path, flags, message):
    out = tmp_path / "x"
    p = dtrain_cli("run", *COMMON, "--workers", "2", *flags, "--out", str(out))
    assert p.returncode != 0
    assert message in p.stderr, p.stderr[-2000:]
    assert not (out / "metrics.jsonl").exists()


def test_16_bit_compute_reduce_scatters_16_bit_gradients(tmp_path, baseline):
    """--precision bf16: the gradients' reduce-scatter moves 2 bytes an element, the stepped float32 shards'
    allgather still 4 (they are the master weights); the loss stays that of fp32 dp within bf16's error."""
    out = tmp_path / "bf16"
    p = dtrain_cli("run", *COMMON, "--workers", "4", "--shard", "gradients", "--precision", "bf16", "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    closed = 3 * _cnn_padded(4) // 4 * (2 + 4)  # ring: (P-1)/P of the padded buffer, per collective
    rows = [r for r in read_metrics(out) if 1 <= r["step"] <= 6]
    assert {r["bytes_sent"] for r in rows} == {closed}, (closed, {r["bytes_sent"] for r in rows})
    a, b = _losses(baseline), _losses(out)
    assert all(b[s] == pytest.approx(a[s], rel=0.02) for s in a), (a, b)
