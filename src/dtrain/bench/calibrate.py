"""``dtrain bench calibrate``: measure a cluster and write its TOML (see :mod:`dtrain.perfmodel.calibrate`)."""

from __future__ import annotations

from dtrain.perfmodel.calibrate import main

__all__ = ["main"]

if __name__ == "__main__":
    import sys

    sys.exit(main())
