"""Compressors in one process: round trips, packed sizes, unbiasedness, error feedback, state, specs."""

from __future__ import annotations

import io
import math

import pytest
import torch

from dtrain.compress import (
    BF16,
    FP16,
    QSGD,
    REGISTRY,
    Compressor,
    ErrorFeedback,
    Identity,
    OneBit,
    PowerSGD,
    RandomK,
    SignSGD,
    TernGrad,
    Threshold,
    TopK,
    from_spec,
    resolve,
)
from dtrain.compress._bits import pack_bits, unpack_bits
from dtrain.compress.base import pack_payload, payload_nbytes, unpack_payload
from dtrain.errors import ConfigError
from dtrain.job.validate import validate


def _all() -> list[Compressor]:
    return [
        Identity(),
        FP16(),
        BF16(),
        QSGD(levels=16, seed=1),
        QSGD(levels=4, block=64, seed=1),
        TernGrad(seed=1),
        SignSGD(),
        SignSGD(majority_vote=True),
        OneBit(),
        TopK(ratio=0.05),
        RandomK(ratio=0.05, seed=1),
        Threshold(value=0.5),
        PowerSGD(rank=2),
    ]


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- bits and wire


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1001])
def test_pack_bits_round_trip(bits: int, n: int) -> None:
    codes = torch.randint(0, 2**bits, (n,), generator=torch.Generator().manual_seed(n))
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n * bits / 8)
    assert torch.equal(unpack_bits(packed, bits, n), codes)


def test_payload_wire_format_round_trip() -> None:
    payload = [
        torch.arange(5, dtype=torch.int32),
        _x(2, 3).half(),
        _x(3).bfloat16(),
        torch.zeros(0, dtype=torch.float64),
    ]
    back = unpack_payload(pack_payload(payload))
    assert [(t.dtype, t.shape) for t in back] == [(t.dtype, t.shape) for t in payload]
    assert all(torch.equal(a, b) for a, b in zip(payload, back))
    with pytest.raises(ValueError, match="trailing"):
        unpack_payload(torch.cat([pack_payload(payload), torch.zeros(1, dtype=torch.uint8)]))
    with pytest.raises(ValueError, match="needs"):
        unpack_payload(pack_payload(payload)[:-3])


@pytest.mark.parametrize("comp", _all(), ids=repr)
@pytest.mark.parametrize("shape", [(1,), (5,), (1000,), (33, 17), (4, 3, 5, 5)])
def test_round_trip_shape_dtype_and_wire(comp: Compressor, shape: tuple[int, ...]) -> None:
    x = _x(*shape)
    payload, ctx = comp.compress(x, "k")
    y = comp.decompress(payload, ctx)
    assert y.shape == x.shape and y.dtype == x.dtype and torch.isfinite(y).all()
    # the wire carries the same payload: decoding it gives what decompress gave
    buf = comp.to_wire(x, "k2")
    assert buf.dtype == torch.uint8 and buf.dim() == 1
    z = comp.from_wire(buf, x.shape, x.dtype)
    assert z.shape == x.shape and z.dtype == x.dtype
    if comp.name in ("none", "fp16", "bf16", "sign", "onebit", "topk", "threshold"):  # deterministic
        assert torch.equal(z, y)


def test_round_trip_fp16_input_keeps_dtype() -> None:
    x = _x(300).half()
    for comp in _all():
        payload, ctx = comp.compress(x, "h")
        assert comp.decompress(payload, ctx).dtype == torch.float16


def test_exact_compressors() -> None:
    x = _x(50, 20)
    assert torch.equal(Identity().decompress(*Identity().compress(x, "a")), x)
    assert torch.equal(FP16().decompress(*FP16().compress(x, "a")), x.half().float())
    assert torch.equal(BF16().decompress(*BF16().compress(x, "a")), x.bfloat16().float())
    assert torch.equal(TopK(ratio=1.0).decompress(*TopK(ratio=1.0).compress(x, "a")), x)


# ----------------------------------------------------------------------------- packed sizes


