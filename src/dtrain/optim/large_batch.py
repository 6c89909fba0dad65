"""Large-batch rules: the learning rate of a step and the global batch of an epoch.

The learning rate of optimizer step ``t`` is ``--lr`` times three factors::

    lr(t) = lr x scaling(B(t) / base_batch) x warmup(t) x schedule(t / total)

- ``scaling`` (``--lr-scaling``): ``linear`` multiplies the rate by ``k = B / base_batch`` (Goyal et al.
  2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour", arXiv:1706.02677, section 2.1:
  "when the minibatch size is multiplied by k, multiply the learning rate by k"); ``sqrt`` by ``sqrt(k)``
  (Krizhevsky 2014, "One weird trick for parallelizing convolutional neural networks", arXiv:1404.5997;
  the rule Hoffer et al. 2017 argue keeps the gradient noise's covariance); ``none``: 1. ``B`` is the
  global batch in force (a batch schedule changes it), ``base_batch`` the batch ``--lr`` was tuned for
  (``--base-batch``; 0: the run's first global batch).
- ``warmup`` (``--warmup-steps`` / ``--warmup-epochs``, W steps): Goyal et al.'s gradual warmup, section
  2.2: the rate starts at the unscaled ``lr`` and rises by a constant amount each step to the scaled
  ``k x lr`` at step W; ``warmup(t) = (1 + (k - 1) t / W) / k``. Without scaling (k = 1) that would be
  no warmup at all, so there the ramp starts near zero instead: ``warmup(t) = (t + 1) / W`` (the usual
  linear warmup of transformer training).
- ``schedule`` (``--lr-schedule``): :func:`dtrain.training.lr.lr_factor` (constant or cosine).

A batch schedule (``--batch-schedule "0:256,5:512,10:1024"``: from epoch 0 a global batch of 256, from
epoch 5 of 512, ...) grows the batch instead of decaying the rate (Smith, Kindermans, Ying, Le 2018,
"Don't Decay the Learning Rate, Increase the Batch Size", ICLR): the batch changes only at epoch
boundaries, so each epoch is one ``DistributedSampler`` permutation (the same on every rank and after a
resume) cut into that epoch's batches. ``auto`` lets the measured gradient noise scale choose
(:mod:`dtrain.training.noise_scale`), at the start of each epoch or, with ``--auto-every N``, after every
N steps: then an epoch is still one permutation, cut into consecutive batches of the sizes in force when
each was drawn, and :class:`BatchPlan` finds a step's place in it from the list of changes. A run resumed
from a checkpoint at another ``--batch-size`` (what population-based training's explore does) is such a
change too: the data goes on from the checkpoint's sample, cut into batches of the new size, and
``scaling`` follows the batch in force.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dtrain.errors import ConfigError

__all__ = ["LR_SCALINGS", "AUTO_RULES", "parse_batch_schedule", "BatchPlan", "scaling_factor", "warmup_factor"]

LR_SCALINGS = ("none", "linear", "sqrt")
AUTO_RULES = ("noise", "time")  # --auto-rule: what auto weighs the noise scale by (training.noise_scale.next_batch)


def parse_batch_schedule(spec: str) -> list[tuple[int, int]]:
    """``"0:256,5:512"`` -> ``[(0, 256), (5, 512)]`` (epoch, global batch), checked: the first entry at
    epoch 0, epochs and batches strictly increasing. ConfigError naming the offending value."""
    out: list[tuple[int, int]] = []
    for part in spec.split(","):
        try:
            e, b = part.split(":")
            epoch, batch = int(e), int(b)
        except ValueError:
            raise ConfigError(
                f'batch_schedule entry {part.strip()!r} is not EPOCH:BATCH (e.g. "0:256,5:512"), in {spec!r}'
            ) from None
        if epoch < 0 or batch < 1:
            raise ConfigError(f"batch_schedule entry {part.strip()!r}: the epoch must be >= 0 and the batch >= 1")
        if out and epoch <= out[-1][0]:
            raise ConfigError(f"batch_schedule {spec!r}: epochs must increase ({epoch} follows {out[-1][0]})")
        if out and batch <= out[-1][1]:
            raise ConfigError(
                f"batch_schedule {spec!r} is not increasing: the batch {batch} at epoch {epoch} "
                f"follows {out[-1][1]} (a batch schedule grows the batch)"
            )
        out.append((epoch, batch))
    if out[0][0] != 0:
        raise ConfigError(f'batch_schedule {spec!r} must start at epoch 0 (e.g. "0:{out[0][1]},...")')
    return out


@dataclass
class BatchPlan:
    """The global batch of every step: fixed, scheduled by epoch, or (``auto``) decided as training goes.

    ``batches[e]`` is epoch ``e``'s global batch for the epochs decided so far; later epochs repeat the last
    one until :meth:`set_from` changes them (``auto`` deciding at epoch boundaries). Steps are counted per
    shard: an epoch of ``n`` training samples over ``s`` shards at global batch ``B`` has
    ``(n // s) // (B // s)`` steps.

    ``every > 0`` (``auto`` deciding every ``every`` steps, ``--auto-every``): the batch may change inside an
    epoch. ``changes`` lists ``(step, batch)``, the batch in force from that step on (the first batch
    before any); each epoch is still one permutation of the shard, cut into consecutive batches of the
    sizes in force, and ends when the next batch would not fit (as ``drop_last`` does).
    """

    samples: int
    epochs: int
    batches: list[int]
    auto: bool = False
    every: int = 0
    changes: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def of(cls, batch_size: int, schedule: str, samples: int, epochs: int, every: int = 0) -> BatchPlan:
        if not schedule:
            return cls(samples, epochs, [batch_size] * epochs)
        if schedule == "auto":
            return cls(samples, epochs, [batch_size] * epochs, auto=True, every=every)
        entries = parse_batch_schedule(schedule)
        out = []
        for e in range(epochs):
            out.append([b for start, b in entries if start <= e][-1])
        return cls(samples, epochs, out)

    @property
    def within_epochs(self) -> bool:
        """Whether the batch may change inside an epoch (``auto`` with ``every > 0``, or a run resumed at
        another batch: :meth:`change`)."""
        return (self.auto and self.every > 0) or bool(self.changes)

    def batch(self, epoch: int, shards: int = 1) -> int:
        """The global batch of ``epoch`` (past the last planned epoch: the last one's); deciding within
        epochs, the batch its first step trains on (where that step falls depends on the ``shards``)."""
        if self.within_epochs:
            return self.batch_at(self._walk(epoch=epoch, shards=shards)[1])
        return self.batches[min(epoch, len(self.batches) - 1)]

    def batch_at(self, step: int, shards: int = 1) -> int:
        """The global batch of the ``step``-th step (from 0)."""
        if self.within_epochs:
            return next((b for s, b in reversed(self.changes) if s <= step), self.batches[0])
        return self.batch(self.locate(step, shards)[0])

    @property
    def current(self) -> int:
        """Deciding within epochs: the batch of the latest decision (what the next step draws)."""
        return self.changes[-1][1] if self.changes else self.batches[0]

    def set_from(self, epoch: int, batch: int) -> None:
        """``auto``: epochs from ``epoch`` on train at ``batch``."""
        for e in range(epoch, len(self.batches)):
            self.batches[e] = batch

    def change(self, step: int, batch: int, *, again: bool = False) -> None:
        """Steps from ``step`` on train at ``batch`` (``auto`` deciding within epochs; a run resumed at another
        batch). ``again``: a change at the last change's step replaces it (a resumed run's batch supersedes
        the one its checkpoint was resumed with at that step)."""
        if again and self.changes and step == self.changes[-1][0]:
            self.changes.pop()
        if self.changes and step <= self.changes[-1][0]:
            raise ValueError(f"a batch change at step {step} follows one at step {self.changes[-1][0]}")
        self.changes.append((step, batch))

    def steps_at(self, batch: int, shards: int) -> int:
        """Steps of an epoch at the global batch ``batch``."""
        return (self.samples // shards) // max(1, batch // shards)

    def steps_in(self, epoch: int, shards: int) -> int:
        if self.within_epochs:
            return self._walk(epoch=epoch + 1, shards=shards)[1] - self._walk(epoch=epoch, shards=shards)[1]
        return self.steps_at(self.batch(epoch), shards)

    def total(self, shards: int) -> int:
        if self.within_epochs:
            return self._walk(epoch=self.epochs, shards=shards)[1]
        return sum(self.steps_in(e, shards) for e in range(self.epochs))

    def locate(self, step: int, shards: int) -> tuple[int, int]:
        """``(epoch, batch index)`` of the ``step``-th step (from 0): where a run resumed after ``step``
        steps starts."""
        if self.within_epochs:
            epoch, first, _ = self._walk(step=step, shards=shards)
            return epoch, step - first
        e = 0
        while step >= self.steps_in(e, shards) > 0:
            step -= self.steps_in(e, shards)
            e += 1
        return e, step

    def offset(self, epoch: int, batch: int, shards: int) -> int:
        """Samples of a shard that ``epoch``'s first ``batch`` batches take (where batch ``batch`` starts)."""
        if not self.within_epochs:
            return batch * (self.batch(epoch) // shards)
        _, first, _ = self._walk(epoch=epoch, shards=shards)
        return self._walk(step=first + batch, shards=shards)[2]

    def _walk(self, *, epoch: int | None = None, step: int | None = None, shards: int = 1) -> tuple[int, int, int]:
        """Deciding within epochs: walk the epochs segment by segment (a run of steps at one batch inside
        one epoch) to the start of ``epoch``, or to the ``step``-th step. Returns ``(epoch, the epoch's first
        step, samples of a shard taken before the step)``: for ``epoch=``, that epoch's first step and 0."""
        n = self.samples // shards
        e = s = first = taken = 0
        cuts = [c for c, _ in self.changes]
        while (epoch is None or e < epoch) and (step is None or s < step):
            b = max(1, self.batch_at(s) // shards)
            room = (n - taken) // b
            if room == 0:  # the next batch does not fit: the epoch ends
                if taken == 0:
                    raise ValueError(f"a global batch of {self.batch_at(s)} does not fit {n} samples a shard")
                e, first, taken = e + 1, s, 0
                continue
            k = min([room] + [c - s for c in cuts if c > s] + ([step - s] if step is not None else []))
            s, taken = s + k, taken + k * b
        if step is not None and (n - taken) // max(1, self.batch_at(s) // shards) == 0:
            e, first, taken = e + 1, s, 0  # the step-th batch does not fit the epoch: it opens the next
        return e, first, taken


def scaling_factor(rule: str, batch: int, base_batch: int) -> float:
    """``k`` (``linear``), ``sqrt(k)`` (``sqrt``) or 1 (``none``), with ``k = batch / base_batch``."""
    if rule == "none":
        return 1.0
    k = batch / base_batch
    if rule == "linear":
        return k
    if rule == "sqrt":
        return math.sqrt(k)
    raise ValueError(f"lr scaling {rule!r} is not known; choose one of: {', '.join(LR_SCALINGS)}")


def warmup_factor(step: int, warmup_steps: int, k: float) -> float:
    """Goyal et al.'s gradual warmup over ``warmup_steps`` toward the scaled rate (``k`` its factor):
    ``(1 + (k - 1) t / W) / k`` while ``t < W``; with ``k <= 1``, ``(t + 1) / W``; 1 from step W on."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return 1.0
    if k > 1.0:
        return (1.0 + (k - 1.0) * step / warmup_steps) / k
    return (step + 1) / warmup_steps
