"""What one compressed collective sends and costs in CPU, counted by running it on threads.

:mod:`dtrain.perfmodel.collectives` charges small worlds' compressed allreduces these
counts; :mod:`dtrain.perfmodel.compression` re-exports :func:`compressed_traffic`. Threads
in this process, no process is started.
"""

from __future__ import annotations

import math
import statistics

import torch

from dtrain.perfmodel import memo

__all__ = ["compressed_traffic", "recount_traffic"]


# runs whose median CPU time counts: a single run after the warm-up took 7.5 ms of a rank's CPU for
# powersgd:2 on 4 ranks x 37.6K floats where the next four took 2.7-3.3
_TRAFFIC_RUNS = 5

_KEPT_COUNTS = 9  # the counts of one collective kept on disk between processes (the latest)
_Count = tuple[int, int, float]
Shapes = tuple[tuple[int, ...], ...]
_Key = tuple[str, int, int, Shapes]
_counts: dict[_Key, list[_Count]] = {}  # every count of this process, per collective
_current: set[_Key] = set()  # the collectives counted since the last recount_traffic()


def recount_traffic() -> None:
    """Count every compressed collective once more when it is next asked for.

    The CPU time :func:`compressed_traffic` returns is then the median over all
    of this process's counts, this one included: the CPU a count reads moves
    with the machine's load (:func:`dtrain.planning.calibrate.refresh_load` calls
    this each time it re-measures the load). Pooling the counts keeps one
    moment's load from moving every prediction: a count forgotten and redone
    each time would carry that moment's load alone.
    """
    _current.clear()


def compressed_traffic(spec: str, world: int, numel: int, shapes: Shapes = ()) -> tuple[int, int, float]:
    """(messages, bytes, CPU seconds) of the busiest rank in one ``compressed_allreduce`` of ``numel`` floats.

    ``shapes``: the bucket's parameter shapes, as the data-parallel reducer passes them (PowerSGD then
    factors each weight matrix and sends the vectors dense: for the CNN's 38,282 floats on 4 ranks
    10,944 bytes a rank where the bucket as one flat matrix sends 4,704); empty, or not adding up to
    ``numel``: one flat bucket.

    Counted, not modelled: the collective runs once over the in-process thread
    transport (:func:`dtrain.comm.transport.run_threads`) and the transport's
    counters are read, so the count is the implementation's own (headers, size
    exchanges and all); the CPU time is each rank thread's own
    (``time.thread_time``: encoding, merging, decoding, bookkeeping; no waiting),
    on one intra-op thread, the median of five runs; the busiest rank's, and the median of three such
    probes (six single probes of topk:0.01 on 4 ranks x 38K floats read 1.7-2.6 ms; six medians of
    three, minutes later, 2.3-2.7). Only for small worlds (``world <= 16``); callers use closed forms beyond.
    Counted once per process and collective, and once more after each :func:`recount_traffic`; the CPU
    time is the median of those counts. Inside :func:`dtrain.perfmodel.memo.kept_in` (the planner) the
    counts are kept on disk, and a later process starts from them instead of counting.
    """
    if world < 2 or numel < 1:
        return 0, 0, 0.0
    if world > 16:
        raise ValueError("compressed_traffic counts worlds of up to 16 ranks")
    if sum(math.prod(sh) for sh in shapes) != numel:
        shapes = ()
    key = (spec, world, numel, shapes)
    if key not in _current:
        on_disk = memo.digest([*key, torch.__version__])
        kept = memo.recall("traffic", on_disk) if key not in _counts else None
        if kept:  # counted by an earlier plan on this machine (inside memo.kept_in only)
            _counts[key] = [(int(m), int(b), float(c)) for m, b, c in kept]
        else:
            _counts.setdefault(key, []).append(_count(spec, world, numel, shapes))
            memo.remember("traffic", on_disk, _counts[key][-_KEPT_COUNTS:])
        _current.add(key)
    msgs, sent, _ = _counts[key][-1]
    return msgs, sent, float(statistics.median(c for _, _, c in _counts[key]))


def _count(spec: str, world: int, numel: int, shapes: Shapes = ()) -> _Count:
    """One count of :func:`compressed_traffic`: the collective run on ``world`` threads."""
    import time

    from dtrain.comm.transport import Transport, run_threads
    from dtrain.compress import from_spec
    from dtrain.compress.reduce import compressed_allreduce

    def one(t: Transport) -> tuple[int, int, float]:
        g = torch.Generator().manual_seed(t.rank)
        x = torch.randn(numel, generator=g)
        comp, layout = from_spec(spec), [list(sh) for sh in shapes] or None
        compressed_allreduce(x.clone(), comp, "warm", t, algorithm="ring", shapes=layout)
        before = t.stats.snapshot()
        cpus = []
        for i in range(_TRAFFIC_RUNS):
            c0 = time.thread_time()
            compressed_allreduce(x.clone(), comp, f"probe{i}", t, algorithm="ring", shapes=layout)
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
