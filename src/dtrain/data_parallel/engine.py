"""``dtrain.DataParallel``: synchronous data parallelism with fused, overlapped allreduce.

Usage is DDP's::

    model = dtrain.DataParallel(net, algorithm="ring", bucket_mb=25)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in loader:                 # each rank reads its own shard
        opt.zero_grad()
        loss_fn(model(x), y).backward()  # returns with every .grad averaged over ranks
        opt.step()

What happens (Sergeev & Del Balso, Horovod, arXiv 1802.05799; Li et al.,
"PyTorch Distributed: Experiences on Accelerating Data Parallel Training",
VLDB 2020):

1. Wrap: the ranks check they hold the same architecture and options (one
   16-byte all_gather), then take rank 0's parameters and buffers (broadcast).
2. Trainable parameters are fused into buckets of about ``bucket_mb`` MiB in the
   order backward produces their gradients (reverse registration order at
   first; after the first step, the order actually observed, agreed from rank 0).
   Each ``.grad`` is a view into its bucket's flat buffer.
3. Backward: a post-accumulate-grad hook per parameter counts arrivals; when a
   bucket's last gradient lands, its allreduce starts -- while backward goes on
   computing earlier layers. Buckets start strictly in index order on every rank.
4. End of backward (an autograd callback): wait for every bucket. ``.grad`` now
   holds the average over ranks, so ``optimizer.step()`` works unchanged.

Cost per step: ``ceil(n / bucket)`` allreduces of the model's ``n`` gradient
bytes, each ``2(P-1)·alpha + 2(P-1)/P·n_b·beta`` for the ring; everything but
the last bucket hides behind backward compute.

``overlap="forward"`` (priority scheduling, ByteScheduler / P3) changes step 4:
backward returns at once; a communication thread reduces buckets nearest the
input first and applies the optimizer to each bucket as it arrives; the next
forward waits, module by module, only for the buckets of the parameters it is
about to use. See :class:`DataParallel` for the API of that mode.
"""

from __future__ import annotations

import datetime
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from dtrain.data_parallel._buckets import Bucket, build_buckets
from dtrain.data_parallel._comm import BucketReducer, NativeScheduler, StreamSync, ThreadScheduler
from dtrain.data_parallel._model_sync import broadcast_tensors, check_same_everywhere, describe_module, wait_work
from dtrain.data_parallel._optim import BucketOptimizer
from dtrain.data_parallel._priority import PriorityScheduler
from dtrain.data_parallel._stats import StepStats
from dtrain.data_parallel.config import DataParallelConfig
from dtrain.errors import ConfigError, DTrainError

__all__ = ["DataParallel", "UnusedParametersError"]


class UnusedParametersError(DTrainError):
    """Parameters received no gradient in a synchronised backward (and find_unused_parameters is off)."""


def _queue_callback(fn: Callable[[], None]) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(fn)  # type: ignore[attr-defined]


