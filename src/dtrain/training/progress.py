"""A run's progress bar: :func:`progress_bar`."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["progress_bar"]


def progress_bar(total: int, show: bool, desc: str) -> Any:
    """A tqdm bar of ``total`` steps named ``desc`` when ``show``, else a no-op one (tqdm's ``disable``)."""
    from tqdm import tqdm

    # on a terminal the bar redraws in place; in a log file (CI, a redirected run) every
    # redraw is a line of its own, so there it updates at most every 30 s
    tty = sys.stderr.isatty()
    return tqdm(
        total=total,
        disable=not show,
        desc=desc,
        unit="step",
        dynamic_ncols=True,
        leave=False,
        mininterval=0.1 if tty else 30.0,
    )
