"""Configuration: validation errors say what to change; TOML round-trips; CLI flags mirror fields."""

import dataclasses

import pytest

from dtrain.cli import build_parser, config_from_args
from dtrain.config.files import dump_toml, load_toml
from dtrain.config.schema import RunConfig, parse_straggler
from dtrain.errors import ConfigError
from dtrain.job.validate import validate


def test_defaults_validate():
    validate(RunConfig())


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"algorithm": "bogus"}, ["algorithm 'bogus'", "ring"]),
        ({"strategy": "magic"}, ["strategy", "dp"]),
        ({"model": "resnet"}, ["model", "cnn"]),
        ({"dataset": "imagenet"}, ["dataset", "digits"]),
        ({"workers": 0}, ["workers must be >= 1"]),
        ({"batch_size": 2, "workers": 4}, ["at least workers"]),
        ({"lr": 0.0}, ["lr must be > 0"]),
        ({"momentum": 1.0}, ["momentum"]),
        ({"bucket_mb": -1.0}, ["bucket_mb"]),
        ({"timeout_s": 0.0}, ["timeout_s"]),
        ({"straggler": "x"}, ["RANK:FACTOR"]),
        ({"straggler": "9:2"}, ["outside"]),
        ({"backend": "mystery"}, ["backend"]),
        ({"overlap": "sideways"}, ["overlap", "forward"]),
        ({"strategy": "ps", "consistency": "backup:4", "workers": 4}, ["backup"]),
        ({"strategy": "ps", "consistency": "eventual"}, ["eventual"]),
        ({"lr_schedule": "step"}, ["lr_schedule 'step'", "constant, cosine"]),
        ({"strategy": "ps", "lr_schedule": "cosine", "resume": "runs/x"}, ["--lr-schedule constant"]),
    ],
)
def test_invalid_values_name_the_fix(changes, words):
    with pytest.raises(ConfigError) as e:
        validate(RunConfig.from_mapping(changes))
    for w in words:
        assert w in str(e.value)


def test_unknown_and_mistyped_keys():
    with pytest.raises(ConfigError, match="unknown option.*bucketmb"):
        RunConfig.from_mapping({"bucketmb": 3})
    with pytest.raises(ConfigError, match="workers must be a number"):
        RunConfig.from_mapping({"workers": "four"})
    with pytest.raises(ConfigError, match="must be an integer"):
        RunConfig.from_mapping({"workers": 2.5})
    with pytest.raises(ConfigError, match="true or false"):
        RunConfig.from_mapping({"trace": "yes"})


def test_toml_round_trip(tmp_path):
    cfg = RunConfig.make(workers=2, algorithm="tree", lr=0.1, compression="none", extra={"note": "x"})
    p = tmp_path / "c.toml"
    p.write_text(dump_toml(cfg))
    assert RunConfig.from_mapping(load_toml(p)) == cfg


