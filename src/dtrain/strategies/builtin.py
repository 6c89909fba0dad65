"""The built-in strategies: importing this module registers them (in this order)."""

from dtrain.strategies import dp, ps, auto  # noqa: I001 - registration order: dp, ddp, ps, auto

__all__ = ["dp", "ps", "auto"]
