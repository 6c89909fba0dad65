"""Signals during `dtrain run`: real runs in their own session, hard timeouts.

- Ctrl-C (SIGINT to the process group): exit 130 within seconds, one line naming the step, the last
  complete checkpoint and the command that resumes from it (which works); no process left behind.
- SIGKILL of a dp worker: exit 2 within about a second, naming the rank and the signal; the error is
  the last thing on stderr (no "leaked semaphore" warnings from multiprocessing's resource tracker).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _helpers import dtrain_cli, read_summary
from _procs import processes, workers_of

from dtrain.checkpoint import MARKER, find_checkpoint
from dtrain.config.schema import RunConfig
from dtrain.job.run import _interrupted_message

LONG_RUN = ("run", "--workers", "2", "--epochs", "200", "--no-progress")
RESUME_LINE = re.compile(
    r"^dtrain: interrupted \(SIGINT\) at step (\d+); last complete checkpoint: step (\d+); "
    r"resume with: (dtrain run \S+ --resume \S+ --out \S+)$"
)


def _start(*args: str) -> subprocess.Popen[str]:
    """``dtrain ARGS`` in a new session (its own process group, as a terminal's foreground job is)."""
    return subprocess.Popen(
        [sys.executable, "-m", "dtrain.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _session(sid: int) -> list[tuple[int, str]]:
    """``(pid, command)`` of the live (not zombie) processes of session ``sid``, oldest first."""
    return [(pid, cmd) for _, pid, _, session, cmd in sorted(processes()) if session == sid]


def _wait_running(p: subprocess.Popen[str], out: Path, *, checkpoint: bool, timeout: float = 120) -> None:
    """Until both ranks have reported a step (and, with ``checkpoint``, a checkpoint is complete)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert p.poll() is None, f"the run ended early (exit {p.returncode}): {p.communicate()[1][-2000:]}"
        rows = [f for f in out.glob("metrics.rank*.jsonl") if f.stat().st_size > 0]
        ckpt = list(out.glob(f"checkpoints/step_*/{MARKER}"))
        if len(rows) == 2 and (ckpt or not checkpoint):
            return
        time.sleep(0.1)
    p.kill()
    pytest.fail(f"the run did not start within {timeout}s")


def _finish(p: subprocess.Popen[str], sent: float) -> tuple[float, str, str]:
    """Wait for the launcher: (seconds from the signal to its exit, stdout, stderr); all its processes gone."""
    try:
        p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        pytest.fail("the launcher did not exit within 60 s of the signal")
    took = time.monotonic() - sent
    stdout, stderr = p.communicate(timeout=30)  # returns once every holder of the pipes (the tracker too) is gone
    deadline = time.monotonic() + 10
    while _session(p.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _session(p.pid), f"left behind: {_session(p.pid)}"
    return took, stdout, stderr


@pytest.mark.procs
@pytest.mark.timeout(180)
def test_ctrl_c_says_where_to_resume_and_exits_130(tmp_path):
    out = tmp_path / "run"
    p = _start(*LONG_RUN, "--checkpoint-every", "1", "--out", str(out))
    _wait_running(p, out, checkpoint=True)
    time.sleep(0.5)  # a checkpoint every step: the signal often lands inside a save
    sent = time.monotonic()
    os.killpg(p.pid, signal.SIGINT)
    took, stdout, stderr = _finish(p, sent)
    assert p.returncode == 130, stderr[-3000:]
    assert took < 10, f"exit {took:.1f}s after Ctrl-C"
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and (m := RESUME_LINE.match(lines[0])), stderr[-3000:]
    assert "Traceback" not in stdout
    step, saved, command = int(m.group(1)), int(m.group(2)), shlex.split(m.group(3))

    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert step == max(max(r["step"] for r in rows) + 1, saved)  # steps completed, as checkpoints count
    ckpt = find_checkpoint(out)
    assert command[2:6] == [str(out / "config.toml"), "--resume", str(ckpt), "--out"], command
    assert ckpt.name == f"step_{saved:06d}"
    for d in out.glob("checkpoints/step_*"):  # a folder under a step name is a whole checkpoint (.tmp-*: cut short)
        assert {f.name for f in d.iterdir()} == {MARKER, ".metadata", "__0_0.distcp", "__1_0.distcp"}, d

    resumed = dtrain_cli(*command[1:], "--max-steps", str(saved + 3), "--no-progress", timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = read_summary(Path(command[-1]))
    assert summary["start_step"] == saved and summary["steps"] == 3


@pytest.mark.procs
@pytest.mark.timeout(180)
def test_sigkill_of_a_dp_worker_is_the_last_line(tmp_path):
    out = tmp_path / "run"
    p = _start(*LONG_RUN, "--out", str(out))
    _wait_running(p, out, checkpoint=False)
    workers = workers_of(p.pid)  # by start: rank 0, rank 1
    assert len(workers) == 2, _session(p.pid)
    sent = time.monotonic()
    os.kill(workers[1], signal.SIGKILL)
    took, _, stderr = _finish(p, sent)
    assert p.returncode == 2, stderr[-3000:]
    assert took < 15, f"exit {took:.1f}s after the SIGKILL"  # ~1 s idle; a missed death: the 300 s timeout
    lines = stderr.strip().splitlines()
    assert lines[-2:] == ["dtrain: error: worker processes failed:", lines[-1]], stderr[-3000:]
    assert lines[-1].startswith("  rank 1: killed by signal 9"), stderr[-3000:]
    assert "leaked semaphore" not in stderr and "resource_tracker" not in stderr, stderr[-3000:]


def test_interrupted_message_takes_only_complete_checkpoints(tmp_path):
    """A save cut short (a ``.tmp-*`` folder, a step folder without its marker) is never offered."""
    out = tmp_path / "run"
    (out / "checkpoints" / "step_000004").mkdir(parents=True)
    (out / "checkpoints" / "step_000004" / MARKER).write_text(json.dumps({"step": 4, "world_size": 2}))
    (out / "checkpoints" / ".tmp-step_000008").mkdir()
    (out / "checkpoints" / "step_000006").mkdir()
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "rank": 0}) + "\n" for s in (1, 8, 9)))
    cfg = RunConfig(out=str(out))
    msg = _interrupted_message(cfg, out, signal.SIGINT)
    assert msg == (
        f"interrupted (SIGINT) at step 10; last complete checkpoint: step 4; resume with: "
        f"dtrain run {out / 'config.toml'} --resume {out / 'checkpoints' / 'step_000004'} "
        f"--out {tmp_path / 'run-resumed'}"
    )
    (tmp_path / "run-resumed").mkdir()  # taken: the next free name
    assert _interrupted_message(cfg, out, signal.SIGINT).endswith(f"--out {tmp_path / 'run-resumed-2'}")
    (out / "metrics.jsonl").unlink()
    msg = _interrupted_message(cfg, tmp_path / "empty", signal.SIGTERM)
    assert (
        msg == "interrupted (SIGTERM) before the first step; no checkpoint to resume from "
        "(--checkpoint-every N saves some)"
    )
