"""The GPT models (dtrain.workloads.models.gpt) and the pytext language-modelling dataset (dtrain.workloads.data)."""

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dtrain.workloads.data import DATASETS, load_dataset, pytext_bytes, unigram_entropy
from dtrain.workloads.models import GPT_PRESETS, MODELS, GPTConfig, build_model, generate, gpt_config, is_language_model
from dtrain.workloads.models.gpt import Block, CausalSelfAttention, Embedding, build_gpt, resolve_gpt_config


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matmuls run fastest on one thread, and the test machine is shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _tiny(seed: int = 0, **kw) -> nn.Sequential:
    torch.manual_seed(seed)
    return build_gpt("gpt-tiny", **kw)


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- the model


def test_forward_shape_dtype_and_short_sequences():
    m = _tiny()
    x = torch.randint(0, 256, (3, 64))
    out = m(x)
    assert out.shape == (3, 64, 256) and out.dtype == torch.float32
    assert m(x[:, :10]).shape == (3, 10, 256)  # shorter than seq_len: positions 0..9
    # the first 10 positions do not depend on what follows, so a prefix gives the same logits
    torch.testing.assert_close(m(x[:, :10]), out[:, :10], atol=1e-5, rtol=1e-5)


def test_longer_than_seq_len_and_bad_rank_raise():
    m = _tiny(seq_len=16)
    with pytest.raises(ValueError, match="seq_len 16"):
        m(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="batch, seq"):
        m(torch.zeros(16, dtype=torch.long))


def test_param_counts_of_presets():
    assert set(GPT_PRESETS) == {"gpt-tiny", "gpt-small", "gpt-medium"}
    for name in ("gpt-tiny", "gpt-small"):  # the closed form agrees with the built model
        assert GPT_PRESETS[name].num_params() == _count(build_gpt(name))
    small = GPT_PRESETS["gpt-small"].num_params()
    assert 4_500_000 <= small <= 5_500_000, small
    medium = build_gpt("gpt-medium")  # built once
    assert _count(medium) == GPT_PRESETS["gpt-medium"].num_params()
    assert 35_000_000 <= _count(medium) <= 45_000_000, _count(medium)


def test_causality():
    m = _tiny(seed=1).eval()
    x = torch.randint(0, 256, (2, 20))
    t = 7
    x2 = x.clone()
    x2[:, t] = (x2[:, t] + 1) % 256
    a, b = m(x), m(x2)
    torch.testing.assert_close(a[:, :t], b[:, :t], atol=1e-6, rtol=0)  # the past does not see the future
    assert (a[:, t] - b[:, t]).abs().max() > 1e-4  # position t sees its own token
    assert (a[:, t + 1 :] - b[:, t + 1 :]).abs().amax(dim=-1).min() > 1e-6  # and every later one sees it too


def test_is_a_cuttable_sequential_with_documented_names():
    m = _tiny()
    assert type(m) is nn.Sequential
    assert [n for n, _ in m.named_children()] == ["embed", "block0", "block1", "ln_f", "head"]
    assert isinstance(m.embed, Embedding) and isinstance(m.block1, Block)
    assert isinstance(m.block0.attn, CausalSelfAttention) and isinstance(m.ln_f, nn.LayerNorm)
    sd = m.state_dict()
    d = 64
    assert sd["embed.tok.weight"].shape == (256, d) and sd["embed.pos.weight"].shape == (64, d)
    assert sd["block1.attn.qkv.weight"].shape == (3 * d, d) and sd["block1.attn.proj.weight"].shape == (d, d)
    assert sd["block1.mlp.fc1.weight"].shape == (4 * d, d) and sd["block1.mlp.fc2.weight"].shape == (d, 4 * d)
    assert {"block0.ln1.weight", "block0.ln2.bias", "ln_f.weight", "head.bias"} <= set(sd)
    assert sd["head.weight"].shape == (256, d)
    assert m.head.weight.data_ptr() != m.embed.tok.weight.data_ptr()  # no weight tying


def test_child_by_child_equals_whole_and_cut_halves():
    m = _tiny().eval()
    x = torch.randint(0, 256, (2, 32))
    whole = m(x)
    h = x
    for child in m:
        h = child(h)
    assert torch.equal(h, whole)
    first, second = m[:2], m[2:]  # a pipeline cut after block0
    assert [n for n, _ in second.named_children()] == ["block1", "ln_f", "head"]
    assert torch.equal(second(first(x)), whole)