def test_toml_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_toml(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("workers = = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_toml(bad)


def test_run_table_is_unwrapped(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[run]\nworkers = 2\nepochs = 3\n")
    assert RunConfig.from_mapping(load_toml(p)).workers == 2


def test_cli_overrides_file(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('workers = 2\nalgorithm = "tree"\nepochs = 3\n')
    ns = build_parser().parse_args(["run", str(p), "--algorithm", "ring", "--no-trace"])
    cfg = config_from_args(ns)
    assert (cfg.workers, cfg.options.algorithm, cfg.epochs, cfg.trace) == (2, "ring", 3, False)


def test_every_field_has_a_flag():
    ap = build_parser()
    run = next(a for a in ap._subparsers._group_actions[0].choices.values() if a.prog.endswith("run"))
    dests = {a.dest for a in run._actions}
    from dtrain.config.schema import option_fields

    tables = {n for n, owners in option_fields().items() if "table" in owners[0][1].metadata}  # [tensor.plan]
    assert tables == {"plan"}
    for name in [f.name for f in RunConfig.shared_fields()] + sorted(set(option_fields()) - tables):
        assert name in dests, name
    assert {f.name for f in dataclasses.fields(RunConfig)} - {f.name for f in RunConfig.shared_fields()} == {
        "extra",
        "options",
        "model_args",
    }
    assert "model_arg" in dests  # the table model_args is filled by --model-arg KEY=VALUE, repeated


def test_lr_schedule_flag():
    cfg = config_from_args(build_parser().parse_args(["run", "--lr-schedule", "cosine"]))
    assert cfg.lr_schedule == "cosine" and RunConfig().lr_schedule == "constant"
    with pytest.raises(SystemExit):  # argparse: invalid choice
        build_parser().parse_args(["run", "--lr-schedule", "linear"])


def test_parse_straggler():
    assert parse_straggler("3:4") == (3, 4.0)
    with pytest.raises(ConfigError):
        parse_straggler("3:0.5")


def test_device_cuda_without_a_gpu_is_refused_before_any_process_starts(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError) as e:
        validate(RunConfig.from_mapping({"device": "cuda"}))
    assert "device cuda" in str(e.value) and "no CUDA device" in str(e.value) and "--device cpu" in str(e.value)


# the checks --device cuda makes on a machine with GPUS GPUs (torch's answers replaced: the check is of the
# configuration, made before any process starts; the CUDA runs themselves are tests/test_allreduce_dist.py's
# and tests/test_run.py's device cases, on a machine with a GPU)
@pytest.mark.parametrize(
    "changes, gpus, words",
    [
        ({"device": "tpu"}, 0, ["device 'tpu'", "cpu, cuda"]),
        ({"backend": "nccl"}, 1, ["nccl reduces CUDA tensors", "--device cuda"]),
        ({"device": "cuda", "strategy": "ps"}, 1, ["strategy ps trains on the CPU", "dp or ddp"]),
        (
            {"device": "cuda", "backend": "nccl", "workers": 4},
            1,
            ["one GPU per process", "4 processes on 1 GPU(s)", "--backend gloo"],
        ),
        ({"device": "cuda", "backend": "mpi"}, 1, ["mpi backend carries CPU tensors"]),
        ({"device": "cuda", "compression": "topk:0.01"}, 1, ["without --shard", "topk:0.01"]),
        ({"device": "cuda", "shard": "optimizer"}, 1, ["without --shard", "zero-1"]),
        ({"device": "cuda", "noise_scale": True}, 1, ["noise scale", "--device cpu"]),
    ],
)
def test_device_settings_that_cannot_run_name_the_fix(monkeypatch, changes, gpus, words):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with pytest.raises(ConfigError) as e:
        validate(RunConfig.from_mapping(changes))
    for w in words:
        assert w in str(e.value)


def test_the_backend_follows_the_device(monkeypatch):
    import torch
    import torch.distributed as dist

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert RunConfig().process_backend() == "gloo"  # CPU training, whatever the machine has
    shared = validate(RunConfig.from_mapping({"device": "cuda", "workers": 4, "precision": "fp16"}))
    assert shared.process_backend() == "gloo"  # 4 processes, 1 GPU: gloo through host memory
    own = validate(RunConfig.from_mapping({"device": "cuda", "workers": 1, "strategy": "ddp"}))
    assert own.process_backend() == ("nccl" if dist.is_nccl_available() else "gloo")
    assert RunConfig.from_mapping({"device": "cuda", "backend": "gloo", "workers": 1}).process_backend() == "gloo"


@pytest.mark.parametrize(
    "base, changes",
    [
        ({}, {"lr": 0.5, "workers": 3}),
        ({"strategy": "ps", "servers": 2}, {"consistency": "ssp:2", "out": "x"}),
        ({"strategy": "dp", "algorithm": "tree"}, {"algorithm": "ring", "bucket_mb": 4.0, "batch_size": 96}),
        ({"model_args": {"width": 8}}, {"model_args.width": 16, "model_args.depth": 2}),
        ({"batch_schedule": "0:32,1:64"}, {"epochs": 3}),
        ({"strategy": "ps"}, {"strategy": "gossip", "workers": 4}),
    ],
)
def test_replace_equals_parsing_the_whole_and_checks_only_what_changed(base, changes, monkeypatch):
    """A change of the same strategy's values is checked on its own: the result equals parsing the whole
    configuration again, without parsing it (one parse a process); a new strategy is parsed whole."""
    cfg = RunConfig.make(**base)
    d = cfg.to_dict()
    if changes.get("strategy", cfg.strategy) != cfg.strategy:
        d.pop(cfg.strategy)
    dotted = {k.split(".", 1)[1]: changes[k] for k in changes if k.startswith("model_args.")}
    flat = {k: v for k, v in changes.items() if not k.startswith("model_args.")}
    want = RunConfig.from_mapping({**d, **flat, "model_args": {**cfg.model_args, **dotted}})
    calls = []
    parse = RunConfig.from_mapping.__func__

    def spy(cls, values):
        calls.append(values)
        return parse(cls, values)

    monkeypatch.setattr(RunConfig, "from_mapping", classmethod(spy))
    assert cfg.replace(**changes) == want
    assert len(calls) == (1 if "strategy" in changes else 0)


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"lr": "fast"}, ["option lr must be a number"]),
        ({"servers": 2}, ["option servers belongs to strategy", "ps"]),
        ({"bogus": 1}, ["unknown option(s) bogus"]),
        ({"bucket_mb": "big"}, ["option bucket_mb must be a number"]),
        ({"model_args": 3}, ["[model_args] must be a table"]),
    ],
)
def test_replace_refuses_what_parsing_refuses(changes, words):
    cfg = RunConfig.make(strategy="dp")
    with pytest.raises(ConfigError) as e:
        cfg.replace(**changes)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_a_runs_dataset_is_loaded_once_a_process_and_again_when_its_file_changes(tmp_path, monkeypatch):
    import dtrain.workloads.data as data

    calls = []
    load = data.load_dataset

    def spy(name, **kw):
        calls.append(name)
        return load(name, **kw)

    monkeypatch.setattr(data, "load_dataset", spy)
    text = tmp_path / "notes.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    cfg = RunConfig.make(dataset=str(text), model="mlp", seq_len=16)
    first = cfg.load_data()
    assert cfg.replace(lr=0.5).load_data() is first and calls == [str(text)]  # the same data: not read again
    assert cfg.replace(seq_len=8).load_data() is not first  # read with other values: read again
    text.write_text("another text, of another length. " * 30)
    again = cfg.load_data()
    assert len(calls) == 3 and again.train_size != first.train_size  # the file changed: read again
    digits = RunConfig.make(dataset="digits")
    assert digits.load_data() is digits.replace(workers=3).load_data()
