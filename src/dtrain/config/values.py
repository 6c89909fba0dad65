"""From TOML-shaped values to a run's fields: each value checked against its field's type, and the keys
sorted between the fields every run shares and the strategy's options (:func:`build_options`); and
:func:`parse_straggler`, the value of ``--straggler``."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import fields
from typing import Any

from dtrain.errors import ConfigError
from dtrain.registry import Strategy, StrategyOptions, registered

__all__ = ["option_fields", "build_options", "sort_values", "parse_straggler", "typed_field"]


def parse_straggler(spec: str) -> tuple[int, float]:
    """Parse ``"RANK:FACTOR"`` (e.g. ``"2:4"``: worker rank 2 runs 4x slower)."""
    try:
        r, f = spec.split(":")
        rank, factor = int(r), float(f)
    except ValueError:
        raise ConfigError(f"straggler must be RANK:FACTOR, e.g. 1:4; got {spec!r}") from None
    if rank < 0 or factor < 1.0:
        raise ConfigError(f"straggler rank must be >= 0 and factor >= 1; got {spec!r}")
    return rank, factor


def _typed(name: str, default: Any, v: Any) -> Any:
    """``v`` checked against the type of the field's ``default`` (ConfigError naming the option)."""
    if isinstance(default, bool):
        if not isinstance(v, bool):
            raise ConfigError(f"option {name} must be true or false, got {v!r}")
        return v
    if isinstance(default, (int, float)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"option {name} must be a number, got {v!r}")
        if isinstance(default, int) and float(v) != int(v):
            raise ConfigError(f"option {name} must be an integer, got {v!r}")
        return type(default)(v)
    if isinstance(default, str) and not isinstance(v, str):
        raise ConfigError(f"option {name} must be a string, got {v!r}")
    return v


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def typed_field(f: dataclasses.Field[Any], v: Any) -> Any:
    """``v`` checked against the type of field ``f``'s default (ConfigError naming the option)."""
    return _typed(f.name, _default(f), v)


def option_fields() -> dict[str, list[tuple[str, dataclasses.Field[Any]]]]:
    """Field name -> [(strategy, field), ...] over every registered strategy's options."""
    out: dict[str, list[tuple[str, dataclasses.Field[Any]]]] = {}
    for name, entry in registered().items():
        for f in fields(entry.options):
            out.setdefault(f.name, []).append((name, f))
    return out


def build_options(entry: Strategy, values: Mapping[str, Any]) -> StrategyOptions:
    """``entry``'s options from a mapping of its field names (ConfigError for unknown keys, bad types)."""
    known = {f.name: f for f in fields(entry.options)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"[{entry.name}] has no option(s) {', '.join(unknown)}; valid: {', '.join(known) or 'none'}")
    kw = {k: _typed(k, _default(known[k]), v) for k, v in values.items()}
    try:
        return entry.options(**kw)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def sort_values(
    values: Mapping[str, Any], shared: Mapping[str, dataclasses.Field[Any]], strategy: str, tables: Collection[str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``values``' shared keys (typed) and ``strategy``'s options (its table, then its flat keys, which win).

    ``tables`` are keys read elsewhere. Raises ConfigError for a key of another strategy (naming it),
    a table of another strategy, or an unknown key (listing the valid ones).
    """
    table = values.get(strategy, {})
    if not isinstance(table, Mapping):
        raise ConfigError(f"[{strategy}] must be a table of options, got {table!r}")
    opts = dict(table)
    everywhere = option_fields()
    kw: dict[str, Any] = {}
    for k, v in values.items():
        if k in shared:
            kw[k] = _typed(k, _default(shared[k]), v)
        elif k in tables or k == strategy:
            continue
        elif any(s == strategy for s, _ in everywhere.get(k, [])):
            opts[k] = v
        elif k in everywhere:
            owners = sorted({s for s, _ in everywhere[k]} | ({k} if k in registered() else set()))
            raise ConfigError(
                f"option {k} belongs to strategy {' / '.join(owners)} ([{owners[0]}] in TOML); "
                f"this run's strategy is {strategy}"
            )
        elif k in registered():
            raise ConfigError(f"[{k}] holds options of strategy {k}; this run's strategy is {strategy}")
        else:
            mine = (name for name, owners in everywhere.items() if any(s == strategy for s, _ in owners))
            valid = sorted([*shared, *mine])
            raise ConfigError(f"unknown option(s) {k}; valid options: {', '.join(valid)}")
    return kw, opts
