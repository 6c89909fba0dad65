"""Test-suite set-up: the helpers' folder on the path, private folders for what tests write, and the quick tier.

Nothing a test does lands outside its temporary folders: before any test runs, the session points the
user's folders -- ``HOME``, ``XDG_CACHE_HOME`` and ``XDG_CONFIG_HOME``, ``MPLCONFIGDIR`` (matplotlib's
font cache), ``DTRAIN_CACHE`` (this machine's calibration, which ``dtrain run --strategy auto`` makes
while the suite keeps every core busy: a user's later ``dtrain plan`` must not reuse it) -- at one fresh
temporary folder, removed at the end. Every process a test starts inherits them (the pytest-xdist
workers too: they start after this module is imported in the controller, and reuse its folder).

``pytest --quick`` (``bash scripts/test.sh --quick``) runs the tests that start no process: unit tests and
threaded ones, for the edit-test loop. A test that starts a process (``subprocess``, ``multiprocessing``,
a launch) carries the ``procs`` mark, given with the test or its module; under ``--quick`` such a test is
left out, and a test without the mark that starts a process anyway fails, naming what it started, so a
forgotten mark shows up at once instead of slowing the quick tier down.

``DTRAIN_TEST_PATIENCE=N`` (tests/_patience.py) multiplies each test's timeout by N, for a slower machine.
"""

from __future__ import annotations

import atexit
import multiprocessing.process
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

# tests import helpers as `from _dist import ...`
sys.path.insert(0, os.path.dirname(__file__))

from _patience import PATIENCE  # noqa: E402  (the folder is on the path from the line above)

# the variables pointed into the session's folder, each at its own sub-folder
PRIVATE = {
    "HOME": "home",
    "XDG_CACHE_HOME": "home/.cache",
    "XDG_CONFIG_HOME": "home/.config",
    "MPLCONFIGDIR": "matplotlib",
    "DTRAIN_CACHE": "dtrain-cache",
}


def _private_folders() -> None:
    """Point :data:`PRIVATE`'s variables at one temporary folder (made once: a worker inherits the controller's)."""
    base = os.environ.get("DTRAIN_TEST_FOLDER")
    if not base:
        base = tempfile.mkdtemp(prefix="dtrain-tests-")
        os.environ["DTRAIN_TEST_FOLDER"] = base
        atexit.register(shutil.rmtree, base, True)
    for var, sub in PRIVATE.items():
        os.environ[var] = os.path.join(base, sub)
        os.makedirs(os.environ[var], exist_ok=True)


_private_folders()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--quick",
        action="store_true",
        help="only the tests that start no process (no 'procs' mark); one that does fails",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "procs: starts processes (left out by --quick)")


# the modules that take longest (serial seconds, summed over their tests, on the 2-core machine: calibration
# 63, stalls 46, ...); they run first, so that in two pytest processes (``-n 2 --dist loadfile``) neither
# process is left with one of them at the end while the other idles. Order only: every test runs as before.
FIRST = (
    "test_perfmodel_calibrate.py",
    "test_faults_stall.py",
    "test_allreduce.py",
    "test_allreduce_dist.py",
    "test_faults_restart.py",
    "test_sharded_run.py",
    "test_cluster.py",
    "test_parallel_checkpoint.py",
    "test_compress_reduce.py",
    "test_sharded_dist.py",
    "test_precision_run.py",
    "test_data_parallel_dist.py",
    "test_noise_scale_run.py",
    "test_attribution.py",
    "test_param_server_threads.py",
    "test_faults_signals.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # stable: the rest keep their order
    if PATIENCE != 1.0:
        _scale_timeouts(config, items)
    if not config.getoption("--quick"):
        return
    keep = [i for i in items if i.get_closest_marker("procs") is None]
    config.hook.pytest_deselected(items=[i for i in items if i.get_closest_marker("procs") is not None])
    items[:] = keep


def _scale_timeouts(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test's pytest-timeout limit (its mark's, or the ini's) times :data:`_patience.PATIENCE`."""
    default = float(config.getini("timeout") or 0)
    for item in items:
        limit: object = default
        mark = item.get_closest_marker("timeout")
        if mark is not None:  # @pytest.mark.timeout(S) or (timeout=S)
            limit = mark.args[0] if mark.args else mark.kwargs.get("timeout", default)
        if limit:
            item.add_marker(pytest.mark.timeout(float(limit) * PATIENCE), append=False)  # now the closest mark


class ProcessStarted(AssertionError):
    """A test run by ``--quick`` started a process: it needs the ``procs`` mark."""


def _refuse(what: str) -> Any:
    def stop(*args: Any, **kwargs: Any) -> Any:
        test = os.environ.get("PYTEST_CURRENT_TEST", "a test").split(" ")[0]
        raise ProcessStarted(f"{test} starts a process ({what}) in its body or a fixture: mark it @pytest.mark.procs")

    return stop


@pytest.fixture(scope="session", autouse=True)
def _no_process_under_quick(request: pytest.FixtureRequest) -> Iterator[None]:
    """Under ``--quick``, starting a process raises :class:`ProcessStarted`, in fixtures of any scope too."""
    if not request.config.getoption("--quick"):
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess.Popen, "_execute_child", _refuse("subprocess"))
        mp.setattr(multiprocessing.process.BaseProcess, "start", _refuse("multiprocessing"))
        mp.setattr(os, "fork", _refuse("os.fork"))
        yield
