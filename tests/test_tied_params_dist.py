"""A parameter held by two modules (an embedding tied to the LM head) under every strategy that keeps the model
whole: one tensor, communicated once, trained as one process would.

Models: a tiny tied next-token model defined here (``transformer.wte`` an Embedding, ``lm_head`` a Linear over
the same weight) and transformers' GPT-2 built from a config (2 layers, width 64; it ties ``lm_head.weight`` to
``transformer.wte.weight``). Each spawn runs its scenarios one after the other in the same processes and
returns plain numbers; the tests assert on them:

* ZeRO 1/2/3 (also with explicit units that part the two holders, and with ``no_sync`` accumulation and a
  clipped global norm), DataParallel (ring, error-fed compression, priority scheduling with a bucket per
  parameter), torch's DDP and the parameter server under bsp (1 and 2 servers): every step's loss (the mean
  of the ranks' losses on their shards) equals one process on the global batch; the tie holds after
  training; the engine holds the shared weight once (the elements it shards, buckets or splits over servers
  are those of ``model.parameters()``, which counts it once; ZeRO's bytes per step are those of these units);
* local SGD, EASGD and gossip: the tie holds and the loss falls; the replicas' average sends the weight once;
* a ZeRO-3 checkpoint saved after 2 steps and resumed gives the uninterrupted run's last losses, and a full
  state dict (both tied keys, or one) loads back into one tensor; a per-rank checkpoint blob holding a tied
  state dict stores the weight once, and DCP's model and optimizer state dicts round-trip the tie.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _dist import guard as _guard
from _dist import run_distributed
from _dist import scenario_result as _ok
from torch import nn

pytestmark = pytest.mark.procs  # every test here starts processes

STEPS = 3
REL = 1e-5  # as tests/test_sharded_run.py: the losses of one process and of the ranks agree to float32 rounding
VOCAB, WIDTH, PER_RANK, SEQ = 32, 16, 4, 8


class _Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mix(self.wte(x)))


class TinyTied(nn.Module):
    """Next-token logits through an embedding and a head that share one weight (as GPT-2's)."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = _Body()
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.transformer(x))  # type: ignore[no-any-return]


def _gpt2() -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "gpt2",
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=257,
        n_positions=128,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return AutoModelForCausalLM.from_config(cfg)  # type: ignore[no-any-return]


def _model(kind: str) -> nn.Module:
    torch.manual_seed(7)
    return TinyTied() if kind == "tiny" else _gpt2()


def _vocab(kind: str) -> int:
    return VOCAB if kind == "tiny" else 257


def _batches(kind: str, world: int, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(steps):
        t = torch.randint(0, _vocab(kind), (PER_RANK * world, SEQ + 1), generator=g)
        out.append((t[:, :-1], t[:, 1:]))
    return out


def _loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _tied(m: nn.Module) -> bool:
    head, emb = m.lm_head.weight, m.transformer.wte.weight  # type: ignore[union-attr]
    return head is emb and head.data_ptr() == emb.data_ptr()


def _numel(m: nn.Module) -> int:
    """Elements of the deduplicated parameter list (the tied weight once)."""
    return sum(p.numel() for p in m.parameters())


def _opt(params: Any, kind: str = "sgd") -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-2, eps=1e-4)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _train(model: nn.Module, opt: torch.optim.Optimizer, batches: Any, after: Any = None) -> list[float]:
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = _loss(model(x), y)
        loss.backward()
        opt.step()
        if after is not None:
            after()
        losses.append(float(loss.detach()))
    return losses


def _mine(batches: Any, rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    n = batches[0][0].shape[0] // world
    return [(x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]) for x, y in batches]


def _reference(kind: str, world: int, optk: str = "sgd") -> list[float]:
    m = _model(kind)
    return _train(m, _opt(m.parameters(), optk), _batches(kind, world))


# ---------------------------------------------------------------------------------------------- data parallel


