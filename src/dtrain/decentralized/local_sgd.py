"""Local SGD: every worker steps its own optimizer and the replicas are averaged every ``period`` steps.

Usage (the optimizer is the user's, its buffers stay local)::

    local = LocalSGD(model, period=8, warmup_steps=100)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in loader:
        opt.zero_grad(); loss_fn(local(x), y).backward(); opt.step()
        local.step()

Three rules, each matching torch's own implementation step for step:

* **Periodic averaging** (torch's ``PeriodicModelAverager``): ``step()`` number ``s`` (counted
  from 0) averages the trainable parameters over the group when ``s >= warmup_steps`` and
  ``(s - warmup_steps) % period == 0``. The parameters are flattened into one buffer and
  averaged by one dtrain allreduce (``algorithm``), optionally compressed (``compression``).
* **Post-local SGD warm-up** (Lin et al. 2020, arXiv 1808.07217; torch's
  ``PostLocalSGDOptimizer`` with DDP's ``post_localSGD_hook``): during the first
  ``warmup_steps`` steps the *gradients* are averaged over the group before the optimizer
  step, as plain data parallelism does. LocalSGD registers
  ``Tensor.register_post_accumulate_grad_hook`` on every trainable parameter; when every
  parameter's gradient of the current backward has landed, the last hook averages them all,
  flattened, in one allreduce (uncompressed). The user's loop does not change. Every trainable
  parameter must take part in each warm-up backward (``step()`` raises naming the ones that got
  no gradient); a second backward before ``step()`` (gradient accumulation) averages again,
  which is still exact because averaging is linear. After warm-up the hooks are removed.
* **Hierarchical local SGD** (Lin et al. 2020; torch's ``HierarchicalModelAverager``):
  ``hierarchy=[(group_size, period), ...]`` (or a dict ``{group_size: period}``): consecutive
  ranks of the group in blocks of ``group_size`` average every ``period`` steps. At step ``s``
  (``s >= warmup_steps``) only the level with the largest period dividing ``s`` averages, as
  torch does; note that torch counts these periods from step 0, not from the end of warm-up,
  and so does LocalSGD. Rules (a :class:`~dtrain.errors.ConfigError` names the offending
  value): group sizes strictly increasing, each dividing the next (so the blocks nest), the
  last one the whole group; periods >= 1 and strictly increasing (torch requires no more:
  they need not be multiples of each other). ``period`` is ignored under ``hierarchy``.
  The subgroups are created by ``torch.distributed.new_subgroups`` (a collective over the
  default group: every process of the job constructs its LocalSGD in the same order).

Optimizer state is never averaged. ``average_buffers=True`` also averages the floating
buffers (BatchNorm statistics) at each averaging round, in a second allreduce.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from dtrain.comm.allreduce import ALGORITHMS, get_transport
from dtrain.comm.transport import Transport
from dtrain.compress import Compressor, resolve
from dtrain.compress.reduce import compressed_allreduce
from dtrain.decentralized.replica import ReplicaWrapper, assign_flat, flatten_params
from dtrain.errors import ConfigError

__all__ = ["LocalSGD", "parse_hierarchy"]

Level = tuple[int, int]  # (group size, period)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_hierarchy(hierarchy: Any, world: int) -> list[Level]:
    """Check ``hierarchy`` (pairs ``(group_size, period)`` or a dict ``{group_size: period}``)
    against a group of ``world`` ranks and return it as a list of pairs.

    Raises:
        ConfigError: naming the value and what to change.
    """
    pairs = list(hierarchy.items()) if isinstance(hierarchy, Mapping) else hierarchy
    if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Sequence) or not pairs:
        raise ConfigError(
            f"LocalSGD hierarchy={hierarchy!r}: give a non-empty list of (group_size, period) "
            "pairs, e.g. [(2, 2), (WORLD, 8)]"
        )
    levels: list[Level] = []
    for item in pairs:
        if not (isinstance(item, Sequence) and len(item) == 2 and all(_is_int(v) for v in item)):
            raise ConfigError(f"LocalSGD hierarchy level {item!r}: each level is a pair of ints (group_size, period)")
        size, period = int(item[0]), int(item[1])
        if size < 1 or world % size:
            raise ConfigError(
                f"LocalSGD hierarchy group_size={size}: must be >= 1 and divide the group's {world} ranks"
            )
        if period < 1:
            raise ConfigError(f"LocalSGD hierarchy period={period} (group_size {size}): must be >= 1")
        if levels:
            psize, pperiod = levels[-1]
            if size <= psize or size % psize:
                raise ConfigError(
                    f"LocalSGD hierarchy group_size={size} after {psize}: group sizes must "
                    "increase, each a multiple of the one before (the blocks nest)"
                )
            if period <= pperiod:
                raise ConfigError(
                    f"LocalSGD hierarchy period={period} after {pperiod}: periods must increase "
                    "with the group size (the whole group averages least often)"
                )
        levels.append((size, period))
    if levels[-1][0] != world:
        raise ConfigError(
            f"LocalSGD hierarchy: the last group_size={levels[-1][0]} must be the whole group "
            f"({world} ranks); add a level ({world}, PERIOD)"
        )
    return levels


def _check_options(period: Any, warmup_steps: Any, algorithm: Any) -> None:
    if not _is_int(period) or period < 1:
        raise ConfigError(f"LocalSGD period={period!r}: must be an int >= 1 (steps between averagings)")
    if not _is_int(warmup_steps) or warmup_steps < 0:
        raise ConfigError(f"LocalSGD warmup_steps={warmup_steps!r}: must be an int >= 0")
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        raise ConfigError(f"LocalSGD algorithm={algorithm!r}: choose one of {', '.join(ALGORITHMS)}")


def _due_fraction(periods: Sequence[int], i: int) -> float:
    """Share of steps at which level ``i`` is the largest level whose period divides the step
    (inclusion-exclusion over the higher levels)."""
    higher = list(periods[i + 1 :])
    total = 0.0
    for k in range(len(higher) + 1):
        for combo in itertools.combinations(higher, k):
            total += (-1) ** k / math.lcm(periods[i], *combo)
    return total


class LocalSGD(ReplicaWrapper):
    """Local SGD / post-local SGD / hierarchical local SGD over a process group (module docstring).

    Args:
        module: this worker's replica.
        period: steps between two averagings (after warm-up); 1 is synchronous model averaging.
        warmup_steps: steps at the start during which gradients are averaged instead (post-local SGD).
        hierarchy: ``[(group_size, period), ...]`` or ``{group_size: period}``; replaces ``period``.
        algorithm: dtrain allreduce algorithm of every average (a name in ``ALGORITHMS``).
        compression: compressor spec (``"fp16"``) or instance for the model averages (not warm-up).
        average_buffers: also average floating buffers at each averaging round.
        group: the workers' process group (default: the default group).
        timeout: seconds any wait may block before a CommTimeoutError.

    Raises:
        ConfigError: a bad value (named in the message), before any communication.
    """

    def __init__(
        self,
        module: nn.Module,
        period: int = 8,
        warmup_steps: int = 0,
        hierarchy: Any = None,
        algorithm: str = "ring",
        compression: str | Compressor | None = None,
        average_buffers: bool = False,
        group: Any = None,
        timeout: float | None = None,
    ) -> None:
        _check_options(period, warmup_steps, algorithm)
        try:
            # None averages exactly; any spec, "none" too, goes through compressed_allreduce
            compressor = resolve(compression, none_is_off=False) if compression is not None else None
        except ConfigError as e:
            raise ConfigError(f"LocalSGD compression={compression!r}: {e}") from None
        levels: list[Level] | None = None
        if hierarchy is not None and dist.is_initialized():
            levels = parse_hierarchy(hierarchy, dist.get_world_size(group))
        super().__init__(module, group=group, algorithm=algorithm, timeout=timeout)
        self.warmup_steps = int(warmup_steps)
        self.average_buffers = bool(average_buffers)
        self.compressor = compressor
        self.hierarchy = levels
        self.period = levels[-1][1] if levels else int(period)
        self.last_average_step: int | None = None
        self._levels: list[tuple[int, int, Transport]] = self._build_levels(levels)
        self._level_rounds = [0] * len(self._levels)
        self._hooks: list[RemovableHandle] = []
        self._landed: set[int] = set()
        self.warmup_rounds = 0
        if self.warmup_steps > 0:
            self._hooks = [p.register_post_accumulate_grad_hook(self._grad_landed) for p in self.params]

    def _build_levels(self, levels: list[Level] | None) -> list[tuple[int, int, Transport]]:
        """``(group_size, period, transport)`` per level, the subgroups made in order on every rank."""
        if not levels:
            return [(self.world, self.period, self.transport)]
        out: list[tuple[int, int, Transport]] = []
        for size, period in levels:
            if size == self.world:
                out.append((size, period, self.transport))
                continue
            if self.group is None:
                sub, _ = dist.new_subgroups(group_size=size)
            else:
                sub, _ = dist.new_subgroups(group_size=size, group=self.group)
            out.append((size, period, get_transport(sub, self.timeout_s)))
        return out

    # -- warm-up: gradient averaging -------------------------------------------------------
    def _grad_landed(self, p: torch.Tensor) -> None:
        """Post-accumulate hook: when the last parameter's gradient of this backward lands, average all."""
        if self.steps >= self.warmup_steps:
            return
        self._landed.add(id(p))
        if len(self._landed) < len(self.params):
            return
        self._landed.clear()
        grads = [q.grad for q in self.params]
        assert all(g is not None for g in grads)
        flat = flatten_params([g for g in grads if g is not None])
        if self.world > 1:
            self._allreduce(flat, "avg")
        with torch.no_grad():
            off = 0
            for q in self.params:
                g = q.grad
                assert g is not None
                n = g.numel()
                g.copy_(flat[off : off + n].view_as(g))
                off += n
        self.warmup_rounds += 1

    def _check_warmup_backward(self) -> None:
        if self._landed:
            names = {id(p): n for n, p in self.module.named_parameters()}
            missing = [names.get(id(p), "?") for p in self.params if id(p) not in self._landed]
            self._landed.clear()
            raise ConfigError(
                f"LocalSGD warm-up (step {self.steps}): parameters {missing} got no gradient in "
                "this backward, so the gradients were not averaged; every trainable parameter "
                "must take part in the loss during warm-up (or set requires_grad=False)"
            )

    # -- the step -------------------------------------------------------------------------
    def _due_level(self, s: int) -> int | None:
        """Index of the level that averages at step ``s`` (torch's rules), or None."""
        if s < self.warmup_steps:
            return None
        if self.hierarchy is None:
            return 0 if (s - self.warmup_steps) % self.period == 0 else None
        for i in reversed(range(len(self._levels))):
            if s % self._levels[i][1] == 0:
                return i
        return None

    def step(self) -> None:
        """Call after ``optimizer.step()``: average the replicas if this step is due, then count it."""
        s = self.steps
        if s < self.warmup_steps:
            self._check_warmup_backward()
        level = self._due_level(s)
        if level is not None:
            self._average(level)
            self.rounds += 1
            self._level_rounds[level] += 1
            self.last_average_step = s
        self.steps += 1
        if self.steps >= self.warmup_steps and self._hooks:
            for h in self._hooks:
                h.remove()
            self._hooks = []

    def _average(self, level: int) -> None:
        size, _, transport = self._levels[level]
        if size <= 1:
            return
        flat = flatten_params(self.params)
        if self.compressor is None:
            self._allreduce(flat, "avg", transport)
        else:
            before = transport.stats.snapshot()
            compressed_allreduce(
                flat,
                self.compressor,
                f"local_sgd/{size}",
                transport,
                algorithm=self.algorithm,
                shapes=[tuple(p.shape) for p in self.params],
            )
            self.count_sent(transport.stats.snapshot() - before)
        assign_flat(self.params, flat)
        if self.average_buffers:
            bufs = [b for b in self.module.buffers() if b.is_floating_point()]
            if bufs:
                fb = flatten_params(bufs)
                self._allreduce(fb, "avg", transport)
                assign_flat(bufs, fb)

    # -- reporting -----------------------------------------------------------------------
    def model_bytes(self) -> int:
        """Bytes of the trainable parameters (what one average reduces)."""
        return sum(p.numel() * p.element_size() for p in self.params)

    def expected_bytes_per_step(self) -> float:
        """Bytes this rank sends per step, on average, for the model averages (after warm-up).

        Closed form of the ring average: ``B * 2(N-1)/N / period`` for model bytes ``B`` over
        ``N`` ranks. Under ``hierarchy`` it is the sum over the levels of
        ``B * 2(g-1)/g * f`` with ``f`` the share of steps at which that level is the one that
        averages. The figure is the ring's for ``ring``, ``native`` (charged as a ring) and
        ``hierarchical`` (a ring per node and across nodes, about the same bytes); ``tree``
        sends about ``B`` per edge (``2(N-1)/N * B`` per rank on average), and
        ``recursive_doubling`` ``B log2 N``; ``rabenseifner`` is ring-like. Compression scales
        it by the compressor's ratio (``fp16``: 1/2), which this figure leaves out, as it
        leaves out warm-up gradient averaging (``B * 2(N-1)/N`` per warm-up step) and buffers.
        """
        b = float(self.model_bytes())
        periods = [p for _, p, _ in self._levels]
        if self.hierarchy is None:
            n = self.world
            return b * 2 * (n - 1) / n / self.period if n > 1 else 0.0
        return sum(b * 2 * (g - 1) / g * _due_fraction(periods, i) for i, (g, _, _) in enumerate(self._levels))

    def stats(self) -> dict[str, Any]:
        """The base's counters plus ``period``, ``warmup_steps``, ``last_average_step`` (the step
        index, from 0, of the last average; None before the first), ``warmup_rounds`` (gradient
        averages) and, under ``hierarchy``, ``level_rounds`` per ``group_size``."""
        out = super().stats()
        out.update(
            period=self.period,
            warmup_steps=self.warmup_steps,
            last_average_step=self.last_average_step,
            warmup_rounds=self.warmup_rounds,
        )
        if self.hierarchy is not None:
            out["level_rounds"] = {size: n for (size, _, _), n in zip(self._levels, self._level_rounds)}
        return out
