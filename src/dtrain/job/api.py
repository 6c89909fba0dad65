"""``dtrain.run(...)``: what ``dtrain run`` does, from Python, with the same keys.

    import dtrain

    def build(width=16):                      # a module-level function of an importable module or script
        return MyNet(width)

    if __name__ == "__main__":                # every worker imports this file to find build: guard the run
        summary, out = dtrain.run(model=build, model_args={"width": 32}, strategy="dp", shard="parameters",
                                  workers=2, epochs=1)

The keys are the TOML keys (``batch_size``, ``strategy``, a strategy's options flat or as its table,
``model_args`` as a mapping); a config file's path may come first, the keys then override it. ``model``,
``dataset`` and ``loss`` may be functions instead of their ``MODULE:FN`` / ``FILE.py:FN`` text: each worker is
a new process that imports the function by its module and name, so it must be defined at the top level of an
importable module or of the script being run (whose code outside ``if __name__ == "__main__":`` every worker
runs again, as with ``multiprocessing``'s spawn).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dtrain.errors import ConfigError

__all__ = ["run", "function_spec"]

_FUNCTION_KEYS = ("model", "dataset", "loss")  # keys that name a function as MODULE:FN / FILE.py:FN


def function_spec(fn: Callable[..., Any], key: str = "model") -> str:
    """``fn`` as the ``MODULE:FN`` (or ``FILE.py:FN`` for the running script's own) text a worker imports."""
    name = getattr(fn, "__qualname__", "")
    module = getattr(fn, "__module__", None)
    if not name or "<" in name or "." in name or module is None:
        raise ConfigError(
            f"{key}: {fn!r} is not a top-level function of a module, so a worker process cannot "
            "import it; define it at the top level of a module or of your script"
        )
    if module == "__main__":
        main = getattr(sys.modules.get("__main__"), "__file__", None)
        if not main:
            raise ConfigError(
                f"{key}: {name} is defined in an interactive session, which a worker process "
                "cannot import; put it in a file and pass FILE.py:FN"
            )
        return f"{Path(main).resolve()}:{name}"
    if module.startswith("dtrain_user_"):  # a function of a file dtrain loaded itself (FILE.py:FN)
        path = getattr(sys.modules.get(module), "__file__", None)
        if path:
            return f"{path}:{name}"
    return f"{module}:{name}"


def run(config: str | Path | None = None, /, *, quiet: bool = False, **keys: Any) -> tuple[dict[str, Any], Path]:
    """Train as ``dtrain run`` does; returns the run's summary (the one its run folder holds) and the folder.

    Args:
        config: a TOML file of a run (``dtrain run CONFIG``); ``keys`` override it.
        quiet: print nothing but errors (no progress bar, no summary lines).
        **keys: the configuration's keys; ``model``, ``dataset`` and ``loss`` may be functions.

    Raises:
        ConfigError: a bad key or value, before any process starts.
    """
    from dtrain.config.files import load_toml
    from dtrain.config.schema import RunConfig
    from dtrain.job.run import run as run_job

    values: dict[str, Any] = load_toml(config) if config is not None else {}
    for k, v in keys.items():
        values[k] = function_spec(v, k) if k in _FUNCTION_KEYS and callable(v) else v
    if quiet:
        values.setdefault("progress", False)
    return run_job(RunConfig.from_mapping(values), quiet=quiet)
