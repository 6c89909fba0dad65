"""What one compressed collective sends and costs in CPU, counted by running it on threads.

:mod:`dtrain.perfmodel.collectives` charges small worlds' compressed allreduces these
counts; :mod:`dtrain.perfmodel.compression` re-exports :func:`compressed_traffic`. Threads
in this process, no process is started.
"""

from __future__ import annotations

import statistics
from functools import lru_cache

import torch

__all__ = ["compressed_traffic"]


# runs whose median CPU time counts: a single run after the warm-up took 7.5 ms of a rank's CPU for
# powersgd:2 on 4 ranks x 37.6K floats where the next four took 2.7-3.3
_TRAFFIC_RUNS = 5


@lru_cache(maxsize=256)
def compressed_traffic(spec: str, world: int, numel: int) -> tuple[int, int, float]:
    """(messages, bytes, CPU seconds) of the busiest rank in one ``compressed_allreduce`` of ``numel`` floats.

    Counted, not modelled: the collective runs once over the in-process thread
    transport (:func:`dtrain.comm.transport.run_threads`) and the transport's
    counters are read, so the count is the implementation's own (headers, size
    exchanges and all); the CPU time is each rank thread's own
    (``time.thread_time``: encoding, merging, decoding, bookkeeping; no waiting),
    on one intra-op thread, the median of five runs; the busiest rank's, and the median of three such
    probes (six single probes of topk:0.01 on 4 ranks x 38K floats read 1.7-2.6 ms; six medians of
    three, minutes later, 2.3-2.7). Only for small worlds (``world <= 16``); callers use closed forms beyond.
    Cached per process: :func:`dtrain.bench.calibrate.refresh_load` clears it, as the CPU time
    moves with the machine's load.
    """
    import time

    from dtrain.comm.transport import Transport, run_threads
    from dtrain.compress import from_spec
    from dtrain.compress.reduce import compressed_allreduce

    if world < 2 or numel < 1:
        return 0, 0, 0.0
    if world > 16:
        raise ValueError("compressed_traffic counts worlds of up to 16 ranks")

    def one(t: Transport) -> tuple[int, int, float]:
        g = torch.Generator().manual_seed(t.rank)
        x = torch.randn(numel, generator=g)
        comp = from_spec(spec)
        compressed_allreduce(x.clone(), comp, "warm", t, algorithm="ring")
        before = t.stats.snapshot()
        cpus = []
        for i in range(_TRAFFIC_RUNS):
            c0 = time.thread_time()
            compressed_allreduce(x.clone(), comp, f"probe{i}", t, algorithm="ring")
            cpus.append(time.thread_time() - c0)
        d = t.stats - before
        return int(d.messages) // _TRAFFIC_RUNS, int(d.bytes_sent) // _TRAFFIC_RUNS, statistics.median(cpus)

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        probes = [run_threads(world, one, timeout=60.0) for _ in range(3)]
    finally:
        torch.set_num_threads(old)
    res = probes[0]
    cpu = statistics.median(max(c for _, _, c in r) for r in probes)
    return max(m for m, _, _ in res), max(b for _, b, _ in res), cpu
