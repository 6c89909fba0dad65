"""Performance model: cost formulas, calibration, planner and simulator.

* :mod:`.spec` -- the cluster description (TOML; written by calibration or by hand);
* :mod:`.profile` -- a model's per-layer parameters, FLOPs, activations and times;
* :mod:`.collectives`, :mod:`.predict` -- pure functions: step time, memory, bytes;
* :mod:`.planner` -- :func:`plan` ranks strategies; :func:`choose` picks one for ``--strategy auto``;
* :mod:`.simulator` -- event-driven replay with stragglers and asynchrony;
* :mod:`.calibrate` -- ``dtrain bench calibrate``.
"""

from dtrain.perfmodel.collectives import CompressionModel, allreduce_time
from dtrain.perfmodel.planner import Plan, candidates, plan
from dtrain.perfmodel.predict import Memory, Prediction, Strategy, predict
from dtrain.perfmodel.profile import LayerProfile, ModelProfile, profile_model
from dtrain.perfmodel.simulator import SimResult, Stragglers, scaling_curve, simulate
from dtrain.perfmodel.spec import ClusterSpec, Device, Link, dump_cluster, load_cluster
from dtrain.perfmodel.auto import choose

__all__ = [
    "ClusterSpec",
    "Device",
    "Link",
    "load_cluster",
    "dump_cluster",
    "LayerProfile",
    "ModelProfile",
    "profile_model",
    "CompressionModel",
    "allreduce_time",
    "Strategy",
    "Prediction",
    "Memory",
    "predict",
    "Plan",
    "candidates",
    "plan",
    "choose",
    "SimResult",
    "Stragglers",
    "simulate",
    "scaling_curve",
]
