"""``dtrain run --device``: data parallelism on the run's device, against one process on it.

On a machine with CUDA the ``cuda`` cases run too: 4 dp processes share the GPU over gloo (whose
collectives carry CUDA tensors through host memory, ``dtrain.comm.transport.TorchTransport``), with each
allreduce algorithm's path (ring: dtrain's own, on point-to-point; native: gloo's CUDA allreduce), and in
fp16 with loss scaling; torch's DDP on the same GPU too. Without CUDA the ``cpu`` cases check the same
things on the CPU, and tests/test_config.py checks the refusals of ``--device cuda``.

Checks: each step's mean loss over the ranks equals the one-process run's loss on the same global batch
(the same samples: the sampler's order with one replica cut into the ranks' shards); the summary and the
metrics say which device and backend trained.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import dtrain_cli, mean_losses, read_summary

pytestmark = pytest.mark.procs  # every test here starts processes

GPT = [
    "--model",
    "gpt-tiny",
    "--dataset",
    "pytext",
    "--seq-len",
    "16",
    "--batch-size",
    "8",
    "--eval-samples",
    "16",
    "--max-steps",
    "8",
    "--epochs",
    "1",
    "--optimizer",
    "adam",
    "--lr",
    "0.003",
    "--no-progress",
    "--no-trace",
    "--timeout-s",
    "120",
]
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def _run(tmp_path, name: str, *flags: str) -> dict[int, float]:
    out = tmp_path / name
    p = dtrain_cli("run", *GPT, *flags, "--out", str(out), timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return mean_losses(out)


@pytest.mark.parametrize("device", DEVICES)
def test_dp_on_the_device_takes_the_one_process_steps(tmp_path, device):
    workers = "4" if device == "cuda" else "2"
    one = _run(tmp_path, "one", "--device", device, "--workers", "1")
    assert len(one) == 8 and one[7] < one[0]  # it learns
    for alg in ("ring", "native"):
        many = _run(tmp_path, alg, "--device", device, "--workers", workers, "--algorithm", alg)
        assert set(many) == set(one)
        for step, loss in one.items():
            assert abs(many[step] - loss) < 2e-4 * max(1.0, loss), (alg, step, many[step], loss)
        s = read_summary(tmp_path / alg)
        assert s["device"] == device and s["backend"] == "gloo", s


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_dp_and_ddp_on_the_device_learn(tmp_path, device):
    workers = "4" if device == "cuda" else "2"
    for strategy in ("dp", "ddp"):
        losses = _run(
            tmp_path, strategy, "--device", device, "--workers", workers, "--strategy", strategy, "--precision", "fp16"
        )
        s = read_summary(tmp_path / strategy)
        assert s["precision"] == "fp16" and s["device"] == device, s
        assert losses[7] < losses[0] and s["overflow_steps"] <= 2, (strategy, losses, s["overflow_steps"])
