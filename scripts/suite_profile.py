"""Where a test run's time goes: run pytest (arguments passed on) with every Python process it starts
recording itself (``scripts/suite_profile/sitecustomize.py``), then print the table.

    python scripts/suite_profile.py -q -p no:cacheprovider --durations=0      # the whole default suite

Columns: processes started as new interpreters (each imports torch: its seconds from creation until torch was
loaded are start-up) and as forks; CPU seconds of all of them; seconds spent in ``time.sleep``
(polling and waits); the suite's wall time. Processes killed by SIGKILL leave no line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="suite-profile-") as d:
        path = [str(HERE / "suite_profile"), os.environ.get("PYTHONPATH", "")]
        env = dict(os.environ, DTRAIN_SUITE_PROFILE=d, PYTHONPATH=os.pathsep.join(filter(None, path)))
        t0 = time.monotonic()
        rc = subprocess.call([sys.executable, "-m", "pytest", *argv], env=env)
        wall = time.monotonic() - t0
        rows = [json.loads(line) for f in Path(d).glob("*.jsonl") for line in f.read_text().splitlines()]
    print(summarize(rows, wall))
    return rc


def summarize(rows: list[dict[str, object]], wall: float) -> str:
    execs = [r for r in rows if r["how"] == "exec"]
    forks = [r for r in rows if r["how"] == "fork"]
    with_torch = [r for r in execs if isinstance(r["torch_import_s"], float) and r["torch_import_s"] >= 0]
    startup = sum(float(r["torch_import_s"]) for r in with_torch)  # type: ignore[arg-type]
    cpu = sum(float(r["cpu_s"]) for r in rows)  # type: ignore[arg-type]
    pytest_rows = [r for r in execs if "pytest" in str(r["argv"])]
    slept_pytest = sum(float(r["slept_s"]) for r in pytest_rows)  # type: ignore[arg-type]
    slept = sum(float(r["slept_s"]) for r in rows)  # type: ignore[arg-type]
    cli = [r for r in execs if "dtrain/cli.py" in str(r["argv"]) or "dtrain.cli" in str(r["argv"])]
    lines = [
        f"suite wall time                                   {wall:8.1f} s",
        f"processes started as new interpreters             {len(execs):8d}  (dtrain CLI: {len(cli)})",
        f"  of them importing torch                         {len(with_torch):8d}",
        f"  their seconds from creation to torch loaded     {startup:8.1f} s  (process-seconds)",
        f"processes forked                                  {len(forks):8d}",
        f"CPU seconds of every recorded process             {cpu:8.1f} s  (2 cores: {cpu / 2:.1f} s of wall at best)",
        f"seconds in time.sleep, the test process           {slept_pytest:8.1f} s",
        f"seconds in time.sleep, every process              {slept:8.1f} s  (process-seconds)",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