def _zero(rank: int, world: int, kind: str, stage: str, units: list[str] | None = None) -> dict[str, Any]:
    from dtrain.sharded import ShardedDataParallel

    m = _model(kind)
    dp = ShardedDataParallel(m, shard=stage, units=units)
    ids = [id(p) for u in dp.units for p in u.params]
    held = {"numel": sum(u.numel for u in dp.units), "distinct": len(ids) == len(set(ids))}
    losses = _train(dp, _opt(dp.parameters()), _mine(_batches(kind, world), rank, world))
    # ring reduce-scatter and allgather send (P-1) segments of each unit; a step reduces every unit once and
    # gathers it once (stages 1-2: the stepped shards), stage 3 twice (forward, backward) but the root unit once
    # (held from its forward to the end of backward)
    times = {u.name: 2 if stage != "parameters" or u.name == "" else 3 for u in dp.units}
    held["bytes"] = dp.step_stats()["bytes_sent"]
    held["want_bytes"] = sum(times[u.name] * (world - 1) * u.seg * 4 for u in dp.units)
    dp.synchronize()
    out = {"losses": losses, "tied": _tied(m), "want_numel": _numel(m), **held}
    dp.close()
    return out


def _dp(rank: int, world: int, kind: str, compression: Any = None) -> dict[str, Any]:
    from dtrain.data_parallel import DataParallel

    m = _model(kind)
    dp = DataParallel(m, compression=compression)
    losses = _train(dp, _opt(dp.parameters()), _mine(_batches(kind, world), rank, world))
    dp.synchronize()
    members = [i for b in dp._reducer.bucket_objects for i in b.members]
    out = {
        "losses": losses,
        "tied": _tied(m),
        "want_numel": _numel(m),
        "distinct": len(members) == len(set(members)),
        "numel": sum(v.numel() for b in dp._reducer.bucket_objects for v in b.buffer.views),
    }
    if compression is not None:  # error feedback keeps one residual per bucket: the tied weight in it once
        res = dp.compressor.state_dict()["residuals"]
        out["residual_numel"] = sum(v.numel() for v in res.values())
    dp.close()
    return out


def _ddp(rank: int, world: int, kind: str) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    m = _model(kind)
    dp = DistributedDataParallel(m)
    losses = _train(dp, _opt(dp.parameters()), _mine(_batches(kind, world), rank, world))
    log = dp._get_ddp_logging_data()  # torch's own account of its buckets, in bytes
    n = sum(int(b) for b in str(log["bucket_sizes"]).replace(",", " ").split()) // 4
    idx = str(log["rebuilt_per_bucket_param_indices"]).replace(",", " ").split()
    return {
        "losses": losses,
        "tied": _tied(m),
        "want_numel": _numel(m),
        "numel": n,
        "distinct": len(idx) == len(set(idx)),
    }


CLIP = 0.5  # below the gradient norm of every step: the clip scales, so a weight counted twice would show


def _clipped(rank: int, world: int, stage: str | None) -> dict[str, Any]:
    """Two micro-batches a step (the first under ``no_sync``) and the global norm clipped; ``stage`` None:
    one process on the global batch, clipped by torch."""
    from dtrain.sharded import ShardedDataParallel

    m = _model("tiny")
    dp = ShardedDataParallel(m, shard=stage) if stage is not None else None
    net: nn.Module = dp if dp is not None else m
    opt = _opt(net.parameters())
    batches = _batches("tiny", world)
    losses = []
    for x, y in _mine(batches, rank, world) if dp is not None else batches:
        opt.zero_grad()
        total = 0.0
        for k, (xa, ya) in enumerate(zip(x.chunk(2), y.chunk(2))):
            with dp.no_sync() if dp is not None and k == 0 else contextlib.nullcontext():
                loss = _loss(net(xa), ya) / 2
                loss.backward()
            total += float(loss.detach())
        norm = dp.clip_grad_norm_(CLIP) if dp is not None else nn.utils.clip_grad_norm_(m.parameters(), CLIP)
        assert float(norm) > CLIP
        opt.step()
        losses.append(total)
    if dp is None:
        return {"losses": losses}
    dp.synchronize()
    numel = sum(u.numel for u in dp.units)
    dp.close()
    return {"losses": losses, "tied": _tied(m), "numel": numel, "want_numel": _numel(m), "distinct": True}


