"""Performance model: cost formulas, planner and simulator -- pure functions, nothing started.

* :mod:`.spec` -- the cluster description (TOML; written by calibration or by hand);
* :mod:`.profile` -- a model's per-layer parameters, FLOPs, activations and times;
* :mod:`.collectives`, :mod:`.predict` -- step time, memory, bytes (each strategy's hooks
  in :mod:`dtrain.strategies` call them);
* :mod:`.hooks` -- what a strategy's performance-model hooks take and return (:class:`ModelHooks`);
* :mod:`.ranking` -- :func:`plan` ranks the registered strategies' candidates;
* :mod:`.simulator` -- event-driven replay with stragglers and asynchrony;
* :mod:`.fit` -- a cluster description's terms fitted to what calibration measured;
* :mod:`.pipeline`, :mod:`.sharded`, :mod:`.decentralized`, :mod:`.tensor`, :mod:`.mesh` -- the
  pipelines, ZeRO, model averaging, tensor parallelism and the DP x PP x TP mesh (a pipeline's cut:
  :mod:`.pipeline_cut`).

Measuring a cluster is :mod:`dtrain.planning.calibrate` (its probes :mod:`dtrain.planning._probes`); planning for a run
(``--strategy auto``, ``dtrain plan``, this machine's calibration) is :mod:`dtrain.planning`.
"""

from dtrain.perfmodel.collectives import CompressionModel, allreduce_time, cluster_allreduce_time
from dtrain.perfmodel.predict import Memory, Prediction, predict
from dtrain.perfmodel.profile import LayerProfile, ModelProfile, profile_model
from dtrain.perfmodel.ranking import Plan, candidates, plan
from dtrain.perfmodel.simulator import SimResult, Stragglers, scaling_curve, simulate, simulate_steps
from dtrain.perfmodel.spec import ClusterSpec, Device, Link, dump_cluster, load_cluster

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
    "cluster_allreduce_time",
    "Prediction",
    "Memory",
    "predict",
    "Plan",
    "candidates",
    "plan",
    "SimResult",
    "Stragglers",
    "simulate",
    "simulate_steps",
    "scaling_curve",
]