@pytest.mark.parametrize(
    "comp, bits_per_elem, scale_bytes_per_elem",
    [
        (QSGD(levels=16), 5, 4 / 512),
        (QSGD(levels=2), 2, 4 / 512),
        (QSGD(levels=128), 8, 4 / 512),
        (TernGrad(), 2, 4 / 512),
        (SignSGD(), 1, 4 / 512),
        (OneBit(), 1, 8 / 512),
        (FP16(), 16, 0),
        (BF16(), 16, 0),
    ],
    ids=repr,
)
def test_quantizer_payload_bytes(comp: Compressor, bits_per_elem: int, scale_bytes_per_elem: float) -> None:
    n = 512 * 40
    expected = n * bits_per_elem // 8 + int(n * scale_bytes_per_elem)
    assert payload_nbytes(comp.compress(_x(n), "k")[0]) == expected


def test_sparse_payload_is_int32_indices_plus_values() -> None:
    x = _x(10_000)
    payload, _ = TopK(ratio=0.01).compress(x, "k")
    assert payload[0].dtype == torch.int32 and payload[1].dtype == torch.float32
    assert payload[0].numel() == 100 and payload_nbytes(payload) == 800
    assert torch.all(payload[0][1:] > payload[0][:-1])  # ascending


def test_powersgd_payload_is_two_factors() -> None:
    x = _x(64, 100)
    payload, _ = PowerSGD(rank=2).compress(x, "k")
    assert [tuple(t.shape) for t in payload] == [(64, 2), (100, 2)]
    # too small to gain: sent dense
    assert len(PowerSGD(rank=2).compress(_x(3, 3), "s")[0]) == 1


# ----------------------------------------------------------------------------- semantics


def test_topk_keeps_largest_magnitudes() -> None:
    x = torch.tensor([0.1, -5.0, 0.2, 3.0, -0.3, 0.0])
    y = TopK(ratio=0.3).decompress(*TopK(ratio=0.3).compress(x, "k"))  # k = ceil(1.8) = 2
    assert torch.equal(y, torch.tensor([0.0, -5.0, 0.0, 3.0, 0.0, 0.0]))


def test_threshold_keeps_at_or_above() -> None:
    x = torch.tensor([0.5, -0.49, -2.0, 0.0])
    y = Threshold(value=0.5).decompress(*Threshold(value=0.5).compress(x, "k"))
    assert torch.equal(y, torch.tensor([0.5, 0.0, -2.0, 0.0]))
    empty, _ = Threshold(value=10.0).compress(x, "k")
    assert empty[0].numel() == 0


def test_sign_scales_by_block_mean_magnitude() -> None:
    x = torch.tensor([1.0, -3.0, 2.0, -2.0, 4.0])
    c = SignSGD(block=4, scale="mean")
    y = c.decompress(*c.compress(x, "k"))
    assert torch.allclose(y, torch.tensor([2.0, -2.0, 2.0, -2.0, 4.0]))


def test_sign_rms_scale_keeps_each_blocks_norm() -> None:
    x = torch.tensor([1.0, -3.0, 2.0, -2.0, 4.0])
    y = SignSGD(block=4).decompress(*SignSGD(block=4).compress(x, "k"))  # default scale="rms"
    s = math.sqrt((1 + 9 + 4 + 4) / 4)
    assert torch.allclose(y, torch.tensor([s, -s, s, -s, 4.0]))
    assert torch.allclose(y[:4].norm(), x[:4].norm())


def test_majority_vote_combines_signs() -> None:
    mv = SignSGD(majority_vote=True, block=8)
    decoded = [torch.tensor([1.0, 1.0, -1.0]), torch.tensor([2.0, -2.0, -2.0]), torch.tensor([3.0, -3.0, 3.0])]
    assert torch.allclose(mv.combine(decoded), torch.tensor([2.0, -2.0, -2.0]))
    assert torch.allclose(SignSGD().combine(decoded), torch.tensor([2.0, -4 / 3, 0.0]))


