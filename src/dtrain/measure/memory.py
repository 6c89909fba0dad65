"""Memory as the process sees it: the peak resident set above a baseline, an instrument the measured code
does not control (or, on a GPU, ``torch.cuda.max_memory_allocated`` above its value at the baseline).

A wrapper's own count (``ShardedDataParallel.memory_stats``) lists the buffers it knows of; a buffer it
forgot, or a copy it did not mean to keep, is invisible to it and not to this. Usage::

    with ProcessMemory() as mem:      # the baseline: before the model is built
        model = build(); train_a_few_steps(model)
    mem.peak_bytes                    # the peak resident set during the block, minus the baseline

The peak is the kernel's high-water mark of the resident set (``VmHWM`` in ``/proc/self/status``), reset
at the baseline by writing 5 to ``/proc/self/clear_refs`` (Linux 4.0 and later), so a long-lived process
measures one block at a time; where the reset is refused, the peak is the process's since it started, and
:attr:`ProcessMemory.reset` says so.
"""

from __future__ import annotations

import gc
from pathlib import Path
from types import TracebackType

__all__ = ["ProcessMemory", "rss_bytes", "peak_rss_bytes", "reset_peak"]

STATUS = Path("/proc/self/status")


def _status_kib(field: str) -> int:
    for line in STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise OSError(f"{STATUS} has no {field}")


def rss_bytes() -> int:
    """This process's resident set now."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """The resident set's high-water mark since the process started or since :func:`reset_peak`."""
    return _status_kib("VmHWM") * 1024


def reset_peak() -> bool:
    """Set the high-water mark to the current resident set; False where the kernel refuses."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class ProcessMemory:
    """The peak memory of a block above the process's memory at its start (see the module docstring)."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self.baseline = 0
        self.peak = 0
        self.reset = False

    def _now(self) -> int:
        if self.device.startswith("cuda"):
            import torch

            return int(torch.cuda.memory_allocated())
        return rss_bytes()

    def __enter__(self) -> ProcessMemory:
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.reset = True
        else:
            gc.collect()  # garbage of earlier work freed now, not inside the block (where it would lower the RSS)
            self.reset = reset_peak()
        self.baseline = self._now()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()
            self.peak = int(torch.cuda.max_memory_allocated())
        else:
            self.peak = peak_rss_bytes()

    @property
    def peak_bytes(self) -> int:
        """The block's peak above the baseline."""
        return max(0, self.peak - self.baseline)
