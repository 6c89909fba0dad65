"""Planning on a real model and cluster: :func:`plan` (with this machine's calibration when
given no cluster), :func:`pick_plan` for ``--strategy auto``, and the ``dtrain plan`` command
(:mod:`.cli`). The formulas are :mod:`dtrain.perfmodel`'s; this layer measures."""

from dtrain.planning.auto import cluster_for, pick_plan, plan, plan_for_config

__all__ = ["plan", "pick_plan", "plan_for_config", "cluster_for"]
