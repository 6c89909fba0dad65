"""Consistency models of the parameter server, as objects that need no process.

A policy answers the two questions of a parameter server (DESIGN.md, principle 3):
*may the server apply now?* and *may this worker go on (pull)?* It is driven by
three events -- a worker's ``pull`` (its first read), ``push`` (a gradient
arrives) and ``leave`` (the worker finished or was lost) -- and answers each with a
list of actions:

* :class:`Apply` -- average these buffered gradients and take one optimizer step
  (the update creates parameter version ``version + 1``);
* :class:`Drop` -- discard a gradient that came too late (backup workers);
* :class:`Release` -- send this worker the current parameters; it may go on.

Every action has a short text form (``apply[w0c1,w1c1]@0``, ``drop w2c1@1``,
``release w0@1``) and :func:`run_script` plays a text script of events, so the
schedules are printed and checked in tests without threads or sockets;
:func:`simulate` drives a policy with made-up compute times (a fake clock) to see
waits, drops and staleness.

Vocabulary. A worker's *clock* is the number of gradients it has pushed (its
first gradient has clock 1). A *version* is the number of updates the server has
applied. A gradient's *staleness* is the number of updates applied between the
read of the parameters it was computed on and its own application
(``version - read``; Zhang et al. 2016), and its *clock lag* is how many clocks the
worker was ahead of the slowest active worker when it read those parameters
(what SSP bounds; Ho et al. 2013).

The policies (Ben-Nun & Hoefler 2018, sec. 7.1 give the taxonomy):

===============  ==========================================================  =====================
spec             rule                                                        source
===============  ==========================================================  =====================
``bsp``          apply the average of all active workers' gradients once    Valiant 1990 (BSP)
                 per step; release everyone after it
``asp``          apply every gradient on arrival; release the pusher at     Dean et al. 2012
                 once; nobody waits for anybody                             (Downpour), Recht
                                                                            et al. 2011 (Hogwild)
``ssp:s``        apply on arrival; a worker at clock c is released only     Ho et al. 2013
                 when the slowest active worker's clock is >= c - s
``softsync:k``   apply the average of every k arrivals; release the         Zhang et al. 2016
                 pusher at once                                             (n-softsync)
``backup:b``     with N + b workers, apply the first N gradients of each    Chen et al. 2016
                 step; drop the b that arrive after the step closed
===============  ==========================================================  =====================

:class:`StalenessAwareLR` wraps any of them and scales each update's learning
rate by ``1 / staleness`` (Zhang et al. 2016, "Staleness-aware Async-SGD").
"""

from __future__ import annotations

import abc
import heapq
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from dtrain.errors import ConfigError

__all__ = [
    "Arrival",
    "Apply",
    "Drop",
    "Release",
    "Action",
    "PolicyViolation",
    "Policy",
    "BSP",
    "ASP",
    "SSP",
    "SoftSync",
    "Backup",
    "StalenessAwareLR",
    "ConsistencySpec",
    "POLICIES",
    "parse_consistency",
    "run_script",
    "simulate",
    "SimResult",
]


# ---------------------------------------------------------------------- actions


@dataclass(frozen=True)
class Arrival:
    """One gradient as the server sees it.

    Attributes:
        worker: the worker's id (its rank).
        clock: the worker's clock after this push (1 for its first gradient).
        read: the parameter version the gradient was computed on.
    """

    worker: int
    clock: int
    read: int

    def __str__(self) -> str:
        return f"w{self.worker}c{self.clock}"


@dataclass(frozen=True)
class Apply:
    """Average ``arrivals`` and take one optimizer step, turning ``version`` into ``version + 1``.

    Attributes:
        arrivals: the gradients to average (in arrival order).
        version: the parameter version the update is applied to.
        lr_scale: multiply the learning rate by this for this update (staleness-aware LR).
    """

    arrivals: tuple[Arrival, ...]
    version: int
    lr_scale: float = 1.0

    @property
    def staleness(self) -> tuple[int, ...]:
        """Updates applied between each gradient's read and this update."""
        return tuple(self.version - a.read for a in self.arrivals)

    def __str__(self) -> str:
        s = f"apply[{','.join(map(str, self.arrivals))}]@{self.version}"
        return s if self.lr_scale == 1.0 else f"{s}x{self.lr_scale:.3g}"


@dataclass(frozen=True)
class Drop:
    """Discard ``arrival``: its step closed at an earlier version (backup workers)."""

    arrival: Arrival
    version: int

    def __str__(self) -> str:
        return f"drop {self.arrival}@{self.version}"


