"""A sweep's search space: keys of a ``dtrain run`` configuration and their distributions, from TOML.

``[sweep.space]`` maps a run configuration key (``lr``, ``batch_size``, ``compression``, a gpt's
``layers``, a strategy's option) to a distribution written as a call::

    [sweep.space]
    lr = "loguniform(1e-4, 1e-1)"                       # log-uniform on [1e-4, 1e-1)
    momentum = "uniform(0.8, 0.99)"                     # uniform on [0.8, 0.99)
    layers = "randint(1, 5)"                            # an integer in 1..4
    batch_size = "choice([32, 64, 128])"                # one of the values
    compression = "grid(['none', 'topk:0.01'])"         # every value (a grid's axis)

The space is read and checked here, without Ray, so that bad input is an error before anything
starts: an unknown distribution, arguments it cannot take, a key ``dtrain run`` does not have, a value
of the wrong type, an empty space. :mod:`dtrain.search.tune` turns it into Ray Tune's domains.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dtrain.errors import ConfigError

if TYPE_CHECKING:
    from dtrain.config.schema import RunConfig

__all__ = ["DISTRIBUTIONS", "Param", "parse_param", "parse_space", "MUTABLE"]

# name -> what its arguments are
DISTRIBUTIONS = {
    "uniform": "(low, high): a float in [low, high)",
    "loguniform": "(low, high): a float in [low, high), uniform in its logarithm; 0 < low",
    "randint": "(low, high): an integer in [low, high)",
    "lograndint": "(low, high): an integer in [low, high), uniform in its logarithm; 0 < low",
    "choice": "([v1, v2, ...]): one of the values",
    "grid": "([v1, v2, ...]): every value, each in its own trials",
}

# the keys that may change in the middle of a run (a resumed checkpoint takes them from the new
# configuration, dtrain.training.checkpointing; a fixed batch goes on from the checkpoint's sample, the rate
# following it by --lr-scaling): what population-based training may perturb
MUTABLE = ("lr", "momentum", "weight_decay", "batch_size")


@dataclass(frozen=True)
class Param:
    """One key of the space: ``kind`` is a :data:`DISTRIBUTIONS` name; ``low``/``high`` for the
    ranges, ``values`` for ``choice`` and ``grid``."""

    name: str
    kind: str
    low: float = 0.0
    high: float = 0.0
    values: tuple[Any, ...] = ()

    @property
    def discrete(self) -> bool:
        """Whether the values are listed (``choice``, ``grid``)."""
        return self.kind in ("choice", "grid")

    def edges(self) -> tuple[Any, ...]:
        """Values that stand for the whole range: the listed ones, or the two ends of a range."""
        if self.discrete:
            return self.values
        if self.kind in ("randint", "lograndint"):
            return (int(self.low), int(self.high) - 1)
        return (self.low, self.high)

    def holds(self, value: Any) -> bool:
        """Whether ``value`` is one this key can take (a listed value; inside a range, its high end left out)."""
        if self.discrete:
            return value in self.values
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return False
        if self.kind in ("randint", "lograndint"):
            return float(value).is_integer() and self.low <= value < self.high
        return self.low <= value < self.high

    def text(self) -> str:
        """As written in TOML."""
        if self.discrete:
            return f"{self.kind}({list(self.values)!r})"
        return f"{self.kind}({self.low:g}, {self.high:g})"


def parse_param(name: str, text: Any) -> Param:
    """The distribution ``text`` (e.g. ``"loguniform(1e-4, 1e-1)"``) of key ``name``.

    Raises:
        ConfigError: not a call of a :data:`DISTRIBUTIONS` name with literal arguments it takes.
    """
    known = ", ".join(f"{k}{v.split(':')[0]}" for k, v in DISTRIBUTIONS.items())
    where = f"[sweep.space] {name} = {text!r}"
    if not isinstance(text, str):
        raise ConfigError(f'{where}: a distribution is a string such as "loguniform(1e-4, 1e-1)"; one of {known}')
    try:
        call = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        call = None
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and not call.keywords):
        raise ConfigError(f"{where}: not a distribution; write one of {known}")
    kind = call.func.id
    if kind not in DISTRIBUTIONS:
        raise ConfigError(f"{where}: unknown distribution {kind!r}; one of {known}")
    try:
        args = [ast.literal_eval(a) for a in call.args]
    except ValueError:
        raise ConfigError(f"{where}: the arguments must be literal numbers, strings or lists") from None
    usage = f"{kind}{DISTRIBUTIONS[kind]}"
    if kind in ("choice", "grid"):
        if len(args) != 1 or not isinstance(args[0], (list, tuple)) or not args[0]:
            raise ConfigError(f"{where}: {usage}, with at least one value")
        if len(set(map(repr, args[0]))) != len(args[0]):
            raise ConfigError(f"{where}: a value is listed twice")
        return Param(name, kind, values=tuple(args[0]))
    if len(args) != 2 or not all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args):
        raise ConfigError(f"{where}: {usage}")
    low, high = float(args[0]), float(args[1])
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ConfigError(f"{where}: {usage}, with low < high")
    if kind.startswith("log") and low <= 0:
        raise ConfigError(f"{where}: {usage}")
    if kind.endswith("randint") and not (low.is_integer() and high.is_integer() and high - low >= 1):
        raise ConfigError(f"{where}: {usage}, with integer ends")
    return Param(name, kind, low=low, high=high)


def parse_space(table: Any, base: RunConfig) -> dict[str, Param]:
    """The ``[sweep.space]`` table, each key checked against ``base``'s configuration.

    A key must be one that ``dtrain run`` reads (a shared key or an option of ``base``'s strategy, or
    of any strategy when ``strategy`` is itself in the space), or a model argument (``model_args.KEY``, or
    ``KEY`` alone where ``base``'s ``[model_args]`` gives it), and each of a distribution's values (the
    listed ones, or a range's ends) must be a value that key takes.

    Raises:
        ConfigError: an empty space, an unknown key, a bad distribution or a value of the wrong type.
    """
    from dtrain.config.schema import RunConfig, option_fields

    if not isinstance(table, Mapping) or not table:
        raise ConfigError(
            'the search space is empty: give [sweep.space] at least one key, e.g. lr = "loguniform(1e-4, 1e-1)"'
        )
    # a model argument: model_args.KEY, or KEY alone where the base run gives it (n_layer = "randint(1, 4)")
    names = {str(k): f"model_args.{k}" if k in base.model_args and not hasattr(base, str(k)) else str(k) for k in table}
    space = {names[str(k)]: parse_param(names[str(k)], v) for k, v in table.items()}
    shared = {f.name for f in RunConfig.shared_fields()} - {"extra", "out", "resume"}
    shared |= {name for name in space if name.startswith("model_args.") and len(name) > len("model_args.")}
    options = option_fields()
    own = {name for name, owners in options.items() if any(s == base.strategy for s, _ in owners)}
    keys = shared | (set(options) if "strategy" in space else own)
    for name, p in space.items():
        if name not in keys:
            hint = ""
            if name in options:
                hint = f" (an option of {', '.join(s for s, _ in options[name])}, not of {base.strategy})"
            raise ConfigError(
                f"[sweep.space] {name}: not a key of this run's configuration{hint}; the keys: "
                f"{', '.join(sorted(keys))}"
            )
        for v in p.edges():
            try:
                base.replace(**{name: v})
            except (ConfigError, TypeError, ValueError) as e:
                raise ConfigError(f"[sweep.space] {name} = {p.text()!r}: the value {v!r} does not fit: {e}") from None
    return space
