"""Straggler and bottleneck attribution, under its old name: :mod:`dtrain.rundir.attribution` (the run's
last lines and its summary use it, below the report, so it lives with the run folder's files)."""

from dtrain.rundir.attribution import Arrival, Attribution, RankBlame, arrivals, attribute, own_s, step_time

__all__ = ["Arrival", "RankBlame", "Attribution", "own_s", "step_time", "arrivals", "attribute"]
