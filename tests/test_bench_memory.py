"""The process-memory instrument: the peak resident set above a baseline sees what a wrapper's own count
cannot (a buffer it was not told of), and nothing where nothing was allocated."""

from __future__ import annotations

import pytest
import torch
from _dist import run_distributed
from torch import nn

from dtrain.measure.memory import ProcessMemory, peak_rss_bytes, rss_bytes

MB = 1 << 20


def test_the_probe_sees_a_block_allocate_and_not_what_came_before() -> None:
    before = torch.ones(30 * MB // 4)  # held before the baseline: not the block's
    with ProcessMemory() as idle:
        pass  # an empty block: its peak above the baseline must be about nothing
    with ProcessMemory() as busy:
        x = torch.ones(100 * MB // 4)  # 100 MB, written (resident)
        del x
    assert idle.reset and busy.reset, "the kernel refused to reset the high-water mark"
    assert idle.peak_bytes < 10 * MB, idle.peak_bytes
    assert 95 * MB <= busy.peak_bytes <= 130 * MB, busy.peak_bytes
    assert peak_rss_bytes() >= rss_bytes() > before.numel()


def test_garbage_of_earlier_work_is_freed_before_the_baseline_not_inside_the_block() -> None:
    """A 200 MB tensor held only by a reference cycle is garbage at the block's start; had the collector freed it
    inside the block, the resident set would drop below the baseline and the block's 100 MB would not show."""
    import gc

    class Cycle:
        def __init__(self) -> None:
            self.me, self.t = self, torch.ones(200 * MB // 4)

    gc.disable()
    try:
        Cycle()  # unreachable now; only the cyclic collector frees it
        with ProcessMemory() as busy:
            gc.collect()  # a collection inside the block, as any allocation may trigger
            x = torch.ones(100 * MB // 4)
            del x
    finally:
        gc.enable()
    assert 95 * MB <= busy.peak_bytes <= 130 * MB, busy.peak_bytes


def _sharded_steps(rank: int, world: int, leak: bool) -> dict[str, int]:
    """Two Adam steps of ZeRO-3 on a small MLP inside the probe; with ``leak``, the wrapper's module also
    keeps a 100 MB buffer that its count does not list."""
    from dtrain.sharded import ShardedDataParallel

    with ProcessMemory() as mem:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))
        dp = ShardedDataParallel(net, shard="parameters")
        opt = torch.optim.Adam(dp.parameters(), lr=1e-3)
        if leak:
            dp.module.leaked = torch.ones(100 * MB // 4)  # type: ignore[assignment]
        for _ in range(2):
            opt.zero_grad()
            dp(torch.randn(8, 512)).square().mean().backward()
            opt.step()
        counted = sum(dp.memory_stats(opt).values())
    dp.close()
    return {"process": mem.peak_bytes, "wrapper": counted}


@pytest.mark.procs
def test_the_probe_sees_a_leak_that_the_wrappers_count_does_not() -> None:
    # each variant in fresh processes: memory freed in one block stays resident and is reused by the next
    clean = run_distributed(_sharded_steps, 2, False, timeout=90)
    leaky = run_distributed(_sharded_steps, 2, True, timeout=90)
    for c, k in zip(clean, leaky):
        assert k["wrapper"] == c["wrapper"], (c, k)  # the wrapper cannot see it
        assert k["process"] - c["process"] >= 90 * MB, (c, k)  # the process does