@dataclass(frozen=True)
class Release:
    """Send ``worker`` the parameters of ``version``; it may compute its next gradient.

    Attributes:
        worker: who is released.
        version: the parameter version it will read.
        clock_lag: its clock minus the slowest active worker's clock at this moment.
    """

    worker: int
    version: int
    clock_lag: int = 0

    def __str__(self) -> str:
        return f"release w{self.worker}@{self.version}" + (f" lag{self.clock_lag}" if self.clock_lag else "")


Action = Apply | Drop | Release


class PolicyViolation(ValueError):
    """An event that the protocol does not allow (the server rejects the message)."""


# ---------------------------------------------------------------------- base


class Policy(abc.ABC):
    """State machine of one server's consistency model.

    Subclasses implement :meth:`_on_push` and may extend :meth:`_on_leave`. The
    base class keeps the clock table and checks every event against the
    protocol, raising :class:`PolicyViolation` (never changing state) for a push
    from a worker that is not active, that has not been released since its last
    push, or that claims a clock or a read version the server did not give it.

    Attributes:
        name: the registry name ("bsp", ...).
        tolerates_loss: whether training may go on without a lost worker.
        active: workers that have neither finished nor been lost.
        clock: pushes received per worker (the clock table).
        version: updates applied so far.
        waiting: workers that pushed (or asked to pull) and were not released yet.
        last_read: the version each worker was last released with.
    """

    name: ClassVar[str] = "abstract"
    tolerates_loss: ClassVar[bool] = True

    def __init__(self) -> None:
        self.active: set[int] = set()
        self.clock: dict[int, int] = {}
        self.version = 0
        self.waiting: set[int] = set()
        self.last_read: dict[int, int] = {}
        self.buffer: list[Arrival] = []
        self.workers: tuple[int, ...] = ()

    # ------------------------------------------------------------------ set-up

    def start(self, workers: Iterable[int]) -> Policy:
        """Reset the state for a new run with these worker ids; returns ``self``."""
        ws = tuple(sorted(set(workers)))
        if not ws:
            raise ConfigError("a parameter server needs at least one worker")
        self.workers = ws
        self.active = set(ws)
        self.clock = {w: 0 for w in ws}
        self.version = 0
        self.waiting = set()
        self.last_read = {}
        self.buffer = []
        self._check_workers(len(ws))
        return self

    def _check_workers(self, n: int) -> None:
        """Raise :class:`ConfigError` when the policy cannot run with ``n`` workers."""

    # ------------------------------------------------------------------ events

    def pull(self, worker: int) -> list[Action]:
        """A worker's first read. It is released at once with the current version."""
        self._check_active(worker, "pull")
        if worker in self.last_read or worker in self.waiting:
            raise PolicyViolation(f"worker {worker} asked for its first pull twice")
        self.waiting.add(worker)
        return [self._release(worker)]

    def push(self, worker: int, clock: int, read: int) -> list[Action]:
        """A gradient from ``worker`` with the worker's new ``clock``, computed on version ``read``."""
        self._check_active(worker, "push")
        if worker in self.waiting:
            raise PolicyViolation(f"worker {worker} pushed again before it was released")
        if worker not in self.last_read:
            raise PolicyViolation(f"worker {worker} pushed before its first pull")
        if clock != self.clock[worker] + 1:
            raise PolicyViolation(f"worker {worker} sent clock {clock}, expected {self.clock[worker] + 1}")
        if read != self.last_read[worker]:
            raise PolicyViolation(
                f"worker {worker} claims to have read version {read}, but was sent version {self.last_read[worker]}"
            )
        self.clock[worker] = clock
        self.waiting.add(worker)
        return self._on_push(Arrival(worker, clock, read))

    def leave(self, worker: int, *, lost: bool = False) -> list[Action]:
        """``worker`` finished (``lost=False``) or was lost; the others may now go on."""
        if worker not in self.active:
            raise PolicyViolation(f"worker {worker} left twice or was never part of the run")
        if not lost and worker in self.waiting:
            raise PolicyViolation(f"worker {worker} finished while waiting for a reply")
        self.active.discard(worker)
        self.waiting.discard(worker)
        return self._on_leave(worker, lost)

    # ------------------------------------------------------------------ queries

    def min_clock(self) -> int | None:
        """The slowest active worker's clock (``None`` when no worker is active)."""
        return min((self.clock[w] for w in self.active), default=None)

    def may_proceed(self, worker: int) -> bool:
        """Whether a waiting ``worker`` would be released by the current state."""
        return worker not in self.waiting

    # ------------------------------------------------------------------ helpers

    @abc.abstractmethod
    def _on_push(self, a: Arrival) -> list[Action]: ...

    def _on_leave(self, worker: int, lost: bool) -> list[Action]:
        return []

    def _check_active(self, worker: int, what: str) -> None:
        if worker not in self.clock:
            raise PolicyViolation(f"{what} from unknown worker {worker} (workers: {list(self.workers)})")
        if worker not in self.active:
            raise PolicyViolation(f"{what} from worker {worker}, which has already left")

    def _release(self, worker: int) -> Release:
        m = self.min_clock()
        self.waiting.discard(worker)
        self.last_read[worker] = self.version
        return Release(worker, self.version, self.clock[worker] - m if m is not None else 0)

    def _apply(self, arrivals: Sequence[Arrival]) -> Apply:
        act = Apply(tuple(arrivals), self.version)
        self.version += 1
        return act

    def spec(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec()!r})"


