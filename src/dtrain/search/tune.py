"""Ray Tune under ``dtrain sweep``: the searchers, the schedulers, and the trainable that runs a trial.

Ray Tune does the searching, the early stopping, population-based training and the placing of trials
over a Ray cluster; dtrain supplies the trials (:mod:`dtrain.search.trial`: each an ordinary
``dtrain run``). Nothing else in dtrain imports Ray; it is the ``tune`` extra
(``pip install 'dtrain[tune]'``: Ray Tune, Optuna, Nevergrad).

Searchers (``--search``):

- ``random``: Tune's random sampling; ``grid``: every combination of listed values, once each;
- ``tpe``: Optuna's tree-structured Parzen estimator (Bergstra et al. 2011);
- ``pso``: Nevergrad's particle swarm (Kennedy & Eberhart 1995; Lorenzo et al. 2017 for
  hyper-parameters);
- ``evolution``: Nevergrad's evolution strategy with recombination (a population, the best kept,
  mutated and recombined: the family of Real et al. 2018's search).

Schedulers (``--scheduler``): ``fifo`` (every trial to its end), ``asha`` (asynchronous successive
halving, Li et al. 2018: a trial below the top ``1/reduction`` of those that reached the same step is
stopped), ``pbt`` (population-based training, Jaderberg et al. 2017: every ``perturbation_interval``
steps a trial in the bottom quarter copies a top-quarter trial's checkpoint and perturbs its
hyper-parameters, which must be ones a run can change in the middle: :data:`~dtrain.search.space.MUTABLE`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dtrain.errors import ConfigError
from dtrain.search.space import Param
from dtrain.search.sweep import SweepSpec

__all__ = ["require_tune", "run_sweep_on_tune"]

PIP = "pip install 'dtrain[tune]'"


def require_tune(search: str = "random") -> None:
    """Refuse, naming the pip command, where the ``tune`` extra (or the searcher's library) is missing."""
    need = {"ray": "Ray Tune", "optuna": "Optuna", "nevergrad": "Nevergrad"}
    mods = ["ray"] + (["optuna"] if search == "tpe" else ["nevergrad"] if search in ("pso", "evolution") else [])
    for mod in mods:
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ConfigError(f"dtrain sweep needs {need[mod]}, which is not installed: {PIP}")


def _domain(p: Param) -> Any:
    from ray import tune

    if p.kind == "uniform":
        return tune.uniform(p.low, p.high)
    if p.kind == "loguniform":
        return tune.loguniform(p.low, p.high)
    if p.kind == "randint":
        return tune.randint(int(p.low), int(p.high))
    if p.kind == "lograndint":
        return tune.lograndint(int(p.low), int(p.high))
    if p.kind == "choice":
        return tune.choice(list(p.values))
    return tune.grid_search(list(p.values))


def _searcher(spec: SweepSpec) -> Any:
    from ray.tune.search import BasicVariantGenerator, ConcurrencyLimiter

    start = [dict(spec.start)] if spec.start else None  # --start-at-base: the base configuration first
    if spec.search in ("random", "grid"):
        return BasicVariantGenerator(max_concurrent=spec.concurrent, random_state=spec.seed, points_to_evaluate=start)
    if spec.search == "tpe":
        import optuna
        from ray.tune.search.optuna import OptunaSearch

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        algo: Any = OptunaSearch(sampler=optuna.samplers.TPESampler(seed=spec.seed), points_to_evaluate=start)
    else:
        import nevergrad as ng
        from ray.tune.search.nevergrad import NevergradSearch

        optimizer = (
            ng.optimizers.ConfPSO()
            if spec.search == "pso"
            else ng.families.EvolutionStrategy(
                recombination_ratio=0.5, only_offsprings=False, popsize=max(4, spec.concurrent)
            )
        )
        algo = NevergradSearch(optimizer=optimizer, points_to_evaluate=start)
    return ConcurrencyLimiter(algo, max_concurrent=spec.concurrent)


def _scheduler(spec: SweepSpec) -> Any:
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, PopulationBasedTraining

    if spec.scheduler == "asha":
        return ASHAScheduler(
            time_attr="step", max_t=spec.max_steps, grace_period=spec.grace_steps, reduction_factor=spec.reduction
        )
    if spec.scheduler == "pbt":
        random.seed(spec.seed)  # PBT's choices (whom to copy, how to perturb) draw from the random module
        return PopulationBasedTraining(
            time_attr="step",
            perturbation_interval=spec.perturbation_interval,
            hyperparam_mutations={k: _mutation(p) for k, p in spec.space.items()},
            quantile_fraction=spec.quantile,
            resample_probability=0.25,
            custom_explore_fn=lambda config: clip(spec, config),
            synch=True,
        )
    fifo: Any = FIFOScheduler  # (unannotated in Ray)
    return fifo()


def _mutation(p: Param) -> Any:
    """How PBT's explore changes a key: a range by a factor (0.8 or 1.2) or a fresh draw; listed values by a
    step to a neighbour in the list or a fresh pick (a list, for Ray; a choice domain would be multiplied)."""
    return list(p.values) if p.discrete else _domain(p)


def clip(spec: SweepSpec, config: dict[str, Any]) -> dict[str, Any]:
    """PBT's explore multiplies a value by 0.8 or 1.2: keep it inside its range (a momentum of 0.9 x 1.2 would
    be refused by the run, and the trial lost)."""
    for k, p in spec.space.items():
        v = config.get(k)
        if p.discrete or not isinstance(v, (int, float)):
            continue
        if p.kind.endswith("randint"):
            config[k] = int(min(max(round(v), p.low), p.high - 1))
        else:
            config[k] = float(min(max(v, p.low), math.nextafter(p.high, p.low)))
    return config


def _trainable(spec_json: str) -> Any:
    """The function Tune runs for a trial: :func:`dtrain.search.trial.run_trial`, reporting to Tune."""

    def trainable(config: dict[str, Any]) -> None:
        import ray
        from ray import tune

        from dtrain.search.trial import Limits, run_trial

        spec = SweepSpec.from_json(spec_json)
        util: Any = ray.util  # (unannotated in Ray)
        folder = Path(spec.out) / "trials" / tune.get_context().get_trial_id()

        def report(metrics: dict[str, Any], ckpt: Path | None) -> None:
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(str(ckpt)) if ckpt else None)

        start = tune.get_checkpoint()
        with start.as_directory() if start else contextlib.nullcontext(None) as d:
            try:
                run_trial(
                    folder,
                    spec.base,
                    dict(config),
                    report,
                    metric=spec.metric,
                    resume=Path(d) if d else None,
                    checkpoints=spec.scheduler == "pbt" or spec.max_failures > 0,
                    timeout_s=spec.trial_timeout_s,
                    limits=Limits(spec.max_params, spec.memory_limit),
                    node=util.get_node_ip_address(),
                )
            except ConfigError as e:  # a combination that does not fit: skipped, the worst value for the searcher
                tune.report({spec.metric: spec.worst, "step": 0, "skipped": str(e)})

    return trainable


