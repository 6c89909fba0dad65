"""``derive_plan`` on transformers models built from a config (2 layers, width 64, vocabulary 257, random weights,
nothing downloaded), in one process: the printed plan splits every attention and MLP projection of the model's
layers, listed here against the model's own modules, with the styles their layout needs; the head counts the
forward reads become a rank's share; bad input is one line naming the module, the dimension and the count."""

from __future__ import annotations

import fnmatch
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from dtrain.errors import ConfigError  # noqa: E402
from dtrain.tensor_parallel import check_plan, derive_plan  # noqa: E402
from dtrain.tensor_parallel.layers import is_projection  # noqa: E402

WIDE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, max_position_embeddings=32)
CONFIGS: dict[str, dict[str, Any]] = {
    "gpt2": dict(n_layer=2, n_embd=64, n_head=4, n_positions=32),
    "llama": dict(num_hidden_layers=2, num_key_value_heads=2, **WIDE),
    "qwen2": dict(num_hidden_layers=2, num_key_value_heads=2, **WIDE),  # q/k/v with a bias
    "gpt_neox": dict(num_hidden_layers=2, **WIDE),  # one fused query_key_value, interleaved per head
    "opt": dict(num_hidden_layers=2, hidden_size=64, ffn_dim=128, num_attention_heads=4, word_embed_proj_dim=64),
}
# what each layer's projections must get, by their names in the modeling code (transformers/models/*/modeling_*.py)
LAYER_STYLES = {
    "gpt2": {"attn.c_attn": "colwise:3", "attn.c_proj": "rowwise", "mlp.c_fc": "colwise", "mlp.c_proj": "rowwise"},
    "llama": {
        "self_attn.q_proj": "colwise",
        "self_attn.k_proj": "colwise",
        "self_attn.v_proj": "colwise",
        "self_attn.o_proj": "rowwise",
        "mlp.gate_proj": "colwise",
        "mlp.up_proj": "colwise",
        "mlp.down_proj": "rowwise",
    },
    "gpt_neox": {
        "attention.query_key_value": "colwise",
        "attention.dense": "rowwise",
        "mlp.dense_h_to_4h": "colwise",
        "mlp.dense_4h_to_h": "rowwise",
    },
    "opt": {
        "self_attn.q_proj": "colwise",
        "self_attn.k_proj": "colwise",
        "self_attn.v_proj": "colwise",
        "self_attn.out_proj": "rowwise",
        "fc1": "colwise",
        "fc2": "rowwise",
    },
}
LAYER_STYLES["qwen2"] = LAYER_STYLES["llama"]
LAYERS = {"gpt2": "transformer.h", "gpt_neox": "gpt_neox.layers", "opt": "model.decoder.layers"}
VOCAB = {  # (token embedding, LM head) split by vocabulary; OPT's embedding has a padding row: both stay whole
    "gpt2": ("transformer.wte", "lm_head"),
    "gpt_neox": ("gpt_neox.embed_in", "lm_head"),
    "opt": None,
}


def build(kind: str, **overrides: Any) -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(kind, vocab_size=257, **{**CONFIGS[kind], **overrides})
    config.use_cache = False
    model: nn.Module = transformers.AutoModelForCausalLM.from_config(config)
    return model


def resolved(model: nn.Module, styles: dict[str, str]) -> dict[str, str]:
    """Module name -> style, as parallelize resolves the plan's keys (exact names or fnmatch patterns)."""
    out: dict[str, str] = {}
    for name, _ in model.named_modules():
        for key, style in styles.items():
            if name and (name == key or fnmatch.fnmatchcase(name, key)):
                out[name] = style
    return out


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_derived_plan_splits_every_attention_and_mlp_projection(kind: str) -> None:
    model = build(kind)
    plan = derive_plan(model, 2)
    got = resolved(model, dict(plan.styles))
    layers = LAYERS.get(kind, "model.layers")
    projections = [n for n, m in model.named_modules() if is_projection(m) and n.startswith(f"{layers}.")]
    assert len(projections) == 2 * len(LAYER_STYLES[kind])  # every projection of the layers is one listed here
    for name in projections:
        leaf = name[len(layers) + 1 :].partition(".")[2]
        assert got.get(name) == LAYER_STYLES[kind][leaf], (kind, name, plan.text())
    vocab = VOCAB.get(kind, ("model.embed_tokens", "lm_head"))
    split = sorted(n for n, s in got.items() if s == "vocab")
    assert split == (sorted(vocab) if vocab else []), plan.text()
    text = plan.text()
    for key, style in plan.styles.items():  # the printed plan is the plan
        assert any(line.split() == [key, style] for line in text.splitlines()), (key, text)


