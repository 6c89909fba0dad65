"""compressed_allreduce over threads and over gloo: results, unbiasedness, error feedback, bytes."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _dist import run_distributed
from _helpers import two_phase_residuals

from dtrain.comm.transport import Transport, run_threads
from dtrain.compress import (
    QSGD,
    REGISTRY,
    Compressor,
    ErrorFeedback,
    PowerSGD,
    RandomK,
    SignSGD,
    TernGrad,
    TopK,
    compressed_allreduce,
    from_spec,
)
from dtrain.errors import CommError

SPECS = sorted(REGISTRY) + ["sign:mv", "qsgd:4", "topk:0.1"]


def _grad(rank: int, n: int, step: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(7919 * step + rank))


def _run(p: int, n: int, comps: list[Compressor], step: int = 0, **kw: object) -> list[tuple[torch.Tensor, int]]:
    def fn(t: Transport) -> tuple[torch.Tensor, int]:
        x = _grad(t.rank, n, step)
        before = t.stats.bytes_sent
        compressed_allreduce(x, comps[t.rank], "bucket0", t, **kw)  # type: ignore[arg-type]
        return x, t.stats.bytes_sent - before

    return run_threads(p, fn, timeout=30)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("p", [2, 3, 5])
def test_every_compressor_gives_one_result_on_all_ranks(spec: str, p: int) -> None:
    n = 3001
    out = _run(p, n, [from_spec(spec) for _ in range(p)])
    first = out[0][0]
    assert first.shape == (n,) and torch.isfinite(first).all()
    assert all(torch.equal(first, x) for x, _ in out)
    mean = torch.stack([_grad(r, n) for r in range(p)]).mean(0)
    err = ((first - mean).norm() / mean.norm()).item()
    if spec == "none":
        assert torch.allclose(first, mean, atol=1e-6)
    elif spec in ("fp16", "bf16"):
        assert err < 1e-2
    else:
        # an estimate of the mean, not noise of the wrong size (bounds loose on purpose). Majority
        # vote moves every element by the ranks' mean scale even where the independent random
        # inputs here disagree: its error grows like sqrt(p) (1.7 at p = 5 with the rms scale)
        bound = 12.0 if spec.startswith(("randomk", "terngrad", "qsgd:4")) else 2.5 if spec == "sign:mv" else 1.5
        assert err < bound, err
        cos = torch.nn.functional.cosine_similarity(first, mean, dim=0).item()
        assert cos > 0.05, (spec, cos)


def test_summable_path_uses_the_chosen_algorithm() -> None:
    n, p = 1000, 4
    for alg in ("ring", "tree", "recursive_doubling"):
        out = _run(p, n, [from_spec("none") for _ in range(p)], algorithm=alg)
        mean = torch.stack([_grad(r, n) for r in range(p)]).mean(0)
        assert all(torch.allclose(x, mean, atol=1e-6) for x, _ in out)


def test_world_of_one_applies_compression() -> None:
    out = _run(1, 1000, [from_spec("topk:0.01")])
    assert int((out[0][0] != 0).sum()) == 10 and out[0][1] == 0


@pytest.mark.parametrize(
    "make",
    [lambda r: QSGD(levels=16, seed=r), lambda r: TernGrad(clip=None, seed=r), lambda r: RandomK(ratio=0.1, seed=r)],
    ids=["qsgd16", "terngrad", "randomk0.1"],
)
def test_unbiased_through_the_collective(make: Callable[[int], Compressor]) -> None:
    """Mean over T independent rounds is within 5 standard errors of the true mean, per element."""
    p, n, rounds = 3, 300, 300
    comps = [make(r) for r in range(p)]  # independent seeds per rank, as in a real job
    samples = torch.stack([_run(p, n, comps)[0][0].double() for _ in range(rounds)])
    mean = torch.stack([_grad(r, n) for r in range(p)]).double().mean(0)
    se = samples.std(dim=0) / math.sqrt(rounds)
    assert torch.all((samples.mean(0) - mean).abs() <= 5 * se + 1e-6)
    assert (se > 0).sum() > n // 2  # it really is random


def _sum_of_steps(p: int, n: int, comps: list[Any], steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Over ``steps`` compressed allreduces: the sum of rank 0's results, and each rank's sum of gradients."""
    acc = torch.zeros(n, dtype=torch.float64)
    g = torch.zeros(p, n, dtype=torch.float64)
    for s in range(steps):
        acc += _run(p, n, comps, step=s)[0][0].double()
        g += torch.stack([_grad(r, n, s) for r in range(p)]).double()
    return acc, g