def test_onebit_reconstructs_column_means() -> None:
    x = torch.tensor([1.0, 3.0, -2.0, -4.0, 5.0, -1.0])
    c = OneBit(column_size=4, scale="mean")
    y = c.decompress(*c.compress(x, "k"))
    assert torch.allclose(y, torch.tensor([2.0, 2.0, -3.0, -3.0, 5.0, -1.0]))
    # default scale="rms": each sign class keeps its norm
    y = OneBit(column_size=4).decompress(*OneBit(column_size=4).compress(x, "k"))
    p, n = math.sqrt((1 + 9) / 2), -math.sqrt((4 + 16) / 2)
    assert torch.allclose(y, torch.tensor([p, p, n, n, 5.0, -1.0]))


def test_powersgd_exact_on_low_rank_matrix_after_warm_start() -> None:
    a, b = _x(40, 2, seed=1), _x(30, 2, seed=2)
    m = a @ b.t()
    ps = PowerSGD(rank=2)
    for _ in range(2):  # the first power step from a random Q already spans rank 2
        y = ps.decompress(*ps.compress(m, "w"))
    assert torch.allclose(y, m, atol=1e-4, rtol=1e-4)
    assert "w" in ps.state_dict()["q"]


# ----------------------------------------------------------------------------- unbiasedness


def _mean(comp: Compressor, x: torch.Tensor, draws: int) -> torch.Tensor:
    acc = torch.zeros_like(x, dtype=torch.float64)
    for _ in range(draws):
        acc += comp.decompress(*comp.compress(x, "u")).double()
    return acc / draws


def test_qsgd_unbiased() -> None:
    """Mean of T draws is within 5 standard errors of x, per element.

    One element's draw is ``sign * norm/s * l`` with ``l`` = floor(r) + Bernoulli(frac(r)),
    variance ``(norm/s)^2 f (1 - f)``, f = frac(r).
    """
    x, draws, comp = _x(256, seed=3), 4000, QSGD(levels=4, block=64, seed=7)
    mean = _mean(comp, x, draws)
    s = comp.levels - 1
    norms = x.view(-1, 64).norm(dim=1).repeat_interleave(64).double()
    r = x.abs().double() / norms * s
    f = r - r.floor()
    se = (norms / s) * torch.sqrt(f * (1 - f)) / math.sqrt(draws)
    assert torch.all((mean - x.double()).abs() <= 5 * se + 1e-6)
    # and the estimate is not trivially exact: elements do vary between draws
    assert (se > 0).sum() > 200


def test_terngrad_unbiased() -> None:
    x, draws, comp = _x(256, seed=4), 4000, TernGrad(block=64, clip=None, seed=7)
    mean = _mean(comp, x, draws)
    scale = x.view(-1, 64).abs().amax(dim=1).repeat_interleave(64).double()
    p = x.abs().double() / scale
    se = scale * torch.sqrt(p * (1 - p)) / math.sqrt(draws)
    assert torch.all((mean - x.double()).abs() <= 5 * se + 1e-6)


def test_randomk_unbiased() -> None:
    x, draws, comp = _x(200, seed=5), 4000, RandomK(ratio=0.1, seed=7)
    mean = _mean(comp, x, draws)
    n, k = 200, 20
    se = x.abs().double() * math.sqrt(n / k - 1) / math.sqrt(draws)
    assert torch.all((mean - x.double()).abs() <= 5 * se + 1e-6)


def test_biased_compressor_fails_the_same_test() -> None:
    """The unbiasedness check can fail: TopK's mean stays far from x."""
    x = _x(200, seed=5)
    mean = _mean(TopK(ratio=0.1), x, 10)
    assert (mean - x.double()).abs().max() > 0.1


# ----------------------------------------------------------------------------- error feedback


@pytest.mark.parametrize(
    "inner",
    [TopK(ratio=0.05), SignSGD(), OneBit(), Threshold(value=1.0), PowerSGD(rank=1)],
    ids=repr,
)
def test_error_feedback_loses_nothing(inner: Compressor) -> None:
    """sum(sent) == sum(gradients) - final residual, up to float rounding.

    (For the biased, contractive compressors error feedback is meant for; with a
    scaled unbiased one such as RandomK the residual grows without bound.)
    """
    ef = ErrorFeedback(inner)
    g_sum = torch.zeros(30, 40, dtype=torch.float64)
    sent_sum = torch.zeros_like(g_sum)
    for t in range(60):
        g = _x(30, 40, seed=100 + t)
        sent = ef.decompress(*ef.compress(g, "w"))
        g_sum += g.double()
        sent_sum += sent.double()
    residual = ef.residual("w")
    assert residual is not None
    err = (sent_sum - (g_sum - residual.double())).abs().max().item()
    assert err < 1e-4, err  # 60 float32 roundings of values of size ~10
    # and feedback matters: without it the sums differ by much more
    assert (sent_sum - g_sum).abs().max().item() > 100 * err


