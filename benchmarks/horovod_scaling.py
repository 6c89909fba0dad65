"""Simulate the Horovod paper's scaling experiment and print it next to the reported figures.

Sergeev & Del Balso, "Horovod: fast and easy distributed deep learning in
TensorFlow" (arXiv 1802.05799): 128 Pascal GPUs, 4 per server, 25 Gbit/s
RoCE-capable network; ResNet-101 scaled at ~90% efficiency, VGG-16 at 68% over
TCP and up to ~79% with RDMA. The cluster descriptions, and every input the paper
does not give, are in ``benchmarks/clusters/horovod_{tcp,rdma}.toml``; the models
(built on the meta device, FLOPs and parameters only) in ``horovod_models.py``.

Run::

    python benchmarks/horovod_scaling.py [--png horovod_scaling.png]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import horovod_models  # noqa: E402

from dtrain.perfmodel import load_cluster, profile_model, scaling_curve  # noqa: E402
from dtrain.strategies import choice  # noqa: E402

REPORTED = {  # (model, network) -> scaling efficiency at 128 GPUs reported by the paper
    ("resnet101", "tcp"): 0.90,
    ("vgg16", "tcp"): 0.68,
    ("resnet101", "rdma"): 0.90,
    ("vgg16", "rdma"): 0.79,
}
WORKERS = [4, 8, 16, 32, 64, 128]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--png", default="", help="write the scaling curves here")
    ns = ap.parse_args()
    import torch

    print(f"torch {torch.__version__}; simulator: dtrain.perfmodel.simulate, 20 steps, no stragglers")
    print(f"{'model':<10}{'network':<8}{'GPUs':>5}{'simulated':>11}{'reported':>10}{'diff (points)':>15}")
    curves = {}
    worst = 0.0
    for (model_name, net), reported in REPORTED.items():
        cluster = load_cluster(HERE / "clusters" / f"horovod_{net}.toml")
        model, sample = getattr(horovod_models, model_name)()
        prof = profile_model(model, sample, name=model_name, measure=False)
        s = choice("dp", 1, "native", bucket_mb=64.0)  # NCCL ring, 64 MiB tensor fusion
        rows = scaling_curve(lambda n, prof=prof: prof, cluster, s, WORKERS, steps=20)
        curves[(model_name, net)] = rows
        for r in rows[:-1]:
            print(f"{model_name:<10}{net:<8}{r.workers:>5}{r.efficiency:>10.1%}")
        eff = rows[-1].efficiency
        diff = 100 * (eff - reported)
        worst = max(worst, abs(diff))
        print(f"{model_name:<10}{net:<8}{128:>5}{eff:>10.1%}{reported:>10.0%}{diff:>+15.1f}")
    print(f"largest difference from the paper: {worst:.1f} points (acceptance: within 10)")
    if ns.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for (m, net), rows in curves.items():
            ax.plot([r.workers for r in rows], [100 * r.efficiency for r in rows], marker="o", label=f"{m} {net}")
            ax.scatter([128], [100 * REPORTED[(m, net)]], marker="x", s=60, color="k")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("scaling efficiency % (x: paper)")
        ax.set_ylim(0, 105)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(ns.png, dpi=110)
        print(f"wrote {ns.png}")
    return 0 if worst <= 10 else 1


if __name__ == "__main__":
    sys.exit(main())
