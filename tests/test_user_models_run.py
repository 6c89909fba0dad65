"""Models dtrain did not write, through ``dtrain run``: transformers GPT-2 (its head tied to its embedding) and
Llama (rotary, grouped-query attention) built from a config with random weights, and a residual CNN in a
user's file, under dp, ddp, ZeRO 1/2/3 and the parameter server (bsp) at 3 workers: every step's loss equals a
one-process run on the same global batch. local_sgd, easgd and gossip learn. One case of each model runs in the
default suite (GPT-2 under ZeRO-3, Llama under ZeRO-2, the CNN on the parameter server); the rest are ``slow``
(CI runs them). ``dtrain.run`` takes a script's own function;
a transformers model resumes from a ZeRO-3 checkpoint step for step and learns in bf16."""

from __future__ import annotations

from pathlib import Path

import pytest
from _helpers import dtrain_runs, mean_losses, read_summary
from _user_files import GPT2, LLAMA, RESIDUAL_CNN

pytestmark = pytest.mark.procs  # every test here starts processes

CNN_FILE = RESIDUAL_CNN

TEXT = ["--dataset", "pytext", "--seq-len", "16", "--optimizer", "adam", "--lr", "0.003"]
# a global batch of 12 divides over 1 and 3 workers: the same samples make each step in both
COMMON = ["--epochs", "1", "--no-progress", "--no-trace", "--batch-size", "12", "--max-steps", "4"]
STRATEGIES = {
    "dp": ["--strategy", "dp"],
    "ddp": ["--strategy", "ddp"],
    "zero1": ["--strategy", "dp", "--shard", "optimizer"],
    "zero2": ["--strategy", "dp", "--shard", "gradients"],
    "zero3": ["--strategy", "dp", "--shard", "parameters"],
    "ps": ["--strategy", "ps", "--servers", "1", "--consistency", "bsp"],
}
# the first strategies of each model run in the default suite, the rest under -m slow
QUICK = {"gpt2": ("zero3",), "llama": ("zero2",), "cnn": ("ps",)}


def _model_flags(name: str, tmp: Path) -> list[str]:
    if name == "cnn":
        path = tmp / "my_cnn.py"
        path.write_text(CNN_FILE)
        return ["--model", f"{path}:build", "--model-arg", "width=8"]
    pytest.importorskip("transformers")
    return [*(GPT2 if name == "gpt2" else LLAMA), *TEXT]


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, float]]:
    """Each model's one-process run on the global batch: step -> loss."""
    root = tmp_path_factory.mktemp("one")
    runs = {name: [*_model_flags(name, root), "--workers", "1"] for name in QUICK}
    return {name: mean_losses(out) for name, (out, _) in dtrain_runs(root, COMMON, runs, timeout=400).items()}


def _cases() -> list[object]:
    out: list[object] = []
    for model, quick in QUICK.items():
        for strategy in STRATEGIES:
            marks = () if strategy in quick else (pytest.mark.slow,)
            out.append(pytest.param(model, strategy, marks=marks, id=f"{model}-{strategy}"))
    return out


@pytest.mark.parametrize("model, strategy", _cases())
def test_three_workers_train_a_users_model_as_one_process_does(
    tmp_path: Path, references, model: str, strategy: str
) -> None:
    flags = [*_model_flags(model, tmp_path), *STRATEGIES[strategy], "--workers", "3"]
    ((out, text),) = dtrain_runs(tmp_path, COMMON, {strategy: flags}, timeout=400).values()
    got, want = mean_losses(out), references[model]
    assert sorted(got) == sorted(want) == [0, 1, 2, 3], text[-2000:]
    for step in want:  # float32 sums in another order: the tolerance of tests/test_sharded_run.py's oracles
        assert got[step] == pytest.approx(want[step], rel=1e-5), (model, strategy, step, got, want)
    assert read_summary(out)["steps"] == 4


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["local_sgd", "easgd", "gossip"])
def test_model_averaging_learns_a_transformers_model(tmp_path: Path, strategy: str) -> None:
    flags = [*_model_flags("gpt2", tmp_path), "--strategy", strategy, "--workers", "3"]
    common = ["--epochs", "1", "--no-progress", "--no-trace", "--batch-size", "24", "--max-steps", "30"]
    ((out, text),) = dtrain_runs(tmp_path, common, {strategy: flags}, timeout=500).values()
    losses = mean_losses(out)
    first, last = sum(losses[s] for s in range(3)) / 3, sum(losses[s] for s in range(27, 30)) / 3
    assert last < 0.8 * first, (strategy, first, last)


SCRIPT = """
import sys

import dtrain
from torch import nn


def build(width=8):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10))


if __name__ == "__main__":  # every worker imports this file to find build
    summary, out = dtrain.run(model=build, model_args={"width": 16}, strategy="dp", shard="parameters",
                              workers=2, epochs=1, max_steps=5, batch_size=32, trace=False, quiet=True,
                              out=sys.argv[1])
    print("RESULT", summary["strategy"], summary["workers"], summary["steps"], out)
"""


def test_dtrain_run_from_python_takes_a_function_of_the_script(tmp_path: Path) -> None:
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    p = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "run")], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"RESULT dp 2 5 {tmp_path / 'run'}" in p.stdout, p.stdout
    from dtrain.config.files import load_toml

    saved = load_toml(tmp_path / "run" / "config.toml")
    assert saved["model"] == f"{script}:build" and saved["model_args"] == {"width": 16}


@pytest.mark.slow
def test_a_transformers_model_resumes_and_trains_in_bf16(tmp_path: Path) -> None:
    flags = [*_model_flags("gpt2", tmp_path), "--strategy", "dp", "--shard", "parameters", "--workers", "2"]
    runs = dtrain_runs(
        tmp_path,
        COMMON,
        {"full": [*flags, "--checkpoint-every", "2"], "bf16": [*flags, "--precision", "bf16", "--max-steps", "12"]},
        timeout=400,
    )
    full = runs["full"][0]
    ckpt = full / "checkpoints" / "step_000002"
    ((resumed, _),) = dtrain_runs(tmp_path, COMMON, {"resumed": [*flags, "--resume", str(ckpt)]}, timeout=400).values()
    want, got = mean_losses(full), mean_losses(resumed)
    assert sorted(got) == [2, 3]
    for step in got:  # the same steps from the checkpoint on
        assert got[step] == pytest.approx(want[step], rel=1e-5), step
    bf16 = mean_losses(runs["bf16"][0])
    assert bf16[11] < bf16[0] - 0.3, bf16  # learns in 16-bit
