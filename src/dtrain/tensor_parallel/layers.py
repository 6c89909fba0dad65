"""Tensor-parallel layers: a linear split by output rows or input columns, a vocabulary-split embedding, and the
cross entropy over vocabulary-split logits (Shoeybi et al., "Megatron-LM", arXiv 1909.08053, section 3).

Each layer is built from a whole ``nn.Linear`` (or transformers' ``Conv1D``, the same map with its weight
stored transposed, ``(in, out)``) / ``nn.Embedding``, keeping this rank's slice of its weights, so a
parallelized model starts from the same values as the unsplit one; ``full_weights()`` gathers them back
(in the layout of the layer they came from). ``sequence_parallel`` layers take and give
activations sharded along the sequence (dim 1) instead of replicated (Korthikanti et al. 2022).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dtrain.errors import ConfigError
from dtrain.tensor_parallel._functions import (
    TPGroup,
    copy_to_tp,
    gather_linear,
    reduce_from_tp,
    reduce_scatter_sequence,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "is_projection",
    "projection_shape",
]


def _is_conv1d(m: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2's projections): ``y = x W + b`` with ``W`` of shape ``(in, out)``."""
    w = getattr(m, "weight", None)
    return (
        type(m).__name__ == "Conv1D"
        and isinstance(w, torch.Tensor)
        and w.dim() == 2
        and int(getattr(m, "nf", -1)) == w.shape[1]
    )


def is_projection(m: nn.Module) -> bool:
    """Whether ``m`` is a linear projection the parallel layers split: an ``nn.Linear`` or a transformers
    ``Conv1D``."""
    return isinstance(m, nn.Linear) or _is_conv1d(m)


def projection_shape(m: nn.Module) -> tuple[int, int]:
    """``(out_features, in_features)`` of an ``nn.Linear`` or ``Conv1D``."""
    w = m.weight
    assert isinstance(w, torch.Tensor)
    return (int(w.shape[1]), int(w.shape[0])) if _is_conv1d(m) else (int(w.shape[0]), int(w.shape[1]))


