"""The consistency policies (:mod:`dtrain.param_server.consistency` has their table and sources):
the synchronous ones (:class:`BSP`, :class:`Backup`), the asynchronous ones (:class:`ASP`, :class:`SSP`,
:class:`SoftSync`) and :class:`StalenessAwareLR`, which wraps any asynchronous one.
"""

from __future__ import annotations

from collections.abc import Iterable

from dtrain.errors import ConfigError
from dtrain.param_server._policy_base import Action, Apply, Arrival, Drop, Policy, PolicyViolation

__all__ = ["BSP", "ASP", "SSP", "SoftSync", "Backup", "StalenessAwareLR"]


class BSP(Policy):
    """Bulk-synchronous parallel: one update per step from every active worker's gradient.

    Steps: (1) buffer each arriving gradient; (2) when every active worker has one
    in the buffer, apply their average and release them all. A finished worker no
    longer counts; a lost one stops the run (``tolerates_loss = False``). Equal to
    synchronous SGD on the global batch. Cost per step: the slowest worker's time.
    """

    name = "bsp"
    tolerates_loss = False

    def _on_push(self, a: Arrival) -> list[Action]:
        if a.read != self.version:  # unreachable through the protocol checks
            raise PolicyViolation(f"bsp: worker {a.worker} computed on version {a.read}, current is {self.version}")
        self.buffer.append(a)
        return self._maybe_step()

    def _on_leave(self, worker: int, lost: bool) -> list[Action]:
        return self._maybe_step()

    def _maybe_step(self) -> list[Action]:
        if not self.buffer or not self.active <= {a.worker for a in self.buffer}:
            return []
        batch, self.buffer = self.buffer, []
        acts: list[Action] = [self._apply(batch)]
        acts += [self._release(a.worker) for a in batch if a.worker in self.waiting]
        return acts

    def may_proceed(self, worker: int) -> bool:
        return worker not in self.waiting


class ASP(Policy):
    """Asynchronous parallel (Downpour SGD): apply each gradient on arrival, release at once.

    No worker ever waits for another; a gradient's staleness is the number of
    other workers' updates that landed while it was computed (about W - 1).
    """

    name = "asp"

    def _on_push(self, a: Arrival) -> list[Action]:
        return [self._apply([a]), self._release(a.worker)]


class SSP(Policy):
    """Stale-synchronous parallel with staleness bound ``s`` (Ho et al. 2013).

    Steps: (1) apply each gradient on arrival; (2) release every waiting worker
    whose clock is at most ``s`` ahead of the slowest active worker's clock. A
    worker at clock ``c`` therefore reads only after all active workers reached
    ``c - s``: it blocks exactly when it is ``s + 1`` clocks ahead. ``ssp:0`` waits
    like BSP but applies gradients one by one.

    Args:
        staleness: the bound ``s`` >= 0.
    """

    name = "ssp"

    def __init__(self, staleness: int) -> None:
        super().__init__()
        if staleness < 0:
            raise ConfigError(f"ssp staleness must be >= 0, got {staleness}; e.g. ssp:3")
        self.staleness = staleness

    def spec(self) -> str:
        return f"ssp:{self.staleness}"

    def may_proceed(self, worker: int) -> bool:
        m = self.min_clock()
        return m is None or self.clock[worker] - m <= self.staleness

    def _release_ready(self) -> list[Action]:
        return [self._release(w) for w in sorted(self.waiting) if self.may_proceed(w)]

    def _on_push(self, a: Arrival) -> list[Action]:
        return [self._apply([a]), *self._release_ready()]

    def _on_leave(self, worker: int, lost: bool) -> list[Action]:
        return self._release_ready()


class SoftSync(Policy):
    """n-softsync (Zhang et al. 2016): apply the average of every ``k`` gradients, in arrival order.

    Steps: (1) buffer each arriving gradient and release its worker at once with
    the current parameters; (2) when ``k`` gradients are buffered, apply their
    average. When the last worker leaves, a partial buffer is applied so that no
    gradient is lost. ``softsync:1`` is ASP.

    Args:
        k: gradients per update, >= 1.
    """

    name = "softsync"

    def __init__(self, k: int) -> None:
        super().__init__()
        if k < 1:
            raise ConfigError(f"softsync needs k >= 1 gradients per update, got {k}; e.g. softsync:2")
        self.k = k

    def spec(self) -> str:
        return f"softsync:{self.k}"

    def _on_push(self, a: Arrival) -> list[Action]:
        self.buffer.append(a)
        acts: list[Action] = []
        if len(self.buffer) >= self.k:
            batch, self.buffer = self.buffer, []
            acts.append(self._apply(batch))
        acts.append(self._release(a.worker))
        return acts

    def _on_leave(self, worker: int, lost: bool) -> list[Action]:
        if not self.active and self.buffer:
            batch, self.buffer = self.buffer, []
            return [self._apply(batch)]
        return []


