"""A sweep: what ``dtrain sweep`` runs (:class:`SweepSpec`, checked before anything starts) and what it
leaves (``SWEEP/sweep.json``, :func:`record`).

The sweep folder::

    SWEEP/sweep.json               every trial: configuration, metric history, fate; the best trial
    SWEEP/trials/<id>/run-0/       the trial's run folder (an ordinary one: config, metrics, summary)
    SWEEP/trials/<id>/run-1/       after population-based training's exploit: resumed from another trial
    SWEEP/trials/<id>/trial.json   the trial's segments (its own record, kept as it runs)
    SWEEP/ray/                     Ray Tune's own experiment folder (its checkpoints, its logs)

A trial's fate: ``finished`` (its last step, also when ASHA stops it there), ``stopped early`` (by
ASHA, at the step of its last evaluation), ``exploited`` (population-based training restarted it from
another trial's checkpoint: the ``exploits`` list names the donor and the step), ``skipped`` (its
combination does not fit, with the message), ``failed`` (with the message).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtrain.errors import ConfigError, check_choice
from dtrain.search.space import MUTABLE, Param

__all__ = ["SEARCHES", "SCHEDULERS", "SweepSpec", "build_spec", "base_point", "record", "SWEEP_FILE"]

SEARCHES = ("random", "grid", "tpe", "pso", "evolution")
SCHEDULERS = ("fifo", "asha", "pbt")
SWEEP_FILE = "sweep.json"
METRICS = {"test_accuracy": "max", "val_loss": "min"}  # what a run reports at each evaluation, and its direction
STEP_KEYS = ("batch_size", "epochs", "max_steps", "workers", "batch_schedule")  # what changes a trial's step count


@dataclass(frozen=True)
class SweepSpec:
    """A checked sweep: the base run configuration, the space, and how Tune searches it.

    ``samples`` is Tune's ``num_samples`` (for ``grid``: 1, each combination once); ``max_steps`` the
    most steps any trial trains (ASHA's horizon); ``grace_steps`` ASHA's first rung (one evaluation);
    ``perturbation_interval`` PBT's, in steps.
    """

    base: dict[str, Any]
    space: dict[str, Param]
    out: str
    search: str = "random"
    scheduler: str = "fifo"
    trials: int = 8
    concurrent: int = 2
    metric: str = "test_accuracy"
    mode: str = "max"
    seed: int = 0
    address: str = ""
    cpus_per_trial: float = 1.0
    max_steps: int = 0
    grace_steps: int = 0
    reduction: int = 2
    perturbation_interval: int = 0
    quantile: float = 0.25
    max_failures: int = 0
    trial_timeout_s: float = 3600.0
    max_params: int = 0
    memory_limit: float = 0.0
    start: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def samples(self) -> int:
        return 1 if self.search == "grid" else self.trials

    @property
    def eval_every(self) -> int:
        return int(self.base["eval_every"])

    @property
    def worst(self) -> float:
        """The value a skipped trial reports: the worst there is."""
        return math.inf if self.mode == "min" else -math.inf

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["space"] = {k: dataclasses.asdict(p) for k, p in self.space.items()}
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> SweepSpec:
        d = json.loads(text)
        d["space"] = {k: Param(**{**p, "values": tuple(p["values"])}) for k, p in d["space"].items()}
        return cls(**d)


def _grid_size(space: dict[str, Param]) -> int:
    return math.prod(len(p.values) for p in space.values())


def _most_steps(base: Any, space: dict[str, Param]) -> int:
    """The most steps a trial can train: over every combination of the space's step-changing values."""
    from dtrain.training.checkpointing import train_steps

    keys = [k for k in STEP_KEYS if k in space]
    combos = itertools.product(*(space[k].edges() for k in keys)) if keys else [()]
    most = 0
    for combo in combos:
        try:
            most = max(most, train_steps(base.replace(**dict(zip(keys, combo)))))
        except ConfigError:
            continue
    return most or train_steps(base)


def build_spec(
    base: Any,
    table: Any,
    *,
    out: str,
    search: str,
    scheduler: str,
    trials: int | None,
    concurrent: int,
    metric: str | None,
    mode: str | None,
    seed: int,
    address: str = "",
    cpus_per_trial: float = 1.0,
    eval_every: int = 0,
    perturbation_interval: int = 0,
    reduction: int = 2,
    max_failures: int = 0,
    max_params: int = 0,
    memory_limit: str = "",
    start_at_base: bool = False,
) -> SweepSpec:
    """Check everything about a sweep that can be checked before a trial starts.

    Args:
        base: the run configuration every trial starts from (a :class:`RunConfig`).
        table: the ``[sweep.space]`` table.
        eval_every: evaluate every N steps (default: the base's ``eval_every``; else 1/4 of the steps).
        max_params / memory_limit: skip a trial whose model has more parameters, or needs more bytes
            per device by the planner's memory model ("2GB", "512MB", bytes; "": none).
        start_at_base: the first trial is the base configuration itself (:func:`base_point`); the
            searcher goes on from it.

    Raises:
        ConfigError: one line saying what to change (an unknown searcher, scheduler, distribution or
            key; an empty space; a metric the run does not report; PBT over a key a run cannot change
            in the middle; grid over a range).
    """
    asked = SweepSpec(  # the flags as given; checked and completed by _checked
        base={},
        space={},
        out=out,
        search=search,
        scheduler=scheduler,
        concurrent=concurrent,
        metric=metric or "",
        mode=mode or "",
        seed=seed,
        address=address,
        cpus_per_trial=cpus_per_trial,
        reduction=reduction,
        max_failures=max_failures,
        max_params=max_params,
    )
    return _checked(asked, base, table, trials, (eval_every, perturbation_interval), memory_limit, start_at_base)


def _checked(
    asked: SweepSpec,
    base: Any,
    table: Any,
    trials: int | None,
    cadence: tuple[int, int],
    memory_limit: str,
    start_at_base: bool,
) -> SweepSpec:
    """:func:`build_spec`'s checks, in the order the flags' errors are reported, and the sweep they make."""
    from dtrain.perfmodel.ranking import parse_memory_limit
    from dtrain.search.space import parse_space

    search, scheduler, concurrent = asked.search, asked.scheduler, asked.concurrent
    check_choice("--search", search, SEARCHES)
    check_choice("--scheduler", scheduler, SCHEDULERS)
    space = parse_space(table, base)
    metric, mode = _metric_and_mode(base, asked.metric, asked.mode)
    if concurrent < 1:
        raise ConfigError(f"--concurrent must be >= 1, got {concurrent}")
    if asked.cpus_per_trial <= 0:
        raise ConfigError(f"--cpus-per-trial must be > 0, got {asked.cpus_per_trial:g}")
    trials = _trial_count(space, search, trials)
    if scheduler == "pbt":
        _check_pbt(base, space, search, trials, concurrent)
    every, interval = _cadence(base, scheduler, *cadence)
    if asked.reduction < 2:
        raise ConfigError(f"--reduction must be >= 2, got {asked.reduction}")
    if asked.max_params < 0 or asked.max_failures < 0:
        raise ConfigError(
            f"--max-params and --max-failures must be >= 0, got {asked.max_params} and {asked.max_failures}"
        )
    limit = parse_memory_limit(memory_limit) if memory_limit else 0.0
    if start_at_base and search == "grid":
        raise ConfigError("--start-at-base: --search grid runs every combination already; leave it out")
    start = base_point(base, space) if start_at_base else {}
    if asked.max_failures:  # a failed trial restarts from its last checkpoint
        base.hooks.check_checkpointing(base.opts, base)
    base = base.replace(eval_every=every, progress=False)
    return dataclasses.replace(
        asked,
        base=base.to_dict(),
        space=space,
        trials=trials,
        metric=metric,
        mode=mode,
        max_steps=_most_steps(base, space),
        grace_steps=every,
        perturbation_interval=interval,
        memory_limit=limit,
        start=start,
    )


def _metric_and_mode(base: Any, metric: str, mode: str) -> tuple[str, str]:
    """The metric (the one the run reports at each evaluation; another is refused) and its direction."""
    reports = "val_loss" if base.load_data().task == "lm" else "test_accuracy"
    metric = metric or reports
    if metric != reports:
        raise ConfigError(
            f"--metric {metric}: a run of model {base.model} on {base.dataset} reports {reports} at "
            f"each evaluation, not {metric}; use --metric {reports}"
        )
    mode = mode or METRICS[metric]
    check_choice("--mode", mode, ("min", "max"))
    return metric, mode


def _trial_count(space: dict[str, Param], search: str, trials: int | None) -> int:
    """The trials to run (default: 8; grid: every combination, once), checked against the searcher."""
    grid = [k for k, p in space.items() if p.kind == "grid"]
    if search == "grid":
        ranges = [k for k, p in space.items() if not p.discrete]
        if ranges:
            raise ConfigError(
                f"--search grid runs every combination of listed values, and {', '.join(ranges)} "
                "is a range: write it as choice([...]) or grid([...]), or use --search random"
            )
        if trials not in (None, _grid_size(space)):
            raise ConfigError(
                f"--search grid runs each of the {_grid_size(space)} combinations once; leave out "
                f"--trials (got {trials})"
            )
        trials = _grid_size(space)
    elif grid and search != "random":
        raise ConfigError(
            f"{', '.join(grid)}: grid([...]) values are for --search grid or random; "
            f"--search {search} samples: write choice([...])"
        )
    trials = 8 if trials is None else trials
    if trials < 1:
        raise ConfigError(f"--trials must be >= 1, got {trials}")
    return trials


def _cadence(base: Any, scheduler: str, eval_every: int, perturbation_interval: int) -> tuple[int, int]:
    """The steps between evaluations (default: the base's ``eval_every``, else 1/4 of the steps) and between
    PBT's perturbations, checked."""
    from dtrain.training.checkpointing import train_steps

    steps = train_steps(base)
    every = eval_every or base.eval_every or max(1, steps // 4)
    if every < 1:
        raise ConfigError(f"--eval-every must be >= 1, got {every}")
    if scheduler in ("asha", "pbt") and every >= steps:
        raise ConfigError(
            f"--scheduler {scheduler} decides at evaluations, and a trial of {steps} steps evaluating "
            f"every {every} has none before its end: lower --eval-every"
        )
    interval = perturbation_interval or every
    if scheduler == "pbt" and interval % every:
        raise ConfigError(
            f"--perturbation-interval {interval} must be a multiple of --eval-every {every} "
            "(a trial hands over its checkpoint at evaluations)"
        )
    return every, interval


def base_point(base: Any, space: dict[str, Param]) -> dict[str, Any]:
    """The base run's own value of every key of the space (a gpt model's shape as its preset resolves it).

    Raises:
        ConfigError: a value the space does not hold (the searcher could not start there).
    """
    from dtrain.search.trial import meta_model
    from dtrain.workloads.models.gpt import gpt_config

    shape: dict[str, Any] = {}
    if any(k in ("layers", "d_model", "heads") for k in space):
        gcfg = gpt_config(meta_model(base)[0])
        if gcfg is not None:
            shape = {"layers": gcfg.layers, "d_model": gcfg.d_model, "heads": gcfg.heads}
    point = {k: shape.get(k, getattr(base, k, None)) for k in space}
    outside = [f"{k} = {v!r} (the space: {space[k].text()})" for k, v in point.items() if not space[k].holds(v)]
    if outside:
        raise ConfigError(f"--start-at-base: the base configuration is outside the space: {'; '.join(outside)}")
    return point


def _check_pbt(base: Any, space: dict[str, Param], search: str, trials: int, concurrent: int) -> None:
    """Population-based training perturbs keys a resumed run takes anew, from random draws, all at once."""
    fixed = [k for k in space if k not in MUTABLE]
    if fixed:
        raise ConfigError(
            f"--scheduler pbt perturbs hyper-parameters in the middle of a run, and "
            f"{', '.join(fixed)} cannot change there (a checkpoint belongs to its model, data "
            f"order and batch); PBT may perturb: {', '.join(MUTABLE)}"
        )
    if search != "random":
        raise ConfigError(
            f"--scheduler pbt draws its population at random and then perturbs it; "
            f"--search {search} would be overruled: use --search random"
        )
    if concurrent < trials:
        raise ConfigError(
            f"--scheduler pbt: the population of {trials} trains at once (a trial copies the "
            f"checkpoint of one still training), and --concurrent {concurrent} runs fewer: "
            f"give --concurrent {trials}"
        )
    base.hooks.check_checkpointing(base.opts, base)  # PBT's exploit resumes checkpoints
    if "batch_size" in space:
        _check_pbt_batches(base, space["batch_size"])


def _check_pbt_batches(base: Any, p: Param) -> None:
    """PBT over the batch: listed values (explore moves to a neighbour), each one the run takes, and a fixed
    batch to change (a batch schedule belongs to its checkpoint)."""
    from dtrain.job.validate import validate

    if not p.discrete:
        raise ConfigError(
            f"--scheduler pbt moves batch_size to a neighbouring listed value, and {p.text()} is a "
            "range: write it as choice([...]), e.g. choice([32, 64, 128])"
        )
    if base.batch_schedule:
        raise ConfigError(
            f"--scheduler pbt over batch_size changes a fixed batch, and the run has --batch-schedule "
            f"{base.batch_schedule!r}: leave the schedule out of the run"
        )
    for v in p.values:
        try:
            validate(base.replace(batch_size=v))
        except (ConfigError, TypeError, ValueError) as e:
            raise ConfigError(f"batch_size = {v!r} of the space: {e}") from None


def _fate(segments: list[dict[str, Any]], error: str | None, base: dict[str, Any], hp: dict[str, Any]) -> str:
    """The fate of a trial of configuration ``base`` with ``hp`` that left ``segments``."""
    from dtrain.search.trial import trial_config
    from dtrain.training.checkpointing import train_steps

    if error:
        return "failed"
    if not segments:
        return "not started"
    last = segments[-1]
    if last.get("fate") in ("skipped", "failed"):
        return str(last["fate"])
    if last.get("fate") == "finished":
        return "finished"
    evals = last.get("evals") or []
    if evals and int(evals[-1]["step"]) >= train_steps(trial_config(base, hp)):  # ASHA stops a trial at max_t too
        return "finished"
    return "stopped early"


def record(spec: SweepSpec, results: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """``sweep.json``: every trial's configuration, metric history and fate, the best trial; written to
    ``SWEEP/sweep.json`` and returned.

    ``results``: Tune's view of each trial (``trial``, ``config``, ``error``); the rest comes from the
    trial folders' ``trial.json``.
    """
    from dtrain.search.trial import read_trial

    out = Path(spec.out)
    trials = []
    for r in results:
        rec = read_trial(out / "trials" / r["trial"])
        segs = rec.get("segments", [])
        history = [{"segment": i, **e} for i, s in enumerate(segs) for e in s.get("evals", [])]
        exploits = [
            {"at_step": s["from"].get("step"), "from_trial": s["from"].get("trial"), "hp": s["hp"]}
            for s in segs
            if s.get("from") and s["from"].get("trial") != r["trial"]
        ]
        error = r.get("error") or next((s.get("error") for s in segs if s.get("fate") in ("failed", "skipped")), None)
        fate = _fate(segs, r.get("error"), spec.base, r["config"])
        values = [h["value"] for h in history if isinstance(h.get("value"), (int, float))]
        final = values[-1] if values and fate not in ("skipped", "failed") else None
        trials.append(
            {
                "trial": r["trial"],
                "config": {k: r["config"].get(k) for k in spec.space},
                "fate": fate,
                "steps_trained": sum(_steps_trained(s) for s in segs),
                "exploits": exploits,
                "error": error,
                "metric": final,
                "history": history,
                "folder": str(Path("trials") / r["trial"]),
            }
        )
    scored = [t for t in trials if t["metric"] is not None and math.isfinite(t["metric"])]
    best = (min if spec.mode == "min" else max)(scored, key=lambda t: t["metric"]) if scored else None
    doc = {
        "metric": spec.metric,
        "mode": spec.mode,
        "search": spec.search,
        "scheduler": spec.scheduler,
        "space": {k: p.text() for k, p in spec.space.items()},
        "base": spec.base,
        "trials_run": len(trials),
        "wall_s": round(wall_s, 2),
        "best": best and {"trial": best["trial"], "config": best["config"], "metric": best["metric"]},
        "steps_trained": sum(t["steps_trained"] for t in trials),
        "trials": trials,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / SWEEP_FILE).write_text(json.dumps(doc, indent=1, default=str))
    return doc


def _steps_trained(segment: dict[str, Any]) -> int:
    """Steps a segment trained: as far as its rank 0 got, less the step it resumed from."""
    done = int(segment.get("trained_to") or max((int(e["step"]) for e in segment.get("evals", [])), default=0))
    return max(0, done - int((segment.get("from") or {}).get("step") or 0))
