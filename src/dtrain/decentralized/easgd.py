"""Elastic averaging SGD (EASGD, EAMSGD): replicas tied to a center variable by an elastic force.

Zhang, Choromanska & LeCun 2015, "Deep learning with Elastic Averaging SGD" (arXiv 1412.6651).
Every worker ``i`` trains its own replica ``x_i`` with its own optimizer; a center variable
``x~`` (the paper's "center variable", here ``center``) holds the consensus. Every ``period``
steps (the paper's tau) the replica and the center pull on each other:

    d_i  = alpha * (x_i - x~)
    x_i <- x_i - d_i
    x~  <- x~ + sum_i d_i                  (synchronous, eq. 5-6)      or
    x~  <- x~ + d_i   on the master         (asynchronous, Algorithm 1)

Usage (the optimizer is the user's; ``step()`` comes after ``optimizer.step()``)::

    easgd = EASGD(model, alpha=0.9 / workers, period=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)   # EAMSGD
    for x, y in loader:
        opt.zero_grad(); loss_fn(easgd(x), y).backward(); opt.step()
        easgd.step()
    easgd.finish()                          # server form: returns with the final center pulled
    model.load_state_dict(easgd.center_state_dict())     # the center is the model to evaluate

**Which x enters the elastic term.** In the paper the elastic difference of step ``t`` is
taken at the same point as the gradient (``x^i_{t+1} = x^i_t - eta g(x^i_t) - alpha (x^i_t -
x~_t)``; Algorithm 1 reads ``x <- x^i`` before both). The wrapper therefore remembers the
replica as it was when the step's gradient was computed (the parameters at the end of the
previous ``step()``) and, after the optimizer has moved the replica, subtracts
``d_i = alpha (x^i_t - x~_t)`` from the result: exactly the paper's update, for any optimizer.
``step()`` number ``t`` (counted from 0) is an elastic round when ``t > 0`` and
``t % period == 0`` -- the paper's rule ``tau | t``, less its round at ``t = 0``, where every
replica equals the center and ``d_i = 0``.

**EAMSGD** (the paper's Algorithm 2) is local Nesterov-momentum SGD plus the same elastic
step every tau steps, the momentum buffer untouched by the elastic step: use
``torch.optim.SGD(..., momentum=delta, nesterov=True)`` as the local optimizer. (torch's
Nesterov keeps the look-ahead point ``x + delta v`` in the parameters -- the usual
reparametrisation -- so the elastic force acts on that point; for plain heavy-ball momentum
use ``nesterov=False``.) The ``momentum`` argument of EASGD is something else: a momentum on
the *center's* update (``u <- momentum u - sum_i d_i; x~ <- x~ - u``, torch's SGD rule with
lr 1 on the "gradient" ``-sum_i d_i``); 0, the default, is the paper.

Two forms (``center=``):

* ``"allreduce"`` (synchronous EASGD): every worker holds a copy of ``x~``, equal on every
  rank (it starts at the common start and changes only by the allreduced ``sum_i d_i``).
  One dtrain allreduce (ring) of the flattened ``d_i`` per round; the ranks of ``group`` are
  the workers.
* ``"server"`` (asynchronous EASGD): ``x~`` lives on dtrain's parameter-server shards
  (:class:`~dtrain.param_server.ParameterServer`, consistency ``"asp"``, server optimizer
  ``SGD(lr=1, momentum=momentum)``). A worker keeps the center as last pulled, ``x~_r``; at
  a round it computes ``d_i = alpha (x^i_t - x~_r)``, moves its replica by ``-d_i`` and
  pushes ``-d_i`` as the "gradient" of the center: the server applies
  ``x~ <- x~ - 1 * (-d_i) = x~ + d_i`` on arrival (Algorithm 1's master update, bit for bit
  with ``momentum=0``) and replies with the current center, which the worker keeps for its
  next round. So the ``x~`` a round reads is the one pulled at the worker's previous round:
  other workers' exchanges since then are not yet seen (with one worker nothing is missed
  and the two forms agree exactly). A fresher read would need a second round trip: the
  parameter server has no read-only pull after a worker's first message.

  **Rank layout**: every rank of ``group`` (default: all ranks) builds the EASGD. Group
  ranks ``0..servers-1`` are servers (:attr:`is_server`; they call :meth:`serve`, which
  returns once every worker has finished), ranks ``servers..`` are the workers
  (:attr:`worker_index` ``= rank - servers``) that train, call :meth:`step`, then
  :meth:`finish`. The workers' collectives (:meth:`averaged_state_dict`,
  :meth:`consensus_distance`) run on a group of the workers alone, made here: with
  ``group=None`` by every process of the job (``dist.new_group``), with a given ``group``
  by the workers alone (``use_local_synchronization=True``). All ranks start from group
  rank 0's parameters and buffers (broadcast over ``group`` at wrap).

**Stability rule** (checked when the number of workers ``N`` is known). ``alpha`` must lie
in ``(0, 1)``: one exchange between a replica and the center scales their gap by ``1 - 2
alpha``. In the synchronous form a round scales the gap between the replicas' mean and the
center by ``1 - (N + 1) alpha`` (from the update equations, gradients left out), so
``(N + 1) alpha >= 2`` is a :class:`~dtrain.errors.ConfigError` (the elastic exchange no
longer contracts). ``beta = N alpha > 1`` (the paper's moving rate of the center, which its
experiments keep at 0.9, ``alpha = 0.9 / N``) only warns (``UserWarning``): the center then
overshoots the replicas' mean, but the rounds still contract while ``(N + 1) alpha < 2``.

Cost per worker per step (this rank's bytes, :meth:`expected_bytes_per_step`): synchronous
``2 (N - 1) / N * model_bytes / period`` (ring allreduce of ``d``; exact when the parameter
count is a multiple of ``N``, otherwise within an element per segment); server form
``2 * model_bytes / period`` (the push of ``-d`` and the pull of ``x~``), plus 71 bytes of
headers per message (the parameter server's 64-byte header and the payload's 7-byte
description; one push and one reply per server and round).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtrain.comm.replicas import broadcast_tensors
from dtrain.comm.transport import CommStats
from dtrain.decentralized.replica import ReplicaWrapper, assign_flat, flatten_params
from dtrain.errors import ConfigError, DTrainError

__all__ = ["EASGD", "CENTERS"]

#: the two forms of the center variable
CENTERS = ("allreduce", "server")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))


def check_args(alpha: Any, period: Any, center: Any, servers: Any, momentum: Any) -> None:
    """The checks that need no process group; a :class:`ConfigError` names the value."""
    if not _is_real(alpha) or not 0.0 < float(alpha) < 1.0:
        raise ConfigError(f"EASGD alpha={alpha!r}: the elastic rate must lie in (0, 1) (the paper uses 0.9 / workers)")
    if not _is_int(period) or period < 1:
        raise ConfigError(f"EASGD period={period!r}: the communication period (tau) must be an integer >= 1")
    if center not in CENTERS:
        raise ConfigError(f"EASGD center={center!r}: choose 'allreduce' (synchronous) or 'server' (asynchronous)")
    if not _is_int(servers) or servers < 1:
        raise ConfigError(f"EASGD servers={servers!r}: the number of server ranks must be an integer >= 1")
    if not _is_real(momentum) or not 0.0 <= float(momentum) < 1.0:
        raise ConfigError(f"EASGD momentum={momentum!r}: the center's momentum must lie in [0, 1) (0 is the paper)")


def check_workers(alpha: float, workers: int, synchronous: bool, stacklevel: int = 2) -> None:
    """The stability rule of the module docstring for ``workers`` workers (error or warning)."""
    if synchronous and (workers + 1) * alpha >= 2.0:
        raise ConfigError(
            f"EASGD alpha={alpha!r} with {workers} workers: (workers + 1) * alpha = {(workers + 1) * alpha:.4g} >= 2, "
            f"the synchronous elastic round does not contract; use alpha < {2.0 / (workers + 1):.4g} "
            f"(the paper: alpha = 0.9 / workers)"
        )
    if workers * alpha > 1.0:
        warnings.warn(
            f"EASGD alpha={alpha!r} with {workers} workers: beta = workers * alpha = {workers * alpha:.4g} > 1, "
            "the center overshoots the replicas' mean (the paper keeps beta <= 1, e.g. alpha = 0.9 / workers)",
            UserWarning,
            stacklevel=stacklevel + 1,
        )


class _CenterModule(nn.Module):
    """The center variable as a module (what the parameter server shards and serves)."""

    def __init__(self, values: Sequence[nn.Parameter]) -> None:
        super().__init__()
        self.values = nn.ParameterList(values)


class EASGD(ReplicaWrapper):
    """Elastic averaging SGD around ``module`` (see the module docstring).

    Args:
        module: this worker's replica (the same architecture on every rank).
        alpha: the elastic rate ``alpha = eta * rho`` in ``(0, 1)`` (default: 0.1).
        period: the communication period tau, in steps (default: 1).
        center: ``"allreduce"`` (synchronous, a copy of the center on every worker) or
            ``"server"`` (asynchronous, the center on parameter-server ranks) (default: allreduce).
        servers: server ranks of the server form (default: 1; ignored by the allreduce form).
        momentum: momentum of the center's update, in ``[0, 1)`` (default: 0, the paper).
        group: the process group (default: all ranks); see the rank layout in the module docstring.
        timeout: seconds a collective may wait (and the parameter server's liveness timeout).

    Attributes:
        is_server: this rank serves the center (server form, group ranks ``0..servers-1``).
        worker_index: this worker's index among the workers (-1 on a server).
        num_workers: the number ``N`` of workers.
        ps: the :class:`~dtrain.param_server.ParameterServer` of the server form (None otherwise).

    Raises:
        ConfigError: a bad value, named (before any collective).
    """

    def __init__(
        self,
        module: nn.Module,
        alpha: float = 0.1,
        period: int = 1,
        center: str = "allreduce",
        servers: int = 1,
        momentum: float = 0.0,
        *,
        group: Any = None,
        timeout: float | None = None,
    ) -> None:
        check_args(alpha, period, center, servers, momentum)
        if not isinstance(module, nn.Module):
            raise ConfigError(f"EASGD needs a torch.nn.Module, got {type(module).__name__}")
        if not dist.is_initialized():
            raise ConfigError("EASGD needs torch.distributed initialized (call dtrain.init() first)")
        self.alpha = float(alpha)
        self.period = int(period)
        self.center_kind = center
        self.momentum = float(momentum)
        self.num_servers = servers if center == "server" else 0
        self.ps: Any = None
        self._snap: torch.Tensor | None = None
        self._finished = False
        self._received = 0
        if center == "allreduce":
            n = dist.get_world_size(group)
            check_workers(self.alpha, n, synchronous=True, stacklevel=3)
            super().__init__(module, group=group, algorithm="ring", timeout=timeout)
            self.is_server = False
            self.num_workers = self.world
            self.worker_index = self.rank
            self._center = [nn.Parameter(p.detach().clone()) for p in self.params]
            self._center_opt: torch.optim.Optimizer | None = self._center_optimizer(self._center)
        else:
            self._init_server_form(module, servers, group, timeout)

    # ------------------------------------------------------------------ set-up

    def _center_optimizer(self, params: Any) -> torch.optim.Optimizer:
        """``x~ <- x~ - 1 * grad`` with the center's momentum: the rule both forms apply to ``-sum d``."""
        return torch.optim.SGD(params, lr=1.0, momentum=self.momentum)

    def _init_server_form(self, module: nn.Module, servers: int, group: Any, timeout: float | None) -> None:
        """Broadcast the start over ``group``, make the workers' group, start the parameter server."""
        from dtrain.param_server import ParameterServer

        n, me = dist.get_world_size(group), dist.get_rank(group)
        if n - servers < 1:
            raise ConfigError(
                f"EASGD servers={servers!r}: {n} processes cannot hold {servers} servers and a worker; "
                "start more processes or use fewer servers"
            )
        check_workers(self.alpha, n - servers, synchronous=False, stacklevel=4)
        t_out = float(timeout) if timeout is not None else 300.0
        src = dist.get_global_rank(group, 0) if group is not None else 0
        tensors = [p.data for p in module.parameters()] + list(module.buffers())
        broadcast_tensors(
            tensors,
            src=src,
            group=group,
            rank=dist.get_rank(),
            cap_bytes=25 << 20,
            timeout_s=t_out,
            op="EASGD initial broadcast",
        )
        ranks = [dist.get_global_rank(group, r) if group is not None else r for r in range(servers, n)]
        if me < servers:
            workers_group = None
            if group is None:  # new_group is a collective of the whole job unless synchronised locally
                dist.new_group(ranks)
            nn.Module.__init__(self)
            self.module = module
            self.group, self.algorithm, self.timeout_s = None, "ring", t_out
            self.rank, self.world, self.global_rank = me, n - servers, dist.get_rank()
            self.params = [p for p in module.parameters() if p.requires_grad]
            self.steps = self.rounds = 0
            self._sent = CommStats()
        else:
            workers_group = dist.new_group(ranks, use_local_synchronization=group is not None)
            super().__init__(module, group=workers_group, algorithm="ring", timeout=t_out)
        self.is_server = me < servers
        self.num_workers = n - servers
        self.worker_index = -1 if self.is_server else me - servers
        self._center = [nn.Parameter(p.detach().clone()) for p in self.params]
        self._center_opt = None
        self.ps = ParameterServer(
            _CenterModule(self._center),
            self._center_optimizer,
            servers=servers,
            consistency="asp",
            group=group,
            timeout_s=t_out,
        )
        if not self.is_server:  # the worker pulled the center on connecting: start there
            assign_flat(self.params, flatten_params(self._center))

    # ------------------------------------------------------------------ training

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._worker_only("forward")
        return self.module(*args, **kwargs)

    def step(self) -> None:
        """After ``optimizer.step()``: the elastic round when ``steps % period == 0`` (not at step 0)."""
        self._worker_only("step")
        t = self.steps
        self.steps += 1
        if t > 0 and t % self.period == 0:
            if self._snap is None:  # pragma: no cover - step() keeps it before every round
                raise DTrainError(f"rank {self.global_rank}: EASGD lost the replica of step {t}")
            d = self._snap.sub_(flatten_params(self._center)).mul_(self.alpha)  # alpha (x_t - x~), in the buffer
            assign_flat(self.params, flatten_params(self.params).sub_(d))
            if self.ps is None:
                self._round_allreduce(d)
            else:
                self._round_server(d)
            self.rounds += 1
        if self.steps % self.period == 0:  # the next step is a round: keep the point its gradient is taken at
            self._snap = flatten_params(self.params)

    def _set_center_grads(self, g: torch.Tensor) -> None:
        off = 0
        for c in self._center:
            c.grad = g[off : off + c.numel()].view_as(c).clone()
            off += c.numel()

    def _round_allreduce(self, d: torch.Tensor) -> None:
        """``x~ <- x~ + sum_i d_i`` on every worker (with the center's momentum)."""
        self._allreduce(d, "sum")
        assert self._center_opt is not None
        self._set_center_grads(d.neg_())
        self._center_opt.step()
        self._center_opt.zero_grad(set_to_none=True)

    def _round_server(self, d: torch.Tensor) -> None:
        """Push ``-d_i`` (the server does ``x~ <- x~ + d_i``); the reply is the current center."""
        self._set_center_grads(d.neg_())
        before = self.ps.transport.stats.snapshot()
        got = int(self.ps.stats()["bytes_received"])
        self.ps.step()
        self.count_sent(self.ps.transport.stats.snapshot() - before)
        self._received += int(self.ps.stats()["bytes_received"]) - got

    def serve(self) -> dict[str, Any]:
        """Servers of the server form: serve the center until every worker has finished; returns the PS stats."""
        if not self.is_server:
            raise DTrainError(
                f"rank {self.global_rank} is an EASGD worker (center={self.center_kind!r}); only server ranks serve()"
            )
        return dict(self.ps.serve())

    def close(self) -> None:
        """Workers: :meth:`finish` once (a training run's engine ends every wrapper with ``close``)."""
        if not self.is_server and not self._finished:
            self.finish()

    def wrapper_state(self) -> dict[str, Any]:
        """The base's counters and, in the allreduce form, the centre, its optimizer's state and the
        replica kept for the next round (a resumed run continues the same elastic rounds)."""
        out = super().wrapper_state()
        if self._center_opt is not None:
            out.update(
                center=flatten_params(self._center).clone(),
                center_opt=self._center_opt.state_dict(),
                snap=None if self._snap is None else self._snap.clone(),
            )
        return out

    def load_wrapper_state(self, state: dict[str, Any]) -> None:
        super().load_wrapper_state(state)
        if self._center_opt is not None:
            assign_flat(self._center, state["center"])
            self._center_opt.load_state_dict(state["center_opt"])
            self._snap = None if state["snap"] is None else state["snap"].clone()

    def finish(self) -> None:
        """Workers: done training. Server form: returns once every worker is, with the final center pulled."""
        self._worker_only("finish")
        self._finished = True
        if self.ps is not None:
            before = self.ps.transport.stats.snapshot()
            self.ps.finish()
            self.count_sent(self.ps.transport.stats.snapshot() - before)

    # ------------------------------------------------------------------ results

    def center_state_dict(self) -> dict[str, torch.Tensor]:
        """The center as a state dict of ``module``: trainable parameters from ``x~`` (this worker's copy in
        the allreduce form; the last pulled center in the server form -- the final one after
        :meth:`finish`), everything else (buffers, frozen parameters) this replica's."""
        self._worker_only("center_state_dict")
        out = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        center = {id(p): self._center[i].detach().clone() for i, p in enumerate(self.params)}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if id(p) in center:  # a tied parameter: its keys share the one center tensor
                out[name] = center[id(p)]
        return out

    def averaged_state_dict(self) -> dict[str, torch.Tensor]:
        """The workers' replicas averaged (collective over the workers only)."""
        self._worker_only("averaged_state_dict")
        return super().averaged_state_dict()

    def consensus_distance(self) -> float:
        """``sqrt(1/n sum_i ||x_i - mean||^2)`` over the workers (collective over the workers only)."""
        self._worker_only("consensus_distance")
        return super().consensus_distance()

    @property
    def model_bytes(self) -> int:
        """Bytes of the trainable parameters (what one elastic difference or center weighs)."""
        return sum(p.numel() * p.element_size() for p in self.params)

    def expected_bytes_per_step(self) -> float:
        """The closed form of the module docstring: ring ``2 (N-1)/N * model_bytes / period``, or
        ``2 * model_bytes / period`` (push + pull, headers excluded) in the server form; this rank's bytes."""
        if self.ps is not None:
            return 2.0 * self.model_bytes / self.period
        n = self.num_workers
        return 2.0 * (n - 1) / n * self.model_bytes / self.period

    def stats(self) -> dict[str, Any]:
        """The base's counters (``steps``, ``rounds``, ``bytes_sent``, ``messages``) plus the form, and in
        the server form ``bytes_received`` (the pulled centers) and the parameter server's own stats."""
        out = super().stats()
        out.update(center=self.center_kind, alpha=self.alpha, period=self.period, workers=self.num_workers)
        if self.ps is not None:
            out.update(bytes_received=self._received, servers=self.num_servers, ps=self.ps.stats())
        return out

    def _worker_only(self, what: str) -> None:
        if self.is_server:
            raise DTrainError(
                f"rank {self.global_rank} is an EASGD server (ranks 0..{self.num_servers - 1} of the "
                f"group); call serve(), not {what}()"
            )

    def extra_repr(self) -> str:
        role = "server" if self.is_server else f"worker {self.worker_index}/{self.num_workers}"
        return f"center={self.center_kind!r}, alpha={self.alpha}, period={self.period}, {role}"
