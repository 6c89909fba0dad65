"""A user's model by its ``--model`` spec (``FILE.py:FN``, ``MODULE:FN``, ``hf:TYPE``, ``hf:DIR``), its arguments,
its outputs, the checks made before any process starts, and ``dtrain.run``'s functions: in one process.
The runs of these models under each strategy are in tests/test_user_models_run.py."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from _helpers import dtrain_cli
from _user_files import RESIDUAL_CNN
from torch import nn

from dtrain.config.files import dump_toml, load_toml, parse_model_args, parse_toml_value
from dtrain.config.schema import RunConfig
from dtrain.errors import ConfigError
from dtrain.job.api import function_spec
from dtrain.job.validate import validate
from dtrain.workloads.models import logits_of, make_model, task_loss
from dtrain.workloads.models.specs import build_spec, parameter_count

USER_FILE = (
    RESIDUAL_CNN
    + """

def with_sample(width=8):
    return build(width), torch.randn(4, 1, 8, 8)


def tupled():
    class T(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = build()

        def forward(self, x):
            return self.net(x), x.mean()
    return T()


def not_a_module():
    return 3


def raises(width=1):
    raise RuntimeError("the user's own error")


def huge():
    return nn.Linear(200_000, 200_000)


def vector_loss(output, target):
    return torch.nn.functional.cross_entropy(output, target, reduction="none")


def reads_values(width=8):
    n = width + int(torch.zeros(1).item())  # .item() has no value on the meta device
    return build(n)


def few_classes():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 4))
"""
)


@pytest.fixture
def user_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_model.py"
    path.write_text(USER_FILE)
    return path


def _cfg(**kw: object) -> RunConfig:
    return RunConfig.make(epochs=1, workers=2, progress=False, **kw)


def test_a_function_gets_its_arguments_and_may_return_a_sample(user_file: Path) -> None:
    model, sample = build_spec(
        f"{user_file}:build", {"width": 4, "blocks": 3}, task="classify", input_shape=(1, 8, 8), num_classes=10
    )
    assert sample is None
    assert model[0].out_channels == 4 and len(model) == 1 + 3 + 3  # stem, 3 blocks, pool, flatten, head
    model, sample = build_spec(f"{user_file}:with_sample", {}, task="classify", input_shape=(1, 8, 8), num_classes=10)
    assert isinstance(sample, torch.Tensor) and sample.shape == (4, 1, 8, 8)
    # MODULE:FN finds an importable module's function
    model, _ = build_spec(
        "torch.nn:Linear", {"in_features": 3, "out_features": 2}, task="classify", input_shape=(3,), num_classes=2
    )
    assert isinstance(model, nn.Linear) and model.weight.shape == (2, 3)


def test_outputs_are_read_as_a_tensor_a_tuples_first_item_or_logits() -> None:
    x, y = torch.randn(5, 3), torch.tensor([0, 1, 2, 0, 1])

    class Out:
        logits = x

    want = nn.functional.cross_entropy(x, y)
    for out in (x, (x, torch.zeros(())), [x], Out()):
        assert torch.equal(logits_of(out), x)
        assert torch.equal(task_loss(out, y), want)
    with pytest.raises(TypeError, match="--loss MODULE:FN"):
        logits_of({"scores": x})


def test_meta_count_equals_the_built_model_and_counts_a_tied_tensor_once() -> None:
    pytest.importorskip("transformers")
    args = {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 32}
    data = {"task": "lm", "input_shape": (16,), "num_classes": 257, "seq_len": 16}
    n = parameter_count("hf:gpt2", args, **data)
    model, _ = build_spec("hf:gpt2", args, **data)
    assert n == sum(p.numel() for p in model.parameters())
    assert model.lm_head.weight is model.transformer.wte.weight  # tied: one tensor, counted once
    assert n < sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert model.config.vocab_size == 257 and model.config.use_cache is False  # the data's vocabulary
    # a llama's derived fields follow the arguments (head_dim from the width and the heads)
    llama, _ = build_spec(
        "hf:llama",
        {
            "num_hidden_layers": 1,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
        **data,
    )
    assert llama.config.head_dim == 16 and llama(torch.randint(0, 257, (2, 16))).logits.shape == (2, 16, 257)


def test_hf_dir_loads_its_config_and_weights(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    data = {"task": "lm", "input_shape": (16,), "num_classes": 256, "seq_len": 16}
    torch.manual_seed(0)
    model, _ = build_spec("hf:gpt2", {"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 16}, **data)
    model.save_pretrained(tmp_path / "ckpt")
    torch.manual_seed(1)  # another seed: the weights must come from the folder, not from the initialisation
    again, _ = build_spec(f"hf:{tmp_path / 'ckpt'}", {}, **data)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    bigger, _ = build_spec(f"hf:{tmp_path / 'ckpt'}", {"n_layer": 2}, **data)  # arguments override the folder
    assert bigger.config.n_layer == 2


@pytest.mark.parametrize(
    "spec, args, message",
    [
        ("nofile.py:build", {}, "model file 'nofile.py' does not exist"),
        ("{file}:nothere", {}, "has no function 'nothere'"),
        ("{file}:not_a_module", {}, "returned a int, not an nn.Module"),
        ("{file}:raises", {}, "raised RuntimeError: the user's own error"),
        ("{file}:build", {"depth": 3}, "unknown model argument(s) depth; build takes blocks, width"),
        ("no_such_module_here:fn", {}, "model module 'no_such_module_here' cannot be imported"),
        ("hf:no-such-architecture", {}, "neither a transformers model type"),
        ("hf:gpt2", {"nlayer": 2}, "unknown model argument(s) nlayer for GPT2Config"),
    ],
)
def test_a_bad_model_spec_is_one_line_naming_it(user_file: Path, spec: str, args: dict, message: str) -> None:
    if spec.startswith("hf:"):
        pytest.importorskip("transformers")
    with pytest.raises(ConfigError) as e:
        build_spec(spec.format(file=user_file), args, task="classify", input_shape=(1, 8, 8), num_classes=10)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_validate_checks_the_model_against_the_data(user_file: Path) -> None:
    validate(_cfg(model=f"{user_file}:build", model_args={"width": 4}))  # a good one passes
    validate(_cfg(model=f"{user_file}:tupled"))  # a tuple's first item is the logits
    validate(_cfg(model=f"{user_file}:build", strategy="pipeline"))  # an nn.Sequential: cut between its children
    cases = [
        ({"model": f"{user_file}:huge"}, "40,000,200,000 parameters (counted on the meta device)"),
        ({"model": f"{user_file}:few_classes"}, "gives 4 logits a position, and the dataset has labels up to 9"),
        ({"model": f"{user_file}:build", "dataset": "pytext"}, "cannot take the dataset's samples"),
        ({"model": f"{user_file}:build", "loss": f"{user_file}:vector_loss"}, "returned (2,), not a scalar"),
        ({"model": f"{user_file}:build", "loss": f"{user_file}:missing"}, "loss "),
        ({"model": f"{user_file}:build", "layers": 2}, "--layers shape(s) dtrain's gpt models"),
        ({"model": f"{user_file}:tupled", "strategy": "pipeline"}, "model T has no list of repeated blocks"),
        ({"model": f"{user_file}:build", "strategy": "tensor"}, "the plan splits nothing of model"),
    ]
    for kw, message in cases:
        with pytest.raises(ConfigError) as e:
            validate(_cfg(**kw))
        assert message in str(e.value), (kw, str(e.value))


def test_hf_llama_at_its_default_size_is_refused_with_its_count_before_anything_is_allocated() -> None:
    pytest.importorskip("transformers")
    with pytest.raises(ConfigError, match=r"hf:llama has 6,4\d\d,\d{3},\d{3} parameters"):
        validate(_cfg(model="hf:llama", dataset="pytext"))


def test_model_args_from_flags_and_toml_round_trip(tmp_path: Path) -> None:
    assert parse_model_args(["n_layer=2", "p=0.1", "tie=true", 'act="gelu"', "act2=gelu", "sizes=[1, 2]"]) == {
        "n_layer": 2,
        "p": 0.1,
        "tie": True,
        "act": "gelu",
        "act2": "gelu",
        "sizes": [1, 2],
    }
    assert parse_toml_value('{type = "linear", factor = 2.0}') == {"type": "linear", "factor": 2.0}
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_model_args(["n_layer"])
    cfg = _cfg(
        model="hf:gpt2",
        dataset="pytext",
        model_args={"n_layer": 2, "rope": {"type": "linear", "factor": 2.0}, "act": "gelu_new"},
    )
    (tmp_path / "c.toml").write_text(dump_toml(cfg))
    again = RunConfig.from_mapping(load_toml(tmp_path / "c.toml"))
    assert again.model_args == cfg.model_args and again.model == "hf:gpt2"
    with pytest.raises(ConfigError, match=r"\[model_args\] must be a table"):
        RunConfig.make(model_args=3)


def test_function_spec_names_an_importable_function(user_file: Path) -> None:
    assert function_spec(make_model) == "dtrain.workloads.models:make_model"

    def local() -> None:
        return None

    with pytest.raises(ConfigError, match="not a top-level function"):
        function_spec(local)
    with pytest.raises(ConfigError, match="not a top-level function"):
        function_spec(lambda: None)


@pytest.mark.procs
def test_bad_input_from_the_command_line_exits_2_with_one_line_and_no_run_folder(
    tmp_path: Path, user_file: Path
) -> None:
    out = tmp_path / "run"
    for args, message in [
        (["--model", f"{user_file}:raises"], "raised RuntimeError: the user's own error"),
        (["--model", f"{user_file}:build", "--model-arg", "depth=3"], "unknown model argument(s) depth"),
        (["--model", "nofile.py:build"], "model file 'nofile.py' does not exist"),
    ]:
        p = dtrain_cli("run", *args, "--epochs", "1", "--workers", "2", "--no-progress", "--out", str(out))
        assert p.returncode == 2, p.stderr[-2000:]
        assert message in p.stderr and p.stderr.strip().count("\n") == 0, p.stderr
        assert not out.exists()  # nothing but the error: no run folder


def test_a_missing_transformers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'dtrain\[hf\]'"):
        build_spec("hf:gpt2", {}, task="lm", input_shape=(8,), num_classes=256)


def test_readme_forms_are_in_the_model_flag_help() -> None:
    text = textwrap.dedent(RunConfig.__dataclass_fields__["model"].metadata["help"])
    for form in ("FILE.py:FN", "MODULE:FN", "hf:TYPE", "hf:DIR"):
        assert form in text


def test_a_model_argument_is_a_sweep_key(user_file: Path) -> None:
    from dtrain.search.space import parse_space
    from dtrain.search.trial import trial_config

    base = _cfg(model=f"{user_file}:build", model_args={"width": 4, "blocks": 1})
    space = parse_space(
        {"blocks": "randint(1, 3)", "model_args.width": "choice([4, 8])", "lr": "uniform(0.01, 0.1)"}, base
    )
    assert sorted(space) == ["lr", "model_args.blocks", "model_args.width"]
    cfg = trial_config(base.to_dict(), {"model_args.blocks": 2, "model_args.width": 8, "lr": 0.02})
    assert cfg.model_args == {"width": 8, "blocks": 2} and cfg.lr == 0.02
    with pytest.raises(ConfigError, match="unknown model argument"):  # a trial whose argument the model lacks
        trial_config(base.to_dict(), {"model_args.depth": 2})
    with pytest.raises(ConfigError, match="not a key of this run's configuration"):  # not given by the base run
        parse_space({"depth": "randint(1, 3)"}, base)


def test_a_function_that_reads_tensor_values_is_not_counted_on_meta_but_still_checked(user_file: Path) -> None:
    data = {"task": "classify", "input_shape": (1, 8, 8), "num_classes": 10}
    assert parameter_count(f"{user_file}:reads_values", {}, **data) is None
    assert parameter_count(f"{user_file}:build", {}, **data) == sum(
        p.numel() for p in build_spec(f"{user_file}:build", {}, **data)[0].parameters()
    )
    validate(_cfg(model=f"{user_file}:reads_values"))  # built for real and run once instead
    with pytest.raises(ConfigError, match="unknown model argument"):  # what the user gave is still refused
        parameter_count(f"{user_file}:reads_values", {"depth": 1}, **data)
