"""dtrain sweep on a Ray cluster over 4 emulated hosts (root): the trials spread over the hosts, and a host whose
Ray node dies mid-sweep has its trial resumed from its checkpoint on another host.

Real network namespaces, a real Ray node in each (``ray start``), real runs; in the default suite (root), about
a minute and a half."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _patience import patient

from dtrain.cluster import down, load, up
from dtrain.search.raycluster import stop_host

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
pytestmark = [
    pytest.mark.procs,
    pytest.mark.skipif(not (IS_ROOT and shutil.which("ip")), reason="needs root and iproute2: network namespaces"),
]


def _segments(out: Path) -> dict[str, list[dict]]:
    found = {}
    for f in (out / "trials").glob("*/trial.json"):
        try:
            found[f.parent.name] = json.loads(f.read_text())["segments"]
        except (OSError, ValueError, KeyError):
            continue
    return found


@pytest.mark.slow  # minutes of the default suite on 2 cores; CI runs the slow tier
@pytest.mark.timeout(600)
def test_trials_spread_over_the_hosts_and_a_lost_hosts_trial_resumes_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"sw{os.getpid() % 10000}"
    monkeypatch.setenv("DTRAIN_CLUSTER_DIR", str(tmp_path / "state"))
    up(name, hosts=4, bandwidth="1gbit")
    try:
        c = load(name)
        run, space, out = tmp_path / "run.toml", tmp_path / "space.toml", tmp_path / "sweep"
        run.write_text("workers = 1\nepochs = 4\ntrace = false\neval_every = 11\n")  # 88 steps
        space.write_text('[sweep.space]\nlr = "loguniform(1e-3, 1e-1)"\n')
        sweep = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dtrain.cli",
                "sweep",
                str(run),
                "--space",
                str(space),
                "--trials",
                "4",
                "--concurrent",
                "4",
                "--max-failures",
                "2",
                "--cluster",
                name,
                "--out",
                str(out),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            deadline, victim, host = time.monotonic() + patient(300), None, 0
            while victim is None and time.monotonic() < deadline and sweep.poll() is None:
                segs = _segments(out)
                on = {s[0].get("node"): t for t, s in segs.items() if s}
                if len(on) == 4:  # every trial on its own host
                    # the victim: a trial on a worker host past its first evaluation (and checkpoint) and still
                    # running, the least advanced (a trial of 88 steps may end before the last one starts)
                    running = [
                        (len(segs[t][-1]["evals"]), h, t)
                        for h in range(1, 4)
                        if (t := on.get(c.address(h))) and segs[t][-1].get("evals") and "fate" not in segs[t][-1]
                    ]
                    if running:
                        _, host, victim = min(running)
                time.sleep(0.5)
            assert victim is not None, f"no trial on a worker host to stop: {_segments(out)}"
            stop_host(c, host)  # the host's Ray node and its trial's processes, at once
            text, _ = sweep.communicate(timeout=patient(480))
        finally:
            if sweep.poll() is None:
                sweep.kill()
                sweep.wait()
        assert sweep.returncode == 0, text[-4000:]
        doc = json.loads((out / "sweep.json").read_text())
        assert [t["fate"] for t in doc["trials"]] == ["finished"] * 4, doc["trials"]
        segs = _segments(out)[victim]
        assert segs[0]["node"] == c.address(host) and segs[-1]["node"] != c.address(host)
        later = segs[-1]
        assert later["from"]["trial"] == victim and later["from"]["step"] >= 11  # its own last checkpoint
        assert later["evals"][-1]["step"] == 88
    finally:
        down(name)
