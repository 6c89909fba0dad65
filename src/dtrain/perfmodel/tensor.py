"""The performance model of tensor (intra-layer) parallelism and of the hybrid DP x PP x TP mesh.

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
filled in order; each group's link from :func:`group_cluster`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import astuple, dataclass, replace
from functools import partial
from typing import Any

from dtrain.errors import ConfigError
from dtrain.perfmodel.collectives import CompressionModel, allreduce_bytes
from dtrain.perfmodel.pipeline import PipelineCost, _spans, idle_aware, in_flight, pipeline_cost, stage_cut
from dtrain.perfmodel.predict import Memory, Prediction, _opt_state, bucket_collective, compute_times
from dtrain.perfmodel.profile import LayerProfile, ModelProfile
from dtrain.perfmodel.sharded import shard_collective
from dtrain.perfmodel.spec import ClusterSpec
from dtrain.perfmodel.units import format_bytes
from dtrain.registry import Choice

__all__ = ["PARAM_BYTES", "TransformerShape", "TensorComm", "MeshChoice", "mesh_rank", "mesh_groups", "group_cluster",
           "block_activation_bytes", "tensor_memory", "tensor_parallel_comm", "predict_hybrid", "mesh_reason",
           "factorizations", "rank_factorizations"]  # fmt: skip

PARAM_BYTES = 4  # float32 parameters and gradients
_DENSE = CompressionModel()
_HOST = "<tensor-parallel stage>"  # no cluster's host: the pipeline model reads a stage's times as measured here


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
        return {"embed": (v * h, self.seq * h), "block": (4 * h * h + 2 * h * f + 3 * h + f, 6 * h),
                "ln": (0, 2 * h), "head": (h * v + v, 0)}  # fmt: skip


# ---------------------------------------------------------------------- placement


def mesh_rank(dp_i: int, pp_i: int, tp_i: int, *, dp: int, tp: int) -> int:
    """Global rank of mesh coordinate ``(dp_i, pp_i, tp_i)``: tp innermost, then dp, pp outermost."""
    return (pp_i * dp + dp_i) * tp + tp_i


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
    inter = replace(c.inter, bandwidth=c.inter.bandwidth / share,
                    duplex_bandwidth=None if duplex is None else duplex / share)  # fmt: skip
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
    multiple of ``h``) or "other". ConfigError unless it finds ``shape.layers`` blocks."""
    counts = {k: sum(v) for k, v in shape.params().items()}
    vh = shape.vocab * shape.hidden

    def kind(n: int) -> str:
        for k in ("block", "head", "ln"):
            if n == counts[k]:
                return k
        return "embed" if n >= vh and (n - vh) % shape.hidden == 0 else "other"

    kinds = [kind(ly.params) for ly in prof.layers]
    if kinds.count("block") != shape.layers:
        raise ConfigError(f"profile {prof.name!r} has {kinds.count('block')} layers with a block's {counts['block']} "
                          f"parameters (hidden {shape.hidden}), expected {shape.layers} blocks")  # fmt: skip
    return kinds


def _rank_layers(prof: ModelProfile | None, shape: TransformerShape, tp: int, sp: bool) -> list[_Layer]:
    """Per layer on one rank, at ``shape.batch`` samples. A profile's layers keep its parameter bytes,
    split in the proportions of their kind; "other" layers are taken as split evenly over ``tp``."""
    kinds = _kinds(prof, shape) if prof else ["embed"] + ["block"] * shape.layers + ["ln", "head"]
    counts = shape.params()
    out = []
    for i, kind in enumerate(kinds):
        boundary = shape.dtype_bytes * shape.batch * shape.seq * shape.hidden / (tp if sp else 1)
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