def token_mode(env: dict[str, str], home: Path) -> bool:
    """Whether a driver joining a Ray cluster should turn token authentication on (``RAY_AUTH_MODE=token``).

    ``ray start`` (Ray 2.60) turns it on for the cluster and keeps the token in ``~/.ray/auth_token``, while a
    driver left to itself connects without one and is refused. So: on when a token is at hand (that file,
    ``RAY_AUTH_TOKEN_PATH`` or ``RAY_AUTH_TOKEN``) and the user set no mode; a token-mode driver still joins
    a cluster that has authentication off."""
    if "RAY_AUTH_MODE" in env:
        return False
    path = Path(env.get("RAY_AUTH_TOKEN_PATH") or home / ".ray" / "auth_token")
    return bool(env.get("RAY_AUTH_TOKEN")) or path.is_file()


@contextlib.contextmanager
def _ray(spec: SweepSpec) -> Iterator[None]:
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    if spec.address:
        if token_mode(dict(os.environ), Path.home()):
            os.environ["RAY_AUTH_MODE"] = "token"
        ray.init(address=spec.address, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    else:  # a Ray instance of its own on this machine (never one found running), a logical CPU a trial slot
        env = {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}
        ray.init(
            address="local",
            num_cpus=math.ceil(spec.concurrent * spec.cpus_per_trial),
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.ERROR,
            runtime_env={"env_vars": env},
        )
    try:
        yield
    finally:
        ray.shutdown()


def run_sweep_on_tune(spec: SweepSpec) -> dict[str, Any]:
    """Run the sweep on Ray Tune; returns what ``sweep.json`` records (:func:`dtrain.search.sweep.record`)."""
    from ray import tune

    from dtrain.search.sweep import record

    require_tune(spec.search)
    out = Path(spec.out)
    space = {k: _domain(p) for k, p in spec.space.items()}
    if spec.search == "grid":  # every combination once: choice is an axis of the grid too
        space = {k: tune.grid_search(list(p.values)) for k, p in spec.space.items()}
    t0 = time.time()
    with _ray(spec):
        # a fresh actor a trial: reusing one (reuse_actors) needs the stopped trial's thread gone first, and a
        # trial ASHA stopped while it was still stopping its run failed the next one ("reuse requires
        # reset_config() ... return True") and left the sweep waiting for good
        tuner = tune.Tuner(
            tune.with_resources(_trainable(spec.to_json()), {"cpu": spec.cpus_per_trial}),
            param_space=space,
            tune_config=tune.TuneConfig(
                metric=spec.metric,
                mode=spec.mode,
                search_alg=_searcher(spec),
                scheduler=_scheduler(spec),
                num_samples=spec.samples,
                max_concurrent_trials=spec.concurrent,
                reuse_actors=False,
            ),
            run_config=tune.RunConfig(
                name="tune",
                storage_path=str((out / "ray").resolve()),
                verbose=0,
                failure_config=tune.FailureConfig(max_failures=spec.max_failures),
            ),
        )
        grid = tuner.fit()
        results = []
        for r in (grid[i] for i in range(len(grid))):
            tid = (r.metrics or {}).get("trial_id") or Path(r.path).name.split("_")[1]
            results.append(
                {
                    "trial": tid,
                    "config": r.config,
                    "error": None if r.error is None else str(r.error).strip().splitlines()[-1][:500],
                }
            )
    return record(spec, results, wall_s=time.time() - t0)
