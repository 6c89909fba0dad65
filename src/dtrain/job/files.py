"""Read a TOML file with errors that name it (run configs, cluster descriptions)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from dtrain.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["read_toml"]


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