class Backup(Policy):
    """Synchronous SGD with ``b`` backup workers (Chen et al. 2016).

    With ``N + b`` workers, each step applies the average of the first ``N``
    gradients computed on the current version; a gradient that arrives after its
    step closed is dropped and its worker released at once with the new
    parameters. So every step drops ``b`` gradients when all workers compute each
    step, no gradient is ever applied twice, and the ``b`` slowest workers never
    hold a step up. When workers leave, a step needs ``min(N, active)`` gradients.

    Args:
        b: backup workers, >= 0 and fewer than the workers.
    """

    name = "backup"

    def __init__(self, b: int) -> None:
        super().__init__()
        if b < 0:
            raise ConfigError(f"backup needs b >= 0 backup workers, got {b}; e.g. backup:1")
        self.b = b
        self.needed = 0

    def spec(self) -> str:
        return f"backup:{self.b}"

    def _check_workers(self, n: int) -> None:
        if self.b >= n:
            raise ConfigError(
                f"backup:{self.b} needs more than {self.b} workers (it applies the first N = workers - b "
                f"gradients of each step), got {n}; use fewer backups or more workers"
            )
        self.needed = n - self.b

    def _on_push(self, a: Arrival) -> list[Action]:
        if a.read < self.version:
            return [Drop(a, self.version), self._release(a.worker)]
        self.buffer.append(a)
        return self._maybe_step()

    def _on_leave(self, worker: int, lost: bool) -> list[Action]:
        return self._maybe_step()

    def _maybe_step(self) -> list[Action]:
        need = min(self.needed, len(self.active))
        if not self.buffer or len(self.buffer) < need:
            return []
        batch, self.buffer = self.buffer, []
        acts: list[Action] = [self._apply(batch)]
        acts += [self._release(a.worker) for a in batch if a.worker in self.waiting]
        return acts


class StalenessAwareLR(Policy):
    """Wrap a policy and scale each update's learning rate by 1 / staleness (Zhang et al. 2016).

    The wrapped policy decides everything; each :class:`Apply` it returns gets
    ``lr_scale = 1 / mean(max(1, staleness_i))`` over its gradients. For one
    gradient per update (asp, ssp) that is the paper's ``lr / tau``; for an
    averaged update (softsync) the step is scaled by the mean staleness of its
    gradients, which works for any optimizer (it changes the step, not the
    gradient). Staleness 0 and 1 both give the full rate.

    Args:
        inner: the policy to wrap.
    """

    def __init__(self, inner: Policy) -> None:
        if isinstance(inner, BSP):
            raise ConfigError("staleness_lr needs an asynchronous policy (asp, ssp, softsync, backup), not bsp")
        if isinstance(inner, StalenessAwareLR):
            raise ConfigError("staleness_lr is already on")
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]
        self.tolerates_loss = inner.tolerates_loss  # type: ignore[misc]

    # state lives in the inner policy
    def __getattr__(self, item: str):  # type: ignore[no-untyped-def]
        if item == "inner":
            raise AttributeError(item)
        return getattr(self.inner, item)

    def start(self, workers: Iterable[int]) -> Policy:
        self.inner.start(workers)
        return self

    def pull(self, worker: int) -> list[Action]:
        return self.inner.pull(worker)

    def push(self, worker: int, clock: int, read: int) -> list[Action]:
        return [self._scale(a) for a in self.inner.push(worker, clock, read)]

    def leave(self, worker: int, *, lost: bool = False) -> list[Action]:
        return [self._scale(a) for a in self.inner.leave(worker, lost=lost)]

    def min_clock(self) -> int | None:
        return self.inner.min_clock()

    def may_proceed(self, worker: int) -> bool:
        return self.inner.may_proceed(worker)

    def _on_push(self, a: Arrival) -> list[Action]:  # pragma: no cover - inner decides
        raise NotImplementedError

    @staticmethod
    def _scale(act: Action) -> Action:
        if not isinstance(act, Apply):
            return act
        taus = [max(1, t) for t in act.staleness]
        return Apply(act.arrivals, act.version, len(taus) / sum(taus))

    def spec(self) -> str:
        return self.inner.spec() + "+staleness_lr"
