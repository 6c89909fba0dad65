"""``dtrain run --grad-accum N`` and ``--clip-grad-norm MAX`` through the CLI (real gloo processes, 2 workers, 3 steps).

Accumulation: N = 2 micro-steps of B/N per rank train like one step of B (the same per-step losses and final
test accuracy) under dp (both overlaps), ddp, ZeRO 1-3 and ps bsp; every accumulated run's trace holds two
forwards a step, dp's one synchronised backward a step; the bytes per optimizer step of dp, ZeRO 1-2 and ps are
the unaccumulated run's (ZeRO-3 keeps its units gathered over the micro-steps: one gather and one reduce-scatter
a step, its closed form checked). Clipping: dp, ddp, ZeRO-3 (with accumulation too), a 2-stage
pipeline, ps bsp on 2 servers and tensor parallelism over 2 ranks (with and without accumulation) train like a
plain torch loop on the global batch with ``torch.nn.utils.clip_grad_norm_``, and each row's ``grad_norm`` is
that loop's norm before clipping; the loop without clipping is checked to be far from it (the clip binds);
under fp16 the norm is the unscaled gradient's. Bad input is refused before any process starts.

The default tier runs dp, ZeRO-2/3 and tensor parallelism (7 runs, about a minute); the other strategies and
the final parameters are marked slow (13 more runs, about 3 minutes on 2 cores):
``pytest -m slow tests/test_accumulate_run.py``.
"""

from __future__ import annotations

import json

import pytest
import torch
from _helpers import dtrain_runs, mean_losses, read_metrics, read_summary

from dtrain.config.schema import RunConfig
from dtrain.errors import ConfigError
from dtrain.job.validate import validate

STEPS, BATCH, LR = 3, 32, 0.05
COMMON = [
    "--epochs",
    "1",
    "--no-progress",
    "--no-trace",
    "--batch-size",
    str(BATCH),
    "--max-steps",
    str(STEPS),
    "--workers",
    "2",
    "--lr",
    str(LR),
]
GPT = ["--model", "gpt-tiny", "--dataset", "pytext", "--seq-len", "16", "--eval-samples", "64"]
# the clipped runs: norms far above MAX in each step (0.32, 0.29, 0.19 for the CNN; 3.7, 2.7, 2.2 for gpt-tiny), and a
# learning rate at which the clip changes the losses 100x more than the tolerance (both checked below)
CLIP_LR, MAX_NORM = 0.5, 0.05
GPT_LR, GPT_MAX = 0.1, 0.5
CLIP = ["--clip-grad-norm", str(MAX_NORM), "--lr", str(CLIP_LR)]
TENSOR = ["--clip-grad-norm", str(GPT_MAX), "--strategy", "tensor", *GPT, "--lr", str(GPT_LR)]