def test_error_feedback_rejects_shape_change_and_double_wrap() -> None:
    ef = ErrorFeedback(TopK())
    ef.compress(_x(10), "a")
    with pytest.raises(ValueError, match="one key per tensor"):
        ef.compress(_x(11), "a")
    with pytest.raises(ValueError, match="twice"):
        ErrorFeedback(ef)


# ----------------------------------------------------------------------------- state


def test_state_dict_round_trip_restores_residuals_q_and_rng() -> None:
    for comp in (ErrorFeedback(PowerSGD(rank=2)), ErrorFeedback(TopK(0.1)), QSGD(seed=3), RandomK(0.1, seed=3)):
        for t in range(3):
            comp.compress(_x(20, 30, seed=t), "w")
        buf = io.BytesIO()
        torch.save(comp.state_dict(), buf)  # what a checkpoint does with it
        buf.seek(0)
        state = torch.load(buf)
        after = [comp.decompress(*comp.compress(_x(20, 30, seed=9), "w")) for _ in range(2)]
        if isinstance(comp, ErrorFeedback):
            clone = ErrorFeedback(type(comp.inner)(**_fields(comp.inner)))
        else:
            clone = type(comp)(**_fields(comp))
        clone.load_state_dict(state)
        again = [clone.decompress(*clone.compress(_x(20, 30, seed=9), "w")) for _ in range(2)]
        assert all(torch.equal(a, b) for a, b in zip(after, again)), comp


def _fields(c: Compressor) -> dict[str, object]:
    return {f.name: getattr(c, f.name) for f in c.__dataclass_fields__.values() if f.init}  # type: ignore[attr-defined]


def test_stateless_rejects_state() -> None:
    with pytest.raises(ValueError, match="stateless"):
        TopK().load_state_dict({"x": 1})


# ----------------------------------------------------------------------------- specs


def test_every_registry_name_builds_and_round_trips() -> None:
    expected = {
        "none",
        "fp16",
        "bf16",
        "qsgd",
        "terngrad",
        "sign",
        "onebit",
        "topk",
        "randomk",
        "threshold",
        "powersgd",
    }
    assert expected <= set(REGISTRY)
    x = _x(64, 64)
    for name in REGISTRY:
        c = from_spec(name)
        assert isinstance(c, Compressor) and c.name == name
        assert isinstance(c, ErrorFeedback) == c.biased
        assert c.decompress(*c.compress(x, "k")).shape == x.shape


