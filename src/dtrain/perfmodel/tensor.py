"""The performance model of tensor (intra-layer) parallelism: a GPT's split, its memory and its collectives.

Pure functions over a :class:`~dtrain.perfmodel.profile.ModelProfile` and a
:class:`~dtrain.perfmodel.spec.ClusterSpec`; nothing is run. The model is a GPT laid out
as :mod:`dtrain.workloads.models.gpt` builds it (``embed``, ``L`` blocks, ``ln_f``, ``head``), split
as Megatron-LM splits it (Shoeybi et al., "Megatron-LM", 2019): ``attn.qkv`` and ``mlp.fc1``
column-parallel (heads and the MLP's hidden units split), ``attn.proj`` and ``mlp.fc2``
row-parallel, the token embedding and the head vocab-parallel, with a vocab-parallel cross
entropy. Layernorms, the position embedding and the row-parallel layers' biases are
replicated on every rank of a tensor-parallel (tp) group of ``t`` ranks.

Communication (:func:`tensor_parallel_comm`), per micro-batch of ``b`` samples and ``n = b s h e``
bytes (``e`` the activations' dtype bytes), on the tp group's link: each block allreduces ``n``
twice in forward (after ``proj`` and ``fc2``: Megatron's g) and twice in backward (before ``qkv``
and ``fc1``: f, their conjugates); the embedding once in forward (its output), the head once in
backward (its input's gradient), the loss ``b s`` floats three times in forward (max, sum of
exp, target logit).

With sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", 2022, section 4.2.2) every allreduce becomes an allgather and a
reduce-scatter of ``n`` (one in forward, its conjugate in backward): the same bytes and, on the
ring, the same time (the two halves add up to the allreduce exactly). As dtrain's plan
(:func:`dtrain.tensor_parallel.plans.gpt_sequence_parallel`) runs it, the embedding keeps its
allreduce and ``block0``'s input is split, its backward an allgather of ``n`` (Megatron
reduce-scatters the embedding's output instead); the replicated parameters see different
sequence slices, so their gradients (``6 h`` per block, ``2 h`` for ``ln_f``) are allreduced
over tp once per step (``sync_replicated_grads``). Nothing is
overlapped (each result feeds the next matrix multiply); each step of a collective pays at least
the device's floor, as every other prediction's.

Placement: global rank ``(pp_i dp + dp_i) t + tp_i`` (tp innermost, dp, pp outermost), nodes
filled in order; each group's link from :func:`group_cluster`. One step of the whole DP x PP x TP
mesh, and the ranking of a world's factorizations, is :mod:`dtrain.perfmodel.mesh`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import astuple, dataclass, replace
from functools import partial

from dtrain.errors import ConfigError
from dtrain.hybrid_parallel.mesh import mesh_rank
from dtrain.perfmodel.collectives import CompressionModel, allreduce_bytes
from dtrain.perfmodel.predict import Memory, _opt_state, bucket_collective
from dtrain.perfmodel.profile import ModelProfile
from dtrain.perfmodel.sharded import shard_collective
from dtrain.perfmodel.spec import ClusterSpec

__all__ = [
    "PARAM_BYTES",
    "TransformerShape",
    "TensorComm",
    "mesh_rank",
    "mesh_groups",
    "group_cluster",
    "block_activation_bytes",
    "tensor_memory",
    "tensor_parallel_comm",
    "tp_reason",
]

PARAM_BYTES = 4  # float32 parameters and gradients
_DENSE = CompressionModel()


@dataclass(frozen=True)
class TransformerShape:
    """The sizes of a GPT as :mod:`dtrain.workloads.models.gpt` builds it.

    Attributes:
        batch: samples whose activations are counted (a micro-batch in a pipeline).
        seq / hidden / layers / heads / vocab: sequence length, width, blocks, heads, vocabulary.
        ffn: the MLP's hidden width (0: ``4 hidden``).
        dtype_bytes: bytes per activation element ``e`` (4: float32; 2: Korthikanti's 16-bit).
        dropout: dropout masks are kept (1 byte per element; dtrain's GPT has dropout 0 by default).
        scores: attention keeps its ``s x s`` scores (False: a fused attention that recomputes them).
    """

    batch: int
    seq: int
    hidden: int
    layers: int
    heads: int
    vocab: int
    ffn: int = 0
    dtype_bytes: int = 4
    dropout: bool = False
    scores: bool = True

    def __post_init__(self) -> None:
        for name in ("batch", "seq", "hidden", "layers", "heads", "vocab", "dtype_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"TransformerShape.{name} must be an int >= 1, got {v!r}")
        if self.ffn < 0:
            raise ConfigError(f"TransformerShape.ffn must be >= 0 (0: 4 x hidden), got {self.ffn}")

    @property
    def mlp(self) -> int:
        return self.ffn or 4 * self.hidden

    def params(self) -> dict[str, tuple[int, int]]:
        """(split, replicated) parameter counts of the embedding (``V h`` tokens; ``s h`` positions), a
        block (``qkv`` ``3h^2 + 3h``, ``proj``'s weight, ``fc1``, ``fc2``'s weight; two layernorms and the
        row-parallel biases, ``6 h``), a layernorm and the head."""
        h, f, v = self.hidden, self.mlp, self.vocab
        return {
            "embed": (v * h, self.seq * h),
            "block": (4 * h * h + 2 * h * f + 3 * h + f, 6 * h),
            "ln": (0, 2 * h),
            "head": (h * v + v, 0),
        }


# ---------------------------------------------------------------------- placement


def mesh_groups(axis: str, dp: int, pp: int, tp: int) -> list[list[int]]:
    """Every group of mesh axis ``axis`` ("tp", "dp" or "pp") as its ranks, in the axis' order."""
    r = partial(mesh_rank, dp=dp, tp=tp)
    if axis == "tp":
        return [[r(d, p, t) for t in range(tp)] for p in range(pp) for d in range(dp)]
    if axis == "dp":
        return [[r(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)]
    if axis == "pp":
        return [[r(d, p, t) for p in range(pp)] for d in range(dp) for t in range(tp)]
    raise ConfigError(f"mesh axis must be 'tp', 'dp' or 'pp', got {axis!r}")


def group_cluster(c: ClusterSpec, groups: Sequence[Sequence[int]]) -> ClusterSpec:
    """The cluster as the worst of ``groups`` (most nodes, then fewest members on one) sees it: on one
    node, one node of its size (intra link); over ``N`` nodes with ``k`` members on one at most, ``N``
    nodes of ``k``, the inter link shared by the ``min(d, world) / k`` groups on a node (rates / that)."""

    def spread(g: Sequence[int]) -> tuple[int, int]:
        per = Counter(c.node_of(r) for r in g)
        return len(per), -max(per.values())

    worst = max(groups, key=spread)
    nodes, fewest = spread(worst)
    k = -fewest
    if nodes == 1:
        return replace(c, nodes=1, devices_per_node=len(worst))
    world = 1 + max(r for g in groups for r in g)
    share = max(1, min(c.devices_per_node, world) // k)
    duplex = c.inter.duplex_bandwidth
    inter = replace(
        c.inter, bandwidth=c.inter.bandwidth / share, duplex_bandwidth=None if duplex is None else duplex / share
    )
    return replace(c, nodes=nodes, devices_per_node=k, inter=inter)


# ---------------------------------------------------------------------- memory


def block_activation_bytes(shape: TransformerShape, tp: int, sequence_parallel: bool) -> float:
    """Bytes one block keeps for backward on one rank (Korthikanti et al. 2022, section 4 and table 2).

    With ``e`` = dtype bytes, ``m`` = 1 with dropout masks (else 0), ``f`` the MLP width::

        whole = (4e + 2m) s b h        # both layernorms' inputs, qkv's and fc1's inputs, two dropout masks
        split = (4e + 2e f/h) s b h    # q, k, v, proj's input, GeLU's input and output
              + (e + m (1 + e)) a s^2 b  # softmax output (+ its dropout mask and output); 0 without scores
        per rank = whole / (t if sequence_parallel else 1) + split / t

    With ``e = 2``, dropout and ``f = 4h``: ``sbh (34 + 5as/h)`` on one rank, ``sbh (10 + 24/t + 5as/(ht))``
    with tensor parallelism, ``sbh (34/t + 5as/(ht))`` with sequence parallelism too (table 2).
    """
    b, s, h, e = shape.batch, shape.seq, shape.hidden, shape.dtype_bytes
    m = 1 if shape.dropout else 0
    whole = (4 * e + 2 * m) * s * b * h
    split = (4 * e + 2 * e * shape.mlp / h) * s * b * h
    if shape.scores:
        split += (e + m * (1 + e)) * shape.heads * s * s * b
    return whole / (tp if sequence_parallel else 1) + split / tp


def _activation(kind: str, shape: TransformerShape, tp: int, sp: bool) -> float:
    """Bytes a layer of ``kind`` keeps per rank: a block's (above); the embedding its dropout mask;
    ``ln_f`` its input; the head its input and the cross entropy's float32 softmax over ``V/t`` logits."""
    sbh = shape.batch * shape.seq * shape.hidden
    whole = tp if sp else 1
    if kind == "block":
        return block_activation_bytes(shape, tp, sp)
    if kind == "embed":
        return (1 if shape.dropout else 0) * sbh / whole
    if kind == "ln":
        return shape.dtype_bytes * sbh / whole
    if kind == "head":
        return shape.dtype_bytes * sbh / whole + 4.0 * shape.batch * shape.seq * shape.vocab / tp
    return 0.0


@dataclass(frozen=True)
class _Layer:
    """One layer on one rank: kind, parameter bytes (and the replicated ones sequence parallelism
    allreduces), activations kept per micro-batch, the output a stage sends when cut after it."""

    kind: str
    param_bytes: float
    replicated_bytes: float
    activation_bytes: float
    boundary_bytes: float


def _kinds(prof: ModelProfile, shape: TransformerShape) -> list[str]:
    """Each profile layer's kind by its parameter count: "block", "head", "ln", "embed" (``V h`` plus a
    multiple of ``h``) or "other" (a model profiled by its pieces: the kinds its profile gives). ConfigError
    unless it finds ``shape.layers`` blocks."""
    pieces = prof.extra.get("pieces")
    if pieces is not None and len(pieces["kinds"]) == len(prof.layers):  # a model profiled by its pieces
        return list(pieces["kinds"])
    counts = {k: sum(v) for k, v in shape.params().items()}
    vh = shape.vocab * shape.hidden

    def kind(n: int) -> str:
        for k in ("block", "head", "ln"):
            if n == counts[k]:
                return k
        return "embed" if n >= vh and (n - vh) % shape.hidden == 0 else "other"

    kinds = [kind(ly.params) for ly in prof.layers]
    if kinds.count("block") != shape.layers:
        raise ConfigError(
            f"profile {prof.name!r} has {kinds.count('block')} layers with a block's {counts['block']} "
            f"parameters (hidden {shape.hidden}), expected {shape.layers} blocks"
        )
    return kinds


def _rank_layers(prof: ModelProfile | None, shape: TransformerShape, tp: int, sp: bool) -> list[_Layer]:
    """Per layer on one rank, at ``shape.batch`` samples. A profile's layers keep its parameter bytes,
    split in the proportions of their kind (a model profiled by its pieces: the fraction its derived plan
    splits); "other" layers are taken as split evenly over ``tp``."""
    kinds = _kinds(prof, shape) if prof else ["embed"] + ["block"] * shape.layers + ["ln", "head"]
    counts = shape.params()
    pieces = prof.extra.get("pieces") if prof is not None else None
    out = []
    for i, kind in enumerate(kinds):
        boundary = shape.dtype_bytes * shape.batch * shape.seq * shape.hidden / (tp if sp else 1)
        if pieces is not None and prof is not None and kind != "other":  # the split fraction the derived plan gives
            whole, frac = float(prof.layers[i].param_bytes), float(pieces["split"][i])
            repl = whole * (1.0 - frac)
            grads = repl if kind in ("block", "ln") else 0.0
            out.append(_Layer(kind, whole * frac / tp + repl, grads, _activation(kind, shape, tp, sp), boundary))
            continue
        if kind == "other" and prof is not None:
            ly = prof.layers[i]
            act = ly.activation_bytes * shape.batch / prof.batch
            out.append(_Layer(kind, ly.param_bytes / tp, 0.0, act / tp, act))
            continue
        split, repl = counts[kind]
        per = prof.layers[i].param_bytes / (split + repl) if prof else float(PARAM_BYTES)
        grads = per * repl if kind in ("block", "ln") else 0.0  # positions get the same gradient on every rank
        out.append(_Layer(kind, per * (split / tp + repl), grads, _activation(kind, shape, tp, sp), boundary))
    return out


def _factor(prof: ModelProfile | None, optimizer_state_factor: float | None) -> float:
    """Optimizer state per parameter byte: given, else the profile's optimizer (sgd 1, adam 2, sgd0 0)."""
    if optimizer_state_factor is not None:
        return optimizer_state_factor
    return _opt_state(prof) / prof.param_bytes if prof is not None and prof.param_bytes else 1.0


def tensor_memory(
    model: ModelProfile | TransformerShape,
    tp: int,
    sequence_parallel: bool,
    *,
    shape: TransformerShape | None = None,
    optimizer_state_factor: float | None = None,
) -> Memory:
    """Bytes per rank of a GPT split over ``tp`` ranks (no pipeline).

    Parameters ``P_r = sum over layers of split / t + replicated`` (:meth:`TransformerShape.params`),
    gradients as many, optimizer state ``k P_r``; activations at ``shape.batch``: ``L`` blocks'
    (:func:`block_activation_bytes`), the embedding's dropout mask, ``ln_f``'s and the head's inputs
    (``e s b h`` each, ``/ t`` with sequence parallelism), the cross entropy's ``4 s b V / t``;
    buffers: the inputs. ``model``: a profile (its parameter bytes and optimizer; ``shape`` required)
    or a shape alone (float32 parameters, ``k = 1``, ``8 b s`` bytes of token ids).
    """
    prof = model if isinstance(model, ModelProfile) else None
    if isinstance(model, TransformerShape):
        shape = model
    if shape is None:
        raise ConfigError("tensor_memory of a profile needs its TransformerShape (shape=...)")
    if reason := tp_reason(tp, shape.heads, shape.hidden):
        raise ConfigError(reason)
    layers = _rank_layers(prof, shape, tp, sequence_parallel)
    params = math.fsum(ly.param_bytes for ly in layers)
    inputs = prof.input_bytes * shape.batch / prof.batch if prof else 8.0 * shape.batch * shape.seq
    return Memory(
        params=params,
        grads=params,
        optimizer=_factor(prof, optimizer_state_factor) * params,
        activations=math.fsum(ly.activation_bytes for ly in layers),
        buffers=inputs,
    )


# ---------------------------------------------------------------------- communication

# the collectives of one micro-batch per layer kind (phase:op; "loss" is an allreduce of b s floats)
_OPS: dict[tuple[str, bool], tuple[str, ...]] = {
    ("block", False): ("f:ar", "f:ar", "b:ar", "b:ar"),
    # sequence parallel: qkv's and fc1's inputs gathered again in backward (b:ag), not kept (Korthikanti 4.2.2)
    ("block", True): ("f:ag", "f:rs", "f:ag", "f:rs", "b:rs", "b:ag", "b:ag", "b:rs", "b:ag", "b:ag"),
    ("embed", False): ("f:ar",),
    ("embed", True): ("f:ar", "b:ag"),  # dtrain's plan: the allreduce, then block0's input split
    ("head", False): ("b:ar", "f:loss", "f:loss", "f:loss"),
    ("head", True): ("f:ag", "b:ag", "b:rs", "f:loss", "f:loss", "f:loss"),
}


@dataclass(frozen=True)
class TensorComm:
    """Tensor-parallel communication of one rank; ``seconds`` (``fwd_s + bwd_s + grads_s``) are all exposed.

    Attributes:
        bytes: sent per rank; calls: collectives.
        fwd_s / bwd_s: the collectives of the forward / backward passes.
        grads_s: sequence parallelism's allreduce of the replicated parameters' gradients (else 0).
    """

    bytes: float = 0.0
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    grads_s: float = 0.0
    calls: int = 0

    @property
    def seconds(self) -> float:
        return self.fwd_s + self.bwd_s + self.grads_s

    def __add__(self, o: TensorComm) -> TensorComm:
        return TensorComm(*(a + b for a, b in zip(astuple(self), astuple(o))))

    def times(self, k: int) -> TensorComm:
        return TensorComm(*(k * a for a in astuple(self)))


def _collective(view: ClusterSpec, algorithm: str, op: str, nbytes: float, tp: int) -> tuple[float, float]:
    """(seconds, bytes sent per rank) of one tp collective: an allreduce as a data-parallel bucket's
    (:func:`bucket_collective`, floors included), a half of the ring as ZeRO's (:func:`shard_collective`)."""
    if tp <= 1 or nbytes <= 0:
        return 0.0, 0.0
    if op in ("rs", "ag"):
        return shard_collective(view, algorithm, nbytes, tp, op), (tp - 1) / tp * nbytes
    return bucket_collective(view, algorithm, nbytes, tp, _DENSE)[0], allreduce_bytes(
        algorithm, nbytes, tp, view.devices_per_node
    )


def _layer_comm(kind: str, view: ClusterSpec, algorithm: str, tp: int, sp: bool, n: float, loss_n: float) -> TensorComm:
    """One micro-batch's collectives of a layer of ``kind`` (:data:`_OPS`): ``n`` bytes, the loss ``loss_n``."""
    out = TensorComm()
    for spec in _OPS.get((kind, sp), ()):
        phase, op = spec.split(":")
        t, sent = _collective(view, algorithm, "ar" if op == "loss" else op, loss_n if op == "loss" else n, tp)
        f, b = (t, 0.0) if phase == "f" else (0.0, t)
        out += TensorComm(sent, f, b, 0.0, 1 if tp > 1 else 0)
    return out


def _grads_comm(view: ClusterSpec, algorithm: str, tp: int, replicated: float) -> TensorComm:
    t, sent = _collective(view, algorithm, "ar", replicated, tp)
    return TensorComm(sent, grads_s=t, calls=1 if sent > 0 else 0)


def tensor_parallel_comm(
    c: ClusterSpec,
    batch: int,
    seq: int,
    hidden: int,
    layers: int,
    tp: int,
    *,
    sequence_parallel: bool,
    dtype_bytes: int = 4,
    algorithm: str = "ring",
    microbatches: int = 1,
    embedding: bool = True,
    head: bool = True,
    dp: int = 1,
    pp: int = 1,
) -> TensorComm:
    """One training step's tensor-parallel collectives on one rank (module docstring: which, where).

    Ring bytes per rank: ``M [(4L + E + H) 2(t-1)/t n + 3H 2(t-1)/t 4 b s]`` with ``n = b s h e``
    of a micro-batch of ``b = batch / M``, ``E``, ``H`` 1 with the embedding, the head; with
    sequence parallelism plus ``M (E + 2L + H) (t-1)/t n`` (block0's split, the column layers' inputs
    gathered again in backward) and the allreduce of ``4 (6 h L + 2 h H)`` gradient bytes.

    ``batch`` is a replica's samples per step, ``layers`` the blocks on this rank's stage, each of the
    ``M = microbatches`` pays its own latencies and floors; ``embedding``: the stage holds the embedding;
    ``head``: ``ln_f``, the head and the loss; ``dp`` / ``pp``: the mesh around the tp groups (where
    their ranks sit, who shares their link; :func:`group_cluster` charges the worst group).
    """
    if microbatches < 1 or batch % microbatches:
        raise ConfigError(f"{microbatches} micro-batches do not divide the batch of {batch}")
    view = group_cluster(c, mesh_groups("tp", dp, pp, tp))
    micro = batch // microbatches
    n, loss_n = float(micro * seq * hidden * dtype_bytes), 4.0 * micro * seq
    kinds = {"block": layers, "embed": int(embedding), "head": int(head)}
    per = TensorComm()
    for kind, count in kinds.items():
        per += _layer_comm(kind, view, algorithm, tp, sequence_parallel, n, loss_n).times(count)
    out = per.times(microbatches)
    if sequence_parallel:
        out += _grads_comm(view, algorithm, tp, float(PARAM_BYTES * (6 * hidden * layers + 2 * hidden * int(head))))
    return out


# ---------------------------------------------------------------------- the hybrid mesh


def tp_reason(tp: int, heads: int, hidden: int) -> str:
    """Why ``tp`` ranks could not split the model ("" when they could): it must divide the heads and the width."""
    if tp < 1:
        return f"tp must be >= 1, got {tp}"
    if heads % tp:
        return f"tp={tp} does not divide the {heads} attention heads"
    if hidden % tp:
        return f"tp={tp} does not divide the hidden width {hidden}"
    return ""