def _linear_weights(m: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """A projection's weight in ``nn.Linear``'s layout ``(out, in)``, its bias, and whether it was transposed."""
    w, b = m.weight, getattr(m, "bias", None)
    assert isinstance(w, torch.Tensor)
    bias = b.detach() if isinstance(b, torch.Tensor) else None
    if _is_conv1d(m):
        return w.detach().t(), bias, True
    return w.detach(), bias, False


def _gather_rows(w: torch.Tensor, g: TPGroup) -> torch.Tensor:
    """Every rank's ``w`` stacked along dim 0 (in rank order); a state-dict gather, not training traffic."""
    if g.size == 1:
        return w.detach().clone()
    import torch.distributed as dist

    parts = [torch.empty_like(w) for _ in range(g.size)]
    dist.all_gather(parts, w.detach().contiguous(), group=g.group)
    return torch.cat(parts, 0)


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with the rows of ``A`` (output features) split over the group.

    The input enters through Megatron's ``f`` (its gradient allreduced), or with
    ``sequence_parallel`` is allgathered from sequence shards (and gathered again in backward
    rather than kept: :func:`~dtrain.tensor_parallel._functions.gather_linear`); the output stays split
    along the feature dim. ``chunks`` > 1 splits each of that many equal output blocks on
    its own (a fused q/k/v projection: every rank gets its heads of q, of k and of v).

    Args:
        linear: the whole layer this rank takes its slice of.
        group: the tensor-parallel group.
        chunks: fused output blocks (default: 1).
        sequence_parallel: the input arrives sharded along dim 1 (default: False).
        gathered: an enclosing module's input was gathered from sequence shards, whose backward reduce-scatters
            (and so sums) the input's gradient: the input is taken as it is (default: False).
    """

    def __init__(
        self,
        linear: nn.Module,
        group: TPGroup,
        *,
        chunks: int = 1,
        sequence_parallel: bool = False,
        gathered: bool = False,
        name: str = "",
    ) -> None:
        super().__init__()
        weight, bias, self.transposed = _linear_weights(linear)
        out, inp = weight.shape
        p = group.size
        if out % (chunks * p):
            raise ConfigError(
                f"{name or 'a colwise linear'}: {out} output features"
                f"{f' in {chunks} fused blocks' if chunks > 1 else ''} do not divide over "
                f"tensor-parallel size {p}"
            )
        self.g, self.chunks, self.sequence_parallel, self.gathered = group, chunks, sequence_parallel, gathered
        self.in_features, self.out_features = inp, out // p
        blocks = weight.chunk(chunks, 0)
        w = torch.cat([b.chunk(p, 0)[group.rank] for b in blocks], 0)
        self.weight = nn.Parameter(w.clone())
        self.bias: nn.Parameter | None = None
        if bias is not None:
            bb = bias.chunk(chunks, 0)
            self.bias = nn.Parameter(torch.cat([b.chunk(p, 0)[group.rank] for b in bb], 0).clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gathered:  # an enclosing module gathered the sequence (its backward reduce-scatters the gradient)
            return F.linear(x, self.weight, self.bias)
        if self.sequence_parallel:  # keeps this rank's chunk for backward, not the gathered sequence
            return gather_linear(x, self.weight, self.bias, self.g)
        return F.linear(copy_to_tp(x, self.g), self.weight, self.bias)

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The unsplit ``weight`` and ``bias`` (a collective over the group), in the layout of the layer it was
        built from (a ``Conv1D``'s ``(in, out)``)."""
        w = self._unsplit(self.weight)
        out = {"weight": w.t().contiguous() if self.transposed else w}
        if self.bias is not None:
            out["bias"] = self._unsplit(self.bias)
        return out

    def _unsplit(self, t: torch.Tensor) -> torch.Tensor:
        parts = _gather_rows(t, self.g).chunk(self.g.size, 0)  # per rank: its slice of every block
        per_rank = [q.chunk(self.chunks, 0) for q in parts]
        return torch.cat([torch.cat([per_rank[r][c] for r in range(self.g.size)], 0) for c in range(self.chunks)], 0)

    def load_full(self, weights: dict[str, torch.Tensor]) -> None:
        """Take this rank's slice of unsplit weights."""
        with torch.no_grad():
            for name, t in (("weight", self.weight), ("bias", self.bias)):
                if t is None:
                    continue
                whole = weights[name].t() if name == "weight" and self.transposed else weights[name]
                blocks = whole.chunk(self.chunks, 0)
                t.copy_(torch.cat([b.chunk(self.g.size, 0)[self.g.rank] for b in blocks], 0))


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with the columns of ``A`` (input features) split over the group.

    Takes input split along the feature dim (a column-parallel layer's output), multiplies
    by its slice, and sums the partial results with Megatron's ``g`` (allreduce forward),
    or with ``sequence_parallel`` reduce-scatters them along the sequence. The bias is
    whole on every rank and added after the sum.

    Args:
        linear: the whole layer.
        group: the tensor-parallel group.
        sequence_parallel: the output leaves sharded along dim 1 (default: False).
    """

    def __init__(self, linear: nn.Module, group: TPGroup, *, sequence_parallel: bool = False, name: str = "") -> None:
        super().__init__()
        weight, bias, self.transposed = _linear_weights(linear)
        out, inp = weight.shape
        p = group.size
        if inp % p:
            raise ConfigError(
                f"{name or 'a rowwise linear'}: {inp} input features do not divide over tensor-parallel size {p}"
            )
        self.g, self.sequence_parallel = group, sequence_parallel
        self.in_features, self.out_features = inp // p, out
        self.weight = nn.Parameter(weight.chunk(p, 1)[group.rank].clone())
        self.bias = nn.Parameter(bias.clone()) if bias is not None else None
        if self.bias is not None and sequence_parallel:
            self.bias.tp_partial_grad = True  # type: ignore[attr-defined]  # added on sequence shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        y = reduce_scatter_sequence(y, self.g) if self.sequence_parallel else reduce_from_tp(y, self.g)
        return y + self.bias if self.bias is not None else y

    def full_weights(self) -> dict[str, torch.Tensor]:
        w = _gather_rows(self.weight.t(), self.g)  # (in, out): a Conv1D's layout
        out = {"weight": w.contiguous() if self.transposed else w.t().contiguous()}
        if self.bias is not None:
            out["bias"] = self.bias.detach().clone()
        return out

    def load_full(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            whole = weights["weight"].t() if self.transposed else weights["weight"]
            self.weight.copy_(whole.chunk(self.g.size, 1)[self.g.rank])
            if self.bias is not None:
                self.bias.copy_(weights["bias"])


class VocabParallelEmbedding(nn.Module):
    """An embedding whose vocabulary rows are split over the group; lookups outside a rank's range give zeros,
    and the partial results are summed (``g``, or a reduce-scatter along the sequence).

    A vocabulary the group does not divide is padded to ``ceil(V / P) * P`` rows; the padding
    rows are zero and never looked up.
    """

    def __init__(self, emb: nn.Embedding, group: TPGroup, *, sequence_parallel: bool = False) -> None:
        super().__init__()
        vocab, dim = emb.weight.shape
        p = group.size
        self.g, self.sequence_parallel = group, sequence_parallel
        self.vocab_size, self.per = vocab, -(-vocab // p)
        self.start = group.rank * self.per
        w = torch.zeros(self.per, dim, dtype=emb.weight.dtype)
        rows = emb.weight.detach()[self.start : self.start + self.per]
        w[: rows.shape[0]] = rows
        self.weight = nn.Parameter(w)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.start) | (idx >= self.start + self.per)
        local = (idx - self.start).masked_fill(outside, 0)
        y = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_sequence(y, self.g) if self.sequence_parallel else reduce_from_tp(y, self.g)

    def full_weights(self) -> dict[str, torch.Tensor]:
        return {"weight": _gather_rows(self.weight, self.g)[: self.vocab_size].contiguous()}

    def load_full(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.weight.zero_()
            rows = weights["weight"][self.start : self.start + self.per]
            self.weight[: rows.shape[0]].copy_(rows)


class VocabParallelHead(ColumnParallelLinear):
    """The LM head split by vocabulary rows (a column-parallel linear whose output stays split: the logits are
    never gathered whole); a vocabulary the group does not divide is padded with rows whose logits are
    masked to ``-inf`` in :func:`vocab_parallel_cross_entropy`."""

    def __init__(self, linear: nn.Linear, group: TPGroup, *, sequence_parallel: bool = False) -> None:
        vocab, dim = linear.weight.shape
        per = -(-vocab // group.size)
        padded = nn.Linear(dim, per * group.size, bias=linear.bias is not None)
        with torch.no_grad():
            padded.weight.zero_()
            padded.weight[:vocab].copy_(linear.weight)
            if linear.bias is not None:
                assert padded.bias is not None
                padded.bias.zero_()
                padded.bias[:vocab].copy_(linear.bias)
        super().__init__(padded, group, sequence_parallel=sequence_parallel)
        self.vocab_size = vocab
        self.vocab_start = group.rank * per

    def full_weights(self) -> dict[str, torch.Tensor]:
        return {k: v[: self.vocab_size].contiguous() for k, v in super().full_weights().items()}

    def load_full(self, weights: dict[str, torch.Tensor]) -> None:
        per = self.out_features
        with torch.no_grad():
            for name, t in (("weight", self.weight), ("bias", self.bias)):
                if t is None:
                    continue
                rows = weights[name][self.vocab_start : self.vocab_start + per]
                t.zero_()
                t[: rows.shape[0]].copy_(rows)


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, head: VocabParallelHead) -> torch.Tensor:
    """Mean cross entropy over vocabulary-split logits, without gathering them (Megatron's).

    Each rank holds ``logits[..., start:start+per]``: the max, the sum of exponentials and the
    target's logit are each reduced over the group as one scalar per position (``b*s``
    floats), and every rank gets the same loss; the gradient reaches each rank's slice only.

    Args:
        logits: ``(..., per)`` this rank's slice (``VocabParallelHead`` output).
        target: ``(...)`` int64 class ids in ``[0, vocab)``.
        head: the layer that produced the logits (its group, range and vocabulary size).
    """
    g = head.g
    # in float32 whatever the logits' dtype, as autocast runs cross_entropy (and Megatron its vocab-parallel
    # one): under fp16 the sum of exponentials loses precision, and a loss-scaled loss (loss x 2**16) overflows
    logits = logits.float()
    per = logits.shape[-1]
    start = head.vocab_start
    cols = torch.arange(start, start + per, device=logits.device)
    logits = logits.masked_fill(cols >= head.vocab_size, float("-inf"))  # padding rows
    with torch.no_grad():
        m = g.allreduce(logits.max(dim=-1).values, op="max")
    shifted = logits - m.unsqueeze(-1)
    sum_exp = reduce_from_tp(shifted.exp().sum(dim=-1), g)
    inside = (target >= start) & (target < start + per)
    local_t = (target - start).masked_fill(~inside, 0)
    picked = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
    picked = reduce_from_tp(picked, g)
    return (sum_exp.log() - picked).mean()
