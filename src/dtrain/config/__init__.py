"""A run's configuration: what every run shares plus the strategy's options, and its TOML file.

* :mod:`.schema` -- :class:`~.schema.RunConfig` (the shared fields, each with its help beside it) and
  the names the fields accept;
* :mod:`.values` -- TOML-shaped values to typed fields: :func:`~.values.build_options` (a strategy's
  options), :func:`~.values.option_fields`, which keys are shared and which the strategy's, and
  :func:`~.values.parse_straggler`;
* :mod:`.data` -- :func:`~.data.load_run_data`, a run's dataset loaded once a process;
* :mod:`.files` -- TOML in and out (:func:`~.files.load_toml`, :func:`~.files.dump_toml`) and
  :func:`~.files.read_toml`, which every TOML reader uses (run configurations, cluster descriptions).

Validation that looks beyond the values (CUDA, the data, a checkpoint on disk) is :mod:`dtrain.job.validate`.
This package imports nothing itself.
"""