def test_head_counts_become_a_ranks_share() -> None:
    model = build("llama")
    plan = derive_plan(model, 2)
    assert plan.prepare is not None
    assert any("2 key/value heads (1 per rank)" in n and "config.num_key_value_heads 2->1" in n for n in plan.notes)
    plan.prepare(model, 2)
    attn = model.get_submodule("model.layers.0.self_attn")
    assert (attn.config.num_attention_heads, attn.config.num_key_value_heads) == (2, 1)
    assert attn.num_key_value_groups == 2 and attn.head_dim == 16  # the ratio and the head's width stay
    gpt2 = build("gpt2")
    plan = derive_plan(gpt2, 2)
    assert plan.prepare is not None
    plan.prepare(gpt2, 2)
    a = gpt2.get_submodule("transformer.h.1.attn")
    assert (a.num_heads, a.split_size, a.head_dim) == (2, 32, 16)


def test_sequence_parallel_plan_gathers_at_attention_and_mlp() -> None:
    plan = derive_plan(build("llama"), 2, sequence_parallel=True)
    s = dict(plan.styles)
    assert s["model.layers.0"] == "sequence" and s["model.norm"] == "gather_end"
    assert s["model.layers.*.self_attn"] == "gather:hidden_states" and s["model.layers.*.mlp"] == "gather"
    assert s["model.layers.*.input_layernorm"] == s["model.layers.*.post_attention_layernorm"] == "replicate"


def _error(fn: Any) -> str:
    with pytest.raises(ConfigError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_bad_input_is_one_line_naming_the_module_the_dimension_and_the_count() -> None:
    msg = _error(lambda: derive_plan(build("llama", num_key_value_heads=1), 2))
    assert msg == "'model.layers.0.self_attn': 1 key/value heads do not divide over tensor-parallel size 2", msg
    msg = _error(lambda: derive_plan(build("gpt2"), 8))
    assert msg == "'transformer.h.0.attn': 4 attention heads do not divide over tensor-parallel size 8", msg
    msg = _error(lambda: derive_plan(build("llama", num_key_value_heads=4, intermediate_size=130), 4))
    assert "'model.layers.0.mlp.gate_proj': 130 output features do not divide over tensor-parallel size 4" in msg
    gpt2 = build("gpt2")
    msg = _error(lambda: check_plan(gpt2, {"transformer.h.9.attn.c_attn": "colwise:3"}, 2))
    assert "'transformer.h.9.attn.c_attn', which matches no module" in msg, msg
    msg = _error(lambda: check_plan(gpt2, {"transformer.h.*.attn.c_attn": "colwise:5"}, 2))
    assert "'transformer.h.0.attn.c_attn': 192 output features do not divide over tensor-parallel size 2 in 5" in msg
    msg = _error(lambda: derive_plan(build("opt"), 2, sequence_parallel=True))
    assert "'model.decoder.layers.0' holds" in msg and "run without --sequence-parallel" in msg, msg


def test_a_plan_table_in_toml_reaches_the_tensor_options_and_is_written_back(tmp_path: Any) -> None:
    from dtrain.config.files import dump_toml, load_toml
    from dtrain.config.schema import RunConfig

    path = tmp_path / "run.toml"
    path.write_text(
        'strategy = "tensor"\nworkers = 2\nmodel = "hf:gpt2"\n\n[tensor.plan]\n'
        '"transformer.h.*.attn.c_attn" = "colwise:3"\n"transformer.h.*.attn.c_proj" = "rowwise"\n'
    )
    cfg = RunConfig.from_mapping(load_toml(path))
    want = {"transformer.h.*.attn.c_attn": "colwise:3", "transformer.h.*.attn.c_proj": "rowwise"}
    assert dict(cfg.opts.plan) == want  # type: ignore[attr-defined]
    again = tmp_path / "again.toml"
    again.write_text(dump_toml(cfg))
    assert dict(RunConfig.from_mapping(load_toml(again)).opts.plan) == want  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="unknown tensor-parallel style 'columnwise'"):
        RunConfig.make(strategy="tensor", workers=2, plan={"x": "columnwise"})


