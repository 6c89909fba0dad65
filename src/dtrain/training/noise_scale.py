"""The gradient noise scale: how large a batch is still worth it, measured during training.

McCandlish, Kaplan, Amodei et al. 2018, "An Empirical Model of Large-Batch Training"
(arXiv:1812.06162). The simple noise scale ``B_simple = tr(Sigma) / |G|^2`` -- the per-sample
gradient covariance's trace over the squared norm of the true gradient -- predicts the batch
size at which training trades steps for samples: far below it, a step's gradient is mostly
noise and doubling the batch nearly halves the steps (steps wasted); far above it, the batch
gradient is already close to ``G`` and a bigger batch buys few steps (samples wasted).

Data parallelism measures it for free (appendix A): each of ``N`` workers already holds the
gradient of its own ``b_small`` samples, and the allreduce produces the gradient of all
``b_big = N * b_small`` of them. For a batch of ``B`` samples ``E|G_B|^2 = |G|^2 + tr(Sigma)/B``,
so the two batch sizes give two equations in the two unknowns:

1. ``|G_small|^2``: the mean over workers of each worker's squared gradient norm (before the
   allreduce; one extra scalar in the allreduce, or a separate one);
2. ``|G_big|^2``: the squared norm of the averaged gradient (after the allreduce);
3. :func:`estimate` solves for unbiased estimates of ``|G|^2`` and ``tr(Sigma)``;
4. :class:`NoiseScale` smooths the two separately with bias-corrected exponential moving
   averages and reports their ratio (a ratio of two noisy estimates is biased; the paper
   averages numerator and denominator first);
5. :func:`next_batch` is the auto batch schedule's rule: double the batch while the noise
   scale is well above it; with ``--auto-rule time`` the noise scale is weighed by the step's
   fixed time over its per-sample time (:class:`StepCost`), so the batch grows toward the one that
   reaches a loss soonest in time rather than in samples.

Everything here is arithmetic on floats: the caller computes the norms (of unscaled gradients,
when a loss scaler is in use) and does the collectives. Cost: the norms, one fused 2-norm per
gradient before and after the allreduce, and one scalar allreduce per step.

Example::

    ns = NoiseScale(beta=0.99)
    # per step, after the caller's allreduce of the gradients and of the local squared norm:
    b_simple = ns.update(mean_local_sq, averaged_sq, b_small=per_worker, b_big=per_worker * world)
    batch = next_batch(batch, b_simple, maximum=4096, multiple=world)
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["estimate", "NoiseScale", "StepCost", "next_batch"]


def estimate(small_sq: float, big_sq: float, b_small: float, b_big: float) -> tuple[float, float]:
    """Unbiased estimates of ``|G|^2`` and ``tr(Sigma)`` from two batch sizes (appendix A).

    ``|G|^2 = (b_big |G_big|^2 - b_small |G_small|^2) / (b_big - b_small)`` and
    ``S = tr(Sigma) = (|G_small|^2 - |G_big|^2) / (1/b_small - 1/b_big)``. Either may come out
    negative on one step (noise); their averages (:class:`NoiseScale`) settle.

    Args:
        small_sq: ``|G_small|^2``, the mean over workers of each worker's squared gradient norm.
        big_sq: ``|G_big|^2``, the squared norm of the gradient averaged over all workers.
        b_small: samples behind one worker's gradient.
        b_big: samples behind the averaged gradient (``N * b_small`` for ``N`` workers).

    Returns:
        ``(g2, s)``: the estimates of ``|G|^2`` and ``tr(Sigma)``.

    Raises:
        ValueError: a batch size below 1, ``b_big <= b_small``, or a squared norm that is
            negative or not finite.
    """
    if not b_small >= 1:
        raise ValueError(f"b_small must be >= 1, got {b_small}")
    if not b_big >= 1:
        raise ValueError(f"b_big must be >= 1, got {b_big}")
    if not b_big > b_small:
        raise ValueError(f"b_big must be > b_small (two different batch sizes), got b_big={b_big}, b_small={b_small}")
    for name, value in (("small_sq", small_sq), ("big_sq", big_sq)):
        # a NaN would poison the moving averages for good; the caller skips such a step
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite squared norm >= 0, got {value}")
    g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    s = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    return g2, s


class NoiseScale:
    """The smoothed simple noise scale ``B_simple = EMA(S) / EMA(|G|^2)``.

    Each :meth:`update` turns one step's two squared norms into ``(|G|^2, S)`` with
    :func:`estimate` and folds them into two exponential moving averages. The averages are
    bias-corrected as in Adam: each is divided by the total weight its terms carry
    (``1 - beta^count`` for a fixed ``beta``), so the first values are not pulled toward 0.

    Tuning: ``beta`` sets the memory, about ``1 / (1 - beta)`` steps (default 0.99: ~100).
    One step's estimates are very noisy (``S`` is a difference of two nearly equal norms), so
    a short memory gives a jumpy ``B_simple``; the true noise scale drifts as training goes
    on (it grows as the loss falls), so a very long one lags.

    Args:
        beta: the moving averages' decay, ``0 <= beta < 1`` (default: 0.99; 0 keeps only the
            last step).
    """

    def __init__(self, beta: float = 0.99) -> None:
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {beta}")
        # tunable
        self.beta = beta
        # internal: the biased averages and the weight they carry (the bias correction)
        self._g2_avg = 0.0
        self._s_avg = 0.0
        self._weight = 0.0
        # statistics
        self._count = 0

    def update(self, small_sq: float, big_sq: float, b_small: float, b_big: float) -> float | None:
        """Fold in one step's measurement (arguments as in :func:`estimate`).

        Returns:
            The smoothed ``B_simple`` after this step; None while ``EMA(|G|^2) <= 0``.
        """
        g2, s = estimate(small_sq, big_sq, b_small, b_big)
        beta = self.beta
        self._g2_avg = beta * self._g2_avg + (1.0 - beta) * g2
        self._s_avg = beta * self._s_avg + (1.0 - beta) * s
        # the total weight, tracked rather than computed as 1 - beta**count, stays exact when a
        # checkpoint is resumed with a different beta
        self._weight = beta * self._weight + (1.0 - beta)
        self._count += 1
        return self.b_simple

    @property
    def g2(self) -> float | None:
        """The bias-corrected average of ``|G|^2`` (None before the first update)."""
        return self._g2_avg / self._weight if self._count else None

    @property
    def trace_sigma(self) -> float | None:
        """The bias-corrected average of ``tr(Sigma)`` (None before the first update)."""
        return self._s_avg / self._weight if self._count else None

    @property
    def b_simple(self) -> float | None:
        """``EMA(S) / EMA(|G|^2)``; None before the first update or while ``EMA(|G|^2) <= 0``.

        The bias corrections cancel in the ratio. A negative value means the ``S`` average is
        still noise (no signal yet).
        """
        if not self._count or self._g2_avg <= 0.0:
            return None
        return self._s_avg / self._g2_avg

    @property
    def count(self) -> int:
        """The number of updates folded in."""
        return self._count

    def state_dict(self) -> dict[str, float | int]:
        """The averages and the count, as plain numbers (for a checkpoint)."""
        return {
            "beta": self.beta,
            "g2_avg": self._g2_avg,
            "s_avg": self._s_avg,
            "weight": self._weight,
            "count": self._count,
        }

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Restore what :meth:`state_dict` returned.

        The averages and the count are restored; ``beta`` stays this object's own, so a resumed
        run may change it (the bias correction carries the weight actually accumulated).

        Raises:
            ValueError: a key is missing, or a value is not a finite number.
        """
        missing = sorted({"g2_avg", "s_avg", "weight", "count"} - state.keys())
        if missing:
            raise ValueError(f"noise scale state lacks {missing}; it has {sorted(state)}")
        values = {key: float(state[key]) for key in ("g2_avg", "s_avg", "weight")}
        for key, value in values.items():
            if not math.isfinite(value):
                raise ValueError(f"noise scale state {key} must be finite, got {value}")
        count = int(state["count"])
        if count < 0 or not 0.0 <= values["weight"] <= 1.0 or (count > 0) != (values["weight"] > 0.0):
            raise ValueError(f"noise scale state is inconsistent: count={count}, weight={values['weight']}")
        self._g2_avg = values["g2_avg"]
        self._s_avg = values["s_avg"]
        self._weight = values["weight"]
        self._count = count


