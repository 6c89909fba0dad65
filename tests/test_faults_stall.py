"""A stopped worker (SIGSTOP) ends the run within --timeout-s and a few seconds, and the message
names it.

The surviving ranks' collectives time out after --timeout-s; torch's agent then SIGTERMs the
others and waits a fixed 30 s before SIGKILL, which a stopped process never outlives on its own:
the launcher now wakes stopped workers (SIGCONT) once one has failed. Which surviving rank's
message comes first is a race (only the stopped rank's ring neighbour waits on it directly), but
every survivor's message carries the watchdog's verdict from the heartbeats
(dtrain.training.watchdog): the stopped rank, how long it has been silent and its last step.
Also unit tests of that verdict.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _procs import workers_of

from dtrain.training.watchdog import Heartbeat, diagnose, explain

# the survivors' wait: long enough that the stopped rank's heartbeat is stale by then (3.5 s,
# watchdog.STALE_S) while the live ranks', one a second, are not, and that no wait of the steps before the
# stop times out on a loaded machine; the run then ends within it and a few seconds
TIMEOUT_S = 6


def _rank_of(pid: int) -> int:
    """A worker's rank: the metrics.rank<R>.jsonl it holds open."""
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            name = Path(os.readlink(fd)).name
        except OSError:
            continue
        if name.startswith("metrics.rank") and name.endswith(".jsonl"):
            return int(name[len("metrics.rank") : -len(".jsonl")])
    raise AssertionError(f"worker {pid} holds no metrics file open")


def _steps_done(out: Path, ranks: range, steps: int) -> bool:
    files = [out / f"metrics.rank{r}.jsonl" for r in ranks]
    return all(f.is_file() and len(f.read_text().splitlines()) >= steps for f in files)


# 3 processes each (a stopped rank whose next rank lives, so that a verdict naming the wrong one is seen)
STALLS = {  # name: (flags, the training ranks, the rank to stop, words of the last line)
    # whichever survivor reports first (a timeout, or a connection its neighbour closed on exiting),
    # the watchdog's verdict names the stopped rank
    "dp": (["--workers", "3"], range(3), 1, "it did not arrive: rank 1 "),
    # a parameter server's worker: the server's liveness monitor names it (no heartbeat) as a timeout
    "ps": (["--workers", "2", "--strategy", "ps", "--servers", "1"], range(1, 3), 1, "rank 1 "),
    # a middle stage: both neighbours wait on it; whichever reports first, the watchdog names it
    "pipeline": (["--workers", "3", "--strategy", "pipeline"], range(3), 1, "it did not arrive: rank 1 "),
}


@pytest.mark.procs
@pytest.mark.parametrize("name", list(STALLS))
def test_a_stopped_worker_ends_the_run_within_the_timeout_naming_it(tmp_path: Path, name: str) -> None:
    flags, ranks, victim_rank, words = STALLS[name]
    out = tmp_path / "r"
    cmd = [
        sys.executable,
        "-m",
        "dtrain.cli",
        "run",
        *flags,
        "--epochs",
        "200",
        "--timeout-s",
        str(TIMEOUT_S),
        "--no-progress",
        "--no-trace",
        "--out",
        str(out),
    ]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    victim = None
    try:
        deadline = time.monotonic() + 90
        # a few steps in: every rank has written rows (the files exist before the model is wrapped)
        while time.monotonic() < deadline and not _steps_done(out, ranks, 3):
            time.sleep(0.05)
        workers = workers_of(p.pid)
        assert len(workers) == 3, workers
        victim = next(w for w in workers if _rank_of(w) == victim_rank)
        os.kill(victim, signal.SIGSTOP)
        t0 = time.monotonic()
        _, err = p.communicate(timeout=TIMEOUT_S + 40)
        elapsed = time.monotonic() - t0
    finally:
        if victim is not None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(victim, sig)
                except OSError:
                    pass
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
    assert p.returncode != 0
    assert elapsed < TIMEOUT_S + 8, f"{elapsed:.1f} s after SIGSTOP (timeout {TIMEOUT_S} s)\n{err[-2000:]}"
    last = err.strip().splitlines()[-1]
    assert words in last and "at step" in last, err[-2000:]
    if name == "ps" and "serve (bsp)" in last:  # the server: "worker rank 1 was lost (no heartbeat for 6.0s"
        assert f"worker rank {victim_rank} was lost (no heartbeat for " in last, err[-2000:]
        silent = float(last.split("no heartbeat for ")[1].split("s")[0])
    else:
        assert f"did not arrive: rank {victim_rank} (no heartbeat for " in last, err[-2000:]
        silent = float(last.split(f"rank {victim_rank} (no heartbeat for ")[1].split(" s")[0])
    assert TIMEOUT_S - 2 <= silent <= TIMEOUT_S + 8, last  # stopped when the survivors began to wait


