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
   Each ``.grad`` is a view into its bucket's flat buffer. A parameter that several
   modules hold (an embedding tied to the LM head) is one of them, as in
   ``module.parameters()``: one slot in one bucket, one hook, reduced once.
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

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtrain.comm.replicas import broadcast_tensors, check_same_everywhere, describe_module
from dtrain.compress import resolve
from dtrain.data_parallel._optim import check_optimizer
from dtrain.data_parallel._reducer import Reducer, UnusedParametersError
from dtrain.data_parallel.tunables import DataParallelConfig
from dtrain.errors import ConfigError
from dtrain.sharded import ShardedDataParallel

__all__ = ["DataParallel", "UnusedParametersError"]


def _check_wrap(module: Any, cfg: DataParallelConfig, optimizer: Any, optimizer_factory: Any) -> None:
    """What :class:`DataParallel` wraps (a module not wrapped yet) and the optimizer ``overlap`` asks for."""
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
            ``dtrain.compress.compressed_allreduce`` on the communication thread,
            with the bucket's layout (quantizers scale each tensor on its own)
            (default: None, exact averaging). Sign-type compressors need SGD's
            momentum before them: pass ``from_spec("sign", momentum=0.9)`` and an
            optimizer with ``momentum=0`` (as ``dtrain run`` does); a plain
            ``"sign"`` with momentum in the optimizer trains poorly
            (``benchmarks/compression.py``).
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
        shard: "none", or a ZeRO level -- "optimizer", "gradients", "parameters" -- which
            returns a :class:`dtrain.ShardedDataParallel` instead (default: "none").

    ``overlap="forward"`` -- priority scheduling (ByteScheduler, P3); the engine owns
    the optimizer step::

        model = dtrain.DataParallel(net, overlap="forward",
                                    optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
        sched = torch.optim.lr_scheduler.StepLR(model.optimizer, step_size=10)  # optional, as usual
        for x, y in loader:
            loss_fn(model(x), y).backward()   # returns before communication ends
            sched.step()
        model.synchronize()                   # before evaluating model.module or saving it

    What changes against ``overlap="backward"``:

    * ``loss.backward()`` returns once backward is computed. A communication
      thread reduces the buckets, the one nearest the input first, and as soon
      as a bucket is averaged it runs ``optimizer`` on that bucket's parameters
      and zeroes their gradients. Do not call ``optimizer.step()`` or
      ``optimizer.zero_grad()`` yourself.
    * The next ``model(x)`` waits module by module, each only for the buckets
      holding its own parameters, so the first layers compute while the last
      ones are still being reduced.
    * The optimizer must treat parameters independently (SGD, Adam(W), RMSprop,
      Adagrad, LARS/LAMB-style per-tensor rules); global gradient-norm clipping
      or LBFGS cannot be stepped bucket by bucket.
    * Hyperparameters are read at the start of each backward, so an LR scheduler
      stepped after ``backward()`` takes effect on the next step, as usual.
    * Reading parameters outside ``model(...)`` (evaluating ``model.module``,
      saving ``model.module.state_dict()``) needs ``model.synchronize()``
      first; ``model.state_dict()`` and ``model.load_state_dict()`` do it.
    * ``step_stats()`` reports the last step whose buckets are all done, one
      step behind until ``synchronize()``.
    * Cost: one extra small allreduce (latency ``alpha``) per bucket, by which
      the ranks agree which ready bucket goes next (ranks see buckets become
      ready in different orders, but must issue the same collectives).

    Raises:
        ConfigError: bad option (before anything is communicated), or ranks
            passing different options.
        ModelMismatchError: ranks wrapped different architectures; names the
            first differing parameter and the ranks.
    """

    def __new__(cls, module: nn.Module, *args: Any, shard: str = "none", **kwargs: Any) -> Any:
        """``shard`` other than "none" builds a :class:`dtrain.ShardedDataParallel` (ZeRO) instead."""
        if shard == "none":
            return super().__new__(cls)
        unknown = sorted(set(kwargs) - {"algorithm", "overlap", "group", "timeout_s", "broadcast_buffers"})
        if args or unknown:
            raise ConfigError(
                f"DataParallel(shard={shard!r}) takes algorithm, overlap, group, timeout_s and "
                f"broadcast_buffers; not {', '.join(unknown) or 'positional options'}"
            )
        return ShardedDataParallel(module, shard=shard, **kwargs)

    def __init__(
        self,
        module: nn.Module,
        *,
        shard: str = "none",
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
        _check_wrap(module, cfg, optimizer, optimizer_factory)
        self.config = cfg
        self.module = module
        self.compressor = resolve(compression, none_is_off=True)

        # ranks
        if group is not None and not dist.is_initialized():
            raise ConfigError("a process group was given but torch.distributed is not initialized; call dtrain.init()")
        if group is not None and dist.get_rank(group) < 0:
            raise ConfigError(f"rank {dist.get_rank()} is not a member of the group it passed to DataParallel")
        self._group = group
        self._world = dist.get_world_size(group) if dist.is_initialized() else 1
        self._rank = dist.get_rank() if dist.is_initialized() else 0
        self._ranks = dist.get_process_group_ranks(group or dist.group.WORLD) if dist.is_initialized() else [0]
        self._src = self._ranks[0]

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ConfigError("the module has no trainable parameters (requires_grad=True); nothing to train")
        self._buffers_list = [b for _, b in module.named_buffers()]
        opt = optimizer
        if cfg.overlap == "forward":
            if opt is None:
                opt = optimizer_factory(module.parameters())  # type: ignore[misc]
            check_optimizer(opt, [p for _, p in named])
        if self._world > 1:
            self._agree_at_wrap(module, named)
        self._reducer = Reducer(
            module,
            named,
            cfg,
            group=group,
            world=self._world,
            rank=self._rank,
            ranks=self._ranks,
            compressor=self.compressor,
            optimizer=opt,
        )

    def _agree_at_wrap(self, module: nn.Module, named: list[tuple[str, nn.Parameter]]) -> None:
        """Check device/backend, that every rank has the same model and options, then take rank 0's weights."""
        cfg, group = self.config, self._group
        devs = {p.device.type for _, p in named}
        backend = str(dist.get_backend(group)).lower()
        if backend == "gloo" and devs not in ({"cpu"}, {"cuda"}):
            raise ConfigError(
                f"a gloo group reduces CPU tensors, or CUDA tensors through host memory; the module "
                f"has parameters on {sorted(devs)}: put all of them on one device"
            )
        if backend == "nccl" and devs != {"cuda"}:
            raise ConfigError(
                f"an NCCL group reduces CUDA tensors; move the module to CUDA first (found {sorted(devs)})"
            )
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        check_same_everywhere(
            describe_module(module),
            cfg.describe(),
            group=group,
            device=device,
            ranks=self._ranks,
            timeout_s=cfg.timeout_s,
        )
        broadcast_tensors(
            [*[p.detach() for p in module.parameters()], *self._buffers_list],
            src=self._src,
            group=group,
            rank=self._rank,
            cap_bytes=cfg.cap_bytes,
            timeout_s=cfg.timeout_s,
            op="DataParallel broadcast of rank 0's parameters",
        )

    # ------------------------------------------------------------------ nn.Module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        r = self._reducer
        r.begin_forward()
        if self.config.broadcast_buffers and self._buffers_list and self._world > 1:
            broadcast_tensors(
                self._buffers_list,
                src=self._src,
                group=self._group,
                rank=self._rank,
                cap_bytes=self.config.cap_bytes,
                timeout_s=self.config.timeout_s,
                op=f"DataParallel broadcast of buffers at step {r.step}",
            )
        out = self.module(*args, **kwargs)
        r.end_forward()
        return out

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        if not self._reducer.closed:
            self._reducer.synchronize("state_dict()")
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        if not self._reducer.closed:
            self._reducer.synchronize("load_state_dict()")
        return super().load_state_dict(*args, **kwargs)

    def compressor_state_dict(self) -> dict[str, Any]:
        """This rank's engine state that ``state_dict()`` leaves out, for a checkpoint.

        Returns ``{"compressor": ..., "buckets": ...}``: the compressor's own
        :meth:`~dtrain.compress.Compressor.state_dict` (error-feedback residuals,
        PowerSGD's warm-start ``Q``, random compressors' generators; ``None``
        without compression), and the bucket layout those states are keyed by
        (the agreed gradient order, its generation, the step count). Residuals
        differ between ranks: save the dict per rank and restore it to the same
        rank (:func:`dtrain.checkpoint.save_checkpoint`'s ``rank_state`` does).
        Waits for pending buckets first (``overlap="forward"``).
        """
        if not self._reducer.closed:
            self._reducer.synchronize("compressor_state_dict()")
        return {
            "compressor": self.compressor.state_dict() if self.compressor is not None else None,
            "compressor_repr": repr(self.compressor),
            "buckets": self._reducer.state_dict(),
        }

    def load_compressor_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`compressor_state_dict` returned on this rank, before the first step.

        Raises:
            ConfigError: the state was saved with a different compressor (or
                with/without one), or for a different model.
        """
        if not self._reducer.closed:
            self._reducer.synchronize("load_compressor_state_dict()")
        saved = state.get("compressor_repr")
        if (state.get("compressor") is None) != (self.compressor is None) or saved != repr(self.compressor):
            raise ConfigError(
                f"the saved engine state is for compression {saved}, this DataParallel has {self.compressor!r}; "
                "resume with the same compression"
            )
        try:
            self._reducer.load_state_dict(state["buckets"])
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.compressor is not None:
            self.compressor.load_state_dict(state["compressor"])

    def __repr__(self) -> str:
        c = self.config
        return (
            f"DataParallel(algorithm={c.algorithm!r}, overlap={c.overlap!r}, world={self._world}, "
            f"buckets={len(self._reducer.buckets)}, module={self.module!r})"
        )

    # ------------------------------------------------------------------ DDP/Horovod-style API

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward passes run in this context do not communicate.

        As with DDP, the forward must run inside the context too; the next
        backward outside it averages the accumulated gradients.
        """
        r = self._reducer
        old = r.require_sync
        r.require_sync = False
        try:
            yield
        finally:
            r.require_sync = old

    def synchronize(self) -> None:
        """Wait until every bucket is reduced (and, with overlap="forward", stepped)."""
        self._reducer.synchronize("synchronize()")

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer the engine steps per bucket (``overlap="forward"``); None otherwise."""
        return self._reducer.optimizer

    @property
    def buckets(self) -> list[list[str]]:
        """Parameter names of each bucket, in launch order."""
        return self._reducer.buckets

    def step_stats(self) -> dict[str, Any]:
        """Figures of the most recent step whose communication has finished.

        Returns:
            ``step``, ``compute_s`` (forward + backward, less waits), ``comm_s``
            (time at least one bucket was being reduced: the communication
            thread's reduce calls, or for ``native`` from issuing the async
            allreduce until the end of backward saw it complete), ``wait_s`` (time backward's end
            or the forward pre-hooks blocked), ``bytes_sent`` (this rank, from
            the transport's counters; for ``native`` what a ring sends,
            ``2(P-1)/P·n``, since gloo and NCCL do not report it) and
            ``buckets``. With ``overlap="forward"`` the step's buckets finish
            during the next forward, so this lags one step until
            ``synchronize()``.
        """
        return self._reducer.last_stats.as_dict()

    def measure_local_norms(self, on: bool = True) -> None:
        """Record the squared 2-norm of this rank's own gradients each step, before they are averaged
        (:meth:`local_grad_sq`; the gradient noise scale of :mod:`dtrain.training.noise_scale`)."""
        self._reducer.measure_local_norm = on

    def local_grad_sq(self) -> float | None:
        """This rank's ``sum |g|^2`` of the last synced backward, before averaging (None: not measured)."""
        return self._reducer.last_local_sq

    def close(self) -> None:
        """Stop the communication thread, remove the hooks, free the private groups (idempotent)."""
        self._reducer.close()