def test_same_seed_same_weights_and_gpt2_init():
    a, b, c = _tiny(seed=5), _tiny(seed=5), _tiny(seed=6)
    for (na, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), na
    assert not torch.equal(a.block0.attn.qkv.weight, c.block0.attn.qkv.weight)
    torch.manual_seed(0)
    s = build_gpt("gpt-small")  # 6 layers: residual projections get std 0.02 / sqrt(12)
    assert s.block0.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert s.embed.tok.weight.std().item() == pytest.approx(0.02, rel=0.05)
    for w in (s.block3.attn.proj.weight, s.block3.mlp.fc2.weight):
        assert w.std().item() == pytest.approx(0.02 / math.sqrt(12), rel=0.05)
    assert torch.count_nonzero(s.block2.mlp.fc1.bias) == 0 and torch.count_nonzero(s.head.bias) == 0


def test_dropout_only_in_training():
    m = _tiny(dropout=0.2)
    x = torch.randint(0, 256, (2, 16))
    m.train()
    assert not torch.equal(m(x), m(x))
    m.eval()
    assert torch.equal(m(x), m(x))


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"d_model": 65, "heads": 4}, "divisible by heads"),
        ({"layers": 0}, "layers must be >= 1"),
        ({"heads": -1}, "heads must be >= 1"),
        ({"vocab_size": 0}, "vocab_size must be >= 1"),
        ({"seq_len": 0}, "seq_len must be >= 1"),
        ({"dropout": 1.0}, "0 <= dropout < 1"),
        ({"dropout": -0.1}, "0 <= dropout < 1"),
        ({"layers": 2.5}, "must be an int"),
    ],
)
def test_bad_configs_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kw)


def test_presets_overrides_and_build_model():
    assert MODELS == ("cnn", "mlp", "gpt", "gpt-tiny", "gpt-small", "gpt-medium")
    assert all(is_language_model(n) for n in MODELS[2:]) and not is_language_model("cnn")
    # "gpt" is gpt-small's shape, resized by keyword; 0 / None mean "the preset's value"
    assert resolve_gpt_config("gpt", layers=4) == GPTConfig(layers=4, d_model=256, heads=8)
    assert resolve_gpt_config("gpt-tiny", layers=0, d_model=None, heads=0) == GPT_PRESETS["gpt-tiny"]
    m = build_model("gpt-small", (64,), 256)
    assert gpt_config(m) == GPT_PRESETS["gpt-small"]
    cfg = gpt_config(build_model("gpt-tiny", vocab_size=256, seq_len=48))
    assert cfg is not None and (cfg.vocab_size, cfg.seq_len) == (256, 48)
    cfg = gpt_config(build_model("gpt-tiny", (16,), 100, seq_len=32))  # keywords beat input_shape / num_classes
    assert cfg is not None and (cfg.vocab_size, cfg.seq_len, cfg.layers) == (100, 32, 2)
    cfg = gpt_config(build_model("gpt-tiny", (16,), 100, seq_len=0))
    assert cfg is not None and cfg.seq_len == 16
    assert gpt_config(build_model("cnn")) is None
    with pytest.raises(ValueError, match="vocab_size, seq_len, layers, d_model, heads, dropout"):
        build_model("gpt-tiny", depth=3)
    with pytest.raises(ValueError, match="only apply to GPT"):
        build_model("cnn", layers=3)
    assert isinstance(build_model("mlp", layers=0), nn.Sequential)  # CLI defaults of 0 are harmless
    with pytest.raises(ValueError, match="choose one of"):
        build_model("gpt-huge")


# ---------------------------------------------------------------- generate


def test_generate_shape_range_and_determinism():
    m = _tiny(seed=2)
    prompt = torch.tensor([1, 2, 3, 4, 5])
    a = generate(m, prompt, 20, seed=7)
    assert a.dtype == torch.int64 and a.shape == (25,)
    assert torch.equal(a[:5], prompt)
    assert int(a.min()) >= 0 and int(a.max()) <= 255
    assert torch.equal(a, generate(m, prompt, 20, seed=7))
    assert not torch.equal(a, generate(m, prompt, 20, seed=8))
    assert torch.equal(generate(m, prompt, 0), prompt)


def test_generate_top1_is_greedy_crops_context_and_restores_mode():
    m = _tiny(seed=3, seq_len=8)
    m.train()
    prompt = torch.randint(0, 256, (12,))  # longer than seq_len: the context is cropped
    a = generate(m, prompt, 4, top_k=1, seed=0)
    assert torch.equal(a, generate(m, prompt, 4, top_k=1, seed=99))  # top-1 ignores the seed
    assert m.training and all(c.training for c in m.modules())
    m.eval()
    with torch.no_grad():
        expect = m(prompt[-8:].unsqueeze(0))[0, -1].argmax()
    assert a[12] == expect
    assert not m.training  # eval stays eval
    with pytest.raises(ValueError, match="gpt_config"):
        generate(nn.Sequential(nn.Linear(2, 2)), prompt, 1)
    with pytest.raises(ValueError, match="1-D int64"):
        generate(m, prompt.float(), 1)


