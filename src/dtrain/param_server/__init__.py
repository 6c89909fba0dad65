"""Parameter server: sharded servers, workers, and the consistency models.

* :class:`ParameterServer` -- the public entry point (every rank builds one);
* :mod:`.consistency` -- BSP, ASP, SSP, soft-sync, backup workers and
  staleness-aware LR as objects that run without processes;
* :mod:`.sharding` -- parameters split among servers, balanced by bytes;
* :mod:`.protocol` -- the wire format (integer headers + packed payloads);
* :mod:`.server` / :mod:`.worker` -- the two sides (:mod:`.server_stats`: what a server measured);
  :mod:`.runner` -- ``dtrain run --strategy ps``.
"""

from dtrain.param_server.consistency import (
    ASP,
    BSP,
    POLICIES,
    SSP,
    Backup,
    ConsistencySpec,
    Policy,
    SoftSync,
    StalenessAwareLR,
    parse_consistency,
)
from dtrain.param_server.parameter_server import ParameterServer
from dtrain.param_server.protocol import DroppedError, PeerLostError, ProtocolError, RunAbortedError
from dtrain.param_server.sharding import Piece, Shard, plan_shards

__all__ = [
    "ParameterServer",
    "Policy",
    "BSP",
    "ASP",
    "SSP",
    "SoftSync",
    "Backup",
    "StalenessAwareLR",
    "ConsistencySpec",
    "POLICIES",
    "parse_consistency",
    "Piece",
    "Shard",
    "plan_shards",
    "ProtocolError",
    "PeerLostError",
    "RunAbortedError",
    "DroppedError",
]
