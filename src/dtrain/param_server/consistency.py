"""Consistency models of the parameter server, as objects that need no process.

A policy answers the two questions of a parameter server:
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

Layout: the actions and the :class:`Policy` base are :mod:`._policy`, the policies
:mod:`._policies`; this module holds the registry (:data:`POLICIES`), the parsed
specs (:func:`parse_consistency`), text scripts and the fake-clock simulation, and
re-exports the rest.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dtrain.errors import ConfigError
from dtrain.param_server._policies import ASP, BSP, SSP, Backup, SoftSync, StalenessAwareLR
from dtrain.param_server._policy_base import Action, Apply, Arrival, Drop, Policy, PolicyViolation, Release

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
    "PolicyTrace",
]


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
class PolicyTrace:
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
) -> PolicyTrace:
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
    res = PolicyTrace(gradients={w: 0 for w in workers}, wait={w: 0.0 for w in workers})
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