def _reference(
    model: str, clip: float, *, lr: float, dataset: str = "digits", seq_len: int = 64
) -> tuple[list[float], list[float]]:
    """A plain torch loop on the global batch, as a one-process ``dtrain run`` draws it: the seeded model, the
    epoch's shuffled order, SGD (momentum 0.9), ``clip_grad_norm_`` before each step (``clip`` 0: none).
    The per-step losses and norms before clipping."""
    from torch.utils.data import DataLoader, DistributedSampler

    from dtrain.workloads.data import load_dataset
    from dtrain.workloads.models import build_model, task_loss

    ds = load_dataset(dataset, seed=0, seq_len=seq_len)
    torch.manual_seed(0)
    net = build_model(model, ds.input_shape, ds.num_classes)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    sampler: DistributedSampler[object] = DistributedSampler(
        ds.train, num_replicas=1, rank=0, shuffle=True, seed=0, drop_last=True
    )
    sampler.set_epoch(0)
    losses, norms = [], []
    for _, (x, y) in zip(range(STEPS), DataLoader(ds.train, batch_size=BATCH, sampler=sampler, drop_last=True)):
        opt.zero_grad()
        loss = task_loss(net(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(net.parameters(), clip if clip else float("inf"))
        opt.step()
        losses.append(float(loss.detach()))
        norms.append(float(norm))
    return losses, norms


def _norms(out) -> dict[int, set[float]]:
    got: dict[int, set[float]] = {}
    for r in read_metrics(out):
        got.setdefault(r["step"], set()).add(r["grad_norm"])
    return got


N2 = ["--grad-accum", "2", "--trace"]  # the trace shows the micro-steps


def _spans(out, name: str) -> list[int]:
    """The ranks (trace pids) of every span ``name`` in a run's trace."""
    events = json.loads((out / "trace.json").read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    return sorted(e["pid"] for e in events if e.get("name") == name and e.get("ph") in ("X", "B"))


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory):
    """The default tier's runs: dp without and with accumulation, ZeRO-2 and ZeRO-3 with it."""
    root = tmp_path_factory.mktemp("accum")
    return dtrain_runs(
        root,
        COMMON,
        {
            "dp": [],
            "dp_n2": [*N2],
            "zero2_n2": ["--shard", "gradients", *N2],
            "zero3_n2": ["--shard", "parameters", *N2],
        },
        timeout=400,
    )


@pytest.fixture(scope="module")
def accumulated_more(accumulated, tmp_path_factory):
    """The slow tier's: ZeRO-1, ddp, dp --overlap forward, ps bsp without and with accumulation."""
    root = tmp_path_factory.mktemp("accum_more")
    return {
        **accumulated,
        **dtrain_runs(
            root,
            COMMON,
            {
                "zero1_n2": ["--shard", "optimizer", *N2],
                "ddp_n2": ["--strategy", "ddp", *N2],
                "dp_forward_n2": ["--overlap", "forward", *N2],
                "ps": ["--strategy", "ps"],
                "ps_n2": ["--strategy", "ps", *N2],
            },
            timeout=400,
        ),
    }


SLOW = pytest.mark.slow  # about 20 s a run on 2 cores: the rest of the strategies in the slow tier


def _cnn_padded(world: int) -> int:
    from dtrain.sharded._flat_units import plan_units
    from dtrain.workloads.data import load_dataset
    from dtrain.workloads.models import build_model

    ds = load_dataset("digits")
    return sum(u.padded for u in plan_units(build_model("cnn", tuple(ds.input_shape), ds.num_classes), None, world))


@pytest.mark.procs
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "name",
    [
        "dp_n2",
        "zero2_n2",
        "zero3_n2",
        *(pytest.param(n, marks=SLOW) for n in ("zero1_n2", "ddp_n2", "dp_forward_n2", "ps_n2")),
    ],
)
def test_two_micro_steps_of_half_the_batch_train_like_one_step(request, name):
    runs = request.getfixturevalue("accumulated" if name in ("dp_n2", "zero2_n2", "zero3_n2") else "accumulated_more")
    base, out = runs["ps" if name == "ps_n2" else "dp"][0], runs[name][0]
    a, b = mean_losses(base), mean_losses(out)
    assert sorted(a) == sorted(b) == list(range(STEPS))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5), step
    assert read_summary(out)["metric"] == pytest.approx(read_summary(base)["metric"], abs=1e-9)
    rows = read_metrics(out)
    assert len(rows) == 2 * STEPS  # one row per optimizer step and rank
    ranks = sorted({r["rank"] for r in rows})
    assert _spans(out, "forward") == sorted(ranks * 2 * STEPS)  # two micro-steps a step on each worker


@pytest.mark.procs
@pytest.mark.timeout(900)
def test_the_exchange_happens_once_per_optimizer_step(accumulated):
    sent = {
        name: {(r["step"], r["rank"]): r["bytes_sent"] for r in read_metrics(accumulated[name][0])}
        for name in accumulated
    }
    assert sent["dp_n2"] == sent["dp"] and min(sent["dp"].values()) > 0
    # dp's row holds the figures of a step's synchronised backward: that there is one a step, and not one a
    # micro-step, is in the trace (the end of each synchronised backward waits for the buckets, a span)
    assert _spans(accumulated["dp_n2"][0], "wait for buckets") == [0] * STEPS + [1] * STEPS
    # ring reduce-scatter and allgather over 2 ranks: one segment of padded / 2 float32s per unit and collective
    seg = _cnn_padded(2) // 2 * 4
    later = [k for k in sent["dp"] if k[0] >= 1]  # step 0 of stages 1-2 has no stepped shards to gather yet
    assert {sent["zero2_n2"][k] for k in later} == {2 * seg}  # the unaccumulated run's closed form
    # stage 3 keeps its units gathered over the micro-steps: one gather (the first forward's; the backwards find
    # the units gathered) and one reduce-scatter a step, 2 collectives where an unaccumulated step makes 3
    assert set(sent["zero3_n2"].values()) == {2 * seg}


