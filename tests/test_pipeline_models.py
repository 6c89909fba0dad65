"""A pipeline of models dtrain did not write: transformers GPT-2 (its head tied to its embedding) and Llama
(rotary embeddings, grouped-query attention: 4 heads, 2 key-value heads), built from a config with random
weights, cut between their blocks (``dtrain.Pipeline(model, ..., sample=...)``).

Real processes over gloo: each spawn runs its scenarios one after the other; every rank returns its losses,
the parameters it shares with another rank and its per-stage parameter counts. Each step's loss equals a
one-process run of the same model on the same batch (the tolerance of tests/test_pipeline_dist.py's
oracles), and after 3 steps the copies of GPT-2's tied weight on the first and the last stage are equal, bit
for bit, and equal to the one-process model's. Schedules: 1f1b and interleaved (2 chunks) at 2 ranks, gpipe
at 3, 2bw at 2; activation recomputation on one case, split points on one. Three cases run in the default suite, the
rest under ``-m slow``, as do ``dtrain run --strategy pipeline --model hf:llama`` learning and a clipped GPT-2
pipeline (the global norm counts the tied weight once) against one process, and a GPT-2 pipeline resumed
from its checkpoint step for step.

Bad input (in-process, ranks as threads; and through ``dtrain run``, exit code 2): fewer blocks than
stages, a split point that names no block, a model with no list of repeated blocks, a module that runs
between the blocks, a module that is not an ``nn.Sequential`` without a sample.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import guard as _guard
from _dist import run_distributed
from _dist import scenario_result as _ok
from _helpers import dtrain_cli, dtrain_runs, mean_losses, read_metrics
from _user_files import GPT2, LLAMA
from torch import nn

from dtrain.comm.transport import Transport, run_threads
from dtrain.pipeline import Pipeline, PipelineError
from dtrain.workloads.models import task_loss

pytestmark = pytest.mark.procs  # the distributed and command-line tests start processes

STEPS, BATCH, SEQ, VOCAB, LR = 3, 8, 16, 257, 0.1
REL = 1e-5  # tests/test_pipeline_dist.py's oracles: float32 sums in another order


def _model(kind: str, layers: int) -> nn.Module:
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    torch.manual_seed(3)
    if kind == "gpt2":
        cfg = AutoConfig.for_model(
            "gpt2",
            n_layer=layers,
            n_embd=64,
            n_head=4,
            vocab_size=VOCAB,
            n_positions=32,
            use_cache=False,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    else:
        cfg = AutoConfig.for_model(
            "llama",
            num_hidden_layers=layers,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=32,
            use_cache=False,
        )
    return AutoModelForCausalLM.from_config(cfg)  # type: ignore[no-any-return]


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        t = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return out


def _reference(kind: str, layers: int, twobw: bool = False) -> tuple[list[float], torch.Tensor]:
    """One process, the whole batch: each step's loss, and the embedding's weight after the steps. ``twobw``:
    PipeDream-2BW's rule, ``W(t+1) = W(t) - lr * grad(W(t-1))`` with batch t-1's gradient (the first step
    updates nothing), each step's loss that of its batch on ``W(t)``."""
    model = _model(kind, layers)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    data = _batches()
    params = dict(model.named_parameters())
    prev: dict[str, torch.Tensor] | None = None
    for k, (x, y) in enumerate(data):
        opt.zero_grad()
        if not twobw:
            loss = task_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            continue
        with torch.no_grad():
            losses.append(float(task_loss(model(x), y)))
        cur = {n: p.detach().clone() for n, p in params.items()}
        if prev is not None:  # batch k-1's gradient on the weights its forward used
            old = {n: w.requires_grad_() for n, w in prev.items()}
            out = torch.func.functional_call(model, old, (data[k - 1][0],))
            grads = torch.autograd.grad(task_loss(out, data[k - 1][1]), list(old.values()))
            with torch.no_grad():
                for p, g in zip(params.values(), grads):
                    p -= LR * g
        prev = cur
    return losses, model.get_input_embeddings().weight.detach().clone()


# a scenario: (model, layers, schedule, recompute, split points)
Scenario = tuple[str, int, str, str, tuple[str, ...]]


def _run(kind: str, layers: int, schedule: str, recompute: str, points: tuple[str, ...]) -> dict[str, Any]:
    data = _batches()
    pipe = Pipeline(
        _model(kind, layers),
        microbatches=4,
        schedule=schedule,
        chunks=2,
        checkpoint=recompute,
        sample=data[0][0][:2],
        split_points=points,
        timeout=60,
    )
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    losses = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        losses.append(pipe.step(x, y))
        opt.step()
    return {
        "losses": losses,
        "shared": [p.detach().tolist() for p, _ in pipe.shared_parameters()],  # plain numbers across the queue
        "stage_params": pipe.stage_params,
        "sizes": pipe.sizes,
        "held": sum(p.numel() for p in pipe.parameters()),
    }


