"""Search over hyper-parameters and architectures (``dtrain sweep``) on Ray Tune, each trial a ``dtrain run``.

:mod:`.space` reads the search space (no Ray needed), :mod:`.sweep` checks a sweep and writes its
record, :mod:`.trial` runs one trial as an ordinary run, :mod:`.tune` is the only module that
imports Ray (the ``tune`` extra: ``pip install 'dtrain[tune]'``).
"""

from dtrain.search.space import DISTRIBUTIONS, MUTABLE, Param, parse_space
from dtrain.search.sweep import SCHEDULERS, SEARCHES, SweepSpec, build_spec

__all__ = ["DISTRIBUTIONS", "MUTABLE", "Param", "parse_space", "SCHEDULERS", "SEARCHES", "SweepSpec", "build_spec"]
