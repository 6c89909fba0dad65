"""``dtrain run --strategy tensor`` on transformers models dtrain did not write: GPT-2 (with sequence parallelism)
and Llama (grouped-query attention) split over 2 workers by the derived plan, the plan printed in the run's first
lines, every step's loss equal to a one-process run's (``slow``: CI runs them); a ``[tensor.plan]`` key that
matches no module, and heads the workers do not divide, refused before any process starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from _helpers import dtrain_runs, mean_losses
from test_user_models_run import COMMON, GPT2, LLAMA, TEXT

pytest.importorskip("transformers")


@pytest.mark.procs
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("model, extra", [("gpt2", ["--sequence-parallel"]), ("llama", [])], ids=["gpt2-sp", "llama"])
def test_tensor_strategy_trains_a_transformers_model_as_one_process(
    tmp_path: Path, model: str, extra: list[str]
) -> None:
    flags = [*(GPT2 if model == "gpt2" else LLAMA), *TEXT]
    runs = dtrain_runs(
        tmp_path,
        COMMON,
        {"one": [*flags, "--workers", "1"], "tp": [*flags, "--strategy", "tensor", "--workers", "2", *extra]},
        timeout=600,
    )
    (one, _), (tp, text) = runs["one"], runs["tp"]
    assert "tensor-parallel plan auto" in text and "rowwise" in text, text[-3000:]
    got, want = mean_losses(tp), mean_losses(one)
    assert sorted(got) == sorted(want) == [0, 1, 2, 3], text[-2000:]
    for step in want:  # float32 sums in another order: the tolerance of the other runs' oracles
        assert got[step] == pytest.approx(want[step], rel=1e-5), (model, step, got, want)


def _config(**extra: object) -> object:
    from dtrain.config.files import parse_model_args
    from dtrain.config.schema import RunConfig

    args = parse_model_args([a for a in GPT2 if "=" in a])
    values: dict[str, object] = dict(
        strategy="tensor", workers=2, model="hf:gpt2", model_args=args, dataset="pytext", seq_len=16, batch_size=12
    )
    return RunConfig.make(**{**values, **extra})


def test_a_bad_plan_or_heads_are_refused_before_any_process_starts() -> None:
    from dtrain.errors import ConfigError
    from dtrain.job.validate import validate

    with pytest.raises(ConfigError, match=r"'transformer\.h\.7\.mlp\.c_fc', which matches no module"):
        validate(_config(plan={"transformer.h.7.mlp.c_fc": "colwise"}))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"'transformer\.h\.0\.attn': 4 attention heads do not divide over .* 8"):
        validate(_config(workers=8, batch_size=16))  # type: ignore[arg-type]
