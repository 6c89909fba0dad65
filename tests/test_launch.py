"""The launcher goes through torch's elastic agent: real processes, return values, clear failures."""

import os
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

import dtrain
from dtrain.launch.agent import LaunchError, launch, threads_per_worker


def _sum_ranks(x):
    t = torch.tensor([float(dtrain.rank())])
    dist.all_reduce(t)
    return dtrain.rank(), dtrain.world_size(), float(t), x, os.environ["LOCAL_WORLD_SIZE"]


def _fail_on_one():
    if dtrain.rank() == 1:
        raise ValueError("deliberate failure on rank one")
    return 0


def _die_on_zero():
    if dtrain.rank() == 0:
        os._exit(7)
    return 0


def _leave_a_busy_thread():
    a = torch.randn(128, 128)

    def spin():
        while True:
            torch.mm(a, a)  # releases the GIL and takes it back, again and again

    threading.Thread(target=spin, name="dtrain-test-spin", daemon=True).start()
    time.sleep(0.1)
    return dtrain.rank()


def _env_seen(names):
    return {n: os.environ.get(n) for n in names}


@pytest.mark.procs
def test_workers_take_the_launching_process_environment_at_the_launch(monkeypatch):
    """Workers fork from a forkserver that copied the environment when it started; each launch's workers see
    the launching process's environment as it is then (set, changed, removed), the agent's variables on top."""
    monkeypatch.setenv("DTRAIN_TEST_GONE", "before")
    launch(_env_seen, (["DTRAIN_TEST_GONE"],), nprocs=1)  # the forkserver is up, with DTRAIN_TEST_GONE set
    monkeypatch.delenv("DTRAIN_TEST_GONE")
    monkeypatch.setenv("DTRAIN_TEST_NEW", "after")
    monkeypatch.setenv("RANK", "99")  # a stale rank in the parent never reaches a worker
    out = launch(_env_seen, (["DTRAIN_TEST_GONE", "DTRAIN_TEST_NEW", "RANK", "TORCHELASTIC_RESTART_COUNT"],), nprocs=2)
    assert out == {
        r: {"DTRAIN_TEST_GONE": None, "DTRAIN_TEST_NEW": "after", "RANK": str(r), "TORCHELASTIC_RESTART_COUNT": "0"}
        for r in (0, 1)
    }


def _say(words):
    for stream, name in ((sys.stdout, "stdout"), (sys.stderr, "stderr")):  # one write per line: the ranks'
        stream.flush()  # lines may interleave, not their characters
        os.write(stream.fileno(), f"{name} of rank {os.environ['RANK']}: {words}\n".encode())


@pytest.mark.procs
def test_workers_write_to_the_launching_process_stdout_and_stderr_at_the_launch(tmp_path):
    """The forkserver keeps the descriptors 1 and 2 of the process that started it; each launch's workers
    write to the launching process's own, as they are at the launch (redirected since the server started)."""
    launch(_say, ("server up",), nprocs=1)  # the forkserver is up, with this process's descriptors then
    saved = [os.dup(1), os.dup(2)]
    files = [tmp_path / "out", tmp_path / "err"]
    try:
        for fd, path in zip((1, 2), files):
            with path.open("wb") as f:
                os.dup2(f.fileno(), fd)
        launch(_say, ("redirected",), nprocs=2)
    finally:
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)
    out, err = (sorted(path.read_text().splitlines()) for path in files)
    assert out == ["stdout of rank 0: redirected", "stdout of rank 1: redirected"], (out, err)
    assert [line for line in err if line.startswith("stderr of rank")] == [
        "stderr of rank 0: redirected",
        "stderr of rank 1: redirected",
    ], err


@pytest.mark.procs
def test_launch_returns_values_by_rank():
    out = launch(_sum_ranks, ("a",), nprocs=3)
    assert sorted(out) == [0, 1, 2]
    for r, v in out.items():
        assert v == (r, 3, 3.0, "a", "3")


@pytest.mark.procs
def test_failure_names_rank_and_error():
    with pytest.raises(LaunchError) as e:
        launch(_fail_on_one, nprocs=2)
    assert "rank 1" in str(e.value) and "deliberate failure on rank one" in str(e.value)


@pytest.mark.procs
def test_dead_process_is_reported():
    with pytest.raises(LaunchError, match="rank 0"):
        launch(_die_on_zero, nprocs=2)


@pytest.mark.procs
def test_a_thread_inside_torch_at_exit_does_not_kill_the_worker():
    # a daemon thread that comes back from torch while the interpreter finalizes cannot take the GIL:
    # the process dies of SIGABRT after its work (seen: a ps server on the emulated cluster); the
    # launcher ends a worker with dtrain's threads still alive before finalization instead
    assert launch(_leave_a_busy_thread, nprocs=2) == {0: 0, 1: 1}


def test_threads_share_cores():
    cores = len(os.sched_getaffinity(0))
    assert threads_per_worker(1) == cores
    assert threads_per_worker(cores * 4) == 1


def test_world_of_one_without_launcher():
    # no torchrun environment: init is a no-op and the world is one process
    assert "RANK" not in os.environ
    dtrain.init()
    assert (dtrain.rank(), dtrain.world_size()) == (0, 1)
