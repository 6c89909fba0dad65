"""The gradient-synchronisation machinery behind :class:`~dtrain.data_parallel.DataParallel`.

:class:`Reducer` owns the buckets, the per-parameter hooks, the end-of-backward
callback, the schedulers and the private process groups. It is a plain object
(not an ``nn.Module``) so the per-gradient hot path touches only ordinary
attributes.

Backward, per synchronised step:

1. First hook of the backward: decide whether this backward synchronises
   (``no_sync`` as captured by the forward, like DDP) and queue the autograd
   callback that runs when backward ends.
2. Each post-accumulate-grad hook: make sure ``.grad`` is the parameter's bucket
   view (one copy if ``zero_grad()`` replaced it), count it; a bucket whose last
   gradient arrived is launched -- strictly in bucket order, so every rank issues
   the same collectives in the same order.
3. Callback: parameters without gradient either raise
   :class:`UnusedParametersError` or (``find_unused_parameters``) are agreed over
   ranks with one small allreduce and marked ready; then wait for every bucket
   (``overlap="backward"``) and, after the first step, adopt rank 0's observed
   gradient order as the bucket order.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtrain import trace as _trace
from dtrain.comm.step_stats import StepStats
from dtrain.comm.waits import wait_work
from dtrain.compress.reduce import BucketReducer
from dtrain.data_parallel._buckets import Bucket, build_buckets
from dtrain.data_parallel._comm import NativeScheduler, StreamSync, ThreadScheduler
from dtrain.data_parallel._optim import BucketOptimizer
from dtrain.data_parallel._priority import PriorityScheduler
from dtrain.data_parallel.tunables import DataParallelConfig
from dtrain.errors import DTrainError

__all__ = ["Reducer", "UnusedParametersError"]


class UnusedParametersError(DTrainError):
    """Parameters received no gradient in a synchronised backward (and find_unused_parameters is off)."""


def _queue_callback(fn: Callable[[], None]) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(fn)


class Reducer:
    """Average the gradients of ``params`` over the ranks of ``group`` during backward.

    Args:
        module: the wrapped model (for the forward pre-hooks of ``overlap="forward"``).
        named: the trainable parameters with their names, in registration order.
        cfg: validated options.
        group: the data-parallel group (None: the default group, or a world of one).
        world: ranks in the group; rank: this process's global rank.
        ranks: global rank of each group rank.
        compressor: a compressor or None.
        optimizer: ``overlap="forward"``: the optimizer stepped per bucket.
    """

    def __init__(
        self,
        module: nn.Module,
        named: Sequence[tuple[str, nn.Parameter]],
        cfg: DataParallelConfig,
        *,
        group: Any,
        world: int,
        rank: int,
        ranks: Sequence[int],
        compressor: Any,
        optimizer: torch.optim.Optimizer | None,
    ) -> None:
        self.cfg = cfg
        self._module = module
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._index_of = {id(p): i for i, p in enumerate(self._params)}
        self._group, self._world, self._rank, self._ranks = group, world, rank, list(ranks)
        self._src = self._ranks[0]
        self.forward_mode = cfg.overlap == "forward"

        # private groups: the communication thread's, and a gloo one for small control messages
        self._own_groups: list[Any] = []
        needs_thread = cfg.algorithm != "native" or self.forward_mode or compressor is not None
        self._comm_group = self._new_group(None) if needs_thread else None
        self._ctl_group = self._new_group("gloo")
        agree = None
        if self.forward_mode and world > 1:
            agree = self._comm_group if str(dist.get_backend(self._comm_group)) == "gloo" else self._new_group("gloo")

        self._streams: dict[torch.device, StreamSync] = {}
        self._version = 0
        self.step = 0
        self.require_sync = True
        self._fwd_sync: bool | None = None  # no_sync state captured by forward, as DDP
        self._bw_sync = True
        self._cb_queued = False
        self._record_order: list[int] | None = []  # the first synced backward records arrival order
        self._pending_order: list[int] | None = None
        self._stats = StepStats(step=0)
        self.last_stats = StepStats()
        self._t_fwd: float | None = None
        self._wait_at_fwd = 0.0
        self.closed = False
        self.measure_local_norm = False  # the noise scale: sum of squares of this rank's own gradients
        self._local_sq: torch.Tensor | None = None
        self.last_local_sq: float | None = None
        self._install_buckets(list(reversed(range(len(self._params)))))

        reducer = BucketReducer(cfg.algorithm, self._comm_group, world, cfg.timeout_s, compressor)
        self.optimizer = optimizer
        self._bucket_opt: BucketOptimizer | None = None
        self._sched: Any
        self._pre_hooks: list[Any] = []
        if self.forward_mode:
            assert optimizer is not None
            self._bucket_opt = BucketOptimizer(optimizer, self._bucket_params())
            self._sched = PriorityScheduler(
                reducer, self._apply_bucket, agree, rank, cfg.timeout_s, self._stream_of, self._publish
            )
            self._sched.set_buckets(self._buckets)
            self._module_buckets: dict[nn.Module, list[int]] = {}
            self._map_modules()
            self._pre_hooks = [
                m.register_forward_pre_hook(self._forward_wait) for m in module.modules() if self._direct_params(m)
            ]
        elif world == 1 or (cfg.algorithm == "native" and compressor is None):
            self._sched = NativeScheduler(group, world, rank, cfg.timeout_s)
        else:
            self._sched = ThreadScheduler(reducer, rank, cfg.timeout_s, self._stream_of)
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self._params)]

    # ------------------------------------------------------------------ set-up helpers

    def _new_group(self, backend: str | None) -> Any:
        if self._world <= 1:
            return None
        whole = len(self._ranks) == dist.get_world_size()
        g = dist.new_group(
            ranks=self._ranks,
            timeout=datetime.timedelta(seconds=self.cfg.timeout_s),
            backend=backend,
            use_local_synchronization=not whole,
        )
        self._own_groups.append(g)
        return g

    def _stream_of(self, b: Bucket) -> StreamSync:
        dev = b.flat.device
        s = self._streams.get(dev)
        if s is None:
            s = self._streams[dev] = StreamSync(dev)
        return s

    def _install_buckets(self, order: list[int]) -> None:
        """(Re)build buckets in ``order``; current gradients move into the new views."""
        cfg = self.cfg
        self._buckets = build_buckets(
            self._params, order, cap_bytes=cfg.cap_bytes, first_cap_bytes=cfg.first_cap_bytes, version=self._version
        )
        self._version += 1
        self._bucket_of: list[Bucket] = [None] * len(self._params)  # type: ignore[list-item]
        self._views: list[torch.Tensor] = [None] * len(self._params)  # type: ignore[list-item]
        for b in self._buckets:
            for k, i in enumerate(b.members):
                self._bucket_of[i] = b
                self._views[i] = b.buffer.views[k]
        with torch.no_grad():
            for p, v in zip(self._params, self._views):
                if p.grad is not None:
                    v.copy_(p.grad)
                    p.grad = v
        self._order_now = order
        self._reset_backward()

    def _bucket_params(self) -> list[list[torch.Tensor]]:
        return [[self._params[i] for i in b.members] for b in self._buckets]

    def _direct_params(self, m: nn.Module) -> list[int]:
        ids = self._index_of
        return [ids[id(p)] for p in m.parameters(recurse=False) if id(p) in ids]

    def _map_modules(self) -> None:
        self._module_buckets = {}
        for m in self._module.modules():
            idx = self._direct_params(m)
            if idx:
                self._module_buckets[m] = sorted({self._bucket_of[i].index for i in idx})

    def _reset_backward(self) -> None:
        self._ready = [False] * len(self._params)
        self._used = [False] * len(self._params)
        self._n_ready = 0
        self._next = 0
        for b in self._buckets:
            b.reset()

    # ------------------------------------------------------------------ called by DataParallel

    @property
    def buckets(self) -> list[list[str]]:
        return [[self._names[i] for i in b.members] for b in self._buckets]

    @property
    def bucket_objects(self) -> list[Bucket]:
        return self._buckets

    def begin_forward(self) -> None:
        if self.closed:
            raise DTrainError("this DataParallel was closed; wrap the module again")
        self._fwd_sync = self.require_sync
        self._t_fwd = time.perf_counter()
        self._wait_at_fwd = self._stats.wait_s

    def end_forward(self) -> None:
        if self.forward_mode:
            self._quiesce("forward")

    def synchronize(self, what: str) -> None:
        if self.closed:
            raise DTrainError("this DataParallel was closed; wrap the module again")
        if self.forward_mode:
            self._quiesce(what)

    def close(self) -> None:
        if self.closed:
            return
        if self.forward_mode:
            with contextlib.suppress(Exception):  # the failure was raised to the user already
                self._quiesce("close()")
        for h in self._pre_hooks:
            h.remove()
        self.closed = True
        self._sched.close()
        for h in self._hooks:
            h.remove()
        for g in self._own_groups:
            with contextlib.suppress(Exception):  # best effort at teardown: a peer may be gone
                dist.destroy_process_group(g)
        self._own_groups = []

    # ------------------------------------------------------------------ backward path

    def _make_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            self._on_grad(i, p)

        return hook

    def _on_grad(self, i: int, p: torch.Tensor) -> None:
        if not self._cb_queued:
            self._start_backward()
        self._used[i] = True
        if not self._bw_sync:
            return
        if self._ready[i]:
            raise DTrainError(
                f"parameter {self._names[i]!r} received its gradient twice in one backward (reentrant checkpointing "
                "or a second backward through the same graph); DataParallel reduces each gradient once per backward"
            )
        self._ready[i] = True
        self._n_ready += 1
        if self._record_order is not None:
            self._record_order.append(i)
        view = self._views[i]
        g = p.grad
        if g is not view:
            if g.is_sparse:  # type: ignore[union-attr]
                raise DTrainError(
                    f"parameter {self._names[i]!r} has a sparse gradient; DataParallel reduces dense gradients "
                    "(use nn.Embedding(..., sparse=False))"
                )
            view.copy_(g)  # type: ignore[arg-type]
            p.grad = view
        b = self._bucket_of[i]
        b.pending -= 1
        if b.pending == 0:
            self._bucket_ready(b, inline=self._n_ready == len(self._params))

    def _start_backward(self) -> None:
        self._cb_queued = True
        self._bw_sync = self.require_sync if self._fwd_sync is None else self._fwd_sync
        if self.forward_mode:
            self._quiesce("backward")  # the user may have bypassed model(...) forward
            if self._bw_sync:
                self._bucket_opt.snapshot()  # type: ignore[union-attr]
                self._sched.begin_step(self.step, self._stats)
        _queue_callback(self._on_backward_end)

    def _bucket_ready(self, b: Bucket, inline: bool) -> None:
        b.ready = True
        if self.measure_local_norm:  # before the bucket is reduced in place
            sq = torch.dot(b.flat, b.flat)
            self._local_sq = sq if self._local_sq is None else self._local_sq + sq
        if self.forward_mode:
            self._sched.mark_ready(b)
            return
        buckets = self._buckets
        while self._next < len(buckets) and buckets[self._next].ready:
            self._sched.launch(buckets[self._next], inline, self.step)
            self._next += 1

    def _on_backward_end(self) -> None:
        self._cb_queued = False
        now = time.perf_counter()
        st = self._stats
        if self._t_fwd is not None:
            st.compute_s += now - self._t_fwd - (st.wait_s - self._wait_at_fwd)
            self._t_fwd = None
        self._fwd_sync = None
        if not self._bw_sync:
            return
        try:
            if self.cfg.find_unused_parameters or self._n_ready < len(self._params):
                self._handle_unused()
            if not self.forward_mode:
                t0 = time.perf_counter()
                with _trace.span("wait for buckets"):
                    self._sched.wait_all(self.step, st)
                st.add_wait(time.perf_counter() - t0)
            if self._record_order is not None:
                self._agree_order(self._record_order)
            if self._bucket_opt is not None:
                self._bucket_opt.committed()
        except BaseException as e:
            self._sched.abort(e)  # this step's gradients are undefined; nothing of it is left pending
            raise
        finally:
            self._reset_backward()
        self.step += 1
        if self._local_sq is not None:
            self.last_local_sq, self._local_sq = float(self._local_sq), None
        self._stats = StepStats(step=self.step)
        if not self.forward_mode:
            self._publish(st)
            if self._pending_order is not None:
                self._apply_order()

    def _handle_unused(self) -> None:
        missing = [i for i, r in enumerate(self._ready) if not r]
        if not self.cfg.find_unused_parameters:
            names = [self._names[i] for i in missing]
            shown = ", ".join(repr(n) for n in names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
            raise UnusedParametersError(
                f"rank {self._rank}: {len(names)} parameter(s) received no gradient at step {self.step}: {shown}. "
                "Make them take part in the loss, set requires_grad=False on them, or pass "
                "find_unused_parameters=True to DataParallel to treat them as zero gradients (as DDP does)"
            )
        used = self._used
        if self._world > 1:
            flags = torch.tensor(used, dtype=torch.int32)
            wait_work(
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._ctl_group, async_op=True),
                self.cfg.timeout_s,
                self._rank,
                "DataParallel used-parameter agreement",
                self.step,
            )
            used = [bool(f) for f in flags.tolist()]
        with torch.no_grad():
            for i in missing:
                p, view = self._params[i], self._views[i]
                if p.grad is None:
                    view.zero_()
                    if used[i]:  # used on another rank: its average includes our zero
                        p.grad = view
                elif p.grad is not view:
                    view.copy_(p.grad)
                    p.grad = view
        for i in missing:
            self._ready[i] = True
            self._n_ready += 1
            b = self._bucket_of[i]
            b.pending -= 1
            if b.pending == 0:
                self._bucket_ready(b, inline=True)

    def _publish(self, stats: StepStats) -> None:
        self.last_stats = stats.close()

    # ------------------------------------------------------------------ bucket order rebuild

    def _agree_order(self, observed: list[int]) -> None:
        """After the first synced backward: adopt rank 0's observed gradient order (DDP's bucket rebuild)."""
        self._record_order = None
        seen = set(observed)
        order = observed + [i for i in reversed(range(len(self._params))) if i not in seen]
        if self._world > 1:
            t = torch.tensor(order, dtype=torch.int64)
            wait_work(
                dist.broadcast(t, src=self._src, group=self._ctl_group, async_op=True),
                self.cfg.timeout_s,
                self._rank,
                "DataParallel bucket order agreement",
                self.step,
            )
            order = [int(x) for x in t.tolist()]
        if order != self._order_now:
            self._pending_order = order

    def _apply_order(self) -> None:
        order, self._pending_order = self._pending_order, None
        assert order is not None
        self._install_buckets(order)
        self._after_install()

    def _after_install(self) -> None:
        if self.forward_mode:
            self._sched.set_buckets(self._buckets)
            self._bucket_opt = BucketOptimizer(self.optimizer, self._bucket_params())  # type: ignore[arg-type]
            self._map_modules()

    # ------------------------------------------------------------------ checkpoint state

    def state_dict(self) -> dict[str, Any]:
        """The bucket layout (order, generation: they make the compressor's keys) and the step count.

        Call between steps (after ``synchronize`` with ``overlap="forward"``). An
        order agreed but not installed yet is reported as the layout the next step uses.
        """
        if self._pending_order is not None:
            order, version = self._pending_order, self._version
        else:
            order, version = self._order_now, self._version - 1
        return {
            "order": list(order),
            "version": version,
            "step": self.step,
            "order_agreed": self._record_order is None,
            "names": list(self._names),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Install the saved bucket layout and step count (before the first step of a resumed run)."""
        names = list(state["names"])
        if names != self._names:
            raise ValueError(
                f"the saved bucket layout is for parameters {names[:5]}..., this model has "
                f"{self._names[:5]}...; resume with the same model"
            )
        order = [int(i) for i in state["order"]]
        if sorted(order) != list(range(len(self._params))):
            raise ValueError(f"the saved bucket order is not a permutation of the {len(self._params)} parameters")
        self._pending_order = None
        self._version = int(state["version"])
        self._install_buckets(order)
        self._after_install()
        self._record_order = None if state["order_agreed"] else []
        self.step = int(state["step"])
        self._stats = StepStats(step=self.step)

    # ------------------------------------------------------------------ overlap="forward"

    def _apply_bucket(self, b: Bucket) -> None:
        """Per-bucket optimizer step, then zero the bucket (runs on the communication thread)."""
        self._bucket_opt.step(b.index)  # type: ignore[union-attr]
        b.flat.zero_()

    def _forward_wait(self, m: nn.Module, args: Any) -> None:
        idx = self._module_buckets.get(m)
        if idx and self._sched.busy():
            waited = 0.0
            for i in idx:
                waited += self._sched.wait(i, f"forward of {type(m).__name__}")
            self._stats.add_wait(waited)

    def _quiesce(self, what: str) -> None:
        self._sched.raise_if_failed()
        if self._sched.busy():
            self._stats.add_wait(self._sched.wait_all(what))
        if self._pending_order is not None:
            self._apply_order()
