"""A calibration records the load it was made under, and reusing one made under load says so or redoes it
(dtrain.planning.load, ``[calibrated]`` in the cluster TOML, dtrain.planning.calibrate.local_cluster); and the
test session keeps what it writes out of the user's folders (tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dtrain.perfmodel.spec import ClusterSpec, Device, Load, dump_cluster, load_cluster, this_host
from dtrain.planning import calibrate
from dtrain.planning.load import cpu_jiffies, load_around, others_cores

STAT = """cpu  100 5 50 1000 20 3 2 0 0 0
cpu0 50 2 25 500 10 2 1 0 0 0
cpu1 50 3 25 500 10 1 1 0 0 0
intr 12345
"""


def test_cpu_jiffies_reads_busy_total_and_cores_from_proc_stat() -> None:
    busy, total, cores = cpu_jiffies(STAT)
    assert (busy, total, cores) == (100 + 5 + 50 + 3 + 2, 1180, 2)
    with pytest.raises(ValueError, match="no 'cpu' line"):
        cpu_jiffies("intr 1\n")


def test_others_cores_counts_what_other_processes_take(tmp_path: Path) -> None:
    """Over a window in which the machine's two cores are busy 3/4 of the time and this process sleeps, the
    others took 1.5 cores; from the real /proc/stat, a number between 0 and the cores."""
    stat = tmp_path / "stat"
    snapshots = iter([STAT, STAT.replace("cpu  100 5 50 1000", "cpu  250 5 50 1050")])

    class Stat:
        def read_text(self) -> str:
            return next(snapshots)

    got = others_cores(0.01, stat=Stat())  # type: ignore[arg-type]
    # 150 busy ticks of 200 on 2 cores, less this process's own (a few ticks at most while it slept)
    assert got is not None and 1.4 <= got <= 1.5
    assert others_cores(0.01, stat=stat) is None  # no such file: nothing known
    if Path("/proc/stat").exists():
        real = others_cores(0.2)
        assert real is not None and 0 <= real <= os.cpu_count()  # type: ignore[operator]


def test_load_around_measures_before_and_after_and_keeps_the_busier(monkeypatch: pytest.MonkeyPatch) -> None:
    if not Path("/proc/stat").exists():
        pytest.skip("needs /proc/stat (Linux)")
    readings = iter([0.1, 0.9])
    monkeypatch.setattr("dtrain.planning.load.others_cores", lambda seconds: next(readings))
    out, load = load_around(lambda: "done")
    assert out == "done" and load is not None and load.others_cores == 0.9 and load.loaded
    assert load.cores == cpu_jiffies(Path("/proc/stat").read_text())[2]


def test_the_load_goes_into_the_cluster_toml_and_back(tmp_path: Path) -> None:
    spec = ClusterSpec(nodes=1, devices_per_node=2, load=Load(others_cores=1.25, loadavg=2.5, cores=2))
    path = tmp_path / "c.toml"
    path.write_text(dump_cluster(spec))
    assert "[calibrated]" in path.read_text() and load_cluster(path).load == spec.load
    path.write_text(dump_cluster(ClusterSpec(nodes=1)))
    assert load_cluster(path).load is None  # written by hand: not known
    path.write_text(dump_cluster(spec) + "\n[calibrated]\nbusy = 1\n")
    with pytest.raises(Exception, match="calibrated"):
        load_cluster(path)


def _cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, others: float) -> Path:
    monkeypatch.setenv("DTRAIN_CACHE", str(tmp_path))
    monkeypatch.setattr(calibrate, "_now_loaded", [])
    path = tmp_path / f"local-{this_host()}-w2.toml"
    old = ClusterSpec(
        nodes=1,
        devices_per_node=2,
        device=Device(compute_scale=3.0),
        name="old",
        load=Load(others_cores=others, loadavg=others, cores=2),
    )
    path.write_text(dump_cluster(old))
    fresh = ClusterSpec(
        nodes=1,
        devices_per_node=2,
        device=Device(compute_scale=1.5),
        name="fresh",
        load=Load(others_cores=0.0, loadavg=0.1, cores=2),
    )
    monkeypatch.setattr(calibrate, "calibrate_local", lambda w, progress=False: fresh)
    return path


def test_a_calibration_made_under_load_is_made_again_on_a_quiet_machine(tmp_path, monkeypatch, capsys) -> None:
    path = _cached(tmp_path, monkeypatch, others=1.4)
    monkeypatch.setattr(calibrate, "others_cores", lambda seconds: 0.05)
    got = calibrate.local_cluster(2)
    assert got.name == "fresh" and "quiet now (0.05 cores busy): calibrating again" in capsys.readouterr().err
    assert load_cluster(path).name == "fresh"  # the cache holds the new one


def test_a_calibration_made_under_load_is_reused_with_a_note_while_the_machine_is_busy(
    tmp_path, monkeypatch, capsys
) -> None:
    path = _cached(tmp_path, monkeypatch, others=1.4)
    monkeypatch.setattr(calibrate, "others_cores", lambda seconds: 1.2)
    got = calibrate.local_cluster(2)
    err = capsys.readouterr().err
    assert got.name == "old" and "other processes kept 1.40 of 2 cores busy" in err and "now 1.20" in err
    assert load_cluster(path).name == "old"


def test_a_quiet_calibration_is_reused_without_measuring_the_load(tmp_path, monkeypatch, capsys) -> None:
    _cached(tmp_path, monkeypatch, others=0.1)

    def refuse(seconds: float) -> float:
        raise AssertionError("measured the load for a calibration made on a quiet machine")

    monkeypatch.setattr(calibrate, "others_cores", refuse)
    assert calibrate.local_cluster(2).name == "old" and capsys.readouterr().err == ""


@pytest.mark.procs
def test_the_session_keeps_the_users_folders_out_of_reach() -> None:
    """tests/conftest.py points the cache, the home folder and matplotlib's folder at the session's own temporary
    folder, and a process a test starts inherits them."""
    base = os.environ["DTRAIN_TEST_FOLDER"]
    code = "import pathlib; from dtrain.planning.calibrate import cache_dir; print(cache_dir(), pathlib.Path.home())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    cache, home = out.stdout.split()
    assert cache.startswith(base) and home.startswith(base)
    assert os.environ["MPLCONFIGDIR"].startswith(base) and os.environ["XDG_CACHE_HOME"].startswith(base)
