"""The strategy registry: named strategies, their options, and a chosen one.

A strategy is one :class:`Strategy` entry (torchtitan's ``TrainSpec`` is the
model): its name, its options dataclass, and the hooks each layer asks it for,
one object per layer: :class:`dtrain.config.schema.ConfigHooks` (the configuration's
checks and ``auto``'s ``resolve``), :class:`dtrain.training.context.ProcessHooks`
(the process body that ``dtrain run`` starts) and
:class:`dtrain.perfmodel.hooks.ModelHooks` (the performance model's ``predict``,
``memory``, ``simulate``, ``candidates``). A layer reads its own with
``entry.hooks_of(ItsHooks)``; the trainer, the configuration, the checkpoint
checks and the planner ask the entry, none of them holds an ``if name == ...``,
and this module imports none of them (the layers sit above it).

A strategy's options are a frozen dataclass derived from
:class:`StrategyOptions`, validated in ``__post_init__``. Their fields become the
``[NAME]`` table of a run's TOML and flat ``dtrain run`` flags (``--servers 2``).
Methods on the options answer the questions every layer asks without running
anything: how many processes, what a checkpoint depends on, which compressor,
what the planner prints.

:class:`Choice` is a strategy with its options and a number of workers: what the
planner ranks, what ``--strategy auto`` picks, what a run configuration holds.

Registration: :func:`register` adds an entry. The built-in strategies are
registered by importing :mod:`dtrain.strategies.builtin`; :func:`get` and
:func:`registered` import it on first use, so callers that only need the
registry (configuration, the performance model) do not import every engine.
A strategy of one's own lives in any importable module that calls
:func:`register`; name it in the environment variable ``DTRAIN_STRATEGY_MODULES``
(comma-separated module names) and every process of a run imports it along with
the built-ins, the parent and the workers alike (the launcher's children inherit
the environment).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from dtrain.errors import ConfigError

if TYPE_CHECKING:
    from dtrain.compress.base import Compressor

__all__ = [
    "PLUGINS_ENV",
    "options_for",
    "StrategyOptions",
    "Strategy",
    "Choice",
    "register",
    "unregister",
    "get",
    "registered",
    "choice",
]

Hooks = TypeVar("Hooks")


@dataclass(frozen=True)
class StrategyOptions:
    """Base of every strategy's options (a frozen dataclass; subclasses add fields).

    Field metadata read by the CLI: ``help`` (the flag's help text) and
    ``choices`` (a tuple of accepted strings).
    """

    def processes(self, workers: int) -> int:
        """Processes a run starts for ``workers`` training workers (default: the workers)."""
        return workers

    def batch_shards(self, workers: int) -> int:
        """Slices the global batch is split into (default: one per worker; a pipeline's stages share one)."""
        return workers

    def compressor_spec(self) -> str:
        """The gradient compressor's spec string ("none" when the strategy compresses nothing)."""
        return "none"

    def build_compressor(self, momentum: float) -> Compressor | None:
        """The gradient compressor to build (None: the strategy compresses nothing)."""
        return None

    def checkpoint_keys(self) -> dict[str, Any]:
        """Options a checkpoint depends on: a resumed run must match them (default: none)."""
        return {}

    def exchanges_unscaled(self) -> bool:
        """Whether gradients leave the worker after the step's fp16 check, already unscaled (a parameter
        server's push), rather than during backward (default: no)."""
        return False

    def measures_noise_scale(self, workers: int) -> bool:
        """Whether the strategy measures the gradient noise scale (``--noise-scale``, ``--batch-schedule auto``):
        each worker's gradient beside their average (default: no)."""
        return False

    def reshards(self) -> bool:
        """Whether a checkpoint of this strategy resumes on another number of workers (default: no)."""
        return False

    def refuses_grad_accum(self, workers: int) -> str:
        """Why this strategy cannot accumulate gradients over micro-steps (``--grad-accum``): the end of
        the line ``strategy NAME ...``; "" when it can (default: it cannot; an engine that can says so)."""
        return "has no engine that accumulates micro-steps"

    def refuses_clip_grad_norm(self, workers: int) -> str:
        """Why this strategy cannot clip by the global gradient norm (``--clip-grad-norm``): the end of the
        line ``strategy NAME ...``; "" when it can (default: it cannot; an engine that can says so)."""
        return "has no engine that computes the global gradient norm"

    def approximation(self) -> str:
        """What the strategy trades against single-process training ("" when it is exact)."""
        return ""

    def pipeline_schedule(self) -> tuple[str, int, int] | None:
        """``(schedule, micro-batches, virtual stages per worker)`` of a strategy whose workers play one
        pipeline schedule (what a run's report draws); None for one that does not (the default)."""
        return None

    def label(self, workers: int) -> str:
        """One line naming the strategy and its options, as the planner prints it."""
        fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        return f"{type(self).__name__}({fields}) x{workers}"

    def to_table(self) -> dict[str, Any]:
        """The options as a TOML table (field name -> value)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class Strategy:
    """One registered strategy: its name, options type and each layer's hooks.

    Attributes:
        name: the ``--strategy`` value and the TOML table name.
        options: its options dataclass (default-constructible).
        help: one line for ``dtrain run --help``.
        hooks: one hooks object per layer that asks the strategy something (see the module
            docstring); a layer whose hooks are missing uses its defaults.
        devices: the ``--device`` values it trains on (default: the CPU only).
    """

    name: str
    options: type[StrategyOptions]
    help: str
    hooks: tuple[object, ...] = ()
    devices: tuple[str, ...] = ("cpu",)

    def hooks_of(self, kind: type[Hooks]) -> Hooks | None:
        """This strategy's hooks of the layer whose hooks class is ``kind`` (None: it gave none)."""
        return next((h for h in self.hooks if isinstance(h, kind)), None)


_REGISTRY: dict[str, Strategy] = {}
_BUILTINS = "dtrain.strategies.builtin"


PLUGINS_ENV = "DTRAIN_STRATEGY_MODULES"


def _load_builtins() -> None:
    """Register the ten built-in strategies -- ``dp``, ``ddp``, ``ps``, ``local_sgd``, ``easgd``, ``gossip``,
    ``pipeline``, ``tensor``, ``hybrid`` and ``auto`` (:mod:`dtrain.strategies.builtin` imports their modules
    in that order; a module imported before registers first) -- then import each module
    ``DTRAIN_STRATEGY_MODULES`` names (ConfigError for one that does not import)."""
    importlib.import_module(_BUILTINS)
    for name in filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(","))):
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ConfigError(f"{PLUGINS_ENV} names module {name!r}, which cannot be imported: {e}") from None