# ---------------------------------------------------------------------- policies


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


# ---------------------------------------------------------------------- registry and specs

#: name -> (policy class, whether it takes an integer argument). The CLI's --consistency reads it.
POLICIES: dict[str, tuple[Callable[..., Policy], bool]] = {
    "bsp": (BSP, False),
    "asp": (ASP, False),
    "ssp": (SSP, True),
    "softsync": (SoftSync, True),
    "backup": (Backup, True),
}


@dataclass(frozen=True)
class ConsistencySpec:
    """A parsed consistency model: ``kind`` with its integer argument, and staleness-aware LR.

    Attributes:
        kind: a key of :data:`POLICIES`.
        arg: its argument (ssp's bound, softsync's k, backup's b; 0 for bsp/asp).
        staleness_lr: wrap the policy in :class:`StalenessAwareLR`.
    """

    kind: str
    arg: int = 0
    staleness_lr: bool = False

    def __post_init__(self) -> None:
        if self.kind not in POLICIES:
            raise ConfigError(
                f"unknown consistency {self.kind!r}; choose one of: bsp, asp, ssp:S, softsync:K, backup:B"
            )
        if self.staleness_lr and self.kind == "bsp":
            raise ConfigError("staleness_lr needs an asynchronous policy (asp, ssp:S, softsync:K, backup:B), not bsp")
        self.build()  # argument checks live in the policies' constructors

    @property
    def synchronous(self) -> bool:
        return self.kind == "bsp"

    def check_workers(self, workers: int) -> ConsistencySpec:
        """Raise :class:`ConfigError` if the policy cannot run with ``workers`` workers; returns ``self``."""
        self.build().start(range(workers))
        return self

    def build(self) -> Policy:
        """A fresh policy object (one per server)."""
        cls, takes_arg = POLICIES[self.kind]
        p = cls(self.arg) if takes_arg else cls()
        return StalenessAwareLR(p) if self.staleness_lr else p

    def __str__(self) -> str:
        s = f"{self.kind}:{self.arg}" if POLICIES[self.kind][1] else self.kind
        return s + ("+staleness_lr" if self.staleness_lr else "")


def parse_consistency(spec: str | ConsistencySpec, *, staleness_lr: bool = False) -> ConsistencySpec:
    """Parse ``"bsp"``, ``"asp"``, ``"ssp:3"``, ``"softsync:2"`` or ``"backup:1"``.

    Raises:
        ConfigError: (a ``ValueError``) saying what to write instead.
    """
    if isinstance(spec, ConsistencySpec):
        return ConsistencySpec(spec.kind, spec.arg, spec.staleness_lr or staleness_lr)
    if not isinstance(spec, str):
        raise ConfigError(f"consistency must be a string like 'ssp:3', got {type(spec).__name__}")
    m = re.fullmatch(r"\s*([a-z_]+)\s*(?::\s*(-?\d+)\s*)?", spec.lower())
    if not m:
        raise ConfigError(f"cannot read consistency {spec!r}; write bsp, asp, ssp:S, softsync:K or backup:B")
    kind, arg = m.group(1), m.group(2)
    if kind not in POLICIES:
        raise ConfigError(f"unknown consistency {kind!r}; choose one of: bsp, asp, ssp:S, softsync:K, backup:B")
    takes_arg = POLICIES[kind][1]
    if takes_arg and arg is None:
        raise ConfigError(f"{kind} needs an integer argument, e.g. {kind}:{1 if kind == 'backup' else 2}")
    if not takes_arg and arg is not None:
        raise ConfigError(f"{kind} takes no argument; write {kind!r}")
    return ConsistencySpec(kind, int(arg) if arg is not None else 0, staleness_lr)


