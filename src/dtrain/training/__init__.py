"""The one training loop and what a process of a run needs around it.

* :mod:`.context` -- :class:`~.context.TrainContext`: what one process of a run gets, composing
  :mod:`.factories` (model, optimizer, compressor), :mod:`.batch_control` (the global batch),
  :mod:`.lr` (the learning rate), :mod:`.loaders` (a shard's data), :mod:`.evaluation`,
  :mod:`.progress` and :mod:`.stragglers`;
* :mod:`.loop` -- :class:`~.loop.Engine` (what a strategy supplies) and :func:`~.loop.run_loop`
  (epochs, batches, spans, stragglers, metrics rows, checkpoints, evaluation);
* :mod:`.large_batch` -- the learning rate of a step and the global batch of an epoch;
* :mod:`.precision` -- mixed precision (autocast, loss scaling) for every strategy;
* :mod:`.guard`, :mod:`.watchdog`, :mod:`.live`, :mod:`.noise_scale` -- non-finite steps, hangs,
  live progress and the gradient noise scale.

Import the modules themselves: this package imports nothing, so that a low module (the
large-batch rules, precision) can be used without the loop.
"""
