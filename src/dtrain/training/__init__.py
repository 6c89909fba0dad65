"""The one training loop: a per-process context, an engine protocol, and the loop.

* :mod:`.context` -- :class:`TrainContext`: data, model and optimizer factories,
  loaders, evaluation, metrics and tracing for one process of a run;
* :mod:`.loop` -- :class:`Engine` (what a strategy supplies) and :func:`run_loop`
  (epochs, batches, spans, stragglers, metrics rows, checkpoints, evaluation).
"""

from dtrain.training.context import TrainContext, lr_factor, schedule_updates
from dtrain.training.loop import Engine, Position, run_loop

__all__ = ["TrainContext", "lr_factor", "schedule_updates", "Engine", "Position", "run_loop"]