class DataParallel(nn.Module):
    """Wrap a module for synchronous data-parallel training over the ranks of a group.

    Every rank builds the same model and wraps it; gradients are averaged over
    the ranks, so ``loss.backward(); optimizer.step()`` trains on the global
    batch. The wrapped module is ``model.module`` and ``state_dict`` keys carry
    the ``module.`` prefix, as with DDP.

    Args:
        module: the model (on CPU with gloo, on CUDA with NCCL).
        algorithm: allreduce algorithm per bucket: "native" (the backend's own,
            issued asynchronously from the hooks), "ring", "tree",
            "recursive_doubling", "rabenseifner" or "hierarchical" (run on one
            communication thread) (default: "ring").
        bucket_mb: fuse gradients into buckets of about this many MiB (default: 25).
        overlap: "backward" (DDP semantics: ``.grad`` averaged when backward
            returns) or "forward" (priority scheduling: the optimizer is stepped
            per bucket by the engine; see below) (default: "backward").
        compression: a :class:`dtrain.compress.Compressor` or a spec string such
            as ``"topk:0.01"``; each bucket is then averaged by
            ``dtrain.compress.compressed_allreduce`` on the communication thread
            (default: None, exact averaging).
        find_unused_parameters: a parameter that gets no gradient in a step is
            treated as a zero gradient, and one unused on every rank keeps
            ``.grad`` as it was (None stays None), as DDP does. Off: such a
            parameter raises :class:`UnusedParametersError` naming it (default: False).
        group: the process group to average over (default: the default group).
            The engine creates private groups over the same ranks; every member
            must wrap at the same time.
        timeout_s: seconds any wait may block before CommTimeoutError, which
            names the rank, the operation and the step (default: 300).
        optimizer: ``overlap="forward"`` only: the optimizer the engine steps per
            bucket (built over this module's parameters).
        optimizer_factory: ``overlap="forward"`` only, instead of ``optimizer``:
            called once with the module's parameters; the result is
            ``model.optimizer``.
        broadcast_buffers: copy rank 0's buffers to every rank before each
            forward, like DDP (default: True).
        first_bucket_mb: size of the first bucket (default: 1, as DDP).

    ``overlap="forward"``::

        model = dtrain.DataParallel(net, overlap="forward",
                                    optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
        for x, y in loader:
            loss_fn(model(x), y).backward()   # returns before communication ends
        model.synchronize()                   # before evaluating or saving
        # do not call optimizer.step() or zero_grad(): the engine steps each bucket
        # when it arrives and zeroes its gradients after.

    The optimizer must be per-parameter (SGD, Adam, ...), not one that couples all
    gradients (global-norm clipping). Reading parameters outside ``model(...)``
    (evaluating ``model.module`` directly, ``state_dict`` of the inner module)
    needs ``model.synchronize()`` first; ``model.state_dict()`` does it for you.

    Raises:
        ConfigError: bad option (before anything is communicated), or ranks
            passing different options.
        ModelMismatchError: ranks wrapped different architectures; names the
            first differing parameter and the ranks.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        algorithm: str = "ring",
        bucket_mb: float = 25.0,
        overlap: str = "backward",
        compression: Any = None,
        find_unused_parameters: bool = False,
        group: Any = None,
        timeout_s: float = 300.0,
        optimizer: torch.optim.Optimizer | None = None,
        optimizer_factory: Callable[[Any], torch.optim.Optimizer] | None = None,
        broadcast_buffers: bool = True,
        first_bucket_mb: float = 1.0,
    ) -> None:
        super().__init__()
        cfg = DataParallelConfig(
            algorithm=algorithm,
            bucket_mb=bucket_mb,
            first_bucket_mb=first_bucket_mb,
            overlap=overlap,
            find_unused_parameters=find_unused_parameters,
            broadcast_buffers=broadcast_buffers,
            timeout_s=timeout_s,
        )
        if not isinstance(module, nn.Module):
            raise ConfigError(f"DataParallel wraps a torch.nn.Module, got {type(module).__name__}")
        if isinstance(module, DataParallel):
            raise ConfigError("the module is already wrapped in DataParallel; wrap the inner model once")
        if cfg.overlap == "forward":
            if (optimizer is None) == (optimizer_factory is None):
                raise ConfigError(
                    "overlap='forward' steps the optimizer per bucket inside the engine: pass exactly one of "
                    "optimizer=... or optimizer_factory=lambda params: torch.optim.SGD(params, lr=...)"
                )
        elif optimizer is not None or optimizer_factory is not None:
            raise ConfigError(
                "optimizer/optimizer_factory are for overlap='forward'; with overlap='backward' call "
                "optimizer.step() yourself after loss.backward(), as with DDP"
            )
        self.config = cfg
        self.module = module
        self.compressor = self._resolve_compression(compression)

        # ranks
        if group is not None and not dist.is_initialized():
            raise ConfigError("a process group was given but torch.distributed is not initialized; call dtrain.init()")
        self._group = group
        self._world = dist.get_world_size(group) if dist.is_initialized() else 1
        self._rank = dist.get_rank() if dist.is_initialized() else 0
        self._ranks = dist.get_process_group_ranks(group or dist.group.WORLD) if dist.is_initialized() else [0]
        self._src = self._ranks[0]

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ConfigError("the module has no trainable parameters (requires_grad=True); nothing to train")
        self._names = [n for n, _ in named]
        self._params: list[torch.nn.Parameter] = [p for _, p in named]
        self._index_of = {id(p): i for i, p in enumerate(self._params)}
        self._buffers_list = [b for _, b in module.named_buffers()]
        devs = {p.device.type for p in self._params}
        if self._world > 1:
            backend = str(dist.get_backend(group)).lower()
            if backend == "gloo" and devs != {"cpu"}:
                raise ConfigError(f"a gloo group reduces CPU tensors; the module has parameters on {sorted(devs)}; "
                                  "use NCCL for CUDA (dtrain.init() picks it when CUDA is available)")
            if backend == "nccl" and devs != {"cuda"}:
                raise ConfigError(f"an NCCL group reduces CUDA tensors; move the module to CUDA first (found {sorted(devs)})")
            self._coll_device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
            check_same_everywhere(
                describe_module(module), cfg.describe(), group=group, device=self._coll_device,
                ranks=self._ranks, timeout_s=cfg.timeout_s,
            )
            broadcast_tensors(
                [*[p.detach() for _, p in module.named_parameters()], *self._buffers_list],
                src=self._src, group=group, rank=self._rank, cap_bytes=cfg.cap_bytes, timeout_s=cfg.timeout_s,
                op="DataParallel broadcast of rank 0's parameters",
            )

        # private groups: the communication thread's, and a gloo one for small control messages
        self._own_groups: list[Any] = []
        needs_thread = cfg.algorithm != "native" or cfg.overlap == "forward" or self.compressor is not None
        self._comm_group = self._new_group(None) if needs_thread else None
        self._ctl_group = self._new_group("gloo")
        agree = None
        if cfg.overlap == "forward" and self._world > 1:
            agree = self._comm_group if str(dist.get_backend(self._comm_group)) == "gloo" else self._new_group("gloo")

        # buckets, schedulers, hooks
        self._streams: dict[torch.device, StreamSync] = {}
        self._version = 0
        self._step = 0
        self._require_sync = True
        self._fwd_sync: bool | None = None  # no_sync state captured by forward, as DDP
        self._bw_sync = True
        self._cb_queued = False
        self._record_order: list[int] | None = []  # first synced backward records arrival order
        self._pending_order: list[int] | None = None
        self._stats = StepStats(step=0)
        self._last_stats = StepStats()
        self._t_fwd: float | None = None
        self._wait_at_fwd = 0.0
        self._closed = False
        self._install_buckets(list(reversed(range(len(self._params)))))
        reducer = BucketReducer(cfg.algorithm, self._comm_group, self._world, cfg.timeout_s, self.compressor)
        self.optimizer: torch.optim.Optimizer | None = None
        self._bucket_opt: BucketOptimizer | None = None
        self._sched: Any
        if cfg.overlap == "forward":
            self.optimizer = optimizer if optimizer is not None else optimizer_factory(module.parameters())  # type: ignore[misc]
            self._bucket_opt = BucketOptimizer(self.optimizer, self._bucket_params(), {id(p): n for n, p in named})
            self._sched = PriorityScheduler(
                reducer, self._apply_bucket, agree, self._rank, cfg.timeout_s, self._stream_of, self._publish
            )
            self._sched.set_buckets(self._buckets)
            self._module_buckets: dict[nn.Module, list[int]] = {}
            self._map_modules()
            self._pre_hooks = [
                m.register_forward_pre_hook(self._forward_wait) for m in module.modules() if self._direct_params(m)
            ]
        elif self._world == 1 or (cfg.algorithm == "native" and self.compressor is None):
            self._sched = NativeScheduler(group, self._world, self._rank, cfg.timeout_s)
        else:
            self._sched = ThreadScheduler(reducer, self._rank, cfg.timeout_s, self._stream_of)
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self._params)
        ]

    # ------------------------------------------------------------------ set-up helpers

    @staticmethod
    def _resolve_compression(compression: Any) -> Any:
        if compression is None:
            return None
        from dtrain.compress import Compressor, from_spec

        if isinstance(compression, str) and compression.strip().lower() == "none":
            return None
        if not isinstance(compression, (str, Compressor)):
            raise ConfigError(f"compression must be a spec string like 'topk:0.01' or a Compressor, got {type(compression).__name__}")
        return from_spec(compression)

    def _new_group(self, backend: str | None) -> Any:
        if self._world <= 1:
            return None
        whole = len(self._ranks) == dist.get_world_size()
        g = dist.new_group(
            ranks=self._ranks,
            timeout=datetime.timedelta(seconds=self.config.timeout_s),
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
        cfg = self.config
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
        for m in self.module.modules():
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

    # ------------------------------------------------------------------ public API

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check_open()
        self._fwd_sync = self._require_sync
        self._t_fwd = time.perf_counter()
        self._wait_at_fwd = self._stats.wait_s
        if self.config.broadcast_buffers and self._buffers_list and self._world > 1:
            broadcast_tensors(
                self._buffers_list, src=self._src, group=self._group, rank=self._rank,
                cap_bytes=self.config.cap_bytes, timeout_s=self.config.timeout_s,
                op=f"DataParallel broadcast of buffers at step {self._step}",
            )
        out = self.module(*args, **kwargs)
        if self.config.overlap == "forward":
            self._quiesce("forward")
        return out

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward passes run in this context do not communicate.

        As with DDP, the forward must run inside the context too; the next
        backward outside it averages the accumulated gradients.
        """
        old = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = old

    def synchronize(self) -> None:
        """Wait until every bucket is reduced (and, with overlap="forward", stepped)."""
        self._check_open()
        if self.config.overlap == "forward":
            self._quiesce("synchronize()")

    def step_stats(self) -> dict[str, Any]:
        """Figures of the most recent step whose communication has finished.

        Returns:
            ``step``, ``compute_s`` (forward + backward, less waits), ``comm_s``
            (time at least one bucket was being reduced: the communication
            thread's reduce calls, or for ``native`` from issuing the async
            allreduce to its completion callback), ``wait_s`` (time backward's end
            or the forward pre-hooks blocked), ``bytes_sent`` (this rank, from
            the transport's counters; for ``native`` the ring formula
            ``2(P-1)/P·n``, since gloo and NCCL do not report it) and
            ``buckets``. With ``overlap="forward"`` the step's buckets finish
            during the next forward, so this lags one step until
            ``synchronize()``.
        """
        return self._last_stats.as_dict()

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        if self.config.overlap == "forward" and not self._closed:
            self._quiesce("state_dict()")
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        if self.config.overlap == "forward" and not self._closed:
            self._quiesce("load_state_dict()")
        return super().load_state_dict(*args, **kwargs)

    @property
    def buckets(self) -> list[list[str]]:
        """Parameter names of each bucket, in launch order."""
        return [[self._names[i] for i in b.members] for b in self._buckets]

    def close(self) -> None:
        """Stop the communication thread, remove the hooks, free the private groups (idempotent)."""
        if self._closed:
            return
        if self.config.overlap == "forward":
            try:
                self._quiesce("close()")
            except DTrainError:
                pass
            for h in self._pre_hooks:
                h.remove()
        self._closed = True
        self._sched.close()
        for h in self._hooks:
            h.remove()
        for g in self._own_groups:
            try:
                dist.destroy_process_group(g)
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
        self._own_groups = []

    def __repr__(self) -> str:
        c = self.config
        return (f"DataParallel(algorithm={c.algorithm!r}, overlap={c.overlap!r}, world={self._world}, "
                f"buckets={len(self._buckets)}, module={self.module!r})")

    # ------------------------------------------------------------------ backward path

    def _check_open(self) -> None:
        if self._closed:
            raise DTrainError("this DataParallel was closed; wrap the module again")

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
            view.copy_(g)  # type: ignore[arg-type]
            p.grad = view
        b = self._bucket_of[i]
        b.pending -= 1
        if b.pending == 0:
            self._bucket_ready(b, inline=self._n_ready == len(self._params))

    def _start_backward(self) -> None:
        self._cb_queued = True
        self._bw_sync = self._require_sync if self._fwd_sync is None else self._fwd_sync
        if self.config.overlap == "forward":
            self._quiesce("backward")  # the user may have bypassed model(...) forward
            if self._bw_sync:
                self._bucket_opt.snapshot()  # type: ignore[union-attr]
                self._sched.begin_step(self._step, self._stats)
        _queue_callback(self._on_backward_end)

    def _bucket_ready(self, b: Bucket, inline: bool) -> None:
        b.ready = True
        if self.config.overlap == "forward":
            self._sched.mark_ready(b)
            return
        buckets = self._buckets
        while self._next < len(buckets) and buckets[self._next].ready:
            self._sched.launch(buckets[self._next], inline, self._step)
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
            if self.config.find_unused_parameters or self._n_ready < len(self._params):
                self._handle_unused()
            if self.config.overlap == "backward":
                t0 = time.perf_counter()
                self._sched.wait_all(self._step, st)
                st.wait_s += time.perf_counter() - t0
            if self._record_order is not None:
                self._agree_order(self._record_order)
            if self._bucket_opt is not None:
                self._bucket_opt.committed()
        finally:
            self._reset_backward()
        self._step += 1
        self._stats = StepStats(step=self._step)
        if self.config.overlap == "backward":
            self._publish(st)
            if self._pending_order is not None:
                self._apply_order()

    def _handle_unused(self) -> None:
        missing = [i for i, r in enumerate(self._ready) if not r]
        if not self.config.find_unused_parameters:
            names = [self._names[i] for i in missing]
            shown = ", ".join(repr(n) for n in names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
            raise UnusedParametersError(
                f"rank {self._rank}: {len(names)} parameter(s) received no gradient at step {self._step}: {shown}. "
                "Make them take part in the loss, set requires_grad=False on them, or pass "
                "find_unused_parameters=True to DataParallel to treat them as zero gradients (as DDP does)"
            )
        used = self._used
        if self._world > 1:
            flags = torch.tensor(used, dtype=torch.int32)
            wait_work(dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._ctl_group, async_op=True),
                      self.config.timeout_s, self._rank, "DataParallel used-parameter agreement", self._step)
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
        self._last_stats = stats.close()

    # ------------------------------------------------------------------ bucket order rebuild

    def _agree_order(self, observed: list[int]) -> None:
        """After the first synced backward: adopt rank 0's observed gradient order (DDP's bucket rebuild)."""
        self._record_order = None
        seen = set(observed)
        order = observed + [i for i in reversed(range(len(self._params))) if i not in seen]
        if self._world > 1:
            t = torch.tensor(order, dtype=torch.int64)
            wait_work(dist.broadcast(t, src=self._src, group=self._ctl_group, async_op=True),
                      self.config.timeout_s, self._rank, "DataParallel bucket order agreement", self._step)
            order = [int(x) for x in t.tolist()]
        if order != self._order_now:
            self._pending_order = order

    def _apply_order(self) -> None:
        order, self._pending_order = self._pending_order, None
        assert order is not None
        self._install_buckets(order)
        if self.config.overlap == "forward":
            self._sched.set_buckets(self._buckets)
            self._bucket_opt = BucketOptimizer(self.optimizer, self._bucket_params(), {})  # type: ignore[arg-type]
            self._map_modules()

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
            self._stats.wait_s += waited

    def _quiesce(self, what: str) -> None:
        self._sched.raise_if_failed()
        if self._sched.busy():
            self._stats.wait_s += self._sched.wait_all(what)
        if self._pending_order is not None:
            self._apply_order()