@pytest.mark.parametrize("sp", [False, True], ids=["plain", "sequence_parallel"])
def test_derived_plan_of_dtrains_gpt_splits_as_the_hand_written_one(sp: bool) -> None:
    from dtrain.tensor_parallel import plans
    from dtrain.workloads.models import build_model

    model = build_model("gpt-tiny", vocab_size=32, seq_len=8)
    hand = resolved(model, dict((plans.gpt_sequence_parallel() if sp else plans.gpt).styles))
    derived = resolved(model, dict(derive_plan(model, 2, sequence_parallel=sp).styles))
    split = ("colwise", "rowwise", "vocab")
    assert {n: s for n, s in derived.items() if s.partition(":")[0] in split} == {
        n: s for n, s in hand.items() if s.partition(":")[0] in split
    }
    if sp:  # the same region: block0's input split, the norms inside it on shards
        assert derived["block0"] == hand["block0"] == "sequence"
        assert {n for n, s in derived.items() if s == "replicate"} == {
            n for n, s in hand.items() if s == "replicate" and n != "ln_f"
        }
        assert derived["ln_f"] == "gather_end"  # the hand plan gathers at the head instead


class _Attention(nn.Module):
    """Causal attention reading its head count from ``count_attr`` (``num_heads``: found by its name; ``nh``: not)."""

    def __init__(self, count_attr: str, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))
        self.count_attr, self.head_dim = count_attr, width // heads
        setattr(self, count_attr, heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        heads = getattr(self, self.count_attr)
        q, k, v = (p(x).view(b, t, heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))  # type: ignore[no-any-return]


class _TinyLM(nn.Module):
    def __init__(self, count_attr: str) -> None:
        super().__init__()
        self.emb, self.attn = nn.Embedding(50, 32), _Attention(count_attr)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.head = nn.Linear(32, 50)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        x = x + self.attn(x)
        return self.head(x + self.mlp(x))  # type: ignore[no-any-return]


def test_an_attention_whose_split_does_not_reproduce_it_stays_replicated() -> None:
    torch.manual_seed(0)
    found = derive_plan(_TinyLM("num_heads"), 2)  # its head count found: split, and checked on the sample
    assert {k: v for k, v in found.styles.items() if k.startswith("attn.")} == {
        "attn.q": "colwise",
        "attn.k": "colwise",
        "attn.v": "colwise",
        "attn.o": "rowwise",
    }
    assert any("num_heads 4->2" in n for n in found.notes), found.notes
    missed = derive_plan(_TinyLM("nh"), 2)  # a count the rule cannot see: the rank's slice would be wrong
    assert not any(k.startswith("attn.") for k in missed.styles), missed.text()
    assert "attn: no split of its projections reproduced its output on the sample; replicated" in missed.notes
    for plan in (found, missed):  # the MLP (inside an nn.Sequential), the embedding and the head still split
        assert {k: plan.styles[k] for k in ("mlp.0", "mlp.2", "emb", "head")} == {
            "mlp.0": "colwise",
            "mlp.2": "rowwise",
            "emb": "vocab",
            "head": "vocab",
        }


def test_dtrain_plan_shows_the_tp_plan(capsys: pytest.CaptureFixture[str]) -> None:
    from dtrain.planning.cli import main

    args = ["--model", "hf:gpt2", "--dataset", "pytext", "--seq-len", "16", "--tp", "2", "--sequence-parallel"]
    shape = ["n_layer=2", "n_embd=64", "n_head=4", "n_positions=32"]
    assert main(["--show-tp-plan", *args, *(x for a in shape for x in ("--model-arg", a))]) == 0
    out = capsys.readouterr().out
    assert "hf:gpt2 over 2 tensor-parallel ranks with sequence parallelism" in out, out
    rows = {tuple(line.split()) for line in out.splitlines()}
    for row in [
        ("transformer.h.*.attn.c_attn", "colwise:3"),
        ("transformer.h.*.mlp.c_proj", "rowwise"),
        ("transformer.h.0", "sequence"),
        ("transformer.ln_f", "gather_end"),
        ("lm_head", "vocab"),
    ]:
        assert row in rows, (row, out)
    assert "config.n_head 4->2" in out and "split_size 64->32" in out, out
    assert main(["--show-tp-plan", "--model", "gpt-tiny", "--dataset", "pytext"]) == 0  # dtrain's own: written
    assert "tensor-parallel plan gpt:" in capsys.readouterr().out
