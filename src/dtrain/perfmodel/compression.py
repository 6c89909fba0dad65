"""Compressor costs for the model, taken from the compressors themselves.

:func:`compression_model` builds the compressor from its spec through
:func:`dtrain.compress.from_spec` (so every name of the registry is known here),
reads which collective :func:`dtrain.compress.compressed_allreduce` will use for
it, measures its payload on a gradient-like tensor (ratio = payload bytes /
dense bytes) and, unless told not to, times ``compress`` + ``decompress`` per
byte. A cluster TOML may carry measured values under ``[compressors."SPEC"]``;
those win (they were measured on the cluster's own devices).

:func:`compressed_traffic` (what one compressed collective sends, counted by running it on
threads) lives in :mod:`dtrain.perfmodel._traffic`, where :mod:`dtrain.perfmodel.collectives`
takes it from too; it is re-exported here, with :func:`recount_traffic` (count once more).
"""

from __future__ import annotations

import statistics
import time
from functools import lru_cache

import torch

from dtrain.perfmodel._traffic import compressed_traffic, recount_traffic
from dtrain.perfmodel.collectives import CompressionModel
from dtrain.perfmodel.spec import ClusterSpec

__all__ = ["compression_model", "compressor_kind", "measure_compressor", "compressed_traffic", "recount_traffic"]


def compressor_kind(spec: str) -> str:
    """ "dense", "summable", "lowrank", "sparse" or "quantizer": which collective the bucket goes through."""
    if spec in ("", "none"):
        return "dense"
    from dtrain.compress import from_spec

    collective = from_spec(spec).collective  # the compressor declares it
    return "quantizer" if collective == "gathered" else collective


@lru_cache(maxsize=64)
def measure_compressor(
    spec: str, numel: int = 1 << 18, repeats: int = 5, threads: int = 1
) -> tuple[float, float, float]:
    """(payload ratio, encode seconds per dense byte, decode seconds per dense byte) of ``spec``.

    The probe is a ``(rows, cols)`` matrix of ``numel`` normal values (matrices let
    PowerSGD compress); timing is the median of ``repeats`` runs with ``threads``
    intra-op threads.
    """
    from dtrain.compress import from_spec

    comp = from_spec(spec)
    cols = 256
    rows = max(1, numel // cols)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cols, generator=g)
    dense = x.numel() * x.element_size()
    ratio = comp.payload_nbytes(x, key="probe") / dense
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        enc, dec = [], []
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            payload, ctx = comp.compress(x, key="probe")
            t1 = time.perf_counter()
            comp.decompress(payload, ctx)
            t2 = time.perf_counter()
            if r:
                enc.append(t1 - t0)
                dec.append(t2 - t1)
    finally:
        torch.set_num_threads(old)
    return ratio, statistics.median(enc) / dense, statistics.median(dec) / dense


def compression_model(spec: str, cluster: ClusterSpec | None = None, *, measure: bool = True) -> CompressionModel:
    """The :class:`~dtrain.perfmodel.collectives.CompressionModel` of a compressor spec.

    Args:
        spec: a spec ``dtrain.compress.from_spec`` accepts ("none", "fp16", "topk:0.01", ...).
        cluster: its ``[compressors]`` table, if it has the spec, gives ratio and times.
        measure: time encode/decode here when the cluster does not know them
            (False: ratio only, zero coding time).
    """
    kind = compressor_kind(spec)
    if kind == "dense":
        return CompressionModel()
    if cluster is not None and spec in cluster.compressors:
        cc = cluster.compressors[spec]
        scale = cluster.device.compute_scale
        return CompressionModel(
            spec, kind, cc.ratio, cc.encode_s_per_byte * scale, cc.decode_s_per_byte * scale, cc.cpu_ratio
        )
    if measure:
        ratio, enc, dec = measure_compressor(spec)
    else:
        ratio, enc, dec = measure_compressor(spec, numel=1 << 16, repeats=1)[0], 0.0, 0.0
    scale = cluster.device.compute_scale if cluster is not None else 1.0
    return CompressionModel(spec, kind, ratio, enc * scale, dec * scale)
