"""Planning on a real model and cluster: :func:`plan` (with this machine's calibration when
given no cluster), :func:`choose` for ``--strategy auto``, and the ``dtrain plan`` command
(:mod:`.cli`). The formulas are :mod:`dtrain.perfmodel`'s; this layer measures."""

from dtrain.planning.auto import choose, cluster_for, plan, plan_for_config

__all__ = ["plan", "choose", "plan_for_config", "cluster_for"]
