"""How long a wait in a test may last before it counts as a hang, on a machine slower than this one.

Every limit in the suite is written for this 2-core machine at its usual speed (a few times what the wait
takes here). A loaded machine runs the same suite several times slower (CI's once took 1255 s for what
takes 450 s here), and a limit that is a hang guard here fails a healthy run there. ``DTRAIN_TEST_PATIENCE``
(a number, at least 1; .ci/run sets 3) multiplies the hang guards: each test's pytest-timeout limit
(tests/conftest.py) and the waits of the helpers and of the tests on whole runs. Limits that a test asserts
on (a run stops within its --timeout-s) stay as written.
"""

from __future__ import annotations

import os


def _patience() -> float:
    raw = os.environ.get("DTRAIN_TEST_PATIENCE", "").strip()
    if not raw:
        return 1.0
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not value >= 1.0:  # also NaN
        raise ValueError(f"DTRAIN_TEST_PATIENCE={raw!r}: give a number of at least 1 (how many times longer to wait)")
    return value


PATIENCE = _patience()


def patient(seconds: float) -> float:
    """``seconds``, a hang guard written for this machine's usual speed, times :data:`PATIENCE`."""
    return seconds * PATIENCE
