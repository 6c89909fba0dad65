"""TOML files: read one with errors that name it (run configs, cluster descriptions), and a run's
configuration from and to TOML (:func:`load_toml`, :func:`dump_toml`)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtrain.errors import ConfigError
from dtrain.rundir.files import CONFIG

if TYPE_CHECKING:
    from dtrain.config.schema import RunConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["read_toml", "load_toml", "dump_toml", "parse_toml_value", "parse_model_args"]


def read_toml(path: str | Path, what: str, *, hint: str = "") -> dict[str, Any]:
    """The TOML file ``path`` as a dict.

    Args:
        path: the file.
        what: what the file is, for error messages (e.g. "config file").
        hint: how to get the file, added to the message when it is missing
            (e.g. "run `dtrain bench calibrate`") (default: none).

    Raises:
        ConfigError: the file does not exist (``"WHAT 'PATH' does not exist (HINT)"``) or is
            not valid TOML (``"PATH: not valid TOML: "`` and the parser's message).
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} {str(p)!r} does not exist" + (f" ({hint})" if hint else ""))
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from None


def parse_toml_value(text: str) -> Any:
    """``text`` read as one TOML value (``2``, ``0.1``, ``true``, ``"gelu"``, ``[1, 2]``); text that is not one
    is the string itself (``gelu``)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_model_args(items: Sequence[str]) -> dict[str, Any]:
    """``--model-arg KEY=VALUE`` flags as a mapping, each VALUE read by :func:`parse_toml_value`."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--model-arg takes KEY=VALUE, e.g. --model-arg n_layer=2; got {item!r}")
        out[key.strip()] = parse_toml_value(value.strip())
    return out


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a run config file; a top-level ``[run]`` table (with strategy tables beside it) is unwrapped."""
    data = read_toml(path, "config file")
    run = data.get("run")
    if isinstance(run, dict):
        data = {**{k: v for k, v in data.items() if k != "run"}, **run}
    return data


def _toml_key(k: str) -> str:
    return k if k and all(c.isalnum() or c in "_-" for c in k) else json.dumps(k)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):  # a model argument that is a table (a transformers config's rope_scaling)
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def dump_toml(cfg: RunConfig) -> str:
    """The resolved configuration as TOML that :func:`load_toml` reads back."""
    lines = [f"# dtrain run configuration (resolved); rerun with: dtrain run {CONFIG}"]
    d = cfg.to_dict()
    tables = {"model_args": d.pop("model_args"), "extra": d.pop("extra"), cfg.strategy: d.pop(cfg.strategy)}
    for k, v in d.items():
        lines.append(f"{k} = {_toml_value(v)}")
    for name, table in tables.items():
        if table or name == cfg.strategy:
            lines += ["", f"[{name}]"] + [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"
