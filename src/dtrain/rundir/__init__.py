"""A run folder: the files ``dtrain run`` leaves, named, read and written in one place.

* :mod:`.files` -- the folder's file names (the summary, the metrics rows, the evaluations, the
  configuration, each rank's metrics while the run trains) and their readers and writers: one
  metrics reader (:func:`~.files.read_metrics`), one summary reader and writer;
* :mod:`.attribution` -- over a run's metrics rows: which rank the others waited for, and what
  bounds a step (what the run's last lines print and its summary records);
* :mod:`.curves` -- the run's ``curves.png`` (loss, metric, noise scale), drawn when it ends.

The training loop, the job, the report, the sweeps and the benchmarks read and write run
folders through this package; it imports nothing of dtrain but its errors, so it sits below
all of them. This package imports nothing itself.
"""
