"""``dtrain plan`` on a transformers Llama dtrain did not write: the profile is taken by the pieces a pipeline and the
derived tensor-parallel plan cut it into (the embedding, each decoder layer, the norm and the head), a pipeline's
predicted cut falls between the decoder layers as the run's does, and the pipeline, tensor and hybrid layouts
each get a finite prediction and a rank (nothing runs but this process)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from test_user_models_run import LLAMA

pytest.importorskip("transformers")

ARGS = [a for a in LLAMA if "=" in a]


def _llama_profile(measure: bool = False):  # type: ignore[no-untyped-def]
    from dtrain.config.files import parse_model_args
    from dtrain.perfmodel.profile import profile_model
    from dtrain.workloads.load import load_model

    model, sample, name = load_model("hf:llama", "pytext", batch=8, seq_len=16, model_args=parse_model_args(ARGS))
    return model, profile_model(model, sample, name=name, measure=measure)


def test_a_transformers_llama_is_profiled_by_its_pipeline_and_tensor_pieces() -> None:
    from dtrain.perfmodel.pipeline import stage_cut

    model, prof = _llama_profile()
    names = [ly.name for ly in prof.layers]
    assert names == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]
    pieces = prof.extra["pieces"]
    assert pieces["kinds"] == ["embed", "block", "block", "ln", "head"]
    assert pieces["units"] == [2, 3]  # the embedding rides with the first layer, the norm and head with the last
    norm_params = 2 * 64  # each layer's two RMSNorm weights stay whole on every rank; the projections split
    block = prof.layers[1].params
    assert pieces["split"][1] == pytest.approx((block - norm_params) / block)
    assert pieces["split"][0] == pieces["split"][4] == 1.0 and pieces["split"][3] == 0.0
    assert prof.extra["gpt"] == {"layers": 2, "hidden": 64, "heads": 2, "vocab": model.config.vocab_size, "seq": 16}
    assert all(ly.fwd_flops > 0 for ly in prof.layers[1:3])
    assert stage_cut(prof, 2, "equal") == (2, 3)  # one decoder layer a stage, as Pipeline cuts it
    with pytest.raises(Exception, match="2 blocks to cut between, fewer than the 3 virtual stages"):
        stage_cut(prof, 3, "equal")


def test_dtrain_plan_ranks_pipeline_tensor_and_hybrid_layouts_of_a_transformers_llama(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from test_planner import spec

    from dtrain.perfmodel import dump_cluster
    from dtrain.planning.cli import main as plan_main

    toml = tmp_path / "c.toml"
    toml.write_text(dump_cluster(spec("10gbit", 1e-5, nodes=1, per_node=2)))
    argv = ["--model", "hf:llama", *[x for a in ARGS for x in ("--model-arg", a)], "--seq-len", "16"]
    argv += ["--dataset", "pytext", "--batch", "16", "--cluster", str(toml), "--workers", "2"]
    argv += ["--mesh", "--pipeline", "--no-measure"]
    assert plan_main(argv) == 0
    out = capsys.readouterr().out
    ranked = {
        m[2].strip(): (int(m[1]), float(m[3]), float(m[4]))
        for m in re.finditer(r"^\s*(\d+)\s+(\S.*?)\s{2,}([\d.]+)\s+([\d.e+]+)\s", out, re.M)
    }
    for label in ("tensor tp2", "pipeline 1f1b M4 x2", "pipeline gpipe M8 x2", "hybrid dp1 pp2 tp1 M4 1f1b"):
        assert label in ranked, (label, out)
        rank, step_ms, per_s = ranked[label]
        assert rank >= 1 and math.isfinite(step_ms) and step_ms > 0 and per_s > 0, (label, out)
    rejected = [line.split("rejected")[0].strip(" -") for line in out.splitlines() if "rejected" in line]
    assert "tensor tp2" not in rejected and "hybrid dp1 pp2 tp1 M4 1f1b" not in rejected, out
    # the hybrid mesh of one pipeline is that pipeline: the same prediction
    assert ranked["hybrid dp1 pp2 tp1 M4 1f1b"][1] == pytest.approx(ranked["pipeline 1f1b M4 x2"][1], rel=0.05), out
