"""The built-in strategies: importing this module registers them (in this order)."""

from dtrain.strategies import dp, ps, decentralized, pipeline, hybrid, auto  # noqa: I001 - registration order: dp, ddp, ps, then local_sgd, easgd, gossip, pipeline, tensor, hybrid, auto

__all__ = ["dp", "ps", "decentralized", "pipeline", "hybrid", "auto"]