@pytest.mark.procs
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_zero1_and_ps_exchange_once_per_optimizer_step(accumulated_more):
    sent = {
        name: {(r["step"], r["rank"]): r["bytes_sent"] for r in read_metrics(accumulated_more[name][0])}
        for name in ("zero1_n2", "ps", "ps_n2")
    }
    assert sent["ps_n2"] == sent["ps"] and min(sent["ps"].values()) > 0  # one push and pull a step
    seg = _cnn_padded(2) // 2 * 4
    assert {v for (step, _), v in sent["zero1_n2"].items() if step >= 1} == {2 * seg}


@pytest.mark.procs
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_final_parameters_of_an_accumulated_run_are_the_unaccumulated_ones(tmp_path):
    """gpt-tiny (a language model's run leaves its final parameters in model.pt): dp with 2 micro-steps and ZeRO-3
    with 2 micro-steps end with dp's parameters and validation loss."""
    runs = dtrain_runs(
        tmp_path,
        [*COMMON, *GPT, "--lr", str(GPT_LR)],
        {"dp": [], "dp_n2": ["--grad-accum", "2"], "zero3_n2": ["--shard", "parameters", "--grad-accum", "2"]},
        timeout=400,
    )
    want = torch.load(runs["dp"][0] / "model.pt")
    for name in ("dp_n2", "zero3_n2"):
        got = torch.load(runs[name][0] / "model.pt")
        assert sorted(got) == sorted(want), name
        moved = max(float((want[k] - got[k]).abs().max()) for k in want)
        assert moved < 1e-5, (name, moved)
        assert read_summary(runs[name][0])["val_loss"] == pytest.approx(
            read_summary(runs["dp"][0])["val_loss"], rel=1e-5
        )
    from dtrain.workloads.data import load_dataset
    from dtrain.workloads.models import build_model

    ds = load_dataset("pytext", seed=0, seq_len=16)
    torch.manual_seed(0)
    init = build_model("gpt-tiny", ds.input_shape, ds.num_classes).state_dict()
    # the 1e-5 above can fail: the 3 steps moved the parameters far more than it
    assert max(float((want[k] - init[k]).abs().max()) for k in want) > 1e-3


@pytest.fixture(scope="module")
def clipped(tmp_path_factory):
    """The default tier's clipped runs: dp, ZeRO-3 with accumulation, tensor parallel."""
    root = tmp_path_factory.mktemp("clip")
    return dtrain_runs(
        root,
        COMMON,
        {"dp": CLIP, "zero3_n2": [*CLIP, "--shard", "parameters", "--grad-accum", "2"], "tensor": TENSOR},
        timeout=400,
    )


@pytest.fixture(scope="module")
def clipped_more(clipped, tmp_path_factory):
    """The slow tier's: ddp, a 2-stage pipeline, ps bsp on 2 servers, tensor with accumulation, dp under fp16."""
    root = tmp_path_factory.mktemp("clip_more")
    return {
        **clipped,
        **dtrain_runs(
            root,
            COMMON,
            {
                "ddp": [*CLIP, "--strategy", "ddp"],
                "pipeline": [*CLIP, "--strategy", "pipeline", "--microbatches", "2"],
                "ps": [*CLIP, "--strategy", "ps", "--servers", "2"],
                "tensor_n2": [*TENSOR, "--grad-accum", "2"],
                "dp_fp16": [*CLIP, "--precision", "fp16"],
            },
            timeout=400,
        ),
    }


