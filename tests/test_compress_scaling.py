"""Per-tensor scales, TernGrad's clipping, momentum before the compressor, rand-k with memory.

These guard the fixes that made sign, sign:mv, onebit and terngrad train the
default CNN with SGD momentum 0.9 (``benchmarks/compression.py``): a bucket's
tensors are scaled each by its own magnitudes, also through DataParallel's
reduce-scatter and the parameter server's wire; the error feedback of sign-type
compressors carries the optimizer's momentum; the server aggregates sign:mv by
majority vote. Single process and threads only.
"""

from __future__ import annotations

import math

import pytest
import torch
from _helpers import two_phase_residuals

from dtrain.comm.sparse import chunk_bounds
from dtrain.comm.transport import Transport, run_threads
from dtrain.compress import (
    QSGD,
    Compressor,
    ErrorFeedback,
    Identity,
    OneBit,
    RandomK,
    SignSGD,
    TernGrad,
    compressed_allreduce,
    from_spec,
)
from dtrain.compress._groups import from_table, group_index, segments_of, to_table, whole
from dtrain.errors import ConfigError
from dtrain.job.validate import validate

# a bucket as DataParallel packs it: a big weight beside a bias 1000x smaller, and another weight
SHAPES = [(64, 40), (64,), (10, 64)]
SCALES = [1.0, 1e-3, 0.05]


def _bucket(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randn(math.prod(s), generator=g) * a for s, a in zip(SHAPES, SCALES)])


def _parts(flat: torch.Tensor) -> list[torch.Tensor]:
    out, off = [], 0
    for s in SHAPES:
        n = math.prod(s)
        out.append(flat[off : off + n])
        off += n
    return out


def _rms(t: torch.Tensor) -> float:
    return float(t.double().pow(2).mean().sqrt())


# ----------------------------------------------------------------------------- groups


def test_groups_follow_tensors_and_rows() -> None:
    segs = segments_of([(3, 700), (5,), (8, 100)])
    assert segs == ((2100, 700, 0), (5, 5, 0), (800, 100, 0))
    ids, count = group_index(segs, 512)
    sizes = torch.bincount(ids).tolist()
    # rows of 700 cut 512 + 188; the bias alone; rows of 100 five at a time (500 + 300)
    assert sizes == [512, 188] * 3 + [5] + [500, 300]
    assert count == len(sizes)
    # without a layout: plain blocks, as before
    assert torch.bincount(group_index(whole(1300), 512)[0]).tolist() == [512, 512, 276]


@pytest.mark.parametrize("offset, length", [(0, 2905), (100, 1500), (2099, 7), (2104, 801), (1000, 1)])
def test_a_slice_has_the_groups_of_the_whole_cut_at_its_ends(offset: int, length: int) -> None:
    shapes = [(3, 700), (5,), (8, 100)]
    full_ids, _ = group_index(segments_of(shapes), 512)
    part = segments_of(shapes, offset, length)
    ids, count = group_index(part, 512)
    want = full_ids[offset : offset + length]
    assert torch.equal(ids, want - want[0]) and count == int(want[-1] - want[0]) + 1
    assert from_table(to_table(part), length) == part


def test_layout_errors() -> None:
    with pytest.raises(ValueError, match="outside"):
        segments_of([(3, 4)], 10, 5)
    with pytest.raises(ValueError, match="corrupt layout table"):
        from_table(to_table(((10, 10, 0),)), 11)


# ----------------------------------------------------------------------------- per-tensor scales


@pytest.mark.parametrize(
    "comp",
    [SignSGD(), SignSGD(scale="mean"), OneBit(), QSGD(levels=16, seed=1), TernGrad(seed=1)],
    ids=repr,
)
def test_a_bucket_of_two_magnitudes_keeps_each_tensors_scale(comp: Compressor) -> None:
    """The tiny bias decodes at its own size with a layout; without one it takes the weight's."""
    x = _bucket()
    with_layout = _parts(comp.from_wire(comp.to_wire(x, "b", shapes=SHAPES), x.shape, x.dtype))
    for got, want in zip(with_layout, _parts(x)):
        assert 0.2 < _rms(got) / _rms(want) < 5, (comp, _rms(got), _rms(want))
    if comp.name in ("sign", "onebit"):  # deterministic: the regression this guards against
        flat = _parts(comp.decompress(*comp.compress(x, "b")))
        assert _rms(flat[1]) / _rms(_parts(x)[1]) > 20  # the bias moved by its neighbour's step