# ---------------------------------------------------------------------- scripts and simulation


def run_script(policy: Policy, script: str, workers: Sequence[int] | None = None) -> list[str]:
    """Play a text script of events and return the actions, one line per event.

    Events are separated by ``;`` or newlines: ``wN pull``, ``wN push`` (the clock
    and read version are the ones the protocol expects), ``wN finish`` and
    ``wN lost``. Each output line is ``"<event> -> <actions>"``. Workers default to
    those named in the script.
    """
    events = [e.strip() for e in re.split(r"[;\n]", script) if e.strip()]
    parsed = []
    for e in events:
        m = re.fullmatch(r"w(\d+)\s+(pull|push|finish|lost)", e)
        if not m:
            raise ValueError(f"cannot read event {e!r}; write e.g. 'w0 push'")
        parsed.append((int(m.group(1)), m.group(2)))
    policy.start(workers if workers is not None else sorted({w for w, _ in parsed}))
    out = []
    for w, kind in parsed:
        if kind == "pull":
            acts = policy.pull(w)
        elif kind == "push":
            acts = policy.push(w, policy.clock[w] + 1, policy.last_read.get(w, -1))
        else:
            acts = policy.leave(w, lost=kind == "lost")
        out.append(f"w{w} {kind} -> " + (", ".join(map(str, acts)) if acts else "-"))
    return out


@dataclass
class SimResult:
    """What :func:`simulate` saw.

    Attributes:
        actions: every action in order, with the fake time it happened.
        gradients: gradients computed per worker.
        time: fake time when the last worker stopped.
        wait: fake time each worker spent waiting for a release.
    """

    actions: list[tuple[float, Action]] = field(default_factory=list)
    gradients: dict[int, int] = field(default_factory=dict)
    time: float = 0.0
    wait: dict[int, float] = field(default_factory=dict)

    @property
    def applies(self) -> list[Apply]:
        return [a for _, a in self.actions if isinstance(a, Apply)]

    @property
    def drops(self) -> list[Drop]:
        return [a for _, a in self.actions if isinstance(a, Drop)]

    @property
    def releases(self) -> list[Release]:
        return [a for _, a in self.actions if isinstance(a, Release)]


def simulate(
    policy: Policy,
    compute: Callable[[int, int], float],
    workers: Sequence[int],
    steps: int,
) -> SimResult:
    """Drive ``policy`` with fake compute times: each worker pushes ``steps`` gradients.

    A discrete-event loop on a fake clock: a released worker computes for
    ``compute(worker, clock)`` time units, then pushes; it finishes after its
    ``steps``-th release. Ties are broken by worker id, so runs are reproducible.

    Args:
        policy: the policy (restarted here).
        compute: fake compute time of ``worker``'s gradient number ``clock + 1``.
        workers: worker ids.
        steps: gradients each worker computes.
    """
    policy.start(workers)
    res = SimResult(gradients={w: 0 for w in workers}, wait={w: 0.0 for w in workers})
    events: list[tuple[float, int]] = []  # (time a push arrives, worker)
    waiting_since: dict[int, float] = {}
    done: set[int] = set()

    def handle(now: float, acts: list[Action]) -> None:
        for act in acts:
            res.actions.append((now, act))
            if isinstance(act, Release):
                w = act.worker
                res.wait[w] += now - waiting_since.pop(w, now)
                if res.gradients[w] >= steps:
                    done.add(w)
                    handle(now, policy.leave(w))
                else:
                    heapq.heappush(events, (now + compute(w, policy.clock[w]), w))

    for w in workers:
        waiting_since[w] = 0.0
        handle(0.0, policy.pull(w))
    while events:
        now, w = heapq.heappop(events)
        res.gradients[w] += 1
        waiting_since[w] = now
        res.time = now
        handle(now, policy.push(w, policy.clock[w] + 1, policy.last_read[w]))
    if len(done) != len(workers):  # pragma: no cover - a policy bug
        raise RuntimeError(f"simulation stalled: workers {sorted(set(workers) - done)} never finished")
    return res