def _ranks(rank: int, world: int, scenarios: list[Scenario]) -> list[Any]:
    return [_guard(lambda s=s: _run(*s)) for s in scenarios]


def _check(world: int, scenarios: list[Scenario]) -> None:
    pytest.importorskip("transformers")
    results = run_distributed(_ranks, world, scenarios, timeout=300)
    for i, (kind, layers, schedule, _, points) in enumerate(scenarios):
        want, embedding = _reference(kind, layers, twobw=schedule == "2bw")
        rows = [_ok(results[r][i]) for r in range(world)]
        for r, row in enumerate(rows):
            assert row["losses"] == pytest.approx(want, rel=REL), (scenarios[i], r, row["losses"], want)
        whole = sum(p.numel() for p in _model(kind, layers).parameters())
        assert all(row["held"] < whole for row in rows), [row["held"] for row in rows]  # each holds a part
        stages = rows[0]["stage_params"]
        assert len(stages) == len(rows[0]["sizes"]) and sum(rows[0]["sizes"]) == layers
        if kind == "gpt2":  # the tied weight: on the first and the last stage's ranks, the same after 3 steps
            copies = [row["shared"] for row in rows if row["shared"]]
            assert len(copies) == 2, [len(c) for c in copies]  # the first and the last stage are on two ranks
            first, last = torch.tensor(copies[0][0]), torch.tensor(copies[-1][0])
            assert torch.equal(first, last)
            assert torch.allclose(first, embedding, rtol=0, atol=1e-5), float((first - embedding).abs().max())
        else:
            assert not any(row["shared"] for row in rows)  # Llama's head is its own weight
        if points:
            assert rows[0]["sizes"] == [1, 2], rows[0]["sizes"]


def test_two_stages_of_gpt2_and_llama_train_as_one_process() -> None:
    _check(
        2,
        [("gpt2", 2, "1f1b", "never", ()), ("llama", 2, "1f1b", "never", ()), ("llama", 4, "interleaved", "never", ())],
    )


@pytest.mark.slow
def test_interleaved_gpt2_recompute_and_split_points_train_as_one_process() -> None:
    _check(
        2,
        [
            ("gpt2", 4, "interleaved", "never", ()),
            ("llama", 2, "1f1b", "always", ()),
            ("gpt2", 3, "1f1b", "except_last", ("transformer.h.1",)),
        ],
    )


@pytest.mark.slow
def test_three_stages_under_gpipe_train_as_one_process() -> None:
    _check(3, [("gpt2", 3, "gpipe", "never", ()), ("llama", 3, "gpipe", "never", ())])


@pytest.mark.slow
def test_gpt2_and_llama_under_2bw_follow_its_rule() -> None:
    _check(2, [("gpt2", 2, "2bw", "never", ()), ("llama", 2, "2bw", "never", ())])


# ---------------------------------------------------------------------------------------------- bad input


def _refused(build: Any, world: int, match: str, **kw: Any) -> None:
    """Every rank raises before any message (threads: a collective would time out instead); each rank cuts its
    own model, as each process does."""
    sample = torch.randint(0, VOCAB, (2, SEQ))
    models = [build() for _ in range(world)]

    def rank(t: Transport) -> None:
        Pipeline(models[t.rank], microbatches=2, transport=t, sample=sample, **kw)

    with pytest.raises(PipelineError, match=match):
        run_threads(world, rank, timeout=5)


def test_fewer_blocks_than_stages_is_refused() -> None:
    pytest.importorskip("transformers")
    _refused(lambda: _model("gpt2", 2), 3, r"GPT2LMHeadModel has 2 blocks in transformer.h, fewer than the 3 stages")


def test_a_split_point_that_names_no_block_is_refused() -> None:
    pytest.importorskip("transformers")
    msg = r"split point 'model.layers.7' names no block of model.layers of LlamaForCausalLM \(its 2 blocks"
    _refused(lambda: _model("llama", 2), 2, msg, split_points=["model.layers.7"])


class _Flat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.a, self.b = nn.Embedding(VOCAB, 8), nn.Linear(8, 8), nn.Linear(8, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(self.emb(x))))  # type: ignore[no-any-return]


