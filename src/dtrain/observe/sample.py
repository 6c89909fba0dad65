"""``dtrain sample RUN_DIR``: text from a trained language model of a finished run.

A run of a language model (``--model gpt-* --dataset pytext``) leaves its final
weights in ``model.pt`` (the evaluating rank's copy); this module rebuilds the model
from the run's configuration and samples from it with
:func:`dtrain.workloads.models.generate`. Tokens are bytes, so the text is the sampled bytes
decoded as UTF-8 (an incomplete character shows as U+FFFD).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from dtrain.config.files import load_toml
from dtrain.config.schema import RunConfig
from dtrain.errors import DTrainError
from dtrain.rundir.files import CONFIG, is_run

__all__ = ["sample_run", "main"]


def sample_run(
    run_dir: str | Path,
    prompt: str = "\nThe ",
    tokens: int = 200,
    *,
    temperature: float = 0.8,
    top_k: int | None = 40,
    seed: int = 0,
) -> str:
    """The prompt and ``tokens`` sampled bytes from ``run_dir``'s trained model, as text.

    Raises:
        DTrainError: the folder holds no finished language-model run, or an argument is out of range.
    """
    from dtrain.workloads.models import build_model, generate, is_language_model

    d = Path(run_dir)
    if not is_run(d):
        raise DTrainError(f"{d} is not a run folder (no {CONFIG})")
    cfg = RunConfig.from_mapping(load_toml(d / CONFIG))
    if not is_language_model(cfg.model):
        raise DTrainError(f"{d} trained {cfg.model}, not a language model; nothing to sample")
    if not (d / "model.pt").is_file():
        raise DTrainError(f"{d} has no model.pt: the run did not finish")
    if tokens < 0 or temperature <= 0 or not prompt:
        raise DTrainError("sample needs tokens >= 0, temperature > 0 and a non-empty prompt")
    state = torch.load(d / "model.pt", weights_only=True)
    vocab = int(state["head.bias"].numel()) if "head.bias" in state else 256  # the run's vocabulary
    model = build_model(cfg.model, (cfg.seq_len,), vocab, **cfg.gpt_overrides())
    model.load_state_dict(state)
    encode, decode = _codec(cfg, vocab)
    ids = torch.tensor(encode(prompt), dtype=torch.long)
    out = generate(model, ids, tokens, temperature=temperature, top_k=top_k, seed=seed)
    return decode(out.tolist())


def _codec(cfg: RunConfig, vocab: int) -> tuple[Callable[[str], list[int]], Callable[[list[int]], str]]:
    """How the run's text became tokens and back: bytes, its ``--tokenizer``, or ids written as numbers."""
    if cfg.tokenizer and Path(cfg.tokenizer).is_file():
        from dtrain.workloads.files.tokens import load_tokenizer

        tok = load_tokenizer(cfg.tokenizer)
        return (lambda text: list(tok.encode(text).ids) or [0]), (lambda ids: str(tok.decode(ids)))
    if vocab == 256:
        return (lambda text: list(text.encode("utf-8"))), (lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    return (
        (lambda text: [int(w) % vocab for w in text.split() if w.isdigit()] or [0]),
        (lambda ids: " ".join(map(str, ids))),
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dtrain sample", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a finished run folder of a language model")
    ap.add_argument("--prompt", default="\nThe ", help="text to continue (default: a new line and 'The ')")
    ap.add_argument("--tokens", type=int, default=200, help="bytes to sample (default: 200)")
    ap.add_argument("--temperature", type=float, default=0.8, help="(default: 0.8)")
    ap.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest bytes; 0: all (default: 40)")
    ap.add_argument("--seed", type=int, default=0, help="(default: 0)")
    ns = ap.parse_args(argv)
    print(
        sample_run(ns.run_dir, ns.prompt, ns.tokens, temperature=ns.temperature, top_k=ns.top_k or None, seed=ns.seed)
    )
    return 0
