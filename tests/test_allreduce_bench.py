"""dtrain bench allreduce: argument handling, and one real run on 2 local workers."""

from __future__ import annotations

import pytest

from dtrain.comm import ALGORITHMS
from dtrain.errors import ConfigError
from dtrain.measure.allreduce import BenchConfig, format_size, main, parse_size
from dtrain.perfmodel.units import parse_bytes


def test_parse_and_format_sizes() -> None:
    # one reading of sizes in all of dtrain: binary prefixes with "i", decimal ones without
    assert parse_size("4KiB") == 4096 and parse_size("4KB") == 4000
    assert parse_size("64kib") == 65536
    assert parse_size("1.5MiB") == 3 << 19 and parse_size("1.5MB") == 1_500_000
    assert parse_size("4096") == 4096
    assert parse_size("2 GiB") == 2 << 30
    assert parse_size("16MiB") == int(parse_bytes("16MiB"))
    for bad in ("", "MB", "4XB", "-"):
        with pytest.raises(ConfigError, match="size"):
            parse_size(bad)
    assert format_size(16 << 20) == "16 MiB"
    assert format_size(4096) == "4 KiB"
    assert format_size(100) == "100 B"


def test_config_errors_say_what_to_change() -> None:
    with pytest.raises(ConfigError, match="--workers"):
        BenchConfig(workers=0)
    with pytest.raises(ConfigError, match="multiples of 4"):
        BenchConfig(sizes=(6,))
    with pytest.raises(ConfigError, match="choose from"):
        BenchConfig(algorithms=("ring", "nope"))
    with pytest.raises(ConfigError, match="window"):
        BenchConfig(window=0)


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--sizes", "3B"]) == 2
    assert main(["--algorithms", "ring,bogus"]) == 2
    assert "bogus" in capsys.readouterr().err


@pytest.mark.procs
def test_two_worker_run_prints_every_algorithm(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--workers", "2", "--sizes", "4KiB,68KiB", "--iters", "2", "--warmup", "1", "--timeout", "60"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "torch 2." in out and "world size 2" in out and "alpha-beta fit" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("4 KiB", "68 KiB"))]
    assert len(rows) == 2 * len(ALGORITHMS)
    assert {r[2] for r in rows} == set(ALGORITHMS)
    for r in rows:
        assert r[-1] == "yes", r  # every result matched native
        assert float(r[3]) > 0  # time_ms
    native = [r for r in rows if r[2] == "native"]
    assert all(float(r[6]) == 1.0 for r in native)  # vs_native of native itself