class _Between(nn.Module):
    """Blocks with a norm between the first two: no cut can place it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.mid, self.head = nn.LayerNorm(8), nn.Linear(8, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks[0](self.emb(x))
        h = self.mid(h)
        for block in self.blocks[1:]:
            h = block(h)
        return self.head(h)  # type: ignore[no-any-return]


def test_a_model_without_a_list_of_repeated_blocks_is_refused() -> None:
    _refused(_Flat, 2, r"model _Flat has no list of repeated blocks")


def test_a_module_between_the_blocks_is_refused() -> None:
    _refused(_Between, 2, r"module mid \(LayerNorm, 16 parameters\) runs between the blocks of blocks")


def test_a_module_that_is_not_sequential_needs_a_sample() -> None:
    with pytest.raises(PipelineError, match=r"a pipeline of a _Flat \(not an nn.Sequential\) needs sample="):
        Pipeline(_Flat(), microbatches=2, transport=run_threads(1, lambda t: t)[0])


# ---------------------------------------------------------------------------------------------- the command

TEXT = ["--dataset", "pytext", "--seq-len", "16", "--epochs", "1", "--no-progress", "--no-trace"]


@pytest.mark.slow
def test_dtrain_run_refuses_more_stages_than_blocks_before_starting(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    p = dtrain_cli(
        "run", "--strategy", "pipeline", "--workers", "3", *LLAMA, *TEXT, "--out", str(tmp_path / "r"), timeout=120
    )
    assert p.returncode == 2, p.stdout + p.stderr
    assert "pipeline: model.layers of model hf:llama (LlamaForCausalLM, blocks LlamaDecoderLayer): 2 to cut " in (
        p.stderr
    )
    assert "fewer than the 3 stages" in p.stderr and not (tmp_path / "r" / "metrics.jsonl").exists()


FLAT_FILE = """
from torch import nn


class Flat(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Flatten(), nn.Linear(64, 10)

    def forward(self, x):
        return self.b(self.a(x))


def build():
    return Flat()
"""


def test_dtrain_run_refuses_a_model_file_without_blocks(tmp_path: Path) -> None:
    path = tmp_path / "flat.py"
    path.write_text(FLAT_FILE)
    p = dtrain_cli(
        "run",
        "--strategy",
        "pipeline",
        "--workers",
        "2",
        "--model",
        f"{path}:build",
        "--epochs",
        "1",
        "--no-progress",
        "--no-trace",
        "--out",
        str(tmp_path / "r"),
        timeout=120,
    )
    assert p.returncode == 2, p.stdout + p.stderr
    assert "pipeline: model Flat has no list of repeated blocks" in p.stderr, p.stderr


@pytest.mark.slow
def test_dtrain_run_pipelines_llama_and_it_learns(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    flags = [*LLAMA, *TEXT, "--strategy", "pipeline", "--workers", "2", "--microbatches", "2", "--batch-size", "8"]
    flags += ["--optimizer", "adam", "--lr", "0.003", "--max-steps", "24", "--split-points", "model.layers.1"]
    ((out, text),) = dtrain_runs(tmp_path, [], {"llama": flags}, timeout=300).values()
    losses = mean_losses(out)
    first, last = sum(losses[s] for s in range(3)) / 3, sum(losses[s] for s in range(21, 24)) / 3
    assert last < first - 1.0, (first, last, text[-2000:])


@pytest.mark.slow
def test_a_clipped_gpt2_pipeline_counts_its_tied_weight_once(tmp_path: Path) -> None:
    """``--clip-grad-norm`` below the gradient's norm: the global norm over the stages counts the tied weight
    (on both ranks) once, and every step's loss and norm equal one process's."""
    common = [*GPT2, *TEXT, "--batch-size", "8", "--optimizer", "sgd", "--lr", "0.5", "--max-steps", "4"]
    common += ["--clip-grad-norm", "0.5"]
    runs = {
        "one": ["--strategy", "dp", "--workers", "1"],
        "pipe": ["--strategy", "pipeline", "--workers", "2", "--microbatches", "2"],
    }
    out = dtrain_runs(tmp_path, common, runs, timeout=300)
    want, got = mean_losses(out["one"][0]), mean_losses(out["pipe"][0])
    assert sorted(got) == sorted(want) == [0, 1, 2, 3]
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=REL), (step, got, want)
    norms = {r["step"]: r["grad_norm"] for r in read_metrics(out["one"][0])}
    assert norms[0] > 0.5  # the clip acts
    for r in read_metrics(out["pipe"][0]):
        assert r["grad_norm"] == pytest.approx(norms[r["step"]], rel=REL), r


@pytest.mark.slow
def test_a_gpt2_pipeline_resumes_from_its_checkpoint_step_for_step(tmp_path: Path) -> None:
    """Each stage saves the parameters it holds under the whole model's names (the tied weight on both); a run
    resumed at step 2 gives the uninterrupted run's last losses."""
    common = [*GPT2, *TEXT, "--batch-size", "8", "--optimizer", "adam", "--lr", "0.003", "--max-steps", "4"]
    common += ["--strategy", "pipeline", "--workers", "2", "--microbatches", "2"]
    ((full, _),) = dtrain_runs(tmp_path, common, {"full": ["--checkpoint-every", "2"]}, timeout=300).values()
    ckpt = full / "checkpoints" / "step_000002"
    ((resumed, _),) = dtrain_runs(tmp_path, common, {"resumed": ["--resume", str(ckpt)]}, timeout=300).values()
    want, got = mean_losses(full), mean_losses(resumed)
    assert sorted(got) == [2, 3]
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=REL), (step, got, want)
