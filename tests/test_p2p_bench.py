"""dtrain bench p2p: argument handling, and one real run of 4 local workers (2 pairs)."""

from __future__ import annotations

import json

import pytest

from dtrain.errors import ConfigError
from dtrain.measure.p2p import P2PConfig, main


def test_config_errors_say_what_to_change() -> None:
    with pytest.raises(ConfigError, match="pairs"):
        P2PConfig(workers=1)
    with pytest.raises(ConfigError, match="multiples of 4"):
        P2PConfig(sizes=(6,))
    with pytest.raises(ConfigError, match="--iters"):
        P2PConfig(iters=0)
    with pytest.raises(ConfigError, match="--timeout"):
        P2PConfig(timeout=0)


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--sizes", "3B"]) == 2
    assert main(["--workers", "1"]) == 2
    assert "pairs" in capsys.readouterr().err


@pytest.mark.procs
def test_four_workers_ping_pong_in_two_pairs(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p2p.json"
    rc = main(
        [
            "--workers",
            "4",
            "--sizes",
            "4B,1KiB,256KiB,16MiB",
            "--iters",
            "3",
            "--warmup",
            "1",
            "--timeout",
            "60",
            "--json",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "world size 4 (2 pair(s) at once)" in text
    assert "fit native" in text and "fit dtrain" in text
    sizes = ("4 B", "1 KiB", "256 KiB", "16 MiB")
    rows = [line.split() for line in text.splitlines() if line.strip().startswith(sizes)]
    assert len(rows) == 4
    res = json.loads(out.read_text())
    for path in ("native", "dtrain"):
        t = res["one_way_s"][path]
        assert len(t) == 4 and all(0 < x < 10 for x in t), t
        # 16 MiB take milliseconds even on loopback (~1 GB/s here); 4 bytes take ~0.1 ms, more under load
        assert t[-1] > t[0], t
