"""The gradient noise scale (dtrain.training.noise_scale) against a problem whose noise is known.

Least squares with Gaussian inputs: x ~ N(0, I_d), y = x.w* + eps, eps ~ N(0, sigma^2), loss
0.5 (x.w - y)^2 at a fixed w = w* + delta. The per-sample gradient is g = x (x.delta - eps).

* G = E[g] = E[x x^T] delta - E[x eps] = delta (eps is independent of x with mean 0).
* E|g|^2 = E[|x|^2 (x.delta)^2] - 2 E[|x|^2 (x.delta) eps] + E[|x|^2 eps^2]
         = E[|x|^2 (x.delta)^2] + sigma^2 d.
  E[|x|^2 (x.delta)^2] = sum_i sum_jk delta_j delta_k E[x_i^2 x_j x_k]; only j = k survives, and
  E[x_i^2 x_j^2] is 3 for i = j, 1 otherwise, so it is sum_j delta_j^2 (3 + (d - 1)) = (d + 2)|delta|^2
  (the same as E[x x^T A x x^T] = 2A + tr(A) I with A = delta delta^T, traced).
* tr(Sigma) = E|g|^2 - |G|^2 = (d + 1)|delta|^2 + d sigma^2, and
  B_simple = tr(Sigma) / |G|^2 = (d + 1) + d sigma^2 / |delta|^2.

The simulated workers compute their gradients with autograd on the loss (not with the formula
above), so the test compares the estimator on real gradients with the derivation; a Monte-Carlo
test checks the derivation itself.
"""

from __future__ import annotations

import math

import pytest
import torch

from dtrain.training.noise_scale import NoiseScale, StepCost, estimate, next_batch

# (d, sigma, workers, per-worker batch): B_simple = 17 with b_small 16, b_big 64; 16 with 4, 32
CASES = [(8, 1.0, 4, 16), (12, 0.5, 8, 4)]


