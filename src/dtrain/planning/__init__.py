"""Planning on a real model and cluster. The formulas are :mod:`dtrain.perfmodel`'s; this layer measures.

* :mod:`.auto` -- :func:`plan` (with this machine's calibration when given no cluster),
  :func:`pick_plan` for ``--strategy auto``;
* :mod:`.cli` -- the ``dtrain plan`` command;
* :mod:`.calibrate` -- the calibration of a machine or emulated cluster (``dtrain bench calibrate``,
  this machine's cached one), what each of its processes measures being the private ``_probes``;
* :mod:`.load` -- the load a calibration is made under.
"""

from dtrain.planning.auto import cluster_for, pick_plan, plan, plan_for_config

__all__ = ["plan", "pick_plan", "plan_for_config", "cluster_for"]