def test_the_verdict_names_silent_ranks_else_those_behind():
    beats = {0: (40, 0.2), 1: (40, 0.9), 2: (39, 10.4), 3: (40, 0.1)}
    assert diagnose(beats, me=0) == (
        "watchdog: it did not arrive: rank 2 (no heartbeat for 10.4 s, last at step 39) stopped responding"
    )
    two = diagnose({**beats, 3: (38, 12.0)}, me=1)
    assert "they did not arrive: rank 2 (" in two and "rank 3 (no heartbeat for 12.0 s, last at step 38)" in two
    assert (
        diagnose({0: (5, 0.1), 1: (4, 0.3), 2: (5, 0.2)}, me=0)
        == "watchdog: every rank is alive; behind the others (step 5): rank 1 at step 4"
    )
    assert "every rank is alive and at step 5" in diagnose({0: (5, 0.1), 1: (5, 0.3)}, me=1)
    assert (
        diagnose({0: (5, 30.0)}, me=0) == "watchdog: every rank is alive and at step 5 (a lost message, "
        "or a rank waiting on another group)"
    )  # its own age is not judged
    assert diagnose({}, me=0) == "watchdog: no rank has posted a heartbeat"


def test_heartbeats_go_through_the_store_and_explain_keeps_the_error():
    import datetime

    import torch.distributed as dist

    from dtrain.errors import CommTimeoutError

    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=5))
    beats = [Heartbeat(r, 3, store=store, period_s=0.05).start() for r in range(3)]
    beats[2].stop()  # rank 2 goes silent at step 0
    beats[0].step = beats[1].step = 7
    time.sleep(0.6)
    e = explain(CommTimeoutError(0, "allreduce(ring) recv", "not completed within 10s", peer=1, step=7), beats[0])
    for b in beats:
        b.stop()
    assert isinstance(e, CommTimeoutError) and e.rank == 0 and e.peer == 1 and e.step == 7
    assert str(e).startswith(
        "rank 0: allreduce(ring) recv with rank 1 at step 7: not completed within 10s; "
        "watchdog: it did not arrive: rank 2 (no heartbeat for "
    )
    assert "last at step 0) stopped responding" in str(e)


def test_explain_names_a_stopped_rank_behind_a_closed_connection_and_leaves_other_errors_alone():
    """A survivor whose neighbour timed out first and exited sees a closed connection, not a timeout:
    the verdict still names the stopped rank. With every rank beating, such an error stays as it was."""
    import datetime

    import torch.distributed as dist

    from dtrain.pipeline._channel import PipelineError

    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=5))
    beats = [Heartbeat(r, 3, store=store, period_s=0.05).start() for r in range(3)]
    try:
        time.sleep(0.3)
        closed = PipelineError(
            "rank 0, stage 0, micro-batch 1: receiving the gradient from stage 1 failed: Connection closed by peer"
        )
        assert explain(closed, beats[0]) is closed  # everyone alive: nothing to add
        beats[2].step = 39
        time.sleep(0.1)
        beats[2].stop()  # rank 2 goes silent at step 39
        time.sleep(0.6)
        told = explain(closed, beats[0])
    finally:
        for b in beats:
            b.stop()
    assert isinstance(told, PipelineError) and told is not closed
    assert str(told).startswith(str(closed) + "; watchdog: it did not arrive: rank 2 (no heartbeat for ")
    assert "last at step 39) stopped responding" in str(told)