def _dp_forward(rank: int, world: int) -> dict[str, Any]:
    """DataParallel's priority scheduling (the optimizer stepped per bucket), a bucket per parameter."""
    from dtrain.data_parallel import DataParallel

    m = _model("tiny")
    dp = DataParallel(m, overlap="forward", optimizer_factory=lambda p: _opt(p), bucket_mb=1e-6, first_bucket_mb=1e-6)
    losses = []
    for x, y in _mine(_batches("tiny", world), rank, world):
        loss = _loss(dp(x), y)
        loss.backward()
        losses.append(float(loss.detach()))
    dp.synchronize()
    members = [i for b in dp._reducer.bucket_objects for i in b.members]
    out = {
        "losses": losses,
        "tied": _tied(m),
        "want_numel": _numel(m),
        "distinct": len(members) == len(set(members)),
        "numel": sum(v.numel() for b in dp._reducer.bucket_objects for v in b.buffer.views),
    }
    dp.close()
    return out


def _dp_family(rank: int, world: int, kind: str) -> dict[str, Any]:
    from dtrain.compress import ErrorFeedback, TopK

    out: dict[str, Any] = {"ref": _reference(kind, world) if rank == 0 else None}
    for stage in ("optimizer", "gradients", "parameters"):
        out[f"zero-{stage}"] = _guard(lambda: _zero(rank, world, kind, stage))
    if kind == "tiny":  # units that cut the two holders apart: the weight goes to the root unit
        out["zero-parameters-units"] = _guard(
            lambda: _zero(rank, world, kind, "parameters", ["transformer.wte", "transformer.mix", "lm_head"])
        )
    out["dp-ring"] = _guard(lambda: _dp(rank, world, kind))
    # top-k of every element with error feedback: the residual machinery runs and the result stays exact
    out["dp-topk-ef"] = _guard(lambda: _dp(rank, world, kind, ErrorFeedback(TopK(ratio=1.0))))
    out["ddp"] = _guard(lambda: _ddp(rank, world, kind))
    if kind == "tiny":
        out["dp-forward"] = _guard(lambda: _dp_forward(rank, world))
        out["ref-clip"] = _clipped(rank, world, None) if rank == 0 else None
        for stage in ("optimizer", "gradients", "parameters"):
            out[f"clip-{stage}"] = _guard(lambda: _clipped(rank, world, stage))
    return out


# ---------------------------------------------------------------------------------------------- parameter server


def _ps(rank: int, world: int, kind: str, servers: int) -> dict[str, Any] | None:
    import dtrain

    m = _model(kind)
    # min_split_bytes=0: with two servers the tied weight is cut between them, each piece owned once
    ps = dtrain.ParameterServer(
        m, lambda p: _opt(p), servers=servers, consistency="bsp", timeout_s=60, min_split_bytes=0
    )
    held = {
        "numel": sum(s.numel for s in ps.shards),
        "want_numel": _numel(m),
        "distinct": len(ps.params) == len({id(p) for p in ps.params}),
    }
    if ps.is_server:
        ps.serve()
        return None
    workers = world - servers
    losses = []
    for x, y in _mine(_batches(kind, workers), ps.worker_index, workers):
        loss = _loss(m(x), y)
        loss.backward()
        ps.step()
        losses.append(float(loss.detach()))
    ps.finish()
    return {"losses": losses, "tied": _tied(m), "worker": ps.worker_index, **held}