# ---------------------------------------------------------------- pytext


def test_pytext_corpus_and_split():
    from pydoc_data.topics import topics

    data = pytext_bytes()
    assert data == "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    n, n_train = len(data), 9 * len(data) // 10
    corpus = torch.tensor(list(data), dtype=torch.int64)
    L = 32
    ds = load_dataset("pytext", seed=5, seq_len=L)
    assert "pytext" in DATASETS
    assert ds.task == "lm" and ds.input_shape == (L,) and ds.num_classes == 256
    assert f"{n} bytes" in ds.source
    for split, start, end, off in ((ds.train, 0, n_train, 5), (ds.test, n_train, n, 0)):
        x, y = split.tensors
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape and x.shape[1] == L
        assert int(x.min()) >= 0 and int(x.max()) <= 255
        assert torch.equal(y[:, :-1], x[:, 1:])  # y is x shifted by one
        # the windows tile their part of the corpus from the offset, without overlap
        k = len(x)
        windows = torch.cat([x, y[:, -1:]], dim=1)
        assert torch.equal(windows.flatten(), corpus[start + off : start + off + k * (L + 1)])
        assert start + off + k * (L + 1) <= end < start + off + (k + 1) * (L + 1)
    assert n_train + (n - n_train) == n and n_train == pytest.approx(0.9 * n, abs=1)


def test_pytext_seed_moves_train_offset_only():
    L = 16
    a, b = load_dataset("pytext", seed=0, seq_len=L), load_dataset("pytext", seed=0, seq_len=L)
    c, d = load_dataset("pytext", seed=1, seq_len=L), load_dataset("pytext", seed=L, seq_len=L)
    assert torch.equal(a.train.tensors[0], b.train.tensors[0])
    assert torch.equal(a.train.tensors[0], d.train.tensors[0])  # the offset is seed % seq_len
    assert not torch.equal(a.train.tensors[0][: len(c.train)], c.train.tensors[0])
    assert c.train.tensors[0][0].tolist() == list(pytext_bytes()[1 : L + 1])  # seed 1: windows start at byte 1
    for other in (c, d):  # validation does not depend on the seed
        assert all(torch.equal(u, v) for u, v in zip(a.test.tensors, other.test.tensors))
    with pytest.raises(ValueError, match="seq_len >= 2"):
        load_dataset("pytext", seq_len=1)


def test_classification_splits_keep_defaults():
    s = load_dataset("synthetic", samples=32)
    assert s.task == "classify" and s.source == ""


def test_unigram_entropy():
    assert unigram_entropy(torch.tensor([0, 0, 1, 1])) == pytest.approx(math.log(2))
    assert unigram_entropy(torch.tensor([[3, 1], [2, 0]])) == pytest.approx(math.log(4))
    expect = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert unigram_entropy(torch.tensor([0, 0, 0, 1])) == pytest.approx(expect)
    assert unigram_entropy(torch.full((10,), 7)) == 0.0
    assert unigram_entropy(torch.tensor([0, 1, 2]), vocab=3) == pytest.approx(math.log(3))
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        unigram_entropy(torch.tensor([0, 3]), vocab=3)
    with pytest.raises(ValueError, match="integer"):
        unigram_entropy(torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="at least one"):
        unigram_entropy(torch.tensor([], dtype=torch.long))


# ---------------------------------------------------------------- learning


@pytest.mark.slow  # the default tier's text file beats its byte unigram entropy (test_data_files_run)
def test_tiny_gpt_learns_pytext_beyond_unigram():
    """A few hundred Adam steps take gpt-tiny's validation loss well below the unigram entropy."""
    ds = load_dataset("pytext", seed=0, seq_len=32)
    x, y = ds.train.tensors
    xv, yv = ds.test.tensors[0][::4], ds.test.tensors[1][::4]  # 353 windows spread over the validation text
    baseline = unigram_entropy(x)
    assert 2.5 < baseline < 4.5  # English-like text in bytes: about 3.3 nats
    m = _tiny(seed=0, seq_len=32)
    with torch.no_grad():  # small initial logits: the untrained model is close to uniform over 256 bytes
        initial = F.cross_entropy(m(xv).flatten(0, 1), yv.flatten()).item()
    assert initial == pytest.approx(math.log(256), abs=0.05)
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        i = torch.randint(len(x), (16,), generator=g)
        loss = F.cross_entropy(m(x[i]).flatten(0, 1), y[i].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    m.eval()
    with torch.no_grad():
        val = F.cross_entropy(m(xv).flatten(0, 1), yv.flatten()).item()
    assert val < baseline - 0.5, (val, baseline)  # measured: 2.10 against 3.26 nats
