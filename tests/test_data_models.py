import pytest
import torch

from dtrain.workloads.data import load_dataset
from dtrain.workloads.models import build_model


def test_digits_split_is_fixed_and_disjoint():
    a, b = load_dataset("digits", seed=0), load_dataset("digits", seed=0)
    assert torch.equal(a.train.tensors[0], b.train.tensors[0])
    assert len(a.train) + len(a.test) == 1797
    assert a.input_shape == (1, 8, 8) and a.num_classes == 10
    assert float(a.train.tensors[0].max()) <= 1.0
    c = load_dataset("digits", seed=1)
    assert not torch.equal(a.test.tensors[1], c.test.tensors[1])


def test_synthetic_is_deterministic_and_learnable_shape():
    a = load_dataset("synthetic", seed=3, samples=256, side=6, num_classes=5)
    b = load_dataset("synthetic", seed=3, samples=256, side=6, num_classes=5)
    assert torch.equal(a.train.tensors[0], b.train.tensors[0]) and torch.equal(a.train.tensors[1], b.train.tensors[1])
    assert len(a.train) == 256 and a.input_shape == (1, 6, 6)
    assert len(torch.unique(a.train.tensors[1])) > 1  # the teacher uses more than one class


@pytest.mark.parametrize("name", ["cnn", "mlp"])
def test_models_forward(name):
    m = build_model(name, (1, 8, 8), 10)
    assert m(torch.zeros(3, 1, 8, 8)).shape == (3, 10)


def test_unknown_names():
    with pytest.raises(ValueError, match="choose one of"):
        load_dataset("mnist")
    with pytest.raises(ValueError, match="choose one of"):
        build_model("vgg")
