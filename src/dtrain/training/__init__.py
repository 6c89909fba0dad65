"""The one training loop and what a process of a run needs around it.

* :mod:`.context` -- :class:`~.context.TrainContext`: what one process of a run gets, composing
  :mod:`.factories` (model, optimizer, compressor), :mod:`.batch_control` (the global batch),
  :mod:`.lr` (the learning rate), :mod:`.loaders` (a shard's data), :mod:`.evaluation` (the run's
  metric), :mod:`.progress` (the progress bar) and :mod:`.slowdown` (emulated stragglers);
* :mod:`.loop` -- :class:`~.loop.LoopAdapter` (what a strategy supplies) and :func:`~.loop.run_loop`
  (epochs, batches, spans, stragglers, metrics rows, checkpoints, evaluation);
* :mod:`.accumulate` -- ``--grad-accum N`` (micro-steps, one exchange a step) and ``--clip-grad-norm``;
* :mod:`.checkpointing` -- ``--checkpoint-every N`` and ``--resume PATH`` for every strategy;
* :mod:`.watchdog`, :mod:`.live`, :mod:`.noise_scale` -- the rank(s) a timed-out wait waited for,
  the progress bar's slowest rank, and the gradient noise scale.

The update's rules (the large-batch rules, mixed precision, the non-finite guard) are
:mod:`dtrain.optim`'s. Import the modules themselves: this package imports nothing, so that
one part can be used without the loop.
"""