def test_error_feedback_through_sparse_collective_loses_nothing() -> None:
    """TopK + EF: sum of results == mean over ranks of (sum of gradients - final residual)."""
    p, n, steps = 4, 2000, 25
    comps = [ErrorFeedback(TopK(ratio=0.01)) for _ in range(p)]
    acc, g = _sum_of_steps(p, n, comps, steps)
    res = torch.stack([c.residual("bucket0") for c in comps]).double()  # type: ignore[misc]
    assert (acc - (g - res).mean(0)).abs().max().item() < 1e-4


def test_error_feedback_through_quantized_collective_loses_nothing() -> None:
    """SignSGD + EF in both phases: the owners' residuals account for the re-compression."""
    p, n, steps = 3, 1500, 20
    comps = [ErrorFeedback(SignSGD(block=100)) for _ in range(p)]
    acc, g = _sum_of_steps(p, n, comps, steps)
    # worker residuals, chunk by chunk, and each owner's residual of its combined chunk
    worker, server = two_phase_residuals(comps, "bucket0", n)
    assert (acc - ((g - worker).mean(0) - server)).abs().max().item() < 1e-4


def test_powersgd_collective_is_exact_for_shared_low_rank_gradients() -> None:
    """M_r = A B_r^T (rank 2, shared column space): one power step recovers the mean exactly."""
    p, m = 4, 40
    a = torch.randn(m, 2, generator=torch.Generator().manual_seed(1))
    bs = [torch.randn(m, 2, generator=torch.Generator().manual_seed(10 + r)) for r in range(p)]
    comps = [PowerSGD(rank=2) for _ in range(p)]

    def fn(t: Transport) -> torch.Tensor:
        x = (a @ bs[t.rank].t()).reshape(-1).contiguous()
        compressed_allreduce(x, comps[t.rank], "b", t)
        return x

    out = run_threads(p, fn)
    mean = torch.stack([(a @ b.t()).reshape(-1) for b in bs]).mean(0)
    assert all(torch.allclose(x, mean, atol=1e-4) for x in out)
    # warm start: every rank keeps the same, averaged Q
    assert all(torch.equal(comps[0].state_dict()["q"]["b"], c.state_dict()["q"]["b"]) for c in comps)


