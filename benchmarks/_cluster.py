"""Run one ``dtrain run`` on an emulated cluster and read its step times: what the cluster benchmarks share."""

from __future__ import annotations

import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any


def run_rows(cfg: Any, cluster: str) -> list[dict[str, Any]]:
    """The metrics rows (every rank) of one ``dtrain run`` of ``cfg`` on the emulated ``cluster``."""
    from dtrain.cluster import launch_on_cluster
    from dtrain.job.run import worker_main
    from dtrain.rundir.files import read_metrics
    from dtrain.trace import merge_rank_files

    with tempfile.TemporaryDirectory() as d:
        out = Path(d)
        cfg = cfg.replace(out=str(out))
        try:
            launch_on_cluster(
                worker_main,
                (cfg.to_dict(), str(out)),
                nprocs=cfg.num_processes,
                cluster=cluster,
                stream_first=False,
                timeout_s=900,
            )
        except Exception:  # keep the failed run's folder (error files, metrics) for a look
            kept = Path(tempfile.mkdtemp(prefix="dtrain-failed-run-"))
            shutil.copytree(out, kept, dirs_exist_ok=True)
            print(f"the failed run's folder is kept in {kept}", flush=True)
            raise
        merge_rank_files(out)
        return read_metrics(out)


def measure(cfg: Any, cluster: str, warmup: int) -> tuple[list[float], float]:
    """Step times (seconds, after warm-up, every worker) and mean bytes per step of one run on the cluster
    (rows of strategies whose rows speak for the global batch: dp, tensor, hybrid)."""
    rows = [r for r in run_rows(cfg, cluster) if r["step"] >= warmup and r.get("samples_per_s")]
    times = [cfg.batch_size / r["samples_per_s"] for r in rows]
    return times, statistics.mean(float(r["bytes_sent"]) for r in rows)