def next_batch(
    current: int, b_simple: float | None, *, margin: float = 2.0, maximum: int, multiple: int, ratio: float = 1.0
) -> int:
    """The auto batch schedule's rule: grow the global batch toward the noise scale.

    Training at a batch ``B << B_noise`` wastes steps (each step's gradient is mostly noise, and
    a larger batch would take proportionally fewer of them); at ``B >> B_noise`` it wastes
    samples (a smaller batch would reach the same loss in about as many steps); McCandlish et
    al. section 2. The rule: return ``2 * current`` if ``b_simple`` is known,
    ``ratio * b_simple >= margin * current``, and ``2 * current <= maximum``; otherwise ``current``.
    The batch never shrinks (the noise scale grows as training goes on), and ``margin`` keeps one
    noisy estimate from doubling it too early.

    ``ratio`` (``--auto-rule time``; 1 for ``noise``): the step's fixed time over the time its
    ``current`` samples take, ``T_fixed / T_batch``. McCandlish et al.'s steps to a given loss,
    ``S = S_min (1 + B_noise / B)``, times a step time ``T_fixed + B t``, is the time to it; doubling
    ``B`` shortens that time exactly when ``(B_noise / B) (T_fixed / (B t)) > 2``. So ``margin = 2``
    with ``ratio`` is the break-even of time, and with ``ratio = 1`` (a step's fixed time equal to
    its batch's) it is the plain noise rule. Where communication dominates (a slow network), the
    ratio is large and the batch grows past the noise scale, to about
    ``sqrt(B_noise T_fixed / t)``: more samples, fewer slow allreduces.

    Args:
        current: the global batch now, a multiple of ``multiple``.
        b_simple: the smoothed noise scale (:attr:`NoiseScale.b_simple`), None if not known yet.
        margin: how far above ``current`` the (weighed) noise scale must be before doubling (default: 2.0).
        maximum: the largest global batch allowed (memory, or the data loader's limit).
        multiple: the number of workers; the batch stays a multiple of it (doubling keeps it).
        ratio: the weight on the noise scale, ``T_fixed / T_batch`` at ``current`` (default 1.0).

    Returns:
        The global batch for the next steps.

    Raises:
        ValueError: ``current``, ``multiple`` or ``maximum`` below 1, ``current`` not a multiple of
            ``multiple``, ``current > maximum``, ``margin <= 0``, or ``ratio`` not a finite number > 0.
    """
    if multiple < 1:
        raise ValueError(f"multiple (the number of workers) must be >= 1, got {multiple}")
    if current < 1:
        raise ValueError(f"current must be >= 1, got {current}")
    if current % multiple:
        raise ValueError(f"current must be a multiple of multiple={multiple} (the workers), got {current}")
    if current > maximum:
        raise ValueError(f"maximum must be >= current={current}, got {maximum}")
    if not margin > 0:
        raise ValueError(f"margin must be > 0, got {margin}")
    if not (math.isfinite(ratio) and ratio > 0):
        raise ValueError(f"ratio must be a finite number > 0, got {ratio}")
    if b_simple is not None and ratio * b_simple >= margin * current and 2 * current <= maximum:
        return 2 * current
    return current


