"""Headless Chromium for the report tests, driven from the command line (no Python dependency).

``load(path)`` opens a local HTML file, lets it run (``--virtual-time-budget``), and returns the DOM
after load (``--dump-dom``) with the page's console lines (``--enable-logging=stderr``: an uncaught
error and every ``console.*`` call come out as ``...:CONSOLE...] "message", source: ...``).
``screenshot(path, png)`` writes a PNG of the page. Debian's package: ``apt-get install chromium``.

    python tests/_browser.py RUN/report.html docs/report.png 1280 2000   # a screenshot by hand
"""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

MISSING = "chromium not installed: apt-get install chromium"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--enable-logging=stderr",
    "--v=0",
)
_CONSOLE = re.compile(r":CONSOLE[^\]]*\]\s*(.*)$")


def chromium() -> str | None:
    """The chromium binary, or None where it is not installed."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    return found or ("/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None)


@dataclass
class Page:
    """A loaded page: its DOM after load, the console lines it logged, the browser's wall seconds."""

    dom: str
    console: list[str]
    wall_s: float

    def attr(self, name: str) -> str | None:
        """The value of the first attribute ``name`` in the DOM (unescaped), or None."""
        m = re.search(rf'\s{re.escape(name)}="([^"]*)"', self.dom)
        return html.unescape(m.group(1)) if m else None


def _run(args: list[str], timeout: float) -> tuple[subprocess.CompletedProcess[str], float]:
    exe = chromium()
    if exe is None:
        raise RuntimeError(MISSING)
    with tempfile.TemporaryDirectory(prefix="dtrain-chromium-") as profile:
        t0 = time.perf_counter()
        done = subprocess.run(
            [exe, *FLAGS, f"--user-data-dir={profile}", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        return done, time.perf_counter() - t0


def load(path: str | Path, *, budget_ms: int = 3000, timeout: float = 60) -> Page:
    """Open ``path`` in headless Chromium and return the DOM after load and the console lines."""
    done, wall = _run([f"--virtual-time-budget={budget_ms}", "--dump-dom", Path(path).resolve().as_uri()], timeout)
    if done.returncode != 0 or "<html" not in done.stdout:
        raise RuntimeError(f"chromium failed ({done.returncode}): {done.stderr[-2000:]}")
    console = [m.group(1) for line in done.stderr.splitlines() if (m := _CONSOLE.search(line))]
    return Page(done.stdout, console, wall)


def screenshot(
    path: str | Path, png: str | Path, *, width: int = 1280, height: int = 2000, timeout: float = 60
) -> float:
    """Write a PNG of ``path`` at ``width`` x ``height`` CSS pixels; returns the browser's wall seconds."""
    out = Path(png).resolve()
    done, wall = _run(
        [f"--screenshot={out}", f"--window-size={width},{height}", "--hide-scrollbars", Path(path).resolve().as_uri()],
        timeout,
    )
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"chromium screenshot failed ({done.returncode}): {done.stderr[-2000:]}")
    return wall


if __name__ == "__main__":
    page, png = sys.argv[1], sys.argv[2]
    size = [int(x) for x in sys.argv[3:5]] or [1280, 2000]
    print(f"{screenshot(page, png, width=size[0], height=size[1]):.2f} s")
