"""Derived tensor-parallel plans on real gloo processes against one process training the same transformers model.

transformers GPT-2 (Conv1D projections, fused q/k/v, its head tied to its embedding) and Llama (grouped-query
attention, 4 heads and 2 key/value heads) are built from a config with random weights, the same on every rank;
``derive_plan`` + ``parallelize`` split them over 2 ranks, and each of 3 SGD steps' losses (the vocabulary-parallel
cross entropy) must equal the unsplit model's, and so must the gathered parameters after the steps -- without and
with sequence parallelism; without it, one backward sends Megatron's count of allreduces (one an attention, one an
MLP, one the head), however many projections read the block's input. GPT-2 plain and Llama without and with
sequence parallelism run in the default suite; GPT-2 with sequence parallelism, Qwen2 (q/k/v biases) and GPT-NeoX (a
fused q/k/v interleaved per head, with sequence parallelism) under ``slow``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _dist import guard as _guard
from _dist import run_distributed
from _dist import scenario_result as _ok
from _helpers import max_diff
from torch import nn

pytest.importorskip("transformers")
pytestmark = pytest.mark.procs

STEPS = 3
TOL = 1e-5  # the tolerance of tests/test_tensor_parallel_dist.py's oracles
VOCAB = 257

CONFIGS: dict[str, dict[str, Any]] = {
    "gpt2": dict(n_layer=2, n_embd=64, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "llama": dict(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    ),
}
CONFIGS["qwen2"] = CONFIGS["llama"]  # q/k/v with a bias
CONFIGS["gpt_neox"] = {**CONFIGS["llama"], "num_key_value_heads": 4}  # fused query_key_value, interleaved per head


def build(kind: str) -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(5)
    config = transformers.AutoConfig.for_model(kind, vocab_size=VOCAB, **CONFIGS[kind])
    config.use_cache = False
    model: nn.Module = transformers.AutoModelForCausalLM.from_config(config)
    return model


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(9)
    out = []
    for _ in range(STEPS):
        t = torch.randint(0, VOCAB, (4, 9), generator=g)
        out.append((t[:, :-1], t[:, 1:]))
    return out


def _scenario(kind: str, sp: bool) -> dict[str, Any]:
    import dtrain.tensor_parallel as tp
    from dtrain.workloads.models import logits_of

    batches = _batches()
    ref = build(kind)
    ro = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_losses = []
    for x, y in batches:
        ro.zero_grad()
        loss = F.cross_entropy(logits_of(ref(x)).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        ro.step()
        ref_losses.append(float(loss.detach()))
    model = build(kind)
    plan = tp.derive_plan(model, 2, sequence_parallel=sp)
    tp.parallelize(model, plan, sequence_parallel=sp)
    head = [m for m in model.modules() if isinstance(m, tp.VocabParallelHead)][-1]
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, backward_bytes = [], 0
    for x, y in batches:
        opt.zero_grad()
        loss = tp.vocab_parallel_cross_entropy(logits_of(model(x)), y, head)
        sent = head.g.bytes_sent()
        loss.backward()
        backward_bytes = head.g.bytes_sent() - sent
        tp.sync_replicated_grads(model)
        opt.step()
        losses.append(float(loss.detach()))
    full, want = tp.full_state_dict(model), ref.state_dict()
    return {
        "keys": sorted(full) == sorted(want),
        "diff": max_diff([full[k] for k in want], list(want.values())),
        "losses": losses,
        "ref_losses": ref_losses,
        "backward_bytes": backward_bytes,
        "hidden": [x.numel() * int(ref.config.hidden_size) for x, _ in batches[-1:]][0],
        "layers": int(ref.config.num_hidden_layers),
        "local": sum(p.numel() for p in model.parameters()),
        "whole": sum(p.numel() for p in ref.parameters()),
    }


def _world(rank: int, world: int, cases: list[tuple[str, bool]]) -> Any:
    return {f"{kind}-{sp}": _guard(lambda: _scenario(kind, sp)) for kind, sp in cases}


QUICK = [("gpt2", False), ("llama", False), ("llama", True)]  # one world: transformers imported once per rank
SLOW = [("gpt2", True), ("qwen2", False), ("gpt_neox", True)]


@pytest.fixture(scope="module")
def quick() -> list[dict[str, Any]]:
    return run_distributed(_world, 2, QUICK, timeout=240)


@pytest.fixture(scope="module")
def slow() -> list[dict[str, Any]]:
    return run_distributed(_world, 2, SLOW, timeout=240)


def _check(res: list[dict[str, Any]], kind: str, sp: bool) -> None:
    for rank, r in enumerate(res):
        v = _ok(r[f"{kind}-{sp}"])
        assert v["keys"], rank
        for step, (got, want) in enumerate(zip(v["losses"], v["ref_losses"])):
            assert got == pytest.approx(want, rel=TOL), (kind, sp, rank, step, v["losses"], v["ref_losses"])
        assert v["diff"] < TOL, f"{kind} rank {rank}: parameters differ by {v['diff']:.3g}"
        assert v["local"] < 0.75 * v["whole"], v  # the projections, the embedding and the head are split
        if not sp:  # Megatron's count: the input's gradient allreduced once an attention, once an MLP, once the
            # head -- q, k and v (gate and up) reading one tensor share one allreduce; a ring at 2 sends n floats
            want = (2 * v["layers"] + 1) * 4 * v["hidden"]
            assert v["backward_bytes"] == want, (kind, rank, v["backward_bytes"], want)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind, sp", QUICK, ids=["gpt2", "llama", "llama-sequence_parallel"])
def test_derived_plan_trains_a_transformers_model_as_one_process(quick: Any, kind: str, sp: bool) -> None:
    _check(quick, kind, sp)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind, sp", SLOW, ids=["gpt2-sequence_parallel", "qwen2", "gpt_neox-sp"])
def test_derived_plan_trains_as_one_process_slow_cases(slow: Any, kind: str, sp: bool) -> None:
    _check(slow, kind, sp)