def _ps_all(rank: int, world: int, kind: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for servers in (1, 2) if world > 2 else (1,):
        out[f"ref{servers}"] = _reference(kind, world - servers) if rank == world - 1 else None
        out[f"ps{servers}"] = _guard(lambda: _ps(rank, world, kind, servers))
    return out


# ---------------------------------------------------------------------------------------------- decentralized

DEC_STEPS = 24


def _decentralized(rank: int, world: int, which: str) -> dict[str, Any]:
    import dtrain.decentralized as dec
    from dtrain.comm.allreduce import allreduce_over

    m = _model("tiny")
    if which == "local_sgd":
        w: Any = dec.LocalSGD(m, period=2)
    elif which == "easgd":
        w = dec.EASGD(m, alpha=0.2, period=1)
    else:
        w = dec.Gossip(m, "ring")
    batches = _mine(_batches("tiny", world, 4), rank, world) * (DEC_STEPS // 4)  # a few batches, seen again
    losses = _train(w, torch.optim.SGD(m.parameters(), lr=0.5), batches, after=w.step)
    t = w.transport
    before = t.stats.bytes_sent
    avg = w.averaged_state_dict()
    sent = t.stats.bytes_sent - before
    before = t.stats.bytes_sent
    allreduce_over(t, torch.zeros(_numel(m)), "avg", w.algorithm)  # what one average of the model weighs
    once = t.stats.bytes_sent - before
    fresh = _model("tiny")
    fresh.load_state_dict(avg)  # both tied keys, into one tensor
    bytes_of = w.model_bytes() if callable(w.model_bytes) else w.model_bytes
    out = {
        "losses": losses,
        "tied": _tied(m),
        "loaded_tied": _tied(fresh),
        "avg_sent": sent,
        "once": once,
        "model_bytes": bytes_of,
        "want_bytes": 4 * _numel(m),
    }
    w.close()
    return out


def _decentralized_all(rank: int, world: int) -> dict[str, Any]:
    return {which: _guard(lambda: _decentralized(rank, world, which)) for which in ("local_sgd", "easgd", "gossip")}


# ---------------------------------------------------------------------------------------------- ZeRO-3 checkpoint


def _zero3_resume(rank: int, world: int, root: str) -> dict[str, Any]:
    from dtrain.checkpoint import load_checkpoint, save_checkpoint
    from dtrain.sharded import ShardedDataParallel
    from dtrain.sharded.state import load_sharded_state, sharded_state

    batches = _mine(_batches("tiny", world, 4), rank, world)

    def wrapped() -> tuple[nn.Module, Any, torch.optim.Optimizer]:
        m = _model("tiny")
        dp = ShardedDataParallel(m, shard="parameters")
        return m, dp, _opt(dp.parameters(), "adam")

    m, dp, opt = wrapped()
    whole = _train(dp, opt, batches)
    full = dp.full_state_dict()
    dp.close()
    m, dp, opt = wrapped()
    first = _train(dp, opt, batches[:2])
    save_checkpoint(root, 2, sharded=sharded_state(dp, opt))
    dp.close()
    m, dp, opt = wrapped()
    template = sharded_state(dp, opt)
    load_checkpoint(root, sharded=template)
    load_sharded_state(dp, opt, template)
    rest = _train(dp, opt, batches[2:])
    dp.synchronize()
    resumed_tied = _tied(m)
    dp.close()
    # the full state dict lists the tied weight under both keys; loading it gives one tensor again
    m2 = _model("tiny")
    dp2 = ShardedDataParallel(m2, shard="parameters")
    dp2.load_full_state_dict(full)
    dp2.synchronize()
    loaded = {"tied": _tied(m2), "diff": float((m2.lm_head.weight - full["lm_head.weight"]).abs().max())}
    # the weight under one of its keys (as a file that stores a tie once) loads too; two different values do not
    dp2.load_full_state_dict({k: v for k, v in full.items() if k != "lm_head.weight"})
    dp2.synchronize()
    loaded["one_key_diff"] = float((m2.lm_head.weight - full["lm_head.weight"]).abs().max())
    try:
        dp2.load_full_state_dict({**full, "lm_head.weight": full["lm_head.weight"] + 1})
        loaded["conflict"] = "no error"
    except Exception as e:  # noqa: BLE001 - the message is the result
        loaded["conflict"] = f"{type(e).__name__}: {e}"
    dp2.close()
    return {
        "whole": whole,
        "resumed": first + rest,
        "tied": resumed_tied,
        "keys_equal": bool(torch.equal(full["lm_head.weight"], full["transformer.wte.weight"])),
        "loaded": loaded,
    }


# ---------------------------------------------------------------------------------------------- the tests


def _same_as_one_process(vals: list[dict[str, Any]], ref: list[float]) -> None:
    for v in vals:
        assert v["tied"], "the embedding and the head no longer share one tensor after training"
        assert v["distinct"], "the engine holds the shared parameter more than once"
        assert v["numel"] == v["want_numel"], (v["numel"], v["want_numel"])
        if "want_bytes" in v:  # ZeRO: the bytes of a step, from the deduplicated units
            assert v["bytes"] == v["want_bytes"], (v["bytes"], v["want_bytes"])
    mean = [sum(step) / len(vals) for step in zip(*(v["losses"] for v in vals))]
    assert mean == pytest.approx(ref, rel=REL)


DP_KEYS = [
    "zero-optimizer",
    "zero-gradients",
    "zero-parameters",
    "zero-parameters-units",
    "dp-ring",
    "dp-topk-ef",
    "ddp",
]
TINY_ONLY = {"zero-parameters-units"}


@pytest.fixture(scope="module")
def tiny_dp() -> list[dict[str, Any]]:
    return run_distributed(_dp_family, 2, "tiny", timeout=120)


@pytest.mark.parametrize("key", [*DP_KEYS, "dp-forward"])
def test_tiny_tied_model_under_data_parallel_equals_one_process(tiny_dp: Any, key: str) -> None:
    vals = [_ok(r[key]) for r in tiny_dp]
    _same_as_one_process(vals, tiny_dp[0]["ref"])
    if key == "dp-topk-ef":
        assert all(v["residual_numel"] == v["want_numel"] for v in vals), [v["residual_numel"] for v in vals]


@pytest.fixture(scope="module")
def gpt2_dp() -> list[dict[str, Any]]:
    pytest.importorskip("transformers")
    return run_distributed(_dp_family, 2, "gpt2", timeout=240)


@pytest.mark.parametrize("stage", ["optimizer", "gradients", "parameters"])
def test_zero_accumulation_and_clipping_count_the_tied_weight_once(tiny_dp: Any, stage: str) -> None:
    vals = [_ok(r[f"clip-{stage}"]) for r in tiny_dp]
    _same_as_one_process(vals, tiny_dp[0]["ref-clip"]["losses"])


@pytest.mark.slow  # GPT-2's ZeRO-3 is in the default suite through dtrain run (tests/test_user_models_run.py)
@pytest.mark.parametrize("key", [k for k in DP_KEYS if k not in TINY_ONLY])
def test_gpt2_under_data_parallel_equals_one_process(gpt2_dp: Any, key: str) -> None:
    _same_as_one_process([_ok(r[key]) for r in gpt2_dp], gpt2_dp[0]["ref"])


@pytest.mark.parametrize("kind, world", [("tiny", 3), pytest.param("gpt2", 3, marks=pytest.mark.slow)])
def test_parameter_server_bsp_with_a_tied_model_equals_one_process(kind: str, world: int) -> None:
    if kind == "gpt2":
        pytest.importorskip("transformers")
    res = run_distributed(_ps_all, world, kind, timeout=240)
    for servers in (1, 2):
        vals = [_ok(r[f"ps{servers}"]) for r in res[servers:]]
        assert [v["worker"] for v in vals] == list(range(world - servers))
        _same_as_one_process(vals, res[-1][f"ref{servers}"])


@pytest.fixture(scope="module")
def decentralized() -> list[dict[str, Any]]:
    return run_distributed(_decentralized_all, 2, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["local_sgd", "easgd", "gossip"])
def test_decentralized_keep_the_tie_and_train(decentralized: Any, which: str) -> None:
    for v in (_ok(r[which]) for r in decentralized):
        assert v["tied"] and v["loaded_tied"]
        assert v["model_bytes"] == v["want_bytes"]
        assert v["avg_sent"] == v["once"], "the replicas' average sends the tied weight more than once"
        first, last = sum(v["losses"][:4]) / 4, sum(v["losses"][-4:]) / 4
        assert last < first - 0.1, (first, last)


def test_zero3_checkpoint_of_a_tied_model_resumes_like_the_uninterrupted_run(tmp_path: Path) -> None:
    res = run_distributed(_zero3_resume, 2, str(tmp_path / "ckpt"), timeout=120)
    for v in (_ok(r) for r in res):
        assert v["resumed"] == pytest.approx(v["whole"], rel=REL)
        assert v["tied"] and v["keys_equal"]
        assert v["loaded"]["tied"] and v["loaded"]["diff"] == 0.0 and v["loaded"]["one_key_diff"] == 0.0
        assert v["loaded"]["conflict"].startswith("ConfigError") and "'lm_head.weight'" in v["loaded"]["conflict"]


def _blob(rank: int, world: int, root: str) -> dict[str, Any]:
    """A replica's state dict in the per-rank part of a checkpoint (what local SGD, EASGD and gossip save)."""
    from torch.distributed.checkpoint import FileSystemReader

    from dtrain.checkpoint import load_checkpoint, save_checkpoint

    m = _model("tiny")
    opt = _opt(m.parameters())
    _train(m, opt, _batches("tiny", world))  # the same on every rank, as a replicated model is
    path = save_checkpoint(root, 3, rank_state={"model": m.state_dict(), "optimizer": opt.state_dict()})
    md = FileSystemReader(str(path)).read_metadata()
    stored = [k for k in md.state_dict_metadata if k.startswith(f"rank_state.rank{rank}.t.")]
    _, blob = load_checkpoint(path)
    fresh = _model("tiny")
    fresh.load_state_dict(blob["model"])
    sd = blob["model"]
    distinct = len({p.data_ptr() for p in m.parameters()}) + len(opt.state_dict()["state"])  # + a momentum each
    # the model and optimizer as dp saves them (torch's DCP state dicts, the tied weight under both keys)
    save_checkpoint(root, 4, model=m, optimizer=opt)
    again = _model("tiny")
    again_opt = _opt(again.parameters())
    load_checkpoint(root, model=again, optimizer=again_opt)
    mom = [
        again_opt.state[p]["momentum_buffer"] - opt.state[q]["momentum_buffer"]
        for p, q in zip(again.parameters(), m.parameters())
    ]
    return {
        "stored": len(stored),
        "distinct": distinct,
        "tied": _tied(fresh) and _tied(again),
        "one_tensor": sd["lm_head.weight"] is sd["transformer.wte.weight"],
        "diff": max(float((a - b).abs().max()) for a, b in zip(fresh.parameters(), m.parameters())),
        "dcp_diff": max(float((a - b).abs().max()) for a, b in zip(again.parameters(), m.parameters())),
        "mom_diff": max(float(d.abs().max()) for d in mom),
    }


def test_a_tied_model_in_a_checkpoint_is_stored_once_and_loads_into_one_tensor(tmp_path: Path) -> None:
    for v in run_distributed(_blob, 2, str(tmp_path / "ckpt"), timeout=60):
        assert v["stored"] == v["distinct"], v
        assert v["one_tensor"] and v["tied"] and v["diff"] == 0.0, v
        assert v["dcp_diff"] == 0.0 and v["mom_diff"] == 0.0, v
