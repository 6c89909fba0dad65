"""A server's sends, waited on a thread of their own: :class:`_SendWaiter` takes each flush's works
(:class:`_Sends`) and waits them in order, so the serving thread can ask meanwhile whether a receiver is lost."""

from __future__ import annotations

import queue
import threading

from dtrain.comm.transport import Work
from dtrain.errors import CommError


class _Sends:
    """One flush's sends, waited in order by a :class:`_SendWaiter`."""

    def __init__(self, works: list[tuple[int, Work]]) -> None:
        self.works = works
        self.index = 0
        self.current: int | None = None  # the worker whose send is being waited
        self.errors: list[tuple[int, CommError]] = []
        self.done = threading.Event()
        self._abandoned = False

    def run(self) -> None:
        for i, (w, work) in enumerate(self.works):
            if self._abandoned:
                return
            self.index, self.current = i, w
            try:
                work.wait()
            except CommError as e:
                self.errors.append((w, e))
        self.current = None
        self.done.set()

    def abandon(self) -> list[tuple[int, Work]]:
        """Stop after the send in progress; the sends not yet waited."""
        self._abandoned = True
        return self.works[self.index + 1 :]


class _SendWaiter:
    """A thread that waits sends handed to it (:meth:`start`), one flush after another."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[_Sends | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="ps-send-wait", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (batch := self._q.get()) is not None:
            batch.run()

    def close(self, timeout_s: float = 5.0) -> None:
        """End the thread once it has waited what it was given, and wait for that (``timeout_s`` at most:
        a thread blocked on a peer that stopped stays behind). The thread holds its last batch, whose works
        reach the transport and so the process group: that reference must go now, not on this thread while
        the interpreter finalizes (the group's destructor releases the GIL and cannot take it back: SIGABRT)."""
        self._q.put(None)
        self._thread.join(timeout=timeout_s)

    def start(self, works: list[tuple[int, Work]]) -> _Sends:
        batch = _Sends(works)
        self._q.put(batch)
        return batch
