"""Running a job: ``dtrain run`` from a validated configuration to its summary.

* :mod:`.validate` -- the checks made before any process starts (values, CUDA, the data, a resumed
  checkpoint), each error naming what to change;
* :mod:`.model_check` -- a user's model and loss checked against the data (its size on the meta device,
  one forward) before any process starts;
* :mod:`.api` -- ``dtrain.run(...)``, the same run from Python (functions for the model and data);
* :mod:`.run` -- the parent process of ``dtrain run`` (launch, summary) and each worker's entry point;
* :mod:`.restart` -- resuming after a lost process: the restart log and the checkpoint to restart from.

The configuration itself is :mod:`dtrain.config`; starting processes is :mod:`dtrain.launch`.
This package imports nothing itself.
"""
