"""dtrain sweep: the space and the sweep's checks (no process), a trial resumed from another's checkpoint
(real runs, no Ray), the missing extra; and sweeps on Ray Tune (the tune extra, which ``scripts/test.sh``
installs; real Ray, real runs) on one Ray instance the module starts (``ray start --head``, as a user's
cluster): population-based training, Nevergrad's evolution over gpt shapes that skips what does not fit,
and a trial that fails while the sweep goes on."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _dist import free_port
from _helpers import read_metrics
from _patience import patient

from dtrain.config.schema import RunConfig
from dtrain.errors import ConfigError
from dtrain.search.space import parse_param, parse_space
from dtrain.search.sweep import build_spec

BASE = RunConfig.from_mapping({"workers": 1, "epochs": 2, "trace": False})


@pytest.fixture(scope="module")
def ray_head() -> Iterator[str]:
    """One Ray instance for the module's sweeps (``ray start --head --block``, 2 CPUs: two trials at once), its
    address for ``dtrain sweep --address``, with a token of its own (Ray's token authentication, as on a
    cluster; in this process's environment, so the sweeps pass it on); its processes are killed at the end,
    nothing else of Ray's."""
    import secrets

    from dtrain.search.raycluster import auth_env

    if importlib.util.find_spec("ray") is None:
        pytest.fail(
            "the sweeps on Ray Tune need the tune extra: .venv/bin/pip install -e '.[tune]' "
            "(bash scripts/test.sh installs it)"
        )
    auth = auth_env(secrets.token_hex(32))
    mp = pytest.MonkeyPatch()
    for k, v in auth.items():
        mp.setenv(k, v)
    port = free_port()
    ray = Path(sys.executable).parent / "ray"
    p = subprocess.Popen(
        [
            str(ray),
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--num-cpus=2",
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--object-store-memory={100 << 20}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
    )
    seen = []
    try:
        assert p.stdout is not None
        for line in p.stdout:  # the head says so once its services are up
            seen.append(line)
            if "Ray runtime started" in line:
                break
        else:
            pytest.fail("ray start --head ended:\n" + "".join(seen[-20:]))
        yield f"127.0.0.1:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # the head, its raylet and the workers it started: one group
        p.wait(timeout=30)
        mp.undo()
        current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
        with contextlib.suppress(OSError):
            if current.read_text().strip().endswith(f":{port}"):
                current.unlink()


def _spec(table: dict[str, Any], base: RunConfig = BASE, **kw: Any) -> Any:
    args: dict[str, Any] = dict(
        out="/nonexistent/sweep",
        search="random",
        scheduler="fifo",
        trials=None,
        concurrent=2,
        metric=None,
        mode=None,
        seed=0,
    )
    return build_spec(base, table, **{**args, **kw})


@pytest.mark.parametrize(
    "text, says",
    [
        ("lognormal(1, 2)", "unknown distribution 'lognormal'"),
        ("loguniform(0, 1)", "0 < low"),
        ("uniform(2, 1)", "low < high"),
        ("randint(1.5, 3)", "integer ends"),
        ("choice([])", "at least one value"),
        ("choice([1, 1])", "listed twice"),
        ("uniform(a, 1)", "literal"),
        ("1e-3", "not a distribution"),
        (0.1, "a distribution is a string"),
    ],
)
def test_a_bad_distribution_is_one_line_naming_the_key(text: Any, says: str) -> None:
    with pytest.raises(ConfigError, match="lr") as e:
        parse_param("lr", text)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_the_distributions_parse() -> None:
    p = parse_param("lr", "loguniform(1e-4, 1e-1)")
    assert (p.kind, p.low, p.high, p.edges()) == ("loguniform", 1e-4, 1e-1, (1e-4, 1e-1))
    assert parse_param("layers", "randint(1, 5)").edges() == (1, 4)
    assert parse_param("compression", "grid(['none', 'topk:0.01'])").values == ("none", "topk:0.01")


@pytest.mark.parametrize(
    "table, kw, says",
    [
        ({}, {}, "the search space is empty"),
        ({"learning_rate": "uniform(0.1, 1)"}, {}, "learning_rate: not a key of this run's configuration"),
        ({"microbatches": "choice([2, 4])"}, {}, "an option of pipeline, hybrid, not of dp"),
        ({"batch_size": "choice(['big'])"}, {}, "batch_size"),
        (
            {"lr": "uniform(0.01, 0.1)"},
            {"metric": "val_loss"},
            "reports test_accuracy at each evaluation, not val_loss",
        ),
        ({"layers": "randint(1, 3)"}, {"scheduler": "pbt", "concurrent": 8}, "layers cannot change there"),
        ({"batch_size": "randint(16, 128)"}, {"scheduler": "pbt", "concurrent": 8}, "write it as choice([...])"),
        ({"batch_size": "choice([32, 0])"}, {"scheduler": "pbt", "concurrent": 8}, "batch_size = 0 of the space"),
        ({"lr": "uniform(0.01, 0.1)"}, {"scheduler": "pbt", "trials": 4, "concurrent": 2}, "give --concurrent 4"),
        ({"lr": "uniform(0.01, 0.1)"}, {"scheduler": "pbt", "search": "tpe", "concurrent": 8}, "use --search random"),
        ({"lr": "uniform(0.01, 0.1)"}, {"search": "grid"}, "lr is a range"),
        ({"lr": "grid([0.01, 0.1])"}, {"search": "tpe"}, "write choice([...])"),
        ({"lr": "uniform(0.01, 0.1)"}, {"search": "annealing"}, "--search"),
        ({"lr": "uniform(0.01, 0.1)"}, {"scheduler": "asha", "eval_every": 1000}, "lower --eval-every"),
        ({"lr": "uniform(0.01, 0.1)"}, {"memory_limit": "lots"}, "cannot read the memory limit 'lots'"),
        (
            {"lr": "uniform(0.1, 1)"},
            {"start_at_base": True},
            "outside the space: lr = 0.05 (the space: uniform(0.1, 1))",
        ),
        ({"lr": "choice([0.05])"}, {"start_at_base": True, "search": "grid"}, "runs every combination already"),
    ],
)
def test_a_bad_sweep_is_refused_before_anything_starts(table: dict[str, Any], kw: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError) as e:
        _spec(table, **kw)
    assert says in str(e.value), str(e.value)


def test_the_search_can_start_at_the_base_configuration() -> None:
    """--start-at-base: the first point is the base run's own values, a gpt preset's shape resolved (gpt-tiny:
    2 layers of 64, 4 heads), and the searchers are handed it."""
    from dtrain.search.tune import _searcher

    tiny = RunConfig.from_mapping({"workers": 1, "model": "gpt-tiny", "dataset": "pytext", "trace": False})
    table = {
        "layers": "randint(1, 7)",
        "d_model": "choice([32, 64])",
        "heads": "choice([1, 4])",
        "lr": "loguniform(1e-3, 0.3)",
    }
    spec = _spec(table, base=tiny, start_at_base=True, search="evolution")
    assert spec.start == {"layers": 2, "d_model": 64, "heads": 4, "lr": 0.05}
    assert _spec(table, base=tiny).start == {}
    for search in ("random", "tpe", "evolution"):
        got = _searcher(dataclasses.replace(spec, search=search))
        inner = getattr(got, "searcher", got)  # ConcurrencyLimiter wraps the model-based ones
        points = getattr(inner, "_points_to_evaluate", None)
        assert points == [spec.start], (search, points)


def test_pbt_moves_a_listed_batch_to_a_neighbour() -> None:
    """PBT's explore (Ray's own) changes a listed batch to the next value up or down the list, never by a
    factor (64 x 1.2 would be no batch of the space)."""
    from ray.tune.schedulers.pbt import _explore  # the tune extra, which scripts/test.sh installs

    from dtrain.search.tune import _mutation, clip

    spec = _spec(
        {"batch_size": "choice([32, 64, 128])", "lr": "uniform(0.01, 0.1)"}, scheduler="pbt", trials=4, concurrent=4
    )
    mutations = {k: _mutation(p) for k, p in spec.space.items()}
    seen = set()
    for seed in range(40):
        random.seed(seed)
        new, _ = _explore({"batch_size": 64, "lr": 0.05}, mutations, 0.0, (1.2, 0.8), lambda c: clip(spec, c))
        seen.add(new["batch_size"])
        assert 0.01 <= new["lr"] < 0.1
    assert seen == {32, 128}


def test_pbt_perturbations_stay_inside_the_range() -> None:
    from dtrain.search.tune import clip

    spec = _spec({"momentum": "uniform(0.0, 0.95)", "layers": "randint(1, 4)", "lr": "choice([0.1, 0.2])"})
    got = clip(spec, {"momentum": 0.9 * 1.2, "layers": 3 * 1.2, "lr": 0.2})
    assert 0.0 <= got["momentum"] < 0.95 and got["layers"] == 3 and got["lr"] == 0.2
    assert clip(spec, {"momentum": 0.5, "layers": 0.8, "lr": 0.1}) == {"momentum": 0.5, "layers": 1, "lr": 0.1}


def test_a_sweep_spec_fills_in_what_the_run_implies() -> None:
    s = _spec({"lr": "loguniform(1e-3, 1e-1)", "batch_size": "choice([32, 64])"}, scheduler="asha")
    assert (s.metric, s.mode, s.trials) == ("test_accuracy", "max", 8)
    # digits: 1437 training samples, whole batches; the longest trial is 2 epochs at batch 32 (44 a epoch), the
    # base run's 2 epochs at 64 (22 an epoch) evaluated 4 times
    assert s.max_steps == 2 * 44 and s.eval_every == 2 * 22 // 4 and s.grace_steps == s.eval_every
    g = _spec({"lr": "choice([0.01, 0.1])", "momentum": "grid([0.0, 0.9])"}, search="grid")
    assert (g.trials, g.samples) == (4, 1)
    assert set(parse_space({"lr": "uniform(0.1, 1)", "compression": "choice(['none', 'topk:0.1'])"}, BASE)) == {
        "lr",
        "compression",
    }


def test_a_driver_joining_a_cluster_takes_token_authentication_when_a_token_is_at_hand(tmp_path: Path) -> None:
    from dtrain.search.tune import token_mode

    assert not token_mode({}, tmp_path)  # no token anywhere: Ray's own default
    assert token_mode({"RAY_AUTH_TOKEN": "abc"}, tmp_path)
    (tmp_path / "t").write_text("abc")
    assert token_mode({"RAY_AUTH_TOKEN_PATH": str(tmp_path / "t")}, tmp_path / "nowhere")
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("abc")  # what `ray start` leaves
    assert token_mode({}, tmp_path)
    assert not token_mode({"RAY_AUTH_MODE": "disabled"}, tmp_path)  # the user's own choice stands


def test_a_trial_the_scheduler_stops_at_its_last_step_has_finished(tmp_path: Path) -> None:
    """ASHA stops a trial that reaches its last step (max_t) as it stops one early: sweep.json tells them
    apart by the trial's own last step (2 epochs: 44 at its batch of 64, 88 at 32), not the scheduler's verdict."""
    from dtrain.search.sweep import record

    spec = dataclasses.replace(_spec({"batch_size": "choice([32, 64])"}, scheduler="asha"), out=str(tmp_path))
    runs = {"a": (64, [22, 44]), "b": (32, [22, 44]), "c": (32, [22, 44, 66, 88])}
    for t, (_, steps) in runs.items():
        (tmp_path / "trials" / t).mkdir(parents=True)
        seg = {"run": "run-0", "hp": {}, "evals": [{"step": s, "value": 0.5} for s in steps]}
        (tmp_path / "trials" / t / "trial.json").write_text(json.dumps({"segments": [seg]}))
    doc = record(spec, [{"trial": t, "config": {"batch_size": b}, "error": None} for t, (b, _) in runs.items()], 1.0)
    assert [t["fate"] for t in doc["trials"]] == ["finished", "stopped early", "finished"]


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_an_exploited_trial_continues_exactly_where_its_donor_was(tmp_path: Path) -> None:
    """A trial resumed from another trial's checkpoint (PBT's exploit) trains on from the donor's parameters,
    optimizer state (momentum) and error-feedback residuals: with the donor's own hyper-parameters its losses
    from that step on equal the donor's uninterrupted ones, and its checkpoint is the donor's, byte for byte."""
    from dtrain.search.trial import run_trial

    base = RunConfig.from_mapping(
        {"workers": 2, "epochs": 1, "trace": False, "eval_every": 5, "momentum": 0.9, "compression": "topk:0.05"}
    ).to_dict()
    seen: list[tuple[dict[str, Any], Path | None]] = []
    donor = tmp_path / "trials" / "t0"  # as a sweep folder holds its trials
    run_trial(donor, base, {"lr": 0.05}, lambda m, c: seen.append((m, c)), metric="test_accuracy", checkpoints=True)
    assert [m["step"] for m, _ in seen] == [5, 10, 15, 20, 22] and all(c is not None for _, c in seen)
    at_10 = seen[1][1]
    assert at_10 is not None and json.loads((at_10 / "donor.json").read_text())["trial"] == "t0"
    got: list[dict[str, Any]] = []
    taker = tmp_path / "trials" / "t1"
    rec = run_trial(
        taker, base, {"lr": 0.05}, lambda m, c: got.append(m), metric="test_accuracy", resume=at_10, checkpoints=True
    )
    assert rec["from"]["trial"] == "t0" and rec["from"]["step"] == 10 and rec["fate"] == "finished"
    copied = taker / "from-0"
    for f in at_10.iterdir():
        assert (copied / f.name).read_bytes() == f.read_bytes(), f.name

    def losses(run: Path) -> dict[tuple[int, int], float]:
        return {(r["step"], r["rank"]): r["loss"] for r in read_metrics(run)}

    before, after = losses(donor / "run-0"), losses(taker / "run-0")
    assert min(s for s, _ in after) == 10 and set(after) == {k for k in before if k[0] >= 10}
    assert all(after[k] == before[k] for k in after), "the resumed trial's losses differ from its donor's"
    assert [m["test_accuracy"] for m in got] == [m["test_accuracy"] for m, _ in seen if m["step"] > 10]

    # PBT's explore may change the batch: from the same checkpoint at 128 (the donor's 64), the trial goes on
    # from the donor's sample (10 steps x 32 of each worker's 718) at 64 a worker, to its epoch's end
    wide = tmp_path / "trials" / "t2"
    rec = run_trial(
        wide, base, {"lr": 0.05, "batch_size": 128}, lambda m, c: None, metric="test_accuracy", resume=at_10
    )
    assert rec["fate"] == "finished", rec
    rows = read_metrics(wide / "run-0")
    assert sorted({r["step"] for r in rows}) == list(range(10, 10 + (718 - 10 * 32) // 64))
    assert {r["epoch"] for r in rows} == {0}

    # the two trials as a sweep: sweep.json and dtrain report's page name the exploit, from t0 at step 10
    from dtrain.observe.report_sweep import write_sweep_report
    from dtrain.search.sweep import record

    spec = dataclasses.replace(_spec({"lr": "uniform(0.01, 0.1)"}), out=str(tmp_path), scheduler="pbt")
    doc = record(spec, [{"trial": t, "config": {"lr": 0.05}, "error": None} for t in ("t0", "t1")], wall_s=1.0)
    t1 = doc["trials"][1]
    assert t1["exploits"] == [{"at_step": 10, "from_trial": "t0", "hp": {"lr": 0.05}}] and t1["fate"] == "finished"
    assert t1["steps_trained"] == 22 - 10 and doc["trials"][0]["steps_trained"] == 22
    page, text = write_sweep_report(tmp_path)
    lineage = page.read_text().split('class="lineage"')[1].split("</table>")[0]
    assert lineage.count("<tr>") == 2 and "<td>10</td><td>t1</td><td>t0</td>" in lineage, lineage


def _sweep(tmp_path: Path, run_toml: str, space: str, *flags: str, timeout: float) -> tuple[Any, Path]:
    """``dtrain sweep`` of the run configuration ``run_toml`` over ``[sweep.space]`` ``space``, with ``flags``, in
    a fresh process; its completed process and its sweep folder."""
    run, space_file, out = tmp_path / "run.toml", tmp_path / "space.toml", tmp_path / "sweep"
    run.write_text(run_toml)
    space_file.write_text("[sweep.space]\n" + space)
    p = subprocess.run(
        [sys.executable, "-m", "dtrain.cli", "sweep", str(run), "--space", str(space_file), *flags, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=patient(timeout),
    )
    return p, out


@pytest.mark.slow  # minutes of the default suite on 2 cores; CI runs the slow tier
@pytest.mark.procs
@pytest.mark.timeout(300)
def test_population_based_training_on_ray_tune(tmp_path: Path, ray_head: str) -> None:
    """A real PBT sweep of 2 trials (one epoch, 22 steps, evaluated at 11 and 22: one perturbation, at 11): the
    trial in the bottom half copies the other's checkpoint and goes on with a perturbed learning rate;
    sweep.json records every trial, its history and each exploit, and the best trial."""
    p, out = _sweep(
        tmp_path,
        "workers = 1\nepochs = 1\ntrace = false\n",
        'lr = "loguniform(1e-3, 1e-1)"\n',  # seed 0 draws 0.019 and 0.0035
        "--scheduler",
        "pbt",
        "--trials",
        "2",
        "--concurrent",
        "2",
        "--eval-every",
        "11",
        "--seed",
        "0",
        "--address",
        ray_head,
        timeout=280,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["trials_run"] == 2 and doc["scheduler"] == "pbt"
    trials = {t["trial"]: t for t in doc["trials"]}
    exploits = [(t, ex) for t in trials.values() for ex in t["exploits"]]
    assert exploits, trials
    for taker, ex in exploits:
        donor = trials[ex["from_trial"]]
        assert donor is not taker and ex["at_step"] in (11, 22)  # PBT decides at every evaluation, the last too
        # the taker went on from the donor's evaluation at that step, with a learning rate perturbed from the donor's
        segs = json.loads((out / taker["folder"] / "trial.json").read_text())["segments"]
        seg = next(
            s for s in segs if s.get("from", {}).get("trial") == donor["trial"] and s["from"]["step"] == ex["at_step"]
        )
        mine = json.loads((out / donor["folder"] / "trial.json").read_text())["segments"]
        held = next(s for s in mine if any(e["step"] == ex["at_step"] for e in s.get("evals", [])))
        at = next(e for e in held["evals"] if e["step"] == ex["at_step"])
        assert seg["from"]["value"] == at["value"] and seg["hp"]["lr"] != held["hp"]["lr"]
    for t in trials.values():
        assert t["fate"] == "finished" and t["history"][-1]["step"] == 22
        assert 1e-3 <= t["config"]["lr"] < 1e-1  # PBT's perturbations stay inside the space's range
    best = max(trials.values(), key=lambda t: t["metric"])
    assert doc["best"]["trial"] == best["trial"] and doc["best"]["metric"] == best["metric"]
    assert f"best: trial {best['trial']}" in p.stdout
    # dtrain report SWEEP: the trials, the best, and each exploit as a lineage row naming both trials
    from dtrain.observe.report_sweep import write_sweep_report

    page, text = write_sweep_report(out)
    html = page.read_text()
    assert f"best            trial {best['trial']}" in text and "2 finished" in text
    assert all(t in html for t in trials) and "lr of every trial over the steps" in html
    rows = html.split('class="lineage"')[1].split("</table>")[0].count("<tr>") - 1
    assert rows == len(exploits)


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_without_the_tune_extra_the_sweep_names_the_pip_command(tmp_path: Path) -> None:
    hide = textwrap.dedent("""
        import sys
        from importlib.abc import MetaPathFinder

        class NoRay(MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("ray", "optuna", "nevergrad"):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                return None

        sys.meta_path.insert(0, NoRay())
        from dtrain.cli import main
        sys.exit(main(sys.argv[1:]))
    """)
    space = tmp_path / "space.toml"
    space.write_text('[sweep.space]\nlr = "uniform(0.01, 0.1)"\n')
    p = subprocess.run(
        [sys.executable, "-c", hide, "sweep", "--space", str(space), "--out", str(tmp_path / "s")],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip() == (
        "dtrain: error: dtrain sweep needs Ray Tune, which is not installed: pip install 'dtrain[tune]'"
    ), p.stderr
    assert not (tmp_path / "s").exists()


def test_a_shape_that_does_not_fit_is_skipped_before_it_starts(tmp_path: Path) -> None:
    """Architecture search: heads not dividing the width, a model over the parameter budget, or one that needs
    more memory per device than the limit by the planner's memory model, is refused by the trial's checks
    (dtrain run's own validation, the budgets on the meta device) and recorded as skipped."""
    from dtrain.search.trial import Limits, model_params, read_trial, run_trial

    base = RunConfig.from_mapping(
        {"workers": 1, "model": "gpt-tiny", "dataset": "pytext", "trace": False, "eval_every": 10}
    ).to_dict()

    def never(m: dict[str, Any], c: Path | None) -> None:
        raise AssertionError("a skipped trial reports nothing itself")

    with pytest.raises(ConfigError, match="heads"):
        run_trial(tmp_path / "a", base, {"d_model": 48, "heads": 5}, never, metric="val_loss")
    tiny = model_params(RunConfig.from_mapping(base))
    with pytest.raises(ConfigError, match=f"over the sweep's --max-params {tiny:,}"):
        run_trial(tmp_path / "b", base, {"layers": 3}, never, metric="val_loss", limits=Limits(max_params=tiny))
    with pytest.raises(
        ConfigError, match="per device by the planner's memory model, over the sweep's --memory-limit 16 MiB"
    ):
        run_trial(
            tmp_path / "c",
            base,
            {"layers": 4, "d_model": 128},
            never,
            metric="val_loss",
            limits=Limits(memory_limit=16 * 2**20),
        )
    for t in ("a", "b", "c"):
        (seg,) = read_trial(tmp_path / t)["segments"]
        assert seg["fate"] == "skipped" and not (tmp_path / t / "run-0").exists()


def test_the_memory_limit_is_the_planners_figure() -> None:
    """A trial's memory is what ``dtrain plan --memory-limit`` would find for the same run: the planner's
    prediction for its strategy, workers and batch (dp with a ZeRO stage and Adam, at 4 workers, here);
    the limit lets through what the planner keeps and refuses what it rejects."""
    from dtrain.perfmodel.ranking import plan
    from dtrain.perfmodel.spec import ClusterSpec
    from dtrain.registry import Choice
    from dtrain.search.trial import Limits, model_memory
    from dtrain.workloads.load import load_model

    cfg = RunConfig.from_mapping(
        {"workers": 4, "model": "gpt-tiny", "dataset": "pytext", "optimizer": "adam", "dp": {"shard": "gradients"}}
    )
    need = model_memory(cfg)
    model, sample, name = load_model(cfg.model, cfg.dataset, batch=cfg.batch_size, seq_len=cfg.seq_len)
    own = Choice(cfg.strategy, cfg.workers, cfg.options)
    spec = ClusterSpec(nodes=1, devices_per_node=4)
    fits = plan(
        model,
        sample,
        spec,
        workers=4,
        name=name,
        optimizer="adam",
        strategies=[own],
        measure=False,
        memory_limit=need * 1.01,
    )
    over = plan(
        model,
        sample,
        spec,
        workers=4,
        name=name,
        optimizer="adam",
        strategies=[own],
        measure=False,
        memory_limit=need * 0.99,
    )
    assert fits.ranked and fits.ranked[0].memory.total == pytest.approx(need, rel=1e-9)
    assert not over.ranked and "over the memory limit" in over.rejected[0][1]
    entry: dict[str, Any] = {}
    Limits(memory_limit=need * 1.01).check(cfg, entry)
    assert entry["memory"] == pytest.approx(need, rel=1e-9)
    with pytest.raises(ConfigError, match="--memory-limit"):
        Limits(memory_limit=need * 0.99).check(cfg, {})


@pytest.mark.procs
@pytest.mark.slow  # the default tier: a shape that does not fit skipped (no Ray), a grid sweep on the Ray head
@pytest.mark.timeout(180)
def test_evolution_over_shapes_skips_what_does_not_fit(tmp_path: Path, ray_head: str) -> None:
    """The evolutionary searcher (Nevergrad on Ray Tune) over gpt shapes with a budget no shape meets: every
    trial is skipped before a run starts, the searcher is told the worst value, and the sweep says so."""
    p, out = _sweep(
        tmp_path,
        'workers = 1\nmodel = "gpt-tiny"\ndataset = "pytext"\ntrace = false\neval_every = 10\n',
        'layers = "randint(1, 4)"\nd_model = "choice([32, 64])"\n',
        "--search",
        "evolution",
        "--trials",
        "2",
        "--concurrent",
        "1",
        "--max-params",
        "1000",
        "--address",
        ray_head,
        timeout=170,
    )
    assert p.returncode == 1 and "no trial reported a metric" in p.stderr, p.stdout[-2000:] + p.stderr[-3000:]
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["trials_run"] == 2 and doc["best"] is None and doc["steps_trained"] == 0
    for t in doc["trials"]:
        assert t["fate"] == "skipped" and "over the sweep's --max-params 1,000" in t["error"], t
        assert 1 <= t["config"]["layers"] <= 3 and t["config"]["d_model"] in (32, 64)


@pytest.mark.procs
@pytest.mark.timeout(180)
def test_a_trial_that_fails_is_reported_and_the_sweep_goes_on(tmp_path: Path, ray_head: str) -> None:
    """A trial whose run fails (a learning rate that makes the loss non-finite: the run stops naming the step)
    and has no restarts left is recorded as failed with the run's own message; the other trial finishes and
    the sweep names it the best."""
    p, out = _sweep(
        tmp_path,
        "workers = 1\nepochs = 1\ntrace = false\n",
        'lr = "grid([0.05, 1e12])"\n',
        "--search",
        "grid",
        "--concurrent",
        "2",
        "--eval-every",
        "11",
        "--address",
        ray_head,
        timeout=170,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    doc = json.loads((out / "sweep.json").read_text())
    fates = {t["config"]["lr"]: t for t in doc["trials"]}
    bad, good = fates[1e12], fates[0.05]
    assert bad["fate"] == "failed" and "NonFiniteError: rank 0 at step" in bad["error"], bad
    assert good["fate"] == "finished" and good["history"][-1]["step"] == 22
    assert doc["best"]["trial"] == good["trial"] and f"best: trial {good['trial']}" in p.stdout
    assert f"{bad['trial']}  test_accuracy        -  failed (" in p.stdout, p.stdout
