"""``dtrain run``'s command line: the grouped help, a strategy's help, and options under their old names."""

from __future__ import annotations

import dataclasses

import pytest

from dtrain.cli import build_parser, config_from_args, main, run_help
from dtrain.config.files import dump_toml, load_toml
from dtrain.config.schema import RunConfig
from dtrain.errors import ConfigError
from dtrain.registry import registered


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        main(["run", *argv])
    assert e.value.code == 0
    return capsys.readouterr().out


def _flags(text: str) -> set[str]:
    return {w.strip(",") for w in text.split() if w.startswith("--")}


def test_run_help_is_grouped_and_under_80_lines(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    out = _help(capsys, "--help")
    lines = out.splitlines()
    assert len(lines) < 90, out  # a screen and a bit: one line a shared option
    assert max(map(len, lines)) <= 80, out
    titles = ["what to train:", "how to distribute it:", "the run itself:", "strategy options", "several machines"]
    at = [next(i for i, line in enumerate(lines) if line.startswith(t)) for t in titles]
    assert at == sorted(at), at  # the shared options first, then the strategies, then the nodes
    # every shared option on a line of its own, in its group, with (the start of) its help
    for f in RunConfig.shared_fields():
        flag = "--" + f.name.replace("_", "-")
        flag = flag.replace("--", "--[no-]") if isinstance(f.default, bool) else flag
        (line,) = [x for x in lines[: at[3]] if x.split()[:1] == [flag]]
        assert f.metadata["help"].split()[0] in line, line
    # a line per strategy naming its flags: every option of every strategy is there to be found
    section = lines[at[3] : at[4]]
    for name, entry in registered().items():
        start = next(i for i, line in enumerate(section) if line.split()[:1] == [name])
        rest = [line for line in section[start + 1 :]]
        block = " ".join([section[start], *rest[: next((i for i, x in enumerate(rest) if x[2:3] != " "), len(rest))]])
        for f in dataclasses.fields(entry.options):
            if "table" in f.metadata:  # a TOML table of the strategy's: named as one
                assert f"[{name}.{f.name}]" in block, (name, f.name, block)
            elif "renamed_to" not in f.metadata:
                assert f"--{f.name.replace('_', '-')}" in block.replace("--[no-]", "--"), (name, f.name, block)
    assert "--recompute" in out and "--checkpoint " not in out and "--checkpoint\n" not in out
    assert {"--nnodes", "--node-rank", "--rdzv-endpoint", "--iface"} <= _flags("\n".join(lines[at[4] :]))


def test_run_help_for_a_strategy_shows_the_shared_options_and_its_own(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # each flag's help on one line
    out = _help(capsys, "--strategy", "pipeline", "--help")
    flags = _flags(out)
    assert {"--microbatches", "--schedule", "--chunks", "--balance", "--recompute"} <= flags
    assert {"--model", "--workers", "--checkpoint-every", "--resume", "--nnodes"} <= flags
    assert not {"--servers", "--consistency", "--topology", "--dp", "--compression", "--checkpoint"} & flags
    assert "pipeline options (TOML: a [pipeline] table)" in out
    # each with its full help (as the field has it: help written once), % signs and all
    assert "always, except_last (every micro-batch's but the last's) or never (default: never)" in out
    assert "90% train / 10% validation" in out
    # --help wherever it stands; a CONFIG naming a strategy does what --strategy does, and the flag wins
    assert _help(capsys, "--help", "--strategy", "pipeline") == out
    cfg = tmp_path / "ps.toml"
    cfg.write_text('strategy = "ps"\n[ps]\nservers = 2\n', encoding="utf-8")
    ps = _flags(_help(capsys, str(cfg), "--help"))
    assert {"--servers", "--consistency", "--model"} <= ps and "--recompute" not in ps
    assert _help(capsys, str(cfg), "--strategy", "pipeline", "-h") == out
    assert _help(capsys, str(tmp_path / "missing.toml"), "--help") == run_help()


def test_the_help_of_every_shared_field_is_written_beside_it():
    for f in RunConfig.shared_fields():
        assert f.metadata.get("help"), f"RunConfig.{f.name} has no help metadata"


def test_every_flag_of_every_strategy_is_still_parsed():
    """The help shows one strategy at a time; the parser takes every strategy's flags (a flag of another
    strategy is refused by the configuration, naming the strategy it belongs to)."""
    cfg = config_from_args(build_parser().parse_args(["run", "--strategy", "pipeline", "--recompute", "always"]))
    assert cfg.options.recompute == "always"
    with pytest.raises(ConfigError, match="belongs to strategy ps"):
        config_from_args(build_parser().parse_args(["run", "--strategy", "pipeline", "--consistency", "asp"]))
    cfg = config_from_args(build_parser().parse_args(["run", "--strategy", "hybrid", "--schedule", "gpipe"]))
    assert cfg.options.schedule == "gpipe"


def test_a_config_written_with_the_old_name_of_recompute_still_loads(tmp_path):
    """``recompute`` was ``checkpoint`` (activation recomputation, beside ``--checkpoint-every``): a TOML file
    written before, its strategy table or a flat key, loads with the value moved to ``recompute``."""
    old = tmp_path / "old.toml"
    old.write_text(
        'strategy = "pipeline"\nworkers = 2\n\n[pipeline]\nmicrobatches = 4\ncheckpoint = "except_last"\n',
        encoding="utf-8",
    )
    cfg = RunConfig.from_mapping(load_toml(old))
    assert cfg.options.recompute == "except_last"
    assert cfg == RunConfig.make(strategy="pipeline", workers=2, recompute="except_last")
    assert config_from_args(build_parser().parse_args(["run", str(old)])).options.recompute == "except_last"
    # written back under the new name only
    assert 'recompute = "except_last"' in dump_toml(cfg) and "checkpoint =" not in dump_toml(cfg)
    assert cfg.to_dict()["pipeline"] == {
        "microbatches": 4,
        "schedule": "1f1b",
        "chunks": 2,
        "balance": "equal",
        "recompute": "except_last",
        "split_points": "",
    }
    # a flat key, and the old flag
    assert RunConfig.make(strategy="pipeline", checkpoint="always").options.recompute == "always"
    ns = build_parser().parse_args(["run", "--strategy", "pipeline", "--checkpoint", "always"])
    assert config_from_args(ns).options.recompute == "always"
    # the new flag wins over the file's old name
    ns = build_parser().parse_args(["run", str(old), "--recompute", "never"])
    assert config_from_args(ns).options.recompute == "never"
    # both names with different values in one place: refused, naming both
    with pytest.raises(ConfigError, match="old name of recompute"):
        RunConfig.make(strategy="pipeline", checkpoint="always", recompute="except_last")
    with pytest.raises(ConfigError, match="recompute 'sometimes' is not known"):
        RunConfig.make(strategy="pipeline", checkpoint="sometimes")
