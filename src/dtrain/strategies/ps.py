"""``ps``: the parameter server inside the training loop.

Every process of the run (``servers + workers`` of them) runs :func:`run_process`.
Ranks ``0..S-1`` serve; worker ``i`` (rank ``S + i``) trains on shard ``i`` of
the data (the data is split among workers only).

The amount of work is a budget of gradients, the same for every policy:
``workers x steps`` (steps from the epochs and ``max_steps`` as in data
parallelism). Each worker cycles through its shard until the servers report that
the budget is spent, so under asynchronous policies a fast worker computes more
gradients than a straggler instead of idling at the end -- which is the point of
those policies. Worker 0 evaluates its copy of the model after each pass over its
shard (the accuracy history) and the final model after :meth:`finish`.

``--straggler RANK:FACTOR`` slows a worker's own work (everything from the
previous ``ps.step()``'s return to the end of backward), not the parameter
exchange: a slow machine on the same network (:class:`dtrain.training.slowdown.Straggler`).

Checkpoints (``--checkpoint-every N``, bsp only): each server saves its shard,
optimizer state and clock table from the ``on_update`` hook right after update
``k * N`` (and the last one), when every worker has just been released; each
worker saves its clock, compressor state, data position and RNGs after its step
``k * N``; one collective save (:class:`dtrain.training.checkpointing.RunCheckpointer`)
holds them all. ``--resume`` hands each rank its own state back.

Such a checkpoint resumes on another number of workers (the same servers)
when no compressor keeps per-worker state: the servers hold the whole model and
optimizer state, and under bsp every worker was at one clock, so each server
rebuilds its clock table with every new worker at that clock
(:func:`~dtrain.param_server.parameter_server.reshard_server_state`) and worker
``i`` takes saved worker ``i mod W_saved``'s clock, data position and RNG states, as
data parallelism hands out its ranks' states. With the same global batch (checked
before launch) the resumed steps average the gradients of the same samples.

The end-of-run statistics (staleness, clock lag, the per-rank table) are
:mod:`dtrain.param_server.runner`'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dtrain.checkpoint.layout import CheckpointError
from dtrain.config.schema import ConfigHooks
from dtrain.errors import ConfigError
from dtrain.param_server.consistency import parse_consistency
from dtrain.param_server.parameter_server import ParameterServer
from dtrain.param_server.protocol import DroppedError, RunAbortedError
from dtrain.param_server.runner import lr_scale, publish_worker_stats, serve
from dtrain.perfmodel.hooks import ModelHooks, PlanSpace
from dtrain.perfmodel.predict import Memory, Prediction, StepInputs, predict_parameter_server, server_memory
from dtrain.perfmodel.simulator import simulate_ps
from dtrain.registry import Choice, Strategy, register
from dtrain.strategies._common import CompressedOptions
from dtrain.training.context import ProcessHooks, TrainContext, schedule_updates
from dtrain.training.loop import Position, run_loop

if TYPE_CHECKING:
    from dtrain.config.schema import RunConfig
    from dtrain.perfmodel.collectives import CompressionModel
    from dtrain.perfmodel.profile import ModelProfile
    from dtrain.perfmodel.spec import ClusterSpec
    from dtrain.training.checkpointing import RunCheckpointer

__all__ = ["PSOptions", "PSWorkerAdapter", "PSWorkerEngine", "run_process", "server_updates", "PS"]


@dataclass(frozen=True)
class PSOptions(CompressedOptions):
    """Options of ``--strategy ps``.

    Attributes:
        servers: ranks ``0..servers-1`` serve, each a shard of the parameters (default: 1).
        consistency: bsp | asp | ssp:S | softsync:K | backup:B (default: bsp).
        staleness_lr: divide a gradient's learning rate by its staleness (default: off).
    """

    servers: int = field(default=1, metadata={"help": "parameter-server ranks (default: 1)"})
    consistency: str = field(
        default="bsp", metadata={"help": "parameter-server consistency: bsp, asp, ssp:S, softsync:K, backup:B"}
    )
    staleness_lr: bool = field(
        default=False,
        metadata={
            "help": "staleness-aware learning rate: each gradient's rate divided by its staleness (default: off)"
        },
    )

    def exchanges_unscaled(self) -> bool:
        return True  # a worker pushes after its step's check

    def __post_init__(self) -> None:
        if self.servers < 1:
            raise ConfigError(f"the parameter server needs servers >= 1, got {self.servers}")
        try:
            parse_consistency(self.consistency, staleness_lr=self.staleness_lr)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        super().__post_init__()

    def processes(self, workers: int) -> int:
        return workers + self.servers

    def refuses_grad_accum(self, workers: int) -> str:
        return ""  # a worker pushes once, in its update, the gradient its micro-steps accumulated

    def refuses_clip_grad_norm(self, workers: int) -> str:
        if self.consistency.strip().lower() != "bsp":
            return (
                f"--consistency {self.consistency} clips nothing: its servers apply each shard's updates out of "
                "step with one another, so no update has one global norm; clip under bsp"
            )
        return ""  # each update's aggregated gradient, over every server's shard (dtrain.param_server.clipping)

    def reshards(self) -> bool:
        # bsp: the servers hold the model and optimizer state and every worker is at one clock at a
        # checkpoint, so any number of workers can take it up, unless a compressor keeps per-worker state
        from dtrain.strategies.dp_options import STATELESS_WIRE

        return self.consistency.strip().lower() == "bsp" and self.compressor_spec() in STATELESS_WIRE

    def checkpoint_keys(self) -> dict[str, Any]:
        return {**super().checkpoint_keys(), "servers": self.servers, "consistency": self.consistency}

    def approximation(self) -> str:
        notes = [super().approximation()]
        if not self.consistency.startswith(("bsp", "backup")):
            notes.append(f"approximate: {self.consistency} staleness")
        return "; ".join(n for n in notes if n)

    def label(self, workers: int) -> str:
        return f"ps {self.consistency} {self.servers} server{'s' if self.servers > 1 else ''}{self._comp_label()}"


def _options(cfg: RunConfig) -> PSOptions:
    assert isinstance(cfg.options, PSOptions)
    return cfg.options


def server_updates(cfg: RunConfig, steps: int) -> int:
    """Updates each server applies in a run of ``steps`` steps per worker: one per round under bsp
    and backup:b, ``W / k`` per round under softsync:k, ``W`` under asp and ssp."""
    spec = parse_consistency(_options(cfg).consistency)
    workers = cfg.workers
    if spec.kind in ("bsp", "backup"):
        return max(1, steps)
    if spec.kind == "softsync":
        return max(1, workers * steps // min(spec.arg, workers))
    return max(1, workers * steps)


class PSWorkerAdapter:
    """One parameter-server worker for :func:`~dtrain.training.loop.run_loop`."""

    eval_note = " (worker 0's copy)"
    samples_scale = 1

    def __init__(
        self,
        ctx: TrainContext,
        ps: ParameterServer,
        model: nn.Module,
        workers: int,
        steps: int,
        ckpt: RunCheckpointer | None,
        blob: dict[str, Any] | None,
    ) -> None:
        self.ctx, self.ps, self.model, self.ckpt, self.blob = ctx, ps, model, ckpt, blob
        self.shard, self.num_shards = ps.worker_index, workers
        self.evaluator = ps.worker_index == 0
        self.total_steps = steps
        self._lr = ctx.cfg.lr * lr_scale(_options(ctx.cfg).consistency, workers)
        self._step = 0
        self._sent = 0

    def start(self) -> Position:
        if self.blob is None:
            return Position()
        # resumed: this worker's clock and data position at the checkpoint
        start, epoch, batch = int(self.blob["ps"]["clock"]), int(self.blob["epoch"]), int(self.blob["batch"])
        if batch >= self.ctx.steps_per_epoch(self.num_shards):
            epoch, batch = epoch + 1, 0
        return Position(start, epoch, batch, rng=self.blob)

    def done(self, step: int) -> bool:
        return self.ps.should_stop

    def before_step(self, step: int) -> None:
        self._step = step  # ps.step() zeroes the gradients; the servers' optimizer has the schedule

    def forward(self, x: Any) -> torch.Tensor:
        out: torch.Tensor = self.model(x)
        return out

    def update(self) -> None:
        with self.ctx.tracer.span("ps.step"):
            self.ps.step()

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.model.named_parameters())

    def agree(self, bad: bool) -> list[int]:
        return [self.ctx.rank] if bad else []  # this worker's gradients alone: its own check decides

    def skip(self) -> None:
        """No push (the servers wait for this worker's next gradient instead; nothing changed meanwhile under
        bsp, so the parameters it holds are current), and the gradients dropped as ``ps.step()`` would."""
        for p in self.model.parameters():
            p.grad = None

    def clip_grad_norm(self, max_norm: float) -> float | None:
        """``--clip-grad-norm``: the servers clip the aggregated gradient (bsp), which no worker holds; the
        norm comes with the step's row (:meth:`rows`)."""
        return None

    def lr(self) -> float:
        """The rate of this step's update under bsp (the servers count updates: one per step there)."""
        if not self.ctx.learning_rate.changes:
            return self._lr
        return self._lr * self.ctx.lr_multiplier(self._step, self.total_steps, batch=self.ctx.cfg.batch_size)

    def rows(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        dt = row.pop("step_s")
        last, sent = self.ps.last_step, int(self.ps.stats()["bytes_sent"])
        comm_s = last["push_s"] + last["pull_s"]
        row.update(
            compute_s=dt - comm_s - last["wait_s"], comm_s=comm_s, wait_s=last["wait_s"], bytes_sent=sent - self._sent
        )
        if self.ctx.cfg.clip_grad_norm:  # the norm of the update this step's gradient went into (bsp: the step's)
            row["grad_norm"] = self.ps.grad_norm(row["step"])
        self._sent = sent
        return [row]

    def synchronize(self) -> list[dict[str, Any]]:
        return []

    def save(self, ckpt: RunCheckpointer, step: int, epoch: int, batch: int) -> None:
        ckpt.save(step, rank_state={"ps": self.ps.state_dict(), "epoch": epoch, "batch": batch})

    def finish(self) -> dict[str, Any]:
        self.ps.finish()  # pulls the final parameters
        st = publish_worker_stats(self.ps)
        return {"bytes_sent": st["bytes_sent"], "ps": st}


PSWorkerEngine = PSWorkerAdapter  # the name older scripts import


def run_process(ctx: TrainContext) -> dict[str, Any]:
    """One process of a parameter-server run: serve, or train as a worker."""
    c, o = ctx.cfg, _options(ctx.cfg)
    workers = ctx.world_size - o.servers
    if workers < 1:
        raise ConfigError(f"--strategy ps needs workers >= 1 besides the {o.servers} servers")
    steps = ctx.total_steps(workers)
    if steps < 1:
        raise ConfigError("the data shard of each worker is smaller than one batch; use a smaller batch size")
    comp = ctx.make_compressor()  # with momentum in it for sign/onebit; the servers' optimizer then has none
    from dtrain.training.checkpointing import RunCheckpointer

    ckpt = RunCheckpointer.create(c, ctx.out_dir)  # its group before the parameter server's, on every rank
    blob = _restore(ctx, ckpt, o.servers, workers) if ckpt is not None and ckpt.resume_from is not None else None
    model = ctx.make_model()
    scale = lr_scale(o.consistency, workers)

    def optimizer_factory(params: Iterable[Any]) -> torch.optim.Optimizer:
        opt = ctx.make_optimizer(params)
        for group in opt.param_groups:
            group["lr"] = group["lr"] * scale
        if ctx.learning_rate.changes:  # the servers step the optimizer: each update follows the lr rules
            updates = server_updates(c, steps)
            schedule_updates(
                opt, c.lr_schedule, updates, factor=lambda u: ctx.lr_multiplier(u, updates, batch=c.batch_size)
            )
        return opt

    holder: list[ParameterServer] = []

    def on_update(version: int, spent: bool) -> None:  # servers: after an update's replies went out
        if ckpt is not None and ckpt.due(version, final=spent):
            ckpt.save(version, rank_state={"ps": holder[0].state_dict()}, updates=version)

    ps = ParameterServer(
        model,
        optimizer_factory,
        servers=o.servers,
        consistency=o.consistency,
        staleness_lr=o.staleness_lr,
        compression=comp,
        timeout_s=c.timeout_s,
        max_gradients=workers * steps,
        state=blob["ps"] if blob is not None else None,
        on_update=on_update if ckpt is not None else None,
        reshard=o.reshards(),
        clip_grad_norm=c.clip_grad_norm,
    )
    holder.append(ps)
    if ps.is_server:
        return serve(
            ps, ctx.out_dir, batch_size=c.batch_size, timeout_s=c.timeout_s, table=bool(c.extra.get("ps_table", True))
        )
    try:
        return run_loop(ctx, PSWorkerAdapter(ctx, ps, model, workers, steps, ckpt, blob), ckpt)
    except Exception as e:  # this worker's own error (non-finite gradients, a bad batch): the servers say it
        if not isinstance(e, (RunAbortedError, DroppedError)):  # (not another rank's stop, reported already)
            ps.abort(f"worker rank {ctx.rank} stopped: {e}")
        raise


def _restore(ctx: TrainContext, ckpt: RunCheckpointer, servers: int, workers: int) -> dict[str, Any]:
    """Collective: this rank's saved state. On another number of workers each server takes its own and
    worker ``i`` saved worker ``i mod W_saved``'s, whose clock and data position must be the checkpoint's
    step (all workers' are under bsp)."""
    from dtrain.checkpoint.dcp import load_checkpoint
    from dtrain.checkpoint.layout import read_info

    assert ckpt.resume_from is not None
    saved = int(read_info(ckpt.resume_from)["world_size"]) - servers
    if saved == workers:
        return ckpt.restore()[1]
    r = ctx.rank
    own = r if r < servers else servers + (r - servers) % saved
    info, blob = load_checkpoint(ckpt.resume_from, group=ckpt.group, reshard=True, blob_rank=own)
    if r >= servers:
        step, where = int(blob["ps"]["clock"]), (int(blob["epoch"]), int(blob["batch"]))
        if where[1] >= ctx.steps_per_epoch(workers, where[0]):
            where = (where[0] + 1, 0)
        if step != int(info["step"]) or where != ctx.locate(step, workers):
            raise CheckpointError(
                f"{ckpt.resume_from}: saved worker rank {own} is at clock {step}, epoch/batch "
                f"{where}; the checkpoint's step {info['step']} on {workers} workers starts at "
                f"{ctx.locate(int(info['step']), workers)}: it cannot resume on other workers"
            )
    return dict(blob)


# ---------------------------------------------------------------------- checks and performance model hooks


def _check(o: PSOptions, cfg: RunConfig) -> None:
    try:
        parse_consistency(o.consistency, staleness_lr=o.staleness_lr).check_workers(cfg.workers)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.batch_schedule:
        raise ConfigError(
            f"--batch-schedule {cfg.batch_schedule!r} is not supported by the parameter server: its "
            "servers count updates, not the workers' epochs; use a fixed --batch-size"
        )
    if cfg.precision == "fp16" and cfg.checkpoint_every:
        raise ConfigError(
            "--precision fp16 with --checkpoint-every is not supported by the parameter server: a "
            "worker's overflowing step is no push, so its steps and the servers' updates would no "
            "longer meet at the same checkpoint; use --precision bf16"
        )
    if cfg.skip_nonfinite and cfg.checkpoint_every:
        raise ConfigError(
            "--skip-nonfinite with --checkpoint-every is not supported by the parameter server: a "
            "worker's skipped step is no push, so its steps and the servers' updates would no longer "
            "meet at the same checkpoint; use one of them"
        )
    if cfg.resume and cfg.lr_schedule != "constant":
        raise ConfigError(
            f"resume under the parameter server supports lr_schedule 'constant' only (the servers do not "
            f"restore the schedule's position yet); got {cfg.lr_schedule!r}: resume with --lr-schedule constant"
        )


def _check_checkpointing(o: PSOptions, cfg: RunConfig) -> None:
    if o.consistency.strip().lower() != "bsp":
        raise ConfigError(
            f"checkpoints of the parameter server need consistency bsp (got {o.consistency!r}): under "
            "asynchronous policies the workers and servers never share a step to save at"
        )
    if cfg.resume and not o.reshards():
        _check_same_workers(o, cfg)


def _check_same_workers(o: PSOptions, cfg: RunConfig) -> None:
    """A checkpoint of a run whose compressor keeps per-worker state resumes on its own workers only: say so
    (a different compressor or --servers is the run-options check's to name)."""
    from dtrain.checkpoint.layout import find_checkpoint, read_info

    try:
        ckpt = find_checkpoint(cfg.resume)
        saved = read_info(ckpt).get("run", {})
    except CheckpointError:
        return  # check_resume names what is wrong with it
    if saved.get("compression") != o.compressor_spec() or saved.get("servers") != o.servers:
        return
    if saved.get("workers") != cfg.workers:
        raise CheckpointError(
            f"cannot resume {ckpt} on {cfg.workers} workers: it was saved by {saved.get('workers')} workers with "
            f"--compression {o.compressor_spec()}, whose state (error-feedback residuals, warm starts) belongs "
            f"to each worker and would not move to other workers; resume with --workers {saved.get('workers')}"
        )


def _ps(s: Choice) -> PSOptions:
    assert isinstance(s.options, PSOptions)
    return s.options


def _predict(prof: ModelProfile, c: ClusterSpec, s: Choice, comp: CompressionModel, inputs: StepInputs) -> Prediction:
    return predict_parameter_server(prof, c, s, _ps(s), comp, inputs)


def _memory(prof: ModelProfile, s: Choice, comp: CompressionModel | None) -> Memory:
    return server_memory(prof, _ps(s), comp)


def _simulate(prof: ModelProfile, c: ClusterSpec, s: Choice, *args: Any) -> Any:
    return simulate_ps(prof, c, s, _ps(s), *args)


def _candidates(space: PlanSpace) -> list[Choice]:
    w, out = space.workers, []
    for servers in sorted({1, 2, w // 4} - {0}):
        if w - servers < 1:
            continue
        out += [
            Choice("ps", w - servers, PSOptions(servers=servers, consistency=cons))
            for cons in space.consistencies
            if not (space.exact_only and cons != "bsp")
        ]
    return out


def _parse(args: Sequence[str], compression: str, workers: int) -> Choice:
    """``ps:CONSISTENCY:SERVERS``: ``SERVERS`` a number or ``1/K`` (one server per K workers); a consistency
    with an argument takes it next (``ps:ssp:3:2``: ssp:3, 2 servers)."""
    parts = list(args)
    cons = parts[0] if parts else "bsp"
    if len(parts) > 1 and cons in ("ssp", "softsync", "backup"):
        cons, parts = f"{cons}:{parts[1]}", parts[:1] + parts[2:]
    srv = parts[1] if len(parts) > 1 else "1"
    servers = max(1, workers // int(srv[2:])) if srv.startswith("1/") else int(srv)
    return Choice("ps", workers, PSOptions(servers=servers, consistency=cons, compression=compression))


PS = register(
    Strategy(
        name="ps",
        options=PSOptions,
        help="parameter server: sharded servers, consistency bsp | asp | ssp:S | softsync:K | backup:B",
        hooks=(
            ProcessHooks(run=run_process),
            ConfigHooks(check=_check, check_checkpointing=_check_checkpointing),
            ModelHooks(
                predict=_predict,
                memory=_memory,
                simulate=_simulate,
                candidates=_candidates,
                parse=_parse,
                text="ps:CONSISTENCY:SERVERS",
            ),
        ),
    )
)