def tensor_memory(model: ModelProfile | TransformerShape, tp: int, sequence_parallel: bool, *,
                  shape: TransformerShape | None = None,
                  optimizer_state_factor: float | None = None) -> Memory:  # fmt: skip
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
    if reason := _tp_reason(tp, shape.heads, shape.hidden):
        raise ConfigError(reason)
    layers = _rank_layers(prof, shape, tp, sequence_parallel)
    params = math.fsum(ly.param_bytes for ly in layers)
    inputs = prof.input_bytes * shape.batch / prof.batch if prof else 8.0 * shape.batch * shape.seq
    return Memory(params=params, grads=params, optimizer=_factor(prof, optimizer_state_factor) * params,
                  activations=math.fsum(ly.activation_bytes for ly in layers), buffers=inputs)  # fmt: skip


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
    return bucket_collective(view, algorithm, nbytes, tp, _DENSE)[0], \
        allreduce_bytes(algorithm, nbytes, tp, view.devices_per_node)  # fmt: skip


def _layer_comm(kind: str, view: ClusterSpec, algorithm: str, tp: int, sp: bool, n: float,
                loss_n: float) -> TensorComm:  # fmt: skip
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


def tensor_parallel_comm(c: ClusterSpec, batch: int, seq: int, hidden: int, layers: int, tp: int, *,
                         sequence_parallel: bool, dtype_bytes: int = 4, algorithm: str = "ring",
                         microbatches: int = 1, embedding: bool = True, head: bool = True, dp: int = 1,
                         pp: int = 1) -> TensorComm:  # fmt: skip
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


def _tp_reason(tp: int, heads: int, hidden: int) -> str:
    if tp < 1:
        return f"tp must be >= 1, got {tp}"
    if heads % tp:
        return f"tp={tp} does not divide the {heads} attention heads"
    if hidden % tp:
        return f"tp={tp} does not divide the hidden width {hidden}"
    return ""


