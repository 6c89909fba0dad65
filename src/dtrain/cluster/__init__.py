"""Emulated cluster: network namespaces, a bridge and tc shaping on one Linux machine.

``dtrain cluster up --hosts 4 --bandwidth 100mbit`` builds it (:func:`up`),
:func:`run_on_cluster` runs a multi-node job on it (one torchrun node per
emulated host, c10d rendezvous on host 0), ``dtrain cluster down`` removes it
(:func:`down`). See :mod:`dtrain.cluster.netns` for the layout. A slow host (``--slow``) is
emulated in the training loop: :mod:`dtrain.training.slowdown`.
"""

from dtrain.cluster.multinode import launch_on_cluster, node_env, run_on_cluster
from dtrain.cluster.netns import ClusterError, EmulatedCluster, down, load, require_root, status, up

__all__ = [
    "ClusterError",
    "EmulatedCluster",
    "up",
    "down",
    "status",
    "load",
    "require_root",
    "run_on_cluster",
    "launch_on_cluster",
    "node_env",
]
