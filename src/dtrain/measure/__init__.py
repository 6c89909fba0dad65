"""Benchmarks run as ``dtrain bench NAME``: each module here has ``main(argv) -> int``.

They launch local workers, discard warm-up runs, report medians, print the
torch version and world size, and show the peer (the backend's own collective,
DDP, ...) in the same table as a ratio.
"""

from __future__ import annotations

__all__: list[str] = []
