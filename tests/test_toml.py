"""dtrain.config.files.read_toml: the one TOML reader (run configs, cluster files) and its errors."""

import pytest

from dtrain.config.files import read_toml
from dtrain.errors import ConfigError


def test_reads_a_table(tmp_path):
    p = tmp_path / "a.toml"
    p.write_text('workers = 2\n[dp]\nalgorithm = "ring"\n')
    assert read_toml(p, "config file") == {"workers": 2, "dp": {"algorithm": "ring"}}


def test_a_missing_file_is_named_with_the_hint(tmp_path):
    with pytest.raises(ConfigError, match=r"^cluster file '.*nope\.toml' does not exist$"):
        read_toml(tmp_path / "nope.toml", "cluster file")
    with pytest.raises(ConfigError, match=r"does not exist \(run `dtrain bench calibrate`\)$"):
        read_toml(tmp_path / "nope.toml", "cluster file", hint="run `dtrain bench calibrate`")


def test_bad_toml_gives_the_file_and_the_parsers_message(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("workers = \n")
    with pytest.raises(ConfigError, match=r"bad\.toml: not valid TOML: .*line 1"):
        read_toml(p, "config file")
