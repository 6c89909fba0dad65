"""``dtrain run --strategy auto``: plan for the run's model, data and cluster; return the first choice.

:func:`choose` is what the training CLI calls before launching: it builds the
configured model and one global batch, finds the cluster description (the
calibration of the emulated cluster ``cfg.cluster``, or this machine's cached
quick calibration), runs the planner over strategies that ``dtrain run`` can
execute with ``cfg.workers`` processes, prints the top of the table and returns
the winner as :class:`~dtrain.config.RunConfig` overrides.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dtrain.errors import ConfigError
from dtrain.perfmodel.planner import Plan, candidates, plan
from dtrain.perfmodel.spec import ClusterSpec, load_cluster

__all__ = ["choose", "plan_for_config", "load_model", "cluster_for"]


def load_model(spec: str, dataset: str = "digits", *, batch: int = 64, seed: int = 0,
               samples: int = 4096) -> tuple[nn.Module, Any, str]:  # fmt: skip
    """A model, one batch for it, and its name, from a dtrain model name or ``FILE.py:FN`` / ``MODULE:FN``.

    ``FN()`` must return ``(model, sample_batch)``; dtrain's own names ("cnn",
    "mlp") are built for ``dataset`` and take ``batch`` samples from its training set.
    """
    if ":" in spec:
        where, fn_name = spec.rsplit(":", 1)
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise ConfigError(f"model file {where!r} does not exist")
            mod_spec = importlib.util.spec_from_file_location(path.stem, path)
            assert mod_spec and mod_spec.loader
            mod = importlib.util.module_from_spec(mod_spec)
            sys.modules[path.stem] = mod
            mod_spec.loader.exec_module(mod)
        else:
            mod = importlib.import_module(where)
        fn = getattr(mod, fn_name, None)
        if fn is None:
            raise ConfigError(f"{where} has no function {fn_name!r}")
        model, sample = fn()
        return model, sample, fn_name
    from dtrain.data import load_dataset
    from dtrain.models import MODELS, build_model

    if spec not in MODELS:
        raise ConfigError(f"model {spec!r} is not known; use one of {', '.join(MODELS)} or FILE.py:FUNCTION")
    data = load_dataset(dataset, seed=seed, samples=samples)
    torch.manual_seed(seed)
    model = build_model(spec, data.input_shape, data.num_classes)
    x, y = data.train.tensors
    reps = -(-batch // len(y))
    return model, (x.repeat(reps, 1, 1, 1)[:batch], y.repeat(reps)[:batch]), spec


def cluster_for(name: str, *, processes: int | None = None) -> ClusterSpec:
    """The calibrated description of emulated cluster ``name`` (calibrating it first if needed).

    With ``processes`` (a multiple of the hosts), each host holds ``processes / hosts`` devices.
    """
    from dtrain.perfmodel.calibrate import calibrate_cluster, cluster_file
    from dtrain.perfmodel.spec import dump_cluster

    path = cluster_file(name)
    if path.exists():
        spec = load_cluster(path)
    else:
        print(f"dtrain: calibrating emulated cluster {name!r} (once; kept in {path}) ...", file=sys.stderr)
        spec = calibrate_cluster(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dump_cluster(spec, comment=f"dtrain bench calibrate --cluster {name}"))
    if processes and processes != spec.devices:
        if processes % spec.nodes:
            raise ConfigError(f"{processes} processes do not spread evenly over the {spec.nodes} hosts of {name!r}")
        from dataclasses import replace

        spec = replace(spec, devices_per_node=processes // spec.nodes)
    return spec


def _optimizer(cfg: Any) -> str:
    if cfg.optimizer == "adam":
        return "adam"
    return "sgd" if cfg.momentum > 0 else "sgd0"


def plan_for_config(cfg: Any) -> Plan:
    """The planner's table for a :class:`~dtrain.config.RunConfig` (its model, batch, workers, cluster)."""
    model, sample, name = load_model(cfg.model, cfg.dataset, batch=cfg.batch_size, seed=cfg.seed, samples=cfg.samples)
    if cfg.cluster:
        spec = cluster_for(cfg.cluster, processes=cfg.workers)
    else:
        from dtrain.perfmodel.calibrate import local_cluster

        spec = local_cluster(cfg.workers)
    spec = spec.with_devices(cfg.workers) if cfg.workers < spec.devices else spec
    cands = candidates(spec, cfg.workers, single=not cfg.cluster)
    # the emulated cluster spreads processes over hosts evenly: keep those that do
    cands = [s for s in cands if not cfg.cluster or s.processes == cfg.workers]
    return plan(model, sample, spec, workers=cfg.workers, name=name, optimizer=_optimizer(cfg), strategies=cands)


def choose(cfg: Any, *, verbose: bool = True) -> dict[str, Any]:
    """The planner's first choice for ``cfg`` as RunConfig overrides (``strategy``, ``workers``, ...).

    Args:
        cfg: a :class:`~dtrain.config.RunConfig` (its ``strategy`` is ignored).
        verbose: print the top of the plan to stderr.
    """
    p = plan_for_config(cfg)
    if verbose:
        print(p.table(top=8), file=sys.stderr)
    best = p.best.strategy
    if verbose:
        print(f"dtrain: --strategy auto chose: {best.label()}", file=sys.stderr)
    return best.overrides()
