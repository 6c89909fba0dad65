"""The names of :mod:`dtrain.strategies.dp_adapter` under this module's path, which older scripts import."""

from dtrain.strategies.dp_adapter import DataParallelAdapter, measure_noise

DataParallelEngine = DataParallelAdapter

__all__ = ["DataParallelAdapter", "DataParallelEngine", "measure_noise"]
