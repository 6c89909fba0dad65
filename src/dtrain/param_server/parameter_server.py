"""``dtrain.ParameterServer``: every rank builds one; servers serve, workers train.

::

    ps = dtrain.ParameterServer(model, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                                servers=2, consistency="ssp:3")
    if ps.is_server:
        ps.serve()                       # returns when every worker has finished
    else:
        for x, y in loader:
            loss_fn(model(x), y).backward()
            ps.step()                    # push gradients, pull parameters as the policy allows
            if ps.should_stop: break     # the servers' gradient budget is spent
        ps.finish()                      # the model now holds the final parameters
    print(ps.stats())

Ranks ``0..S-1`` are servers, worker ``i`` is rank ``S + i``. The parameters are
sharded over the servers balanced by bytes (:mod:`.sharding`); each server owns
its shard's optimizer. All traffic is point-to-point on a process group of its
own (so a long wait never disturbs the user's collectives), built with the
default group's backend; liveness goes through the c10d store (:mod:`._liveness`).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from dtrain.comm.transport import TorchTransport, Transport
from dtrain.compress import resolve
from dtrain.compress.base import Compressor
from dtrain.errors import ConfigError, DTrainError
from dtrain.param_server._liveness import Liveness
from dtrain.param_server.consistency import ConsistencySpec, parse_consistency
from dtrain.param_server.server import ShardServer
from dtrain.param_server.sharding import Shard, shard_model
from dtrain.param_server.worker import ShardClient

__all__ = ["ParameterServer", "DATA_TIMEOUT_S", "reshard_server_state"]

#: how long the data path's receives may block: they must never time out (that
#: closes gloo's connections); lost peers are found by heartbeats and closed sockets.
DATA_TIMEOUT_S = 24 * 3600.0

_INSTANCES: dict[str, int] = {}  # process group name -> parameter servers built on it so far


def reshard_server_state(
    state: dict[str, Any], workers: Sequence[int], spec: ConsistencySpec | None = None
) -> dict[str, Any]:
    """A server's saved :meth:`ParameterServer.state_dict` for another set of worker ranks (bsp).

    Under bsp a checkpoint is taken right after an update, when every worker has
    pushed the same number of gradients: the saved clock table holds one clock
    ``c``. The shard, optimizer state, version and update count do not depend on
    the workers; the new clock table puts every new worker at ``c``, and the
    gradients received become ``c`` per new worker -- what a run on the new workers
    would have counted after ``c`` steps (the budget ``workers x steps`` is the new
    run's own).

    Raises:
        ConfigError: ``spec`` (the run's consistency model, if given) is not bsp, or the saved
            clocks differ (not a bsp checkpoint).
    """
    if spec is not None and spec.kind != "bsp":
        raise ConfigError(f"a server's state resumes on another set of workers under bsp only, not {spec}")
    saved = {int(w): int(c) for w, c in state["clock"].items()}
    clocks = set(saved.values())
    if len(clocks) != 1:
        raise ConfigError(
            f"the saved workers are at different clocks {saved}: only a checkpoint where every worker "
            "is at one clock (bsp) resumes on another number of workers"
        )
    (clock,) = clocks
    return {**state, "clock": {int(w): clock for w in workers}, "received": clock * len(workers)}


def _check_arguments(
    model: Any, optimizer_factory: Any, servers: Any, timeout_s: float, max_gradients: int | None
) -> None:
    """:class:`ParameterServer`'s own checks of its arguments (ConfigError naming the one that is wrong)."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(optimizer_factory):
        raise ConfigError("optimizer_factory must be callable: params -> torch.optim.Optimizer")
    if not isinstance(servers, int) or servers < 1:
        raise ConfigError(f"servers must be an integer >= 1, got {servers!r}")
    if not timeout_s > 0:
        raise ConfigError(f"timeout_s must be > 0, got {timeout_s}")
    if max_gradients is not None and max_gradients < 1:
        raise ConfigError(f"max_gradients must be >= 1 or None, got {max_gradients}")


def _consistency(consistency: str | ConsistencySpec, staleness_lr: bool, clip_grad_norm: float) -> ConsistencySpec:
    """The consistency model, refused with ``clip_grad_norm`` unless bsp."""
    spec = parse_consistency(consistency, staleness_lr=staleness_lr)
    if clip_grad_norm and spec.kind != "bsp":
        raise ConfigError(
            f"clip_grad_norm clips each update's gradient over every server's shard, which bsp "
            f"alone applies in step on every server; consistency is {spec}"
        )
    return spec


def _check_role(rank: int, role: str, state: dict[str, Any] | None) -> None:
    """A saved state resumes on a rank of its own role (server or worker) only."""
    if state is not None and state.get("role") != role:
        raise ConfigError(
            f"rank {rank} is a {role} but was given the saved state of a {state.get('role')}; "
            "resume with the same numbers of servers and workers"
        )


class ParameterServer:
    """Parameter-server training under a consistency model.

    Args:
        model: the model (every rank builds the same architecture; the servers'
            copies provide the initial parameters, which workers pull at once).
        optimizer_factory: ``f(params) -> torch.optim.Optimizer``; each server
            calls it on its shard's tensors.
        servers: number of server ranks ``S`` (default: 1).
        consistency: ``"bsp"``, ``"asp"``, ``"ssp:S"``, ``"softsync:K"`` or
            ``"backup:B"`` (default: "bsp"); see :mod:`.consistency`.
        staleness_lr: scale each update's learning rate by 1 / staleness (async policies).
        compression: compressor (or spec like ``"fp16"``) for the pushed gradients (default: none).
        pull_compression: compressor for the pulled parameters (default: none).
        timeout_s: a peer without heartbeat this long is lost; servers stop after
            ``2 * timeout_s`` without progress while workers wait (default: 300).
        max_gradients: the servers raise :attr:`should_stop` once this many
            gradients arrived from all workers together (default: no budget).
        min_split_bytes: tensors smaller than this are never cut between servers (default: 4096).
        group: run on the ranks of this process group, used as given (default: a
            new group of all ranks); ranks in messages are ranks within it.
        transport / store: for in-process tests (a ``ThreadTransport`` and a
            ``torch.distributed.HashStore``); by default a new process group of all
            ranks and the default group's store.
        state: this rank's :meth:`state_dict` from a checkpoint, restored before
            the first message: a server's shard, optimizer state and clock table, a
            worker's clock and compressor state (default: a fresh start).
        on_update: servers only: ``f(version, budget_spent)`` called on the
            serving thread after each update's replies are sent -- under bsp every
            worker has just been released, the moment to call :meth:`state_dict`
            for a checkpoint (default: None).
        reshard: ``state`` may come from a run with another number of workers (bsp
            only, as :func:`reshard_server_state` says); a worker then takes any saved
            worker's state (default: False: the same workers, or a ConfigError).
        clip_grad_norm: bsp only: clip each update's aggregated gradient to this global 2-norm
            (:mod:`dtrain.param_server.clipping`; :meth:`grad_norm` reads it) (default: 0, off).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer_factory: Callable[[Any], torch.optim.Optimizer],
        *,
        servers: int = 1,
        consistency: str | ConsistencySpec = "bsp",
        staleness_lr: bool = False,
        compression: Compressor | str | None = None,
        pull_compression: Compressor | str | None = None,
        timeout_s: float = 300.0,
        max_gradients: int | None = None,
        min_split_bytes: int = 4096,
        group: Any = None,
        transport: Transport | None = None,
        store: Any = None,
        state: dict[str, Any] | None = None,
        on_update: Callable[[int, bool], None] | None = None,
        reshard: bool = False,
        clip_grad_norm: float = 0.0,
    ) -> None:
        _check_arguments(model, optimizer_factory, servers, timeout_s, max_gradients)
        self.spec = _consistency(consistency, staleness_lr, clip_grad_norm)
        self.params = [p for p in model.parameters()]
        if not self.params:
            raise ConfigError("the model has no parameters")
        self.shards: list[Shard] = shard_model(self.params, servers, min_split_bytes=min_split_bytes)
        push_c = resolve(compression, none_is_off=False)
        pull_c = resolve(pull_compression, none_is_off=False, what="pull_compression")

        self.transport, self.store, self.store_prefix = self._connect(transport, store, group)
        store, prefix = self.store, self.store_prefix
        self.rank = self.transport.rank
        self.world_size = self.transport.world_size
        self.num_servers = servers
        self.num_workers = self.world_size - servers
        if self.num_workers < 1:
            raise ConfigError(
                f"{self.world_size} processes cannot hold {servers} servers and at least one worker; "
                f"start more processes or use fewer servers"
            )
        self.spec.check_workers(self.num_workers)  # every rank fails alike, before any message
        self.is_server = self.rank < servers
        self.worker_index = -1 if self.is_server else self.rank - servers
        _check_role(self.rank, "server" if self.is_server else "worker", state)
        self.timeout_s = float(timeout_s)
        workers = list(range(servers, self.world_size))
        self._live = Liveness(store, prefix, self.rank, timeout_s)
        self._server: ShardServer | None = None
        self._client: ShardClient | None = None
        if self.is_server:
            self._server = self._shard_server(
                optimizer_factory, workers, (push_c, pull_c), max_gradients, on_update, clip_grad_norm
            )
            if state is not None:
                if reshard and sorted(int(w) for w in state["clock"]) != workers:
                    state = reshard_server_state(state, workers, self.spec)
                self._server.load_state_dict(state)
            self._live.start(watch=workers)
        else:
            self._client = ShardClient(self.transport, self.shards, self.params, push_c, pull_c, self._live, timeout_s)
            if state is not None:
                self._client.load_state_dict(state)
            self._live.start(watch=range(servers))
            self._client.connect()
        self._served = False

    # ------------------------------------------------------------------ set-up

    def _shard_server(
        self,
        optimizer_factory: Callable[[Any], torch.optim.Optimizer],
        workers: list[int],
        compressors: tuple[Compressor, Compressor],
        max_gradients: int | None,
        on_update: Callable[[int, bool], None] | None,
        clip_grad_norm: float,
    ) -> ShardServer:
        """This server rank's :class:`ShardServer` of its shard (with the clipper of ``clip_grad_norm``)."""
        push_c, pull_c = compressors
        server = ShardServer(
            self.transport,
            self.shards[self.rank],
            self.params,
            optimizer_factory,
            self.spec.build(),
            workers,
            push_c,
            pull_c,
            self._live,
            self.timeout_s,
            max_gradients,
        )
        server.on_update = on_update
        if clip_grad_norm:
            from dtrain.param_server.clipping import ShardClipper

            server.clip = ShardClipper(
                self.store, self.store_prefix, self.rank, self.num_servers, clip_grad_norm, self.timeout_s
            )
        return server

    @staticmethod
    def _connect(transport: Transport | None, store: Any, group: Any) -> tuple[Transport, Any, str]:
        if transport is not None:
            if store is None:
                raise ConfigError("pass a store (e.g. torch.distributed.HashStore()) together with a transport")
            return transport, store, "dtrain/ps"
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ConfigError("torch.distributed is not initialised; call dtrain.init() (or run under torchrun) first")
        backend = dist.get_backend()
        # server state lives on the CPU: with NCCL the parameter traffic goes over gloo
        pg_backend = "gloo" if backend == "nccl" else backend
        if group is None:
            pg = dist.new_group(backend=pg_backend, timeout=datetime.timedelta(seconds=DATA_TIMEOUT_S))
        else:
            pg = group  # used as given: do not run collectives on it while the parameter server runs
        name = dist.distributed_c10d._get_process_group_name(pg)
        # members build parameter servers on one group in the same order, so a counter names them alike
        n = _INSTANCES[name] = _INSTANCES.get(name, -1) + 1
        t = TorchTransport(pg, timeout=DATA_TIMEOUT_S)
        store = store if store is not None else dist.distributed_c10d._get_default_store()
        return t, store, f"dtrain/ps/{name}/{n}"

    # ------------------------------------------------------------------ roles

    def serve(self) -> dict[str, Any]:
        """Serve this rank's shard until every worker has finished; returns :meth:`stats`."""
        if self._server is None:
            raise DTrainError(f"rank {self.rank} is a worker; only ranks 0..{self.num_servers - 1} serve")
        if self._served:
            raise DTrainError(f"rank {self.rank}: serve() was already called")
        self._served = True
        try:
            self._server.serve()
        finally:
            self._live.stop()
        return self.stats()

    def step(self) -> None:
        """Push this worker's gradients, wait as the policy requires, pull the parameters, drop the gradients."""
        if self._client is None:
            raise DTrainError(f"rank {self.rank} is a server; call serve(), not step()")
        self._client.step()

    def finish(self) -> None:
        """This worker is done; returns once every worker is, with the final parameters in the model."""
        if self._client is None:
            raise DTrainError(f"rank {self.rank} is a server; call serve(), not finish()")
        self._client.finish()

    def abort(self, reason: str) -> None:
        """Tell every rank that this one stops, and why (best effort): a server that then finds this rank's
        connection closed reports ``reason`` rather than a lost peer."""
        self._live.abort(reason)

    def state_dict(self) -> dict[str, Any]:
        """This rank's state for a checkpoint; pass it back as ``state=`` to resume.

        A worker calls it between steps (its clock and compressor state: error
        feedback residuals, PowerSGD's Q); a server inside ``on_update`` (its
        shard, optimizer state, clock table and gradient count). Differs per
        rank: save it per rank.
        """
        if self._server is not None:
            return {"role": "server", **self._server.state_dict()}
        assert self._client is not None
        return {"role": "worker", **self._client.state_dict()}

    def grad_norm(self, version: int) -> float:
        """``clip_grad_norm``: the global norm of update ``version``'s aggregated gradient, before clipping."""
        from dtrain.param_server.clipping import read_norm

        return read_norm(self.store, self.store_prefix, version, self.num_servers, self.timeout_s)

    @property
    def should_stop(self) -> bool:
        """True once a server said the gradient budget (``max_gradients``) is spent."""
        return self._client is not None and self._client.stop_requested

    @property
    def last_step(self) -> dict[str, float]:
        """This worker's compute/push/wait/pull seconds of its last step."""
        return dict(self._client.last_step) if self._client is not None else {}

    def stats(self) -> dict[str, Any]:
        """Measurements so far: a server's updates, staleness and clock-lag histograms,
        bytes and busy time; a worker's steps, compute/push/wait/pull time and bytes."""
        base = {"consistency": str(self.spec), "servers": self.num_servers, "workers": self.num_workers}
        if self._server is not None:
            return {"role": "server", **base, **self._server.stats.to_dict()}
        assert self._client is not None
        return {"role": "worker", **base, **self._client.stats.to_dict()}

    def __repr__(self) -> str:
        role = "server" if self.is_server else f"worker {self.worker_index}"
        return (
            f"ParameterServer(rank={self.rank}, {role}, servers={self.num_servers}, "
            f"workers={self.num_workers}, consistency={str(self.spec)!r})"
        )