def register(entry: Strategy, *, replace: bool = False) -> Strategy:
    """Add ``entry`` to the registry (``replace=True`` to overwrite a name); returns it."""
    if not entry.name or not entry.name.replace("_", "").isalnum():
        raise ValueError(f"a strategy name is letters, digits and '_', got {entry.name!r}")
    if entry.name in _REGISTRY and not replace and _REGISTRY[entry.name] is not entry:
        raise ValueError(f"strategy {entry.name!r} is registered already")
    if not (isinstance(entry.options, type) and issubclass(entry.options, StrategyOptions)):
        raise TypeError(f"strategy {entry.name!r}: options must be a StrategyOptions dataclass")
    _REGISTRY[entry.name] = entry
    return entry


def unregister(name: str) -> None:
    """Remove a strategy (tests register throw-away ones)."""
    _REGISTRY.pop(name, None)


def registered() -> dict[str, Strategy]:
    """Every registered strategy by name (built-ins first)."""
    _load_builtins()
    return dict(_REGISTRY)


def get(name: str) -> Strategy:
    """The strategy registered as ``name`` (ConfigError listing the names otherwise)."""
    _load_builtins()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"strategy {name!r} is not known; choose one of: {', '.join(_REGISTRY)}") from None


def options_for(strategy: str, options: StrategyOptions | None) -> StrategyOptions:
    """``options`` checked to be ``strategy``'s type, or its defaults when None (ConfigError otherwise)."""
    entry = get(strategy)
    if options is None:
        return entry.options()
    if not isinstance(options, entry.options):
        raise ConfigError(f"strategy {strategy!r} takes {entry.options.__name__}, got {type(options).__name__}")
    return options


@dataclass(frozen=True)
class Choice:
    """A strategy with its options on ``workers`` training workers.

    Attributes:
        strategy: the registered name.
        workers: training processes (a parameter server's servers come on top).
        options: the strategy's options (default: its defaults).
    """

    strategy: str
    workers: int = 1
    options: StrategyOptions | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", options_for(self.strategy, self.options))
        if self.workers < 1:
            raise ConfigError(f"workers must be >= 1, got {self.workers}")

    @property
    def opts(self) -> StrategyOptions:
        assert self.options is not None
        return self.options

    @property
    def entry(self) -> Strategy:
        return get(self.strategy)

    @property
    def processes(self) -> int:
        return self.opts.processes(self.workers)

    @property
    def kind(self) -> str:
        """ "single" for one process with nothing to exchange, else the strategy's name."""
        return "single" if self.processes == 1 else self.strategy

    def label(self) -> str:
        return "single process" if self.kind == "single" else self.opts.label(self.workers)

    def with_workers(self, workers: int) -> Choice:
        return Choice(self.strategy, workers, self.options)

    def __str__(self) -> str:
        return self.label()


_ALIASES = {"single": "dp"}  # the planner's baseline, one process: one data-parallel worker


def choice(strategy: str, workers: int = 1, algorithm: str | None = None, **options: Any) -> Choice:
    """Shorthand: ``choice("dp", 8, "ring", bucket_mb=1.0)``, ``choice("ps", 6, servers=2)``.

    ``"single"`` means one data-parallel worker (the planner's baseline).
    """
    if strategy in _ALIASES:
        return Choice(_ALIASES[strategy], 1)
    entry = get(strategy)
    if algorithm is not None and "algorithm" in {f.name for f in dataclasses.fields(entry.options)}:
        options["algorithm"] = algorithm
    elif algorithm not in (None, "native"):  # torch's own strategies have only the backend's allreduce
        raise ConfigError(f"strategy {strategy!r} has no algorithm option (got {algorithm!r})")
    try:
        return Choice(strategy, workers, entry.options(**options))
    except TypeError as e:
        raise ConfigError(f"strategy {strategy!r}: {e}") from None