def mesh_reason(dp: int, pp: int, tp: int, *, heads: int, hidden: int, layers: int, batch: int, microbatches: int,
                devices: int | None = None) -> str:  # fmt: skip
    """Why no run could use the mesh ``dp x pp x tp`` ("" when one could): tp must divide the heads and
    the width, pp be at most the blocks, dp split the batch and ``M`` each replica's batch."""
    if min(dp, pp) < 1 or microbatches < 1:
        return f"dp, pp and micro-batches must be >= 1, got {dp}, {pp}, {microbatches}"
    if devices is not None and dp * pp * tp > devices:
        return f"the mesh needs {dp * pp * tp} devices, the cluster has {devices}"
    if reason := _tp_reason(tp, heads, hidden):
        return reason
    if pp > layers:
        return f"pp={pp} stages for {layers} transformer blocks"
    if batch % dp:
        return f"the batch of {batch} does not split over dp={dp} replicas"
    if (batch // dp) % microbatches:
        return f"{microbatches} micro-batches do not divide a replica's batch of {batch // dp}"
    return ""


def _stage_profile(replica: ModelProfile, times: tuple[list[float], list[float]], ranked: list[_Layer],
                   comm: list[TensorComm], tp: int, m: int) -> ModelProfile:  # fmt: skip
    """The replica as one rank of a tp group computes it: each layer's time ``/ t`` plus its ``M``
    micro-batches' tp collectives, its parameter bytes on the rank, and as activation the output a
    stage sends (per rank). Its host is :data:`_HOST`: on a cluster of that host these are the times."""
    fwd, bwd = times
    layers = tuple(LayerProfile(name=ly.name, params=ly.params, param_bytes=int(round(r.param_bytes)), fwd_flops=0.0,
                                bwd_flops=0.0, activation_bytes=m * r.boundary_bytes, fwd_s=f / tp + m * x.fwd_s,
                                bwd_s=b / tp + m * x.bwd_s)
                   for ly, r, x, f, b in zip(replica.layers, ranked, comm, fwd, bwd))  # fmt: skip
    return replace(replica, name=_HOST, layers=layers, optimizer_s=0.0, host=_HOST)


@dataclass(frozen=True)
class _Worker:
    """One pipeline worker (a stage's rank) after the flush: its share of the step's tail."""

    fwd_s: float
    bwd_s: float
    tp: TensorComm
    grads: TensorComm
    dp_s: float
    dp_bytes: float
    opt_s: float
    memory: Memory


def _workers(ranked: list[_Layer], comm: list[TensorComm], owned: list[list[int]], fwd: list[float],
             bwd: list[float], opt_per_byte: float, views: tuple[ClusterSpec, ClusterSpec], mesh: tuple[int, int, int],
             sched: tuple[str, int, int], algorithms: tuple[str, str], factor: float,
             inputs: float) -> list[_Worker]:  # fmt: skip
    """Per pipeline worker: compute, tp collectives, sequence parallelism's gradient allreduce, the dp
    allreduce of its gradient (one bucket, exposed after the flush), its optimizer share (``opt_per_byte`` of
    its parameter bytes on the rank), memory."""
    dp, pp, tp = mesh
    schedule, m, v = sched
    tp_view, dp_view = views
    tp_algorithm, algorithm = algorithms
    out = []
    for w, mine in enumerate(owned):
        params = math.fsum(ranked[i].param_bytes for i in mine)
        sp_grads = math.fsum(ranked[i].replicated_bytes for i in mine)
        tpc = sum((comm[i] for i in mine), TensorComm())
        dp_s = bucket_collective(dp_view, algorithm, params, dp, _DENSE)[0]
        dp_s += dp_view.device.wake if dp > 1 else 0.0  # the first message after compute, from the loop
        held = in_flight(schedule, pp, m, v, w) * math.fsum(ranked[i].activation_bytes for i in mine)
        two = int(schedule == "2bw")  # PipeDream-2BW's second weight version (pipeline_memory)
        mem = Memory(params=(1 + two) * params, grads=(1 + two) * params, optimizer=factor * params,
                     activations=held, buffers=inputs + params * (int(dp > 1) + two))  # fmt: skip
        out.append(_Worker(fwd_s=math.fsum(fwd[i] for i in mine) / tp, bwd_s=math.fsum(bwd[i] for i in mine) / tp,
                           tp=tpc.times(m),
                           grads=_grads_comm(tp_view, tp_algorithm, tp, sp_grads) if sp_grads else TensorComm(),
                           dp_s=dp_s, dp_bytes=allreduce_bytes(algorithm, params, dp, dp_view.devices_per_node),
                           opt_s=opt_per_byte * params, memory=mem))  # fmt: skip
    return out


def predict_hybrid(prof: ModelProfile, c: ClusterSpec, *, dp: int, pp: int, tp: int, microbatches: int, schedule: str,
                   sequence_parallel: bool, batch: int, seq: int, hidden: int, layers: int, heads: int, vocab: int,
                   algorithm: str = "ring", tp_algorithm: str = "ring", optimizer_state_factor: float | None = None,
                   chunks: int | None = None, dtype_bytes: int = 4, overhead_s: float = 0.0,
                   memory_limit: float | None = None, balance: str = "time",
                   strategy: Choice | None = None) -> Prediction:  # fmt: skip
    """One step of the mesh ``dp x pp x tp`` (placement: :func:`mesh_rank`).

    1. Each replica (``batch / dp`` samples; ``prof`` rescaled to it) is one pipeline of ``pp`` stages
       (:func:`~dtrain.perfmodel.pipeline.pipeline_cost`: cut, bubble, transfers) whose layers take
       ``1/t`` of their time plus their tp collectives (per micro-batch, on the critical path). A cut
       sends ``e b s h`` (``/ t`` with sequence parallelism) per rank and micro-batch each way, on the
       pp groups' link. ``pp = 1``: the ``M`` micro-batches one after the other (accumulation).
    2. After the flush each worker allreduces its replicated parameters' gradients over tp (sequence
       parallelism), its gradient over dp (one bucket, exposed: the pipeline model overlaps no
       reduction) and steps its optimizer share: the step's tail is the slowest worker's.
    3. ``step = pipeline + tail + imbalance + overhead``; memory the most loaded worker's (docs/perfmodel.md).

    ``detail``: tp_s, tp_bytes, pp_s (transfers + bubble), pp_bytes, bubble (fraction), dp_s, dp_bytes,
    fwd_s, bwd_s, opt_s, dp, pp, tp, microbatches. ``algorithm``: dp's allreduce, ``tp_algorithm`` the tp
    group's (ring or native with sequence parallelism). ``balance``: the cut, as the pipeline's (:func:`stage_cut`,
    on the split layers' times). ``strategy``: the Choice to name (default: ``dp`` of the world as a
    stand-in). ConfigError for a mesh no run would take (:func:`mesh_reason`).
    """
    if reason := mesh_reason(dp, pp, tp, heads=heads, hidden=hidden, layers=layers, batch=batch,
                             microbatches=microbatches, devices=c.devices):  # fmt: skip
        raise ConfigError(reason)
    m = microbatches
    sched = (schedule, chunks or (2 if schedule == "interleaved" else 1)) if pp > 1 else ("1f1b", 1)
    replica = prof.at_batch(batch // dp)
    shape = TransformerShape(batch // dp // m, seq, hidden, layers, heads, vocab, dtype_bytes=dtype_bytes)
    ranked = _rank_layers(replica, shape, tp, sequence_parallel)
    tp_view = group_cluster(c, mesh_groups("tp", dp, pp, tp))
    n, loss_n = float(shape.batch * seq * hidden * dtype_bytes), 4.0 * shape.batch * seq
    comm = [_layer_comm(r.kind, tp_view, tp_algorithm, tp, sequence_parallel, n, loss_n) for r in ranked]
    stages = group_cluster(c, mesh_groups("pp", dp, pp, tp))  # the stages placed as the mesh places them
    stages = replace(stages, models={}, device=replace(c.device, host=_HOST, compute_scale=1.0))
    # workers sharing cores compute less at once in a pipeline (its bubble): pipeline.idle_aware
    fwd, bwd, opt = compute_times(replica, idle_aware(c, sched[0], pp, m, sched[1]) if pp > 1 else c)
    stage_prof = _stage_profile(replica, (fwd, bwd), ranked, comm, tp, m)
    pc = pipeline_cost(stage_prof, stages, pp, m, *sched, sizes=stage_cut(stage_prof, pp * sched[1], balance, m))
    owned = [[i for k, span in enumerate(_spans(pc.sizes)) if k % pp == w for i in span] for w in range(pp)]
    views = (tp_view, group_cluster(c, mesh_groups("dp", dp, pp, tp)))
    workers = _workers(ranked, comm, owned, fwd, bwd, opt / max(1, replica.param_bytes), views, (dp, pp, tp),
                       (sched[0], m, sched[1]), (tp_algorithm, algorithm), _factor(replica, optimizer_state_factor),
                       replica.input_bytes)  # fmt: skip
    return _assemble(pc, workers, c, (dp, pp, tp, m), batch, sequence_parallel, overhead_s, memory_limit,
                     strategy or Choice("dp", dp * pp * tp))  # fmt: skip


def _assemble(pc: PipelineCost, workers: list[_Worker], c: ClusterSpec, mesh: tuple[int, int, int, int], batch: int,
              sp: bool, overhead_s: float, memory_limit: float | None, strategy: Choice) -> Prediction:  # fmt: skip
    """The :class:`Prediction` of :func:`predict_hybrid` from the pipeline's cost and the workers'."""
    dp, pp, tp, m = mesh
    slow = workers[pc.slowest]
    tail = max(workers, key=lambda w: w.grads.seconds + w.dp_s + w.opt_s)
    transfers = m * pc.link_s[pc.slowest]
    bubble_s = pc.pipeline_s - m * pc.cycle_s[pc.slowest]
    tp_s = slow.tp.seconds + tail.grads.seconds
    wait = c.device.imbalance if dp * pp * tp > 1 else 0.0
    step = pc.pipeline_s + tail.grads.seconds + tail.dp_s + tail.opt_s + wait + overhead_s
    tp_bytes = math.fsum(w.tp.bytes + w.grads.bytes for w in workers) / pp
    pp_bytes = math.fsum(pc.bytes_sent) / pp
    dp_bytes = math.fsum(w.dp_bytes for w in workers) / pp
    mem = max((w.memory for w in workers), key=lambda x: x.total)
    limit = c.device.memory if memory_limit is None else memory_limit
    comm = tp_s + transfers + tail.dp_s
    why = (f"mesh dp={dp} x pp={pp} x tp={tp}{' (sequence parallel)' if sp else ''}: {tp_s * 1e3:.3g} ms of tensor-"
           f"parallel collectives, bubble {pc.bubble:.0%} and {transfers * 1e3:.3g} ms of stage transfers, "
           f"{tail.dp_s * 1e3:.3g} ms of gradient allreduce; {format_bytes(mem.total)} per device")  # fmt: skip
    detail = {"tp_s": tp_s, "tp_bytes": tp_bytes, "pp_s": transfers + bubble_s, "pp_bytes": pp_bytes,
              "bubble": pc.bubble, "dp_s": tail.dp_s, "dp_bytes": dp_bytes, "fwd_s": slow.fwd_s,
              "bwd_s": slow.bwd_s, "opt_s": tail.opt_s, "dp": float(dp), "pp": float(pp), "tp": float(tp),
              "microbatches": float(m)}  # fmt: skip
    return Prediction(strategy, step, batch / step if step > 0 else math.inf, slow.fwd_s + slow.bwd_s + tail.opt_s,
                      comm, comm, bubble_s + wait, tp_bytes + pp_bytes + dp_bytes, mem, mem.total <= limit, why,
                      detail)  # fmt: skip


# ---------------------------------------------------------------------- factorizations


def factorizations(world: int) -> list[tuple[int, int, int]]:
    """Every ``(dp, pp, tp)`` with ``dp * pp * tp == world``, in increasing ``(dp, pp)``."""
    if world < 1:
        raise ConfigError(f"world must be >= 1, got {world}")
    return [(dp, pp, world // dp // pp) for dp in range(1, world + 1) if world % dp == 0
            for pp in range(1, world // dp + 1) if (world // dp) % pp == 0]  # fmt: skip


@dataclass(frozen=True)
class MeshChoice:
    """One factorization of :func:`rank_factorizations`: its prediction (None when no run could take the
    mesh) and, when it is infeasible, why (a memory-bound one keeps its prediction)."""

    dp: int
    pp: int
    tp: int
    prediction: Prediction | None
    reason: str = ""

    @property
    def feasible(self) -> bool:
        return not self.reason

    @property
    def step_s(self) -> float:
        return self.prediction.step_s if self.prediction is not None and self.feasible else math.inf


def rank_factorizations(prof: ModelProfile, c: ClusterSpec, world: int, *, heads: int, layers: int, vocab: int,
                        batch: int, seq: int, hidden: int, memory_limit: float | None = None, microbatches: int = 8,
                        schedule: str = "1f1b", sequence_parallel: bool = False,
                        **options: Any) -> list[MeshChoice]:  # fmt: skip
    """:func:`predict_hybrid` of every factorization of ``world``: the feasible ones by step time, then
    the others (in :func:`factorizations`' order) with their reason: :func:`mesh_reason`'s, what the
    pipeline model refuses (too few layers for the stages, an interleaved ``M``), or memory over
    ``memory_limit`` (default: the device's). ``pp = 1`` takes one micro-batch, ``pp > 1`` ``microbatches``;
    ``options`` go to :func:`predict_hybrid` (algorithm, tp_algorithm, optimizer_state_factor, balance, ...).
    """
    limit = c.device.memory if memory_limit is None else memory_limit
    out = []
    for dp, pp, tp in factorizations(world):
        m = microbatches if pp > 1 else 1
        pred, reason = None, mesh_reason(dp, pp, tp, heads=heads, hidden=hidden, layers=layers, batch=batch,
                                         microbatches=m, devices=c.devices)  # fmt: skip
        if not reason:
            try:
                pred = predict_hybrid(prof, c, dp=dp, pp=pp, tp=tp, microbatches=m, schedule=schedule,
                                      sequence_parallel=sequence_parallel, batch=batch, seq=seq, hidden=hidden,
                                      layers=layers, heads=heads, vocab=vocab, memory_limit=limit,
                                      **options)  # fmt: skip
            except ConfigError as e:
                reason = str(e)
        if pred is not None and not pred.fits:
            reason = f"needs {format_bytes(pred.memory.total)} per device, over the limit of {format_bytes(limit)}"
        out.append(MeshChoice(dp, pp, tp, pred, reason))
    return sorted(out, key=lambda r: (not r.feasible, r.step_s if r.feasible else 0.0))
