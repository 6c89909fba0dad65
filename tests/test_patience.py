"""DTRAIN_TEST_PATIENCE: the hang guards' multiplier for a slower machine (tests/_patience.py)."""

from __future__ import annotations

import importlib
from collections.abc import Iterator

import _patience
import pytest


@pytest.fixture
def reread(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """Re-reads the variable after ``monkeypatch.setenv``; the starting value comes back after the test."""

    def read(value: str) -> float:
        monkeypatch.setenv("DTRAIN_TEST_PATIENCE", value)
        return importlib.reload(_patience).PATIENCE

    yield read
    monkeypatch.undo()
    importlib.reload(_patience)


def test_a_number_of_at_least_1_multiplies_the_guards(reread) -> None:
    assert reread("") == 1.0
    assert reread("3") == 3.0 and _patience.patient(150) == 450.0
    assert reread(" 1.5 ") == 1.5 and _patience.patient(10) == 15.0


@pytest.mark.parametrize("bad", ["0.5", "0", "-2", "nan", "three"])
def test_anything_else_is_refused_naming_the_variable(reread, bad: str) -> None:
    with pytest.raises(ValueError, match=r"DTRAIN_TEST_PATIENCE=.*at least 1"):
        reread(bad)


@pytest.mark.timeout(7)
def test_this_tests_own_timeout_is_its_mark_times_the_patience(request: pytest.FixtureRequest) -> None:
    """Under .ci/run's DTRAIN_TEST_PATIENCE=3 the limit pytest-timeout reads here is 21 s; without it, 7."""
    mark = request.node.get_closest_marker("timeout")
    assert mark is not None and float(mark.args[0]) == 7 * _patience.PATIENCE


def test_the_scaling_multiplies_a_mark_and_the_ini_default(request: pytest.FixtureRequest) -> None:
    import conftest

    item = request.node
    before = item.get_closest_marker("timeout")
    ini = float(request.config.getini("timeout"))
    limit = float(before.args[0]) if before is not None else ini
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(conftest, "PATIENCE", 2.5)
        conftest._scale_timeouts(request.config, [item])
    assert float(item.get_closest_marker("timeout").args[0]) == limit * 2.5