def test_layout_payload_adds_a_small_table() -> None:
    x = _bucket()
    plain = SignSGD().to_wire(x, "b")
    laid = SignSGD().to_wire(x, "b", shapes=SHAPES)
    # groups: 64 rows of 40 -> 5 x 12 rows + 4 rows; the bias; 10 rows of 64 -> 8 + 2 rows
    groups = group_index(segments_of(SHAPES), 512)[1]
    assert groups == 6 + 1 + 2
    # + the int32 table (3 tensors x 3 numbers) and its 6-byte wire header, + 4 bytes per extra scale
    assert laid.numel() - plain.numel() == 36 + 6 + 4 * (groups - math.ceil(x.numel() / 512))


def test_per_tensor_scales_survive_the_reduce_scatter() -> None:
    """DataParallel's quantized collective cuts the bucket into chunks mid-tensor; scales stay per tensor."""
    p = 3
    comps = [ErrorFeedback(SignSGD()) for _ in range(p)]
    xs = [_bucket(seed=r) for r in range(p)]
    bounds = chunk_bounds(xs[0].numel(), p)
    assert any(b < 2560 < bounds[i + 1] for i, b in enumerate(bounds[:-1]))

    def fn(t: Transport) -> torch.Tensor:
        x = xs[t.rank].clone()
        compressed_allreduce(x, comps[t.rank], "b", t, shapes=SHAPES)
        return x

    out = run_threads(p, fn)
    assert all(torch.equal(out[0], o) for o in out)
    mean_bias = _rms(_parts(torch.stack(xs).mean(0))[1])
    assert 0.1 < _rms(_parts(out[0])[1]) / mean_bias < 10


# ----------------------------------------------------------------------------- TernGrad clipping


def test_terngrad_clips_at_2_5_sigma_and_is_unbiased_for_the_clipped_values() -> None:
    x = torch.randn(512, generator=torch.Generator().manual_seed(3))
    x[7] = 40.0  # an outlier: unclipped, the scale would be 40 and almost every element would send 0
    comp, draws = TernGrad(seed=5), 3000
    clipped = comp.clipped(x).double()
    rms = _rms(x)
    assert clipped.abs().max().item() == pytest.approx(2.5 * rms, rel=1e-5)
    assert torch.equal(clipped[x.abs() < 2.5 * rms], x.double()[x.abs() < 2.5 * rms])
    acc = torch.zeros(512, dtype=torch.float64)
    for _ in range(draws):
        acc += comp.decompress(*comp.compress(x, "t")).double()
    mean = acc / draws
    s = clipped.abs().max()
    p = clipped.abs() / s
    se = s * torch.sqrt(p * (1 - p)) / math.sqrt(draws)
    assert torch.all((mean - clipped).abs() <= 5 * se + 1e-6)
    # the variance the clipping saves: per element s |x| - x^2, with s = 2.5 rms instead of 40
    var_clip = float((s * clipped.abs() - clipped**2).sum())
    var_raw = float((40.0 * x.abs().double() - x.double() ** 2).sum())
    assert var_raw > 5 * var_clip


def test_terngrad_clip_argument() -> None:
    with pytest.raises(ValueError, match="2.5"):
        TernGrad(clip=0)
    x = torch.randn(300, generator=torch.Generator().manual_seed(1))
    assert torch.equal(TernGrad(clip=None).clipped(x), x)


# ----------------------------------------------------------------------------- momentum before the compressor