@pytest.mark.procs
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "name", ["dp", "zero3_n2", "tensor", *(pytest.param(n, marks=SLOW) for n in ("ddp", "pipeline", "ps", "tensor_n2"))]
)
def test_a_clipped_run_trains_like_one_process_clipped(request, name):
    clipped = request.getfixturevalue("clipped" if name in ("dp", "zero3_n2", "tensor") else "clipped_more")
    lm = name.startswith("tensor")
    kw = dict(lr=GPT_LR, dataset="pytext", seq_len=16) if lm else dict(lr=CLIP_LR)
    model, limit = ("gpt-tiny", GPT_MAX) if lm else ("cnn", MAX_NORM)
    want, norms = _reference(model, limit, **kw)
    free, _ = _reference(model, 0.0, **kw)
    assert min(norms) > 2 * limit  # the clip binds at every step...
    # ...and changes the training far past the tolerance
    assert max(abs(f - w) / w for f, w in zip(free, want)) > 100 * 1e-5
    got = mean_losses(clipped[name][0])
    assert sorted(got) == list(range(STEPS))
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step
    for step, seen in _norms(clipped[name][0]).items():  # every rank records the same global norm
        assert all(v == pytest.approx(norms[step], rel=1e-4) for v in seen), (step, seen, norms[step])


# ---------------------------------------------------------------------- refused before any process starts


def _cfg(**kw: object) -> RunConfig:
    return RunConfig.make(epochs=1, workers=2, batch_size=32, **kw)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(grad_accum=0), "grad_accum must be an integer >= 1 (micro-steps per optimizer step), got 0"),
        (
            dict(grad_accum=3),
            "--grad-accum 3: the per-worker batch of 16 (--batch-size 32 over 2 shards) does not split "
            "into 3 equal micro-batches; use --batch-size a multiple of 6",
        ),
        (dict(clip_grad_norm=-1.0), "clip_grad_norm must be >= 0 (0: no clipping), got -1"),
        (
            dict(strategy="pipeline", grad_accum=2),
            "--grad-accum 2: strategy pipeline already accumulates a step's gradients over its 4 micro-batches",
        ),
        (dict(strategy="local_sgd", grad_accum=2), "--grad-accum 2: strategy local_sgd has no engine that accumulates"),
        (
            dict(strategy="ps", consistency="asp", clip_grad_norm=1.0),
            "--clip-grad-norm 1: strategy ps --consistency asp clips nothing",
        ),
        (dict(overlap="forward", clip_grad_norm=1.0), "--clip-grad-norm 1: strategy dp applies each bucket as soon as"),
        (dict(clip_grad_norm=1.0, noise_scale=True), "--clip-grad-norm 1: the noise scale"),
    ],
)
def test_bad_input_is_refused_before_any_process_starts(kw, message):
    with pytest.raises(ConfigError) as e:
        validate(_cfg(**kw))
    assert str(e.value).startswith(message), str(e.value)


def test_good_input_passes_and_the_flags_are_in_the_help():
    validate(_cfg(grad_accum=4, clip_grad_norm=1.0))
    validate(_cfg(strategy="ps", grad_accum=2))
    from dtrain.cli import run_help

    text = " ".join(run_help().split())
    assert "--grad-accum gradient accumulation: each optimizer step" in text, text
    assert "--clip-grad-norm clip the gradient to global 2-norm MAX" in text, text


@pytest.mark.procs
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fp16_clips_the_unscaled_gradient(clipped_more):
    """Under fp16 the loss is scaled (65536 at first) for backward: the norm clipped, and recorded, is the
    unscaled gradient's, the fp32 loop's up to fp16's rounding (a scaled one would be 65536 times it)."""
    _, norms = _reference("cnn", MAX_NORM, lr=CLIP_LR)
    rows = [r for r in read_metrics(clipped_more["dp_fp16"][0]) if not r.get("overflow")]
    assert rows and all(r["loss_scale"] > 1 for r in rows)
    for r in rows:
        assert r["grad_norm"] == pytest.approx(norms[r["step"]], rel=2e-2), r
