"""Decentralized training: workers train their own replicas and average *models*.

* :class:`LocalSGD` -- every ``period`` steps an allreduce average (post-local SGD warm-up,
  hierarchical periods); Lin et al. 2020, "Don't Use Large Mini-Batches, Use Local SGD".
* :class:`EASGD` -- elastic averaging towards a centre (Zhang, Choromanska & LeCun 2015).
* :class:`Gossip` -- D-PSGD (Lian et al. 2017) and AD-PSGD (Lian et al. 2018) over a
  :class:`Topology`'s doubly stochastic mixing matrix.

Usage is the same for the three::

    local = dtrain.LocalSGD(model, period=8)       # or dtrain.EASGD(...), dtrain.Gossip(...)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in loader:
        opt.zero_grad(); loss_fn(local(x), y).backward(); opt.step()
        local.step()
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ReplicaWrapper": "dtrain.decentralized.replica",
    "LocalSGD": "dtrain.decentralized.local_sgd",
    "EASGD": "dtrain.decentralized.easgd",
    "Gossip": "dtrain.decentralized.gossip",
    "Topology": "dtrain.decentralized.topology",
    "topology": "dtrain.decentralized.topology",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dtrain.decentralized' has no attribute {name!r}")