def test_from_spec_arguments_and_errors() -> None:
    assert from_spec("topk:0.05").inner.ratio == 0.05  # type: ignore[attr-defined]
    assert from_spec("qsgd:4").levels == 4  # type: ignore[attr-defined]
    assert from_spec("powersgd:3", error_feedback=False).rank == 3  # type: ignore[attr-defined]
    assert from_spec("sign:mv").inner.majority_vote  # type: ignore[attr-defined]
    assert isinstance(from_spec("topk", error_feedback=False), TopK)
    assert isinstance(from_spec(None), Identity)
    c = TopK()
    assert from_spec(c) is c
    for bad, msg in [
        ("nope", "choose one of"),
        ("topk:abc", "ratio must be a float"),
        ("topk:0", "ratio must be in"),
        ("qsgd:3", "power of two"),
        ("qsgd:256", "<= 128"),
        ("threshold:-1", "> 0"),
        ("powersgd:0", ">= 1"),
        ("fp16:2", "no argument"),
        ("sign:x", "majority"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            from_spec(bad)


def test_resolve_gives_none_or_identity_for_none_and_from_spec_otherwise() -> None:
    """The engines' one resolution of ``compression=``: DataParallel and hybrid (off), the parameter
    server (Identity); a spec is from_spec's, a compressor is kept."""
    for off in (None, "none", " None "):
        assert resolve(off, none_is_off=True) is None
        assert type(resolve(off, none_is_off=False)) is Identity
    c = TopK()
    for none_is_off in (True, False):
        assert resolve(c, none_is_off=none_is_off) is c
        got = resolve("topk:0.05", none_is_off=none_is_off)
        assert isinstance(got, ErrorFeedback) and repr(got) == repr(from_spec("topk:0.05"))
        assert isinstance(resolve("qsgd:4", none_is_off=none_is_off), QSGD)
    with pytest.raises(ConfigError, match="pull_compression must be a spec string"):
        resolve(3, none_is_off=False, what="pull_compression")
    with pytest.raises(ConfigError, match="choose one of"):
        resolve("nope", none_is_off=True)


def test_every_registry_name_reachable_from_cli() -> None:
    from dtrain.cli import build_parser, config_from_args

    specs = {
        "qsgd": "qsgd:8",
        "topk": "topk:0.02",
        "randomk": "randomk:0.1",
        "threshold": "threshold:0.01",
        "powersgd": "powersgd:1",
        "sign": "sign:mv",
    }
    for name in REGISTRY:
        spec = specs.get(name, name)
        for flag, wrapped in (("--error-feedback", True), ("--no-error-feedback", False)):
            cfg = validate(config_from_args(build_parser().parse_args(["run", "--compression", spec, flag])))
            c = from_spec(cfg.options.compression, error_feedback=cfg.options.error_feedback)
            assert c.name == name
            assert isinstance(c, ErrorFeedback) == (wrapped and c.biased)


# ----------------------------------------------------------------------------- layout on the wire


def test_powersgd_wire_with_layout_factors_each_matrix() -> None:
    """The parameter server's path: a flat shard of several tensors, decoded without the layout."""
    shapes = [(20, 30), (30,), (16, 4, 3, 3), (7,)]
    a1, a2 = _x(20, 2, seed=1), _x(16, 2, seed=2)
    flat = torch.cat(
        [(a1 @ _x(2, 30, seed=3)).reshape(-1), _x(30, seed=4), (a2 @ _x(2, 36, seed=5)).reshape(-1), _x(7, seed=6)]
    )
    sender, receiver = PowerSGD(rank=2), PowerSGD(rank=2)
    buf = sender.to_wire(flat, "ps/shard0", shapes=shapes)
    got = receiver.from_wire(buf, flat.shape, flat.dtype)
    assert torch.allclose(got, flat, atol=1e-4)  # rank-2 matrices, dense vectors: exact
    floats = (20 + 30) * 2 + 30 + (16 + 36) * 2 + 7
    assert buf.numel() <= 4 * floats + 4 * 8 + 1 + 2 * 11 + 4 * 15  # factors, vectors, table, headers
    assert sorted(sender.state_dict()["q"]) == ["ps/shard0/0", "ps/shard0/2"]
    # other compressors ignore the layout
    assert torch.equal(
        TopK(0.1).from_wire(TopK(0.1).to_wire(flat, "k", shapes=shapes), flat.shape, flat.dtype),
        TopK(0.1).decompress(*TopK(0.1).compress(flat, "k")),
    )
    with pytest.raises(ValueError, match="shapes describe"):
        sender.to_wire(flat, "x", shapes=[(3, 3)])


def test_error_feedback_with_layout_loses_nothing() -> None:
    shapes = [(30, 40), (40,)]
    ef = ErrorFeedback(PowerSGD(rank=1))
    g_sum = torch.zeros(1240, dtype=torch.float64)
    sent_sum = torch.zeros_like(g_sum)
    for t in range(30):
        g = _x(1240, seed=300 + t)
        sent_sum += ef.from_wire(ef.to_wire(g, "w", shapes=shapes), g.shape, g.dtype).double()
        g_sum += g.double()
    assert (sent_sum - (g_sum - ef.residual("w").double())).abs().max().item() < 1e-4  # type: ignore[union-attr]