def test_momentum_in_error_feedback_equals_sgd_momentum_when_lossless() -> None:
    """EF(momentum 0.9) with a lossless inner compressor + SGD(momentum 0) == SGD(momentum 0.9)."""
    torch.manual_seed(0)
    w0 = torch.randn(20, 10)
    a, b = w0.clone().requires_grad_(), w0.clone().requires_grad_()
    opt_a = torch.optim.SGD([a], lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD([b], lr=0.1, momentum=0.0)
    ef = ErrorFeedback(Identity(), momentum=0.9)
    target = torch.randn(20, 10)
    for _ in range(30):
        for w in (a, b):
            w.grad = None
            ((w - target) ** 3).abs().sum().backward()
        opt_a.step()
        assert b.grad is not None
        b.grad = ef.decompress(*ef.compress(b.grad, "w"))
        opt_b.step()
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    assert (a - w0).abs().max() > 0.1


def test_error_feedback_with_momentum_loses_nothing() -> None:
    """sum(sent) == sum(velocity) - final residual, and the velocity is the heavy-ball sum."""
    beta = 0.9
    ef = ErrorFeedback(SignSGD(block=64), momentum=beta)
    v = torch.zeros(300, dtype=torch.float64)
    v_sum = torch.zeros_like(v)
    sent_sum = torch.zeros_like(v)
    for t in range(40):
        g = torch.randn(300, generator=torch.Generator().manual_seed(t))
        sent_sum += ef.decompress(*ef.compress(g, "w")).double()
        v = beta * v + g.double()
        v_sum += v
    assert torch.allclose(ef.velocity("w").double(), v, atol=1e-4)  # type: ignore[union-attr]
    assert (sent_sum - (v_sum - ef.residual("w").double())).abs().max().item() < 1e-3  # type: ignore[union-attr]


def test_momentum_is_not_applied_again_to_the_owners_combined_chunk() -> None:
    """Through the quantized collective: owners' residuals are plain error feedback, velocities per rank."""
    p, n, beta = 3, 900, 0.9
    comps = [ErrorFeedback(SignSGD(block=100), momentum=beta) for _ in range(p)]
    acc = torch.zeros(n, dtype=torch.float64)
    vel = torch.zeros(p, n, dtype=torch.float64)
    vel_sum = torch.zeros_like(vel)
    for s in range(15):
        gs = [torch.randn(n, generator=torch.Generator().manual_seed(100 * s + r)) for r in range(p)]

        def fn(t: Transport) -> torch.Tensor:
            x = gs[t.rank].clone()
            compressed_allreduce(x, comps[t.rank], "b", t)
            return x

        acc += run_threads(p, fn)[0].double()
        vel = beta * vel + torch.stack(gs).double()
        vel_sum += vel
    worker, server = two_phase_residuals(comps, "b", n)
    for r, c in enumerate(comps):
        assert c.velocity(f"b#{r}/agg") is None
    assert (acc - ((vel_sum - worker).mean(0) - server)).abs().max().item() < 1e-3


def test_momentum_state_round_trips_and_resets() -> None:
    ef = ErrorFeedback(OneBit(), momentum=0.5)
    for t in range(3):
        ef.compress(torch.randn(700, generator=torch.Generator().manual_seed(t)), "w")
    state = ef.state_dict()
    assert set(state) == {"residuals", "velocity", "inner"} and "w" in state["velocity"]
    nxt = torch.randn(700, generator=torch.Generator().manual_seed(9))
    want = ef.decompress(*ef.compress(nxt, "w"))
    clone = ErrorFeedback(OneBit(), momentum=0.5)
    clone.load_state_dict(state)
    assert torch.equal(clone.decompress(*clone.compress(nxt, "w")), want)
    with pytest.raises(ValueError, match="momentum 0"):
        ErrorFeedback(OneBit()).load_state_dict(state)
    clone.reset()
    assert clone.velocity("w") is None and clone.residual("w") is None
    assert repr(clone) == "ErrorFeedback(OneBit(column_size=512, scale='rms'), momentum=0.5)"


def test_scale_specs() -> None:
    assert from_spec("sign").inner.scale == "rms"  # type: ignore[attr-defined]
    assert from_spec("sign:mean").inner.scale == "mean"  # type: ignore[attr-defined]
    mv = from_spec("sign:mv:mean").inner  # type: ignore[attr-defined]
    assert mv.majority_vote and mv.scale == "mean"
    assert from_spec("onebit:mean").inner.scale == "mean"  # type: ignore[attr-defined]
    for bad in ("sign:x", "onebit:mv"):
        with pytest.raises(ConfigError, match="takes"):
            from_spec(bad)


def test_from_spec_puts_momentum_where_it_belongs() -> None:
    for spec in ("sign", "sign:mv", "onebit"):
        c = from_spec(spec, momentum=0.9)
        assert isinstance(c, ErrorFeedback) and c.momentum == 0.9, spec
        assert from_spec(spec).momentum == 0.0
        assert not isinstance(from_spec(spec, error_feedback=False, momentum=0.9), ErrorFeedback)
    for spec in ("topk:0.01", "threshold", "powersgd:2", "qsgd", "terngrad", "fp16", "none", "randomk:0.1:memory"):
        assert from_spec(spec, momentum=0.9).momentum == 0.0, spec  # the optimizer keeps it
    with pytest.raises(ConfigError, match=r"\[0, 1\)"):
        from_spec("sign", momentum=1.0)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        ErrorFeedback(SignSGD(), momentum=-0.1)


def test_dtrain_run_moves_momentum_from_the_optimizer_into_the_compressor(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from dtrain.config.schema import RunConfig
    from dtrain.job.run import TrainContext

    def ctx(**kw: object) -> TrainContext:
        cfg = validate(RunConfig.make(workers=2, out=str(tmp_path), **kw))  # type: ignore[arg-type]
        return TrainContext(cfg, 0, 2, tmp_path, None, None, None)  # type: ignore[arg-type]

    w = [torch.nn.Parameter(torch.zeros(3))]
    c = ctx(compression="sign")
    assert c.make_compressor().momentum == 0.9
    assert c.make_optimizer(w).param_groups[0]["momentum"] == 0.0
    c = ctx(compression="topk:0.01")
    assert c.make_compressor().momentum == 0.0
    assert c.make_optimizer(w).param_groups[0]["momentum"] == 0.9
    c = ctx(compression="onebit", strategy="ps", servers=1)
    assert c.make_compressor().momentum == 0.9 and c.make_optimizer(w).param_groups[0]["momentum"] == 0.0
    c = ctx(compression="sign", error_feedback=False)
    assert c.make_compressor().momentum == 0.0 and c.make_optimizer(w).param_groups[0]["momentum"] == 0.9
    assert ctx(strategy="ddp").make_optimizer(w).param_groups[0]["momentum"] == 0.9
    with pytest.raises(ConfigError, match="belongs to strategy dp / hybrid / ps"):  # torch DDP compresses nothing
        ctx(compression="sign", strategy="ddp")


# ----------------------------------------------------------------------------- majority vote on the server


def _ps_one_step(spec: str, grads: list[torch.Tensor]) -> torch.Tensor:
    """One bsp step of a real ParameterServer (ranks as threads), SGD lr 1: returns the update."""
    import torch.distributed as dist

    from dtrain.comm.transport import ThreadTransport
    from dtrain.param_server import ParameterServer

    workers = len(grads)
    store = dist.HashStore()
    ts = ThreadTransport.create(1 + workers, timeout=5.0)

    def rank_fn(t: Transport) -> torch.Tensor | None:
        m = torch.nn.Linear(grads[0].numel(), 1, bias=False)
        with torch.no_grad():
            m.weight.zero_()
        ps = ParameterServer(
            m,
            lambda p: torch.optim.SGD(p, lr=1.0),
            servers=1,
            consistency="bsp",
            transport=t,
            store=store,
            timeout_s=10.0,
            compression=from_spec(spec, error_feedback=False),
        )
        if ps.is_server:
            ps.serve()
            return None
        m.weight.grad = grads[ps.worker_index].view(1, -1).clone()
        ps.step()
        ps.finish()
        return -m.weight.detach().reshape(-1).clone()

    return run_threads(1 + workers, rank_fn, timeout=20.0, transports=ts)[1]


def test_parameter_server_aggregates_sign_mv_by_majority_vote() -> None:
    """The server's average is majority vote for sign:mv (it was the plain mean), the mean for sign."""
    g = torch.Generator().manual_seed(4)
    grads = [torch.randn(40, generator=g) * (r + 1) for r in range(3)]
    decoded = [SignSGD(block=512).decompress(*SignSGD(block=512).compress(x, "k")) for x in grads]
    mv = SignSGD(majority_vote=True).combine(decoded)
    mean = torch.stack(decoded).mean(0)
    assert (mv - mean).abs().max() > 0.5  # the two rules differ here: the test can fail
    assert torch.allclose(_ps_one_step("sign:mv", grads), mv, atol=1e-6)
    assert torch.allclose(_ps_one_step("sign", grads), mean, atol=1e-6)
    assert not from_spec("sign:mv", momentum=0.9).mean_combine and from_spec("sign").mean_combine


# ----------------------------------------------------------------------------- rand-k with memory


def test_randomk_memory_is_unscaled_and_gets_error_feedback() -> None:
    c = from_spec("randomk:0.1:memory")
    assert isinstance(c, ErrorFeedback) and isinstance(c.inner, RandomK) and not c.inner.scale
    x = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    y = c.decompress(*c.compress(x, "k"))
    kept = y != 0
    assert int(kept.sum()) == 100 and torch.equal(y[kept], x[kept])  # values as they are
    # the unbiased, scaled form is still the default and still unbiased (test_compress.py)
    for spec in ("randomk:0.1", "randomk:0.1:unbiased"):
        u = from_spec(spec)
        assert isinstance(u, RandomK) and u.scale and not u.biased
    assert from_spec("randomk:memory").inner.ratio == 0.01  # type: ignore[attr-defined]
    bad_specs = [
        ("randomk:0.1:x", "RATIO:memory"),
        ("randomk:abc", "ratio must be a float"),
        ("randomk:0", "in \\(0, 1\\]"),
    ]
    for bad, msg in bad_specs:
        with pytest.raises(ConfigError, match=msg):
            from_spec(bad)


def test_randomk_memory_loses_nothing() -> None:
    ef = ErrorFeedback(RandomK(ratio=0.05, scale=False, seed=3))
    g_sum = torch.zeros(400, dtype=torch.float64)
    sent_sum = torch.zeros_like(g_sum)
    for t in range(50):
        g = torch.randn(400, generator=torch.Generator().manual_seed(t))
        sent_sum += ef.decompress(*ef.compress(g, "w")).double()
        g_sum += g.double()
    assert (sent_sum - (g_sum - ef.residual("w").double())).abs().max().item() < 1e-4  # type: ignore[union-attr]
