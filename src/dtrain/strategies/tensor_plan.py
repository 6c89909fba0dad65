"""``--strategy tensor`` on a model without a hand-written plan (or with a ``[tensor.plan]`` of its own): the plan
the workers will split it by, found in the parent on the model built as they build it; and ``--strategy hybrid``
on such a model: its blocks counted against the stages, its plan checked as tensor's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dtrain.errors import ConfigError

if TYPE_CHECKING:
    from dtrain.config.schema import RunConfig

__all__ = ["check_tensor_plan", "check_user_mesh"]


def check_tensor_plan(o: Any, cfg: RunConfig, tp: int) -> None:
    """The plan the workers will split the model by, found here on the model built as they build it: every error
    of the plan (a key matching nothing, heads or widths ``tp`` does not divide) before any process starts.

    ``o``: the run's ``TensorOptions`` (``tp_plan``, ``plan``, ``sequence_parallel``) or ``HybridOptions`` (the
    ``auto`` plan)."""
    from dtrain.tensor_parallel.parallelize import check_plan
    from dtrain.tensor_parallel.plans import for_model
    from dtrain.workloads.data import first_samples
    from dtrain.workloads.models import make_model

    data = cfg.load_data()
    if o.sequence_parallel and cfg.seq_len % tp:
        raise ConfigError(f"sequence parallel: --seq-len {cfg.seq_len} does not divide over --tp {tp}")
    torch.manual_seed(cfg.seed)
    model = make_model(
        cfg.model,
        tuple(data.input_shape),
        data.num_classes,
        task=data.task,
        model_args=cfg.model_args,
        seq_len=cfg.seq_len,
        **cfg.gpt_overrides(),
    )
    plan = for_model(
        model,
        tp,
        tp_plan=getattr(o, "tp_plan", "auto"),
        table=dict(getattr(o, "plan", ())),
        sequence_parallel=o.sequence_parallel,
        sample=first_samples(data.train, 2)[0],
    )
    if not any(s.partition(":")[0] in ("colwise", "rowwise", "vocab") for s in plan.styles.values()):
        raise ConfigError(
            f"{cfg.strategy}: the plan splits nothing of model {cfg.model} (no attention, MLP or vocabulary found "
            "to split by its structure); give a [tensor.plan] table, or train it under dp, ddp, dp --shard or ps"
        )
    check_plan(model, plan, tp, sequence_parallel=o.sequence_parallel)
    if plan.prepare is not None:
        plan.prepare(model, tp)  # the head counts: a count tp does not divide is named here
    vocab_split = any(k == "vocab" for k in plan.styles.values())
    if vocab_split and cfg.loss:
        raise ConfigError(
            f"--loss {cfg.loss}: the plan splits the LM head by vocabulary, so each rank holds a slice of the "
            "logits and the loss is the vocabulary-parallel cross entropy; drop --loss"
        )


def check_user_mesh(o: Any, cfg: RunConfig, pp: int, tp: int) -> None:
    """A model dtrain did not write on a ``pp x tp`` mesh: enough blocks for the stages (the pipeline's cut
    points, from the model built on the meta device), and the plan each stage is split by (heads and widths
    ``tp`` divides, :func:`check_tensor_plan`). ``o``: the run's ``HybridOptions``."""
    from dtrain.strategies.pipeline import cut_points, parse_balance

    if pp > 1:
        if o.sequence_parallel:
            raise ConfigError(
                f"hybrid: --sequence-parallel with --pp {pp} covers dtrain's gpt models; model {cfg.model} "
                "takes it under --pp 1 (or --strategy tensor)"
            )
        names, what = cut_points(cfg)
        if names is not None and len(names) < pp:
            raise ConfigError(
                f"hybrid: {what}: {len(names)} blocks to cut between, fewer than the {pp} stages of --pp {pp}; "
                "use a smaller --pp or a model with more layers"
            )
        counts = parse_balance(o.pipeline()[2])
        if names is not None and isinstance(counts, list) and (len(counts) != pp or sum(counts) != len(names)):
            raise ConfigError(
                f"hybrid: balance {o.pipeline()[2]} must give {pp} positive block counts summing to {len(names)}"
            )
    if tp > 1:
        check_tensor_plan(o, cfg, tp)