def _problem(d: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """w* and delta (|delta| = 1) for a d-dimensional problem."""
    w_star = torch.randn(d, generator=gen, dtype=torch.float64)
    delta = torch.randn(d, generator=gen, dtype=torch.float64)
    return w_star, delta / delta.norm()


def _true_trace_sigma(d: int, sigma: float, delta: torch.Tensor) -> float:
    return (d + 1) * float(delta.pow(2).sum()) + d * sigma**2


def _worker_gradients(
    w: torch.Tensor, w_star: torch.Tensor, sigma: float, workers: int, b: int, gen: torch.Generator
) -> torch.Tensor:
    """Each worker's mean gradient over its own fresh batch of b samples, by autograd: (workers, d)."""
    d = w.numel()
    x = torch.randn(workers, b, d, generator=gen, dtype=torch.float64)
    y = x @ w_star + sigma * torch.randn(workers, b, generator=gen, dtype=torch.float64)
    # one copy of w per worker: the gradient of the summed per-worker mean losses w.r.t. copy n is
    # worker n's mean gradient
    copies = w.detach().repeat(workers, 1).requires_grad_()
    pred = torch.einsum("nbd,nd->nb", x, copies)
    loss = (0.5 * (pred - y).pow(2)).mean(dim=1).sum()
    (grad,) = torch.autograd.grad(loss, copies)
    return grad


@pytest.mark.parametrize("d,sigma", [(8, 1.0), (12, 0.5)])
def test_trace_sigma_formula_monte_carlo(d: int, sigma: float) -> None:
    gen = torch.Generator().manual_seed(1)
    w_star, delta = _problem(d, gen)
    n = 400_000
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    eps = sigma * torch.randn(n, generator=gen, dtype=torch.float64)
    g = x * (x @ delta - eps).unsqueeze(1)  # per-sample gradients at w = w* + delta
    mean = g.mean(dim=0)
    assert torch.allclose(mean, delta, atol=0.02)  # G = delta; SE per coordinate ~ 0.007
    trace = float(g.pow(2).sum(dim=1).mean() - mean.pow(2).sum())
    # relative SE of the sample mean of |g|^2 is ~0.4% here; 2% is 5 SE
    assert trace == pytest.approx(_true_trace_sigma(d, sigma, delta), rel=0.02)


def test_worker_gradients_are_the_per_sample_formula() -> None:
    """The autograd path the simulation uses gives mean_b x (x.delta - eps) (guards the helper)."""
    d, workers, b, sigma = 5, 3, 7, 0.3
    w_star, delta = _problem(d, torch.Generator().manual_seed(2))
    grad = _worker_gradients(w_star + delta, w_star, sigma, workers, b, torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(3)  # replay the same draws
    x = torch.randn(workers, b, d, generator=gen, dtype=torch.float64)
    eps = sigma * torch.randn(workers, b, generator=gen, dtype=torch.float64)
    expected = torch.einsum("nbd,nb->nd", x, x @ delta - eps) / b
    assert torch.allclose(grad, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("d,sigma,workers,b", CASES)
def test_noise_scale_matches_the_analytic_value(d: int, sigma: float, workers: int, b: int) -> None:
    gen = torch.Generator().manual_seed(0)
    w_star, delta = _problem(d, gen)
    w = w_star + delta  # fixed: the noise scale is a property of this point
    ns = NoiseScale(beta=0.99)
    b_simple = None
    for _ in range(400):
        grads = _worker_gradients(w, w_star, sigma, workers, b, gen)
        small_sq = float(grads.pow(2).sum(dim=1).mean())  # mean over workers of their squared norms
        big_sq = float(grads.mean(dim=0).pow(2).sum())  # what the allreduce's average gives
        b_simple = ns.update(small_sq, big_sq, b, workers * b)
    true_trace = _true_trace_sigma(d, sigma, delta)
    true_b = true_trace / float(delta.pow(2).sum())
    print(f"d={d} sigma={sigma} N={workers} b={b}: B_simple {b_simple:.3f}, true {true_b:.3f}")
    # across 40 seeds the ratio to the true value spread 0.90-1.09 (sd 4%) and 0.93-1.07 (sd 3%)
    assert b_simple == pytest.approx(true_b, rel=0.2)
    assert ns.trace_sigma == pytest.approx(true_trace, rel=0.2)
    assert ns.g2 == pytest.approx(float(delta.pow(2).sum()), rel=0.2)
    assert ns.count == 400


def test_estimate_is_exact_on_expectations() -> None:
    g2, s = 0.37, 11.5
    for b_small, b_big in [(1, 2), (16, 64), (3, 7.5)]:
        small_sq = g2 + s / b_small
        big_sq = g2 + s / b_big
        got = estimate(small_sq, big_sq, b_small, b_big)
        assert got == pytest.approx((g2, s), rel=1e-12)


@pytest.mark.parametrize(
    "args,name",
    [
        ((1.0, 0.5, 0.5, 4), "b_small"),
        ((1.0, 0.5, 2, 0), "b_big"),
        ((1.0, 0.5, 4, 4), "b_big must be > b_small"),
        ((1.0, 0.5, 8, 4), "b_big must be > b_small"),
        ((math.nan, 0.5, 2, 4), "small_sq"),
        ((1.0, -0.1, 2, 4), "big_sq"),
        ((1.0, math.inf, 2, 4), "big_sq"),
    ],
)
def test_estimate_rejects_bad_arguments(args: tuple[float, float, float, float], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        estimate(*args)


def test_bias_correction_and_none_before_signal() -> None:
    ns = NoiseScale(beta=0.9)
    assert ns.b_simple is None and ns.g2 is None and ns.trace_sigma is None and ns.count == 0
    g2, s = estimate(3.0, 1.0, 2, 8)
    assert ns.update(3.0, 1.0, 2, 8) == pytest.approx(s / g2)
    # corrected: the first average is the first value, not (1 - beta) times it
    assert ns.g2 == pytest.approx(g2) and ns.trace_sigma == pytest.approx(s)
    for _ in range(5):
        ns.update(3.0, 1.0, 2, 8)
    assert ns.g2 == pytest.approx(g2) and ns.trace_sigma == pytest.approx(s)
    # |G_small|^2 much larger than |G_big|^2: the |G|^2 estimate is negative -> no B_simple
    noisy = NoiseScale(beta=0.5)
    assert noisy.update(10.0, 1.0, 2, 4) is None
    assert noisy.g2 is not None and noisy.g2 < 0 and noisy.b_simple is None


def test_beta_zero_keeps_the_last_step() -> None:
    ns = NoiseScale(beta=0.0)
    ns.update(3.0, 1.0, 2, 8)
    g2, s = estimate(5.0, 4.0, 2, 8)
    assert ns.update(5.0, 4.0, 2, 8) == pytest.approx(s / g2)


@pytest.mark.parametrize("beta", [-0.1, 1.0, 1.5])
def test_beta_is_checked(beta: float) -> None:
    with pytest.raises(ValueError, match="beta"):
        NoiseScale(beta=beta)


def test_state_dict_round_trip() -> None:
    a = NoiseScale(beta=0.95)
    for i in range(7):
        a.update(3.0 + 0.1 * i, 1.0, 4, 16)
    state = a.state_dict()
    assert all(type(v) in (float, int) for v in state.values())
    b = NoiseScale(beta=0.95)
    b.load_state_dict(dict(state))
    assert (b.count, b.g2, b.trace_sigma, b.b_simple) == (a.count, a.g2, a.trace_sigma, a.b_simple)
    # both go on identically
    assert a.update(2.5, 0.9, 4, 16) == b.update(2.5, 0.9, 4, 16)
    assert a.state_dict() == b.state_dict()


def test_load_state_dict_rejects_bad_state() -> None:
    ns = NoiseScale()
    with pytest.raises(ValueError, match="lacks"):
        ns.load_state_dict({"g2_avg": 1.0})
    with pytest.raises(ValueError, match="g2_avg"):
        ns.load_state_dict({"g2_avg": math.nan, "s_avg": 1.0, "weight": 0.5, "count": 3})
    with pytest.raises(ValueError, match="inconsistent"):
        ns.load_state_dict({"g2_avg": 1.0, "s_avg": 1.0, "weight": 0.0, "count": 3})
    assert ns.count == 0  # a refused state changes nothing


@pytest.mark.parametrize(
    "current,b_simple,margin,maximum,multiple,expected",
    [
        (32, 64.0, 2.0, 4096, 4, 64),  # exactly margin * current: doubles
        (32, 63.9, 2.0, 4096, 4, 32),  # just below: stays
        (32, None, 2.0, 4096, 4, 32),  # not known yet: stays
        (32, -5.0, 2.0, 4096, 4, 32),  # no signal: stays
        (32, 1000.0, 2.0, 63, 4, 32),  # doubling would pass the maximum: stays
        (32, 1000.0, 2.0, 64, 4, 64),  # exactly the maximum is allowed
        (32, 40.0, 1.0, 4096, 4, 64),  # a smaller margin doubles sooner
        (12, 30.0, 2.0, 4096, 3, 24),  # stays a multiple of the workers
    ],
)
def test_next_batch_rule(
    current: int, b_simple: float | None, margin: float, maximum: int, multiple: int, expected: int
) -> None:
    got = next_batch(current, b_simple, margin=margin, maximum=maximum, multiple=multiple)
    assert got == expected and got % multiple == 0


@pytest.mark.parametrize(
    "current,margin,maximum,multiple,name",
    [
        (30, 2.0, 4096, 4, "current must be a multiple"),
        (0, 2.0, 4096, 2, "current must be >= 1"),
        (32, 2.0, 4096, 0, "multiple"),
        (32, 2.0, 16, 2, "maximum"),
        (32, 0.0, 4096, 2, "margin"),
    ],
)
def test_next_batch_rejects_bad_arguments(current: int, margin: float, maximum: int, multiple: int, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        next_batch(current, 100.0, margin=margin, maximum=maximum, multiple=multiple)


def _time_to_loss(batch: float, b_noise: float, fixed: float, per_sample: float) -> float:
    """McCandlish et al.'s steps to a loss, S_min (1 + B_noise / B) (S_min = 1), times the step time fixed + B t."""
    return (1 + b_noise / batch) * (fixed + batch * per_sample)


@pytest.mark.parametrize("seed", range(5))
def test_the_time_rule_doubles_exactly_where_doubling_shortens_the_time_to_a_loss(seed: int) -> None:
    """With margin 2 and ratio = T_fixed / T_batch, the rule doubles iff (1 + Bn/2B)(F + 2Bt) < (1 + Bn/B)(F + Bt):
    checked against that time on random problems, on both sides of the break-even."""
    g = torch.Generator().manual_seed(seed)
    doubled = stayed = 0
    for _ in range(400):
        u = torch.rand(4, generator=g, dtype=torch.float64)
        b = int(2 ** (1 + 9 * float(u[0]))) * 2  # 4 .. 2048, a multiple of 2
        b_noise, fixed, t = 10 ** (3 * float(u[1])), 10 ** (-4 + 3 * float(u[2])), 10 ** (-6 + 2 * float(u[3]))
        ratio = fixed / (b * t)
        want = 2 * b if _time_to_loss(2 * b, b_noise, fixed, t) < _time_to_loss(b, b_noise, fixed, t) else b
        if abs(b_noise * ratio / (2 * b) - 1) < 1e-9:
            continue  # at the break-even itself both are right
        assert next_batch(b, b_noise, maximum=1 << 14, multiple=2, ratio=ratio) == want, (b, b_noise, ratio)
        doubled, stayed = doubled + (want > b), stayed + (want == b)
    assert doubled > 20 and stayed > 20  # both sides were tried


def test_ratio_one_is_the_noise_rule_and_a_bad_ratio_is_refused() -> None:
    for b_simple in (10.0, 63.9, 64.0, 200.0, None):
        assert next_batch(32, b_simple, maximum=4096, multiple=4) == next_batch(
            32, b_simple, maximum=4096, multiple=4, ratio=1.0
        )
    assert next_batch(32, 20.0, maximum=4096, multiple=4, ratio=4.0) == 64  # 20 x 4 >= 64: a slow network grows it
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="ratio"):
            next_batch(32, 100.0, maximum=4096, multiple=4, ratio=bad)


def test_step_cost_averages_the_fixed_and_per_sample_time_and_ratio_uses_the_agreed_figures() -> None:
    cost = StepCost(beta=0.5)
    assert cost.own is None and cost.ratio(8) is None
    cost.observe(0.030, 0.010, 10)  # fixed 0.020, per sample 0.001
    assert cost.own == pytest.approx((0.020, 0.001))  # one step: its own figures (bias-corrected)
    cost.observe(0.050, 0.020, 10)  # fixed 0.030, per sample 0.002
    w = 0.5 * 0.5 + 0.5  # weights 0.25 and 0.5 over a total of 0.75
    assert cost.own == pytest.approx(((0.25 * 0.020 + 0.5 * 0.030) / w, (0.25 * 0.001 + 0.5 * 0.002) / w))
    cost.observe(math.nan, 0.01, 10)  # not a step: ignored
    cost.observe(0.01, 0.0, 10)
    assert cost.own == pytest.approx(((0.25 * 0.020 + 0.5 * 0.030) / w, (0.25 * 0.001 + 0.5 * 0.002) / w))
    assert cost.ratio(8) is None  # nothing agreed yet
    cost.agree(0.024, 0.0015)
    assert cost.ratio(8) == pytest.approx(0.024 / (0.0015 * 8))
    cost.agree(math.nan, 0.001)  # a rank without figures: the last agreement stands
    assert cost.agreed == (0.024, 0.0015)
    again = StepCost(beta=0.5)
    again.load_state_dict(cost.state_dict())
    assert again.own == cost.own and again.agreed == cost.agreed