def test_powersgd_with_layout_factors_each_matrix_and_sends_vectors_dense() -> None:
    """A bucket of two rank-2 matrices (shared column spaces) and a bias: exact mean, fewer bytes."""
    p = 3
    shapes = [(20, 30), (30,), (16, 4, 3, 3)]
    a1 = torch.randn(20, 2, generator=torch.Generator().manual_seed(1))
    a2 = torch.randn(16, 2, generator=torch.Generator().manual_seed(2))

    def grad(r: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(50 + r)
        return torch.cat(
            [
                (a1 @ torch.randn(2, 30, generator=g)).reshape(-1),
                torch.randn(30, generator=g),
                (a2 @ torch.randn(2, 36, generator=g)).reshape(-1),
            ]
        )

    comps = [PowerSGD(rank=2) for _ in range(p)]

    def fn(t: Transport) -> tuple[torch.Tensor, int]:
        x = grad(t.rank)
        compressed_allreduce(x, comps[t.rank], "b", t, shapes=shapes)
        return x, t.stats.bytes_sent

    out = run_threads(p, fn)
    mean = torch.stack([grad(r) for r in range(p)]).mean(0)
    assert all(torch.allclose(x, mean, atol=1e-4) for x, _ in out)
    # ring allreduce of the Ps (20x2, 16x2), then of the Qs (30x2, 36x2) with the bias (30)
    ring = lambda floats: 2 * (p - 1) * math.ceil(floats / p) * 4  # noqa: E731
    assert max(b for _, b in out) <= ring(72) + ring(162)
    assert max(b for _, b in out) >= ring(72) + ring(162) - 2 * 2 * (p - 1) * 4
    assert sorted(comps[0].state_dict()["q"]) == ["b/0", "b/2"]


def test_layout_must_cover_the_bucket() -> None:
    with pytest.raises(CommError, match="shapes describe 12 elements"):
        run_threads(2, lambda t: compressed_allreduce(torch.ones(10), PowerSGD(), "k", t, shapes=[(3, 4)]))


# ----------------------------------------------------------------------------- bytes


def measured_ratios(p: int = 4, n: int = 100_000) -> dict[str, float]:
    dense = max(b for _, b in _run(p, n, [from_spec("none") for _ in range(p)]))
    return {
        spec: max(b for _, b in _run(p, n, [from_spec(spec) for _ in range(p)])) / dense
        for spec in ("topk:0.01", "powersgd:2", "qsgd:16", "sign", "onebit", "terngrad", "fp16", "randomk:0.01")
    }


def test_bytes_per_step_vs_dense_meet_the_targets() -> None:
    r = measured_ratios()
    assert r["topk:0.01"] <= 1 / 20
    assert r["powersgd:2"] <= 1 / 20
    assert r["qsgd:16"] <= 1 / 5
    assert r["sign"] <= 1 / 25
    assert r["fp16"] == pytest.approx(0.5, abs=1e-3)
    assert r["onebit"] <= 1 / 25 and r["terngrad"] <= 1 / 10


def test_powersgd_bytes_on_the_default_cnn_layout() -> None:
    """PowerSGD(2) per weight matrix of the default CNN, biases dense: <= 1/20 of dense."""
    from dtrain.workloads.models import build_model

    shapes = [tuple(q.shape) for q in build_model("cnn", (1, 8, 8), 10).parameters()]
    n = sum(math.prod(s) for s in shapes)
    p = 4

    def run(c: Compressor) -> int:
        comps = [c if i == 0 else type(c)() for i in range(p)]

        def fn(t: Transport) -> int:
            compressed_allreduce(_grad(t.rank, n), comps[t.rank], "b", t, shapes=shapes)
            return t.stats.bytes_sent

        return max(run_threads(p, fn))

    ratio = run(PowerSGD(rank=2)) / run(from_spec("none"))
    assert ratio <= 1 / 20, ratio


def test_bad_input_is_a_clear_error() -> None:
    with pytest.raises(CommError, match="1-D"):
        run_threads(1, lambda tr: compressed_allreduce(torch.ones(3, 3), from_spec("none"), "k", tr))
    with pytest.raises(CommError, match="floating"):
        run_threads(1, lambda tr: compressed_allreduce(torch.ones(3, dtype=torch.int64), from_spec("none"), "k", tr))


# ----------------------------------------------------------------------------- real processes


def _gloo_every_compressor(rank: int, world_size: int, specs: list[str], n: int) -> dict[str, tuple[list[float], int]]:
    from dtrain.comm.transport import TorchTransport

    t = TorchTransport(timeout=30)
    out = {}
    for spec in specs:
        c = from_spec(spec)
        for step in range(2):  # a second step exercises residuals and warm starts
            x = _grad(rank, n, step)
            before = t.stats.bytes_sent
            compressed_allreduce(x, c, "bucket0", t)
        out[spec] = (x[:50].tolist() + [float(x.sum())], t.stats.bytes_sent - before)
    return out


@pytest.mark.procs
def test_every_compressor_over_gloo() -> None:
    p, n = 4, 20_000
    specs = sorted(REGISTRY)
    out = run_distributed(_gloo_every_compressor, p, specs, n, timeout=150)
    for spec in specs:
        assert all(o[spec][0] == out[0][spec][0] for o in out), spec  # bitwise equal on every rank
    mean = torch.stack([_grad(r, n, 1) for r in range(p)]).mean(0)
    assert torch.allclose(torch.tensor(out[0]["none"][0][:50]), mean[:50], atol=1e-5)
    dense = max(o["none"][1] for o in out)
    ratio = {s: max(o[s][1] for o in out) / dense for s in specs}
    assert ratio["topk"] <= 1 / 20 and ratio["powersgd"] <= 1 / 20
    assert ratio["qsgd"] <= 1 / 5 and ratio["sign"] <= 1 / 25
