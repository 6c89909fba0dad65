"""What every ``dtrain`` command does with a dtrain error: one line on stderr, exit status 2."""

from __future__ import annotations

import sys
from collections.abc import Callable

from dtrain.errors import DTrainError

__all__ = ["run_command"]


def run_command(prog: str, body: Callable[[], int], *, also: tuple[type[Exception], ...] = ()) -> int:
    """``body()``'s exit status; a :class:`DTrainError` (or one of ``also``) becomes
    ``"PROG: error: MESSAGE"`` on stderr and status 2 instead of a traceback."""
    caught: tuple[type[Exception], ...] = (DTrainError, *also)
    try:
        return body()
    except caught as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
