"""``dtrain.ShardedDataParallel``: ZeRO stages 1, 2 and 3 on dtrain's reduce-scatter and allgather.

Usage is FSDP2's: wrap, then build the optimizer over the wrapper's parameters,
which are this rank's shards::

    dp = dtrain.ShardedDataParallel(net, shard="gradients")     # or dtrain.DataParallel(net, shard=...)
    opt = torch.optim.AdamW(dp.parameters(), lr=1e-3)           # 1/P of the optimizer state per rank
    for x, y in loader:
        opt.zero_grad()
        loss_fn(dp(x), y).backward()   # gradients reduce-scattered: each rank's shard .grad is the average
        dp.clip_grad_norm_(1.0)        # optional: the global norm, over every shard
        opt.step()                     # each rank updates its shard; the next forward gathers the rest
    dp.full_state_dict()               # the unsharded state dict, on every rank (a collective)

What each level keeps per rank for ``Psi`` float32 parameters and Adam, ``P`` ranks
(Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020, sec. 5):

============  ==========================  ==================================================
shard         model state                 traffic per step (ring)
============  ==========================  ==================================================
optimizer     4Psi + 4Psi + 8Psi/P        reduce-scatter + allgather = one allreduce
gradients     4Psi + 12Psi/P              the same
parameters    16Psi/P + units in flight   allgather (forward) + allgather (backward) +
                                          reduce-scatter: 1.5x an allreduce
============  ==========================  ==================================================

How (units and flat buffers: :mod:`dtrain.sharded._flat_units`):

1. Wrap: ranks check they hold the same model and options, and flatten each unit's
   parameters into one buffer padded to ``P`` equal segments, which takes rank 0's
   values (a broadcast of that buffer, a unit at a time); the module's parameters
   become views of it (``p.data``), so the model stays an ordinary module. What no
   unit holds (buffers, frozen parameters) is broadcast apart. This rank's segment becomes the shard parameter
   (stages 1-2: a view of the same storage; stage 3: the only copy, the flat
   buffer's storage is freed).
2. Backward: each parameter's gradient is added into its unit's flat gradient
   buffer and dropped; when a unit's last gradient lands, its reduce-scatter
   (average) is queued on a communication thread, in a fixed unit order on every
   rank, overlapping the backward of earlier units. At the end of backward the
   reduced segment becomes (or is added to) the shard's ``.grad``; stage 2-3 free the
   unsharded buffer as soon as it is reduced, stage 1 keeps it.
3. Forward: stages 1-2 allgather the updated segments before the next forward
   (every unit at once with ``overlap="backward"``; with ``overlap="forward"`` each
   unit's forward waits only for its own). Stage 3 gathers a unit just before its
   forward, prefetching the next unit's gather meanwhile, frees it after, gathers it
   again before its backward (prefetching the one before) and frees it once its
   gradients are in.

``no_sync()`` accumulates unsharded gradients locally (as FSDP does) and the next
synchronised backward reduces the sum. Stage 3 keeps its units gathered from the first
such micro-step's forward to the synchronised backward's end, so accumulating micro-steps
cost one step's gathers and reduce-scatters, holding the whole parameters meanwhile.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtrain.comm.shard import segment
from dtrain.comm.step_stats import StepStats
from dtrain.errors import ConfigError, DTrainError
from dtrain.sharded._collectives import (
    agree_at_wrap,
    allgather_flat,
    broadcast_buffers,
    broadcast_flat,
    reduce_scatter_flat,
)
from dtrain.sharded._flat_units import Unit, plan_units
from dtrain.sharded._streams import Job, Stream, private_group
from dtrain.sharded.arguments import SHARDS, check_arguments

__all__ = ["ShardedDataParallel"]


def _queue_callback(fn: Any) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(fn)


class ShardedDataParallel(nn.Module):
    """Data parallelism with ZeRO sharding of optimizer state, gradients and parameters.

    Args:
        module: the model (every rank builds the same one).
        shard: ``"optimizer"`` (stage 1), ``"gradients"`` (stage 2) or ``"parameters"`` (stage 3)
            (default: "gradients").
        algorithm: ``"ring"`` (dtrain's reduce-scatter and allgather, bytes counted) or ``"native"``
            (the backend's ``reduce_scatter_tensor`` / ``all_gather_into_tensor``) (default: "ring").
        overlap: stages 1-2: ``"backward"`` gathers every unit before the forward starts,
            ``"forward"`` lets each unit's forward wait only for its own gather (default: "backward").
            Stage 3 always gathers unit by unit with prefetch.
        units: qualified names of the submodules that are units (default: the top-level children
            holding parameters, cut at a ModuleList's blocks: ``block0``.. of gpt, ``model.layers.0``..).
        group: the data-parallel process group (default: the default group).
        timeout_s: seconds any wait may block before CommTimeoutError naming rank, operation
            and step (default: 300).
        broadcast_buffers: copy rank 0's buffers before each forward, as DDP (default: True).
        grad_dtype: the dtype gradients are reduce-scattered in, e.g. bf16 (default: None, the parameters').

    Raises:
        ConfigError: a bad option, a unit that does not exist, a model that differs between
            ranks (named), or ranks passing different options.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        shard: str = "gradients",
        algorithm: str = "ring",
        overlap: str = "backward",
        units: Sequence[str] | None = None,
        group: Any = None,
        timeout_s: float = 300.0,
        broadcast_buffers: bool = True,
        grad_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_arguments(module, shard=shard, algorithm=algorithm, overlap=overlap, timeout_s=timeout_s)
        self.module = module
        self.shard, self.stage = shard, SHARDS.index(shard)
        self.algorithm, self.overlap, self.timeout_s = algorithm, overlap, float(timeout_s)
        self.broadcast_buffers, self.grad_dtype = broadcast_buffers, grad_dtype
        if group is not None and not dist.is_initialized():
            raise ConfigError("a process group was given but torch.distributed is not initialized; call dtrain.init()")
        init = dist.is_initialized()
        self._group = group
        self._world = dist.get_world_size(group) if init else 1
        self._rank = dist.get_rank() if init else 0
        self._grank = dist.get_rank(group) if init else 0
        if init and self._grank < 0:
            raise ConfigError(f"rank {self._rank} is not a member of the group it passed to ShardedDataParallel")
        self._ranks = dist.get_process_group_ranks(group or dist.group.WORLD) if init else [0]
        self._buffer_list = [b for _, b in module.named_buffers()]
        self._units = plan_units(module, units, self._world)
        if self._world > 1:
            self._agree_at_wrap(units)
        self._rs = Stream(self._ranks, self.timeout_s, self._rank, "dtrain-zero-rs")
        self._ag = Stream(self._ranks, self.timeout_s, self._rank, "dtrain-zero-ag")
        self._ctl = private_group(self._ranks, self.timeout_s)  # small control collectives on the main thread
        with torch.no_grad():
            for u in self._units:
                self._flatten(u)
        self._shards = [u.shard for u in self._units]
        # step state
        self.step = 0
        self.require_sync = True
        self._fwd_sync: bool | None = None
        self._bw_started = False
        self._bw_sync = True
        self._next = 0
        self._order = list(reversed(self._units))  # reduce-scatter launch order, the same on every rank
        self._rs_jobs: list[Job] = []
        self._dirty = False  # stages 1-2: shards stepped since the last gather
        self._summoned = False  # stage 3: every unit held gathered (evaluation, state dicts)
        self._held = False  # stage 3: units kept gathered since a no_sync micro-step, to the next synced backward
        self._stats = StepStats(step=0)
        self.last_stats = StepStats()
        self._t_fwd: float | None = None
        self._peak_gathered = 0
        self.closed = False
        self._hooks: list[Any] = []
        for u in self._units:
            for j, p in enumerate(u.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook(u, j)))
            if self.stage == 3 or overlap == "forward":
                self._hooks.append(u.module.register_forward_pre_hook(self._pre_forward_hook(u)))
            if self.stage == 3:
                self._hooks.append(u.module.register_forward_hook(self._post_forward_hook(u)))

    # ------------------------------------------------------------------ set-up

    def _agree_at_wrap(self, units: Sequence[str] | None) -> None:
        opts = f"shard={self.shard!r}, algorithm={self.algorithm!r}, overlap={self.overlap!r}, units={units!r}"
        params: list[torch.Tensor] = [p for u in self._units for p in u.params]
        held = {id(p) for p in params}
        others = [*(p for p in self.module.parameters() if id(p) not in held), *self._buffer_list]
        agree_at_wrap(self.module, params, others, opts, self._group, self._ranks, self._rank, self.timeout_s)

    def _flatten(self, u: Unit) -> None:
        """``u``'s parameters into its flat buffer (rank 0's, broadcast in place), then its shard; a unit at a
        time, so that wrapping holds one unit's flat copy beyond the model, not a copy of the whole model."""
        full = torch.zeros(u.padded, dtype=u.dtype(), device=u.device())
        views = u.views(full)
        for v, p in zip(views, u.params):
            v.copy_(p.detach())
            p.data = v
        if self._world > 1:
            broadcast_flat(full, u.name or "<root>", self._group, self._ranks, self._rank, self.timeout_s)
        u.full = full
        own = segment(full, self._grank, self._world)
        if self.stage < 3:
            u.shard = nn.Parameter(own)  # the same storage: the optimizer's step writes the gathered buffer
        else:
            u.shard = nn.Parameter(own.clone())
            self._free(u)
        if self.stage == 1:
            u.gbuf = torch.zeros_like(full)
            u.gviews = u.views(u.gbuf)

    # ------------------------------------------------------------------ gather / free

    def _free(self, u: Unit) -> None:
        assert u.full is not None
        u.full.untyped_storage().resize_(0)
        u.gathered = False

    def _gathered_bytes(self) -> int:
        return sum(u.full.untyped_storage().nbytes() for u in self._units if u.full is not None)

    def _gather(self, u: Unit) -> None:
        """Queue ``u``'s allgather (stage 3: into freshly allocated storage) unless it is gathered or queued."""
        if u.gathered or u.gjob is not None:
            return
        full = u.full
        assert full is not None and u.shard is not None
        if self.stage == 3:
            st = full.untyped_storage()
            if st.nbytes() == 0:
                st.resize_(u.padded * full.element_size())
            with torch.no_grad():
                segment(full, self._grank, self._world).copy_(u.shard)
            self._peak_gathered = max(self._peak_gathered, self._gathered_bytes())
        u.gjob = self._ag.submit(
            f"allgather({self.algorithm}) of unit {u.name or '<root>'}", self.step, lambda: self._allgather(full)
        )

    def _wait_gather(self, u: Unit, count: bool = True) -> None:
        job = u.gjob
        if job is None:
            return
        t0 = time.perf_counter()
        try:
            job.wait()
        finally:
            u.gjob = None
        u.gathered = True
        if count:  # not an evaluation's gathers: those are not a training step's traffic
            self._stats.add_wait(time.perf_counter() - t0)
            self._stats.add_comm(job.t0, job.t1, job.nbytes)

    def _allgather(self, flat: torch.Tensor) -> int:
        return allgather_flat(flat, self._ag.group, self.algorithm, self._world, self.timeout_s)

    def _reduce_scatter(self, u: Unit, gbuf: torch.Tensor, out: torch.Tensor | None) -> int:
        """Reduce-scatter ``u``'s gradients; stages 2-3 into ``out`` (the shard's gradient to be, allocated
        by the thread that runs backward), stage 1 into the kept buffer's own segment."""
        wire = gbuf if self.grad_dtype in (None, gbuf.dtype) else gbuf.to(self.grad_dtype)
        group, algo, world, timeout = self._rs.group, self.algorithm, self._world, self.timeout_s
        nbytes = reduce_scatter_flat(wire, group, algo, world, timeout, out=out if wire is gbuf else None)
        if wire is not gbuf:  # this rank's reduced segment back in float32
            own = segment(wire, self._grank, self._world)
            (segment(gbuf, self._grank, self._world) if out is None else out).copy_(own)
        if out is not None:  # keep only the reduced segment; the unsharded buffer goes now
            u.reduced = out
            u.gbuf, u.gviews = None, []
        return nbytes

    def _ensure_gathered(self) -> None:
        """Stages 1-2: allgather the shards stepped since the last gather, and wait."""
        if self._dirty:
            self._dirty = False
            for u in self._units:
                u.gathered = False
                self._gather(u)
        for u in self._units:
            self._wait_gather(u)

    # ------------------------------------------------------------------ forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.closed:
            raise DTrainError("this ShardedDataParallel was closed; wrap the module again")
        self._fwd_sync = self.require_sync
        self._t_fwd = time.perf_counter()
        self._wait_at_fwd = self._stats.wait_s
        if self._summoned:
            self._release()
        if self.stage < 3:
            if self._dirty:
                self._dirty = False
                for u in self._units:
                    u.gathered = False
                    self._gather(u)
            if self.overlap == "backward":
                for u in self._units:
                    self._wait_gather(u)
        if self.broadcast_buffers and self._buffer_list and self._world > 1:
            broadcast_buffers(self._buffer_list, self._ctl, self._ranks, self._rank, self.timeout_s, self.step)
        return self.module(*args, **kwargs)

    def _pre_forward_hook(self, u: Unit) -> Any:
        def hook(module: nn.Module, inputs: Any) -> None:
            if self._summoned:
                return
            if self.stage == 3:
                for v in (u, self._neighbour(u, +1)):
                    if v is not None:
                        self._gather(v)
            self._wait_gather(u)

        return hook

    def _post_forward_hook(self, u: Unit) -> Any:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if self._summoned:
                return
            if torch.is_grad_enabled():
                u.bw_prepared = False
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(self._pre_backward_hook(u))
                if u.name == "":  # the root unit serves the whole forward and backward: freed at backward's end
                    return
            if self._fwd_sync is not False and not self._held:  # accumulating micro-steps keep it: one gather
                self._free(u)

        return hook

    def _neighbour(self, u: Unit, d: int) -> Unit | None:
        i = u.index + d
        return self._units[i] if 0 <= i < len(self._units) else None

    # ------------------------------------------------------------------ backward

    def _pre_backward_hook(self, u: Unit) -> Any:
        def hook(grad: torch.Tensor) -> None:
            if not self._bw_started:
                self._start_backward()
            if u.bw_prepared:
                return
            u.bw_prepared = True
            for v in (u, self._neighbour(u, -1)):
                if v is not None:
                    self._gather(v)
            self._wait_gather(u)

        return hook

    def _start_backward(self) -> None:
        self._bw_started = True
        self._bw_sync = self.require_sync if self._fwd_sync is None else self._fwd_sync
        _queue_callback(self._on_backward_end)

    def _grad_hook(self, u: Unit, j: int) -> Any:
        def hook(p: torch.Tensor) -> None:
            if not self._bw_started:
                self._start_backward()
            if u.gbuf is None:
                u.gbuf = torch.zeros(u.padded, dtype=u.dtype(), device=u.device())
                u.gviews = u.views(u.gbuf)
            elif u.fresh and self.stage == 1:
                u.open_window(self._grank, self._world)
            u.fresh = False
            u.gviews[j].add_(p.grad)  # type: ignore[arg-type]
            p.grad = None
            u.arrived += 1
            if u.arrived == len(u.params):
                self._unit_done(u)

        return hook

    def _unit_done(self, u: Unit) -> None:
        if self.stage == 3 and u.name != "" and not self._summoned and self._bw_sync:
            self._free(u)
        if not self._bw_sync:
            return
        u.ready = True
        order = self._order
        while self._next < len(order) and order[self._next].ready:
            self._launch(order[self._next])
            self._next += 1

    def _launch(self, v: Unit) -> None:
        gbuf = v.gbuf
        assert gbuf is not None
        # stages 2-3: the reduced segment's own tensor, allocated here on the thread that frees it again
        # (the optimizer's zero_grad), not on the communication thread, whose malloc arena would keep the
        # freed gradients from the activations of the next forward
        out = torch.empty(v.seg, dtype=gbuf.dtype, device=gbuf.device) if self.stage > 1 else None
        self._rs_jobs.append(
            self._rs.submit(
                f"reduce_scatter({self.algorithm}) of unit {v.name or '<root>'}",
                self.step,
                lambda: self._reduce_scatter(v, gbuf, out),
            )
        )

    def _on_backward_end(self) -> None:
        self._bw_started = False
        st = self._stats
        if self._t_fwd is not None:
            st.compute_s += time.perf_counter() - self._t_fwd - (st.wait_s - self._wait_at_fwd)
            self._t_fwd = None
        self._fwd_sync = None
        if self.stage == 3 and not self._summoned:
            self._held = not self._bw_sync
            for u in self._units:
                if u.gathered or u.gjob is not None:
                    self._wait_gather(u)
                    if not self._held:
                        self._free(u)
        for u in self._units:
            u.arrived = 0
        if not self._bw_sync:
            return
        # parameters that got no gradient count as zero gradients (as FSDP): launch what is left, in order
        for u in self._order[self._next :]:
            if u.gbuf is None:
                u.gbuf = torch.zeros(u.padded, dtype=u.dtype(), device=u.device())
                u.gviews = u.views(u.gbuf)
            elif u.fresh and self.stage == 1:
                u.open_window(self._grank, self._world)
            u.ready = True
        while self._next < len(self._order):
            self._launch(self._order[self._next])
            self._next += 1
        jobs, self._rs_jobs = self._rs_jobs, []
        t0 = time.perf_counter()
        for job in jobs:
            job.wait()
            st.add_comm(job.t0, job.t1, job.nbytes)
        st.add_wait(time.perf_counter() - t0)
        self._next = 0
        for u in self._units:
            u.hand_over(self.stage, self._grank, self._world)
            u.ready, u.fresh = False, True
        self._dirty = True
        self.step += 1
        self.last_stats = st.close()
        self._stats = StepStats(step=self.step)

    # ------------------------------------------------------------------ the user's API

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """This rank's shards, one flat parameter per unit: build the optimizer over these."""
        for p in self._shards:
            assert p is not None
            yield p

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        for u in self._units:
            assert u.shard is not None
            yield f"{prefix}{u.name or '<root>'}.flat_shard", u.shard

    @property
    def units(self) -> list[Unit]:
        return self._units

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate unsharded gradients locally; the next backward outside the context reduces the sum."""
        old = self.require_sync
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = old

    def synchronize(self) -> None:
        """Make ``self.module`` whole on this rank: stages 1-2 gather the stepped shards; stage 3 gathers
        every unit and keeps them until the next forward (as FSDP's ``summon_full_params``). A collective."""
        if self.stage < 3:
            self._ensure_gathered()
            return
        if not self._summoned:
            for u in self._units:
                self._gather(u)
            for u in self._units:
                self._wait_gather(u, count=False)
            self._summoned = True  # not counted in gathered_peak: that is training's units in flight

    def _release(self) -> None:
        self._summoned = False
        for u in self._units:
            self._free(u)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the shards' gradients so that the global norm (over every rank's shard) is at most ``max_norm``.

        The same rule as ``torch.nn.utils.clip_grad_norm_`` on the unsharded model: one scalar
        allreduce of the local sums of squares (or maxima, for ``norm_type=inf``). Returns the
        total norm. A collective: every rank calls it.
        """
        from dtrain.sharded.state import clip_grad_norm

        return clip_grad_norm(self, max_norm, norm_type)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unwrapped model's state dict with every parameter whole, on every rank (a collective)."""
        from dtrain.sharded.state import full_state_dict

        return full_state_dict(self)

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load an unsharded state dict (the same on every rank); each rank keeps its segments."""
        from dtrain.sharded.state import load_full_state_dict

        load_full_state_dict(self, state)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``optimizer``'s state as an unsharded run over ``module.parameters()`` would hold it (a collective)."""
        from dtrain.sharded.state import full_optimizer_state_dict

        return full_optimizer_state_dict(self, optimizer)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """``module.``-prefixed :meth:`full_state_dict`, as DataParallel's (a collective)."""
        return {f"module.{k}": v for k, v in self.full_state_dict().items()}

    def step_stats(self) -> dict[str, Any]:
        """Figures of the last synchronised step: compute_s, comm_s, wait_s, bytes_sent, buckets (collectives)."""
        return self.last_stats.as_dict()

    def memory_stats(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes this rank holds now, by kind, counting each storage once.

        ``params`` (gathered flat buffers and shards), ``grads`` (flat gradient buffers and shard
        gradients), ``optimizer`` (the state of ``optimizer``), ``gathered_peak`` (stage 3: the most
        unit bytes held gathered at once in training so far).
        """
        from dtrain.sharded.state import memory_stats

        return memory_stats(self, optimizer)

    def close(self) -> None:
        """Remove the hooks and free the private groups (idempotent)."""
        if self.closed:
            return
        self.closed = True
        for h in self._hooks:
            h.remove()
        self._rs.close()
        self._ag.close()
        if self._ctl is not None:
            with contextlib.suppress(Exception):  # best effort at teardown
                dist.destroy_process_group(self._ctl)

    def __repr__(self) -> str:
        return (
            f"ShardedDataParallel(shard={self.shard!r}, algorithm={self.algorithm!r}, world={self._world}, "
            f"units={len(self._units)}, module={self.module!r})"
        )


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []
