"""Heartbeats and the run-wide abort flag, through a c10d key-value store.

Why not through the process group: a gloo receive that times out closes the
group's connections, so the data path waits with a very long timeout
and never polls. Instead every rank bumps a counter ``hb/<rank>`` in the store
every ``interval`` seconds; a rank watching a peer declares it lost when the
counter has not moved for ``timeout_s`` (and for at least ``timeout_s / interval``
of the watcher's own checks, so that a stall of the watching process itself is
not mistaken for the peer's death). A rank that hits a fatal error writes the
reason under ``abort`` so that every other rank stops with it instead of waiting.

One :class:`Liveness` per rank; the store is torch's (``TCPStore`` under torchrun,
``HashStore`` in threaded tests).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["Liveness"]

log = logging.getLogger("dtrain.param_server")


class Liveness:
    """Heartbeat of this rank, watch over peers, and the abort flag.

    Args:
        store: a c10d store (``add``, ``set``, ``get``, ``check``).
        prefix: key prefix, the same on every rank of one parameter server.
        rank: this rank.
        timeout_s: a watched peer whose heartbeat has not moved for this long is lost.
        interval_s: seconds between heartbeats (default: a fifth of the timeout, at most 1 s).
        clock: seconds, for the timeout (default: ``time.monotonic``; tests pass a fake one and
            call :meth:`tick` themselves instead of :meth:`start`'s thread).
    """

    def __init__(
        self,
        store: Any,
        prefix: str,
        rank: int,
        timeout_s: float,
        interval_s: float | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.prefix = prefix.rstrip("/")
        self.rank = rank
        self.timeout_s = float(timeout_s)
        self.interval_s = float(interval_s) if interval_s else min(1.0, self.timeout_s / 5)
        # peer -> (last counter, when it moved, this thread's checks since it moved)
        self._watch: dict[int, tuple[int, float, int]] = {}
        # a peer is lost only after this many of our own checks saw no beat, so that a pause
        # of this whole process (a loaded machine) is not taken for the peer's death
        self._min_checks = max(3, math.ceil(self.timeout_s / self.interval_s))
        self._lost: dict[int, str] = {}
        self._abort: str | None = None
        self.store_error: str | None = None
        self._clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    # ------------------------------------------------------------------ control

    def start(self, watch: Iterable[int] = ()) -> None:
        """Beat once, then keep beating and watching ``watch`` in a daemon thread (a :meth:`tick` per interval)."""
        self._beat()
        self.watch(watch)
        self._thread = threading.Thread(target=self._loop, name=f"ps-heartbeat-{self.rank}", daemon=True)
        self._thread.start()

    def watch(self, peers: Iterable[int]) -> None:
        """Watch ``peers`` from now on: each is lost once its heartbeat stops moving for the timeout."""
        now = self._clock()
        with self._lock:
            for p in peers:
                self._watch[p] = (-1, now, 0)

    def unwatch(self, peer: int) -> None:
        """Stop watching ``peer`` (it finished normally)."""
        with self._lock:
            self._watch.pop(peer, None)
            self._lost.pop(peer, None)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval_s + 2.0)

    # ------------------------------------------------------------------ queries

    def lost(self) -> dict[int, str]:
        """Watched peers declared lost, with the reason."""
        with self._lock:
            return dict(self._lost)

    def aborted(self, refresh: bool = True) -> str | None:
        """The abort reason another rank wrote, if any.

        Args:
            refresh: ask the store now (default); else return what the heartbeat
                thread last saw (no round trip).
        """
        if self._abort is None and refresh:
            try:
                if self.store.check([self._key("abort")]):
                    self._abort = self.store.get(self._key("abort")).decode(errors="replace")
            except Exception as e:  # noqa: BLE001 - the store host is gone
                self.store_error = self.store_error or _first_line(e)
        return self._abort

    def abort(self, reason: str) -> None:
        """Tell every rank to stop, with ``reason`` (best effort: the store may be gone)."""
        try:
            if not self.store.check([self._key("abort")]):
                self.store.set(self._key("abort"), reason)
        except Exception:  # noqa: BLE001
            pass

    # ------------------------------------------------------------------ thread

    def _beat(self) -> None:
        self.store.add(self._key(f"hb/{self.rank}"), 1)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            if not self.tick():
                return

    def tick(self) -> bool:
        """One round of the heartbeat thread: beat, check the watched peers, read the abort flag.

        Returns:
            False when the store is unreachable (``store_error`` says why); the thread then stops.
        """
        try:
            self._beat()
            with self._lock:
                peers = list(self._watch)
            now = self._clock()
            for p in peers:
                count = self.store.add(self._key(f"hb/{p}"), 0)
                with self._lock:
                    if p not in self._watch:
                        continue
                    last, since, checks = self._watch[p]
                    if count != last:
                        self._watch[p] = (count, now, 0)
                        continue
                    self._watch[p] = (last, since, checks + 1)
                    if now - since > self.timeout_s and checks + 1 >= self._min_checks and p not in self._lost:
                        self._lost[p] = f"no heartbeat for {now - since:.1f}s (timeout {self.timeout_s:g}s)"
                        log.warning("rank %d: rank %d %s", self.rank, p, self._lost[p])
            if self._abort is None and self.store.check([self._key("abort")]):
                self._abort = self.store.get(self._key("abort")).decode(errors="replace")
        except Exception as e:  # noqa: BLE001 - the store host is gone; the owner decides
            if not self._stop.is_set():
                self.store_error = _first_line(e)
                log.warning(
                    "rank %d: heartbeats stopped, the store is unreachable (%s); "
                    "lost peers are still seen through their closed connections",
                    self.rank,
                    self.store_error,
                )
            return False
        return True


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0][:200] if s else ''}"