class StepCost:
    """A step's time as ``T(B) = fixed + B x per_sample`` (``B``: this rank's samples), smoothed.

    Each :meth:`observe` takes one step's wall time and its compute (forward and backward, less
    waits: ``compute_s`` of a data-parallel row); ``per_sample`` is the compute over the step's
    samples, ``fixed`` the rest (the exchange, waits, the optimizer). Both are exponential moving
    averages (``beta``; bias-corrected). Ranks measure their own; :meth:`agree` sets the figures all
    ranks decide on (the caller averages them in a collective), and :meth:`ratio` uses those.

    Counting all of the compute as per-sample overstates the cost of a larger batch (a small batch's
    forward has fixed costs too), so the time rule it feeds grows the batch later, not sooner.
    """

    def __init__(self, beta: float = 0.9) -> None:
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {beta}")
        self.beta = beta
        self._fixed = self._per_sample = self._weight = 0.0
        self.agreed: tuple[float, float] | None = None  # (fixed, per_sample), the same on every rank

    def observe(self, step_s: float, compute_s: float, samples: int) -> None:
        """Fold in one step: its wall seconds, its compute seconds and this rank's samples."""
        if not (math.isfinite(step_s) and math.isfinite(compute_s) and samples > 0 and 0 < compute_s):
            return
        b = self.beta
        self._fixed = b * self._fixed + (1 - b) * max(0.0, step_s - compute_s)
        self._per_sample = b * self._per_sample + (1 - b) * compute_s / samples
        self._weight = b * self._weight + (1 - b)

    @property
    def own(self) -> tuple[float, float] | None:
        """This rank's ``(fixed, per_sample)`` seconds; None before the first observed step."""
        if not self._weight:
            return None
        return self._fixed / self._weight, self._per_sample / self._weight

    def agree(self, fixed: float, per_sample: float) -> None:
        """The figures every rank decides on (None-like: not finite or not positive, ignored)."""
        if math.isfinite(fixed) and math.isfinite(per_sample) and per_sample > 0 and fixed >= 0:
            self.agreed = (fixed, per_sample)

    def state_dict(self) -> dict[str, Any]:
        """The averages and the agreed figures (for a checkpoint)."""
        return {
            "fixed": self._fixed,
            "per_sample": self._per_sample,
            "weight": self._weight,
            "agreed": list(self.agreed) if self.agreed is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self._fixed, self._per_sample = float(state["fixed"]), float(state["per_sample"])
        self._weight = float(state["weight"])
        agreed = state.get("agreed")
        self.agreed = (float(agreed[0]), float(agreed[1])) if agreed else None

    def ratio(self, samples: int) -> float | None:
        """``T_fixed / T_batch`` at ``samples`` a rank, from the agreed figures (None before them)."""
        if self.agreed is None or samples < 1:
            return None
        fixed, per_sample = self.agreed
        return max(fixed, 1e-9) / (per_sample * samples)
