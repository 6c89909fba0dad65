"""Write tests/data/timm_reference.json: 20 steps of timm's Lars and Lamb on a tiny model.

tests/test_optim.py replays the same steps with dtrain.optim.LARS / LAMB and compares.
timm is not a dependency of dtrain (it pulls torchvision, which would replace the
pinned CPU torch), so this script runs by hand in a scratch environment that has
timm next to the same torch, e.g. a venv whose .pth file adds the project venv's
site-packages and into which ``pip install --no-deps timm`` was run::

    /tmp/timmvenv/bin/python scripts/timm_reference.py

If ``import timm`` needs packages that are missing there (torchvision), only the
two optimizer modules are loaded from timm's installed files (they need torch alone).

Settings are chosen where timm's definitions coincide with the papers (and dtrain):
constant lr, no dampening or Nesterov, no trust clipping, Lamb without gradient
clipping (``max_grad_norm=None``), with bias correction and grad averaging, L2 (not
decoupled) weight decay, no caution. timm excludes by param group (a group with
``weight_decay == 0`` is not adapted unless ``always_adapt``), dtrain per tensor
(``exclude``): "default" cases put the ndim <= 1 tensors in a ``weight_decay=0`` group
for timm, "exclude_nothing" cases use one group with ``always_adapt=True``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any

import torch
from torch import nn

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "timm_reference.json"
STEPS = 20
SEED = 0

# name -> (timm class, timm kwargs, timm grouping, dtrain class, dtrain kwargs)
CASES: dict[str, tuple[str, dict[str, Any], str, str, dict[str, Any]]] = {
    "lars": (
        "Lars",
        {
            "lr": 0.1,
            "momentum": 0.9,
            "weight_decay": 0.01,
            "trust_coeff": 0.05,
            "eps": 1e-8,
            "dampening": 0.0,
            "nesterov": False,
            "trust_clip": False,
            "always_adapt": False,
        },
        "ndim<=1 in a weight_decay=0 group",
        "LARS",
        {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01, "trust_coefficient": 0.05, "eps": 1e-8},
    ),
    "lars_exclude_nothing": (
        "Lars",
        {
            "lr": 0.1,
            "momentum": 0.9,
            "weight_decay": 0.01,
            "trust_coeff": 0.05,
            "eps": 1e-8,
            "dampening": 0.0,
            "nesterov": False,
            "trust_clip": False,
            "always_adapt": True,
        },
        "one group",
        "LARS",
        {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01, "trust_coefficient": 0.05, "eps": 1e-8, "exclude": False},
    ),
    "lamb": (
        "Lamb",
        {
            "lr": 0.01,
            "betas": [0.9, 0.999],
            "eps": 1e-6,
            "weight_decay": 0.01,
            "bias_correction": True,
            "grad_averaging": True,
            "max_grad_norm": None,
            "trust_clip": False,
            "always_adapt": False,
            "caution": False,
            "decoupled_decay": False,
        },
        "ndim<=1 in a weight_decay=0 group",
        "LAMB",
        {"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-6, "weight_decay": 0.01},
    ),
    "lamb_exclude_nothing": (
        "Lamb",
        {
            "lr": 0.01,
            "betas": [0.9, 0.999],
            "eps": 1e-6,
            "weight_decay": 0.01,
            "bias_correction": True,
            "grad_averaging": True,
            "max_grad_norm": None,
            "trust_clip": False,
            "always_adapt": True,
            "caution": False,
            "decoupled_decay": False,
        },
        "one group",
        "LAMB",
        {"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-6, "weight_decay": 0.01, "exclude": False},
    ),
}


def timm_optimizers() -> tuple[types.ModuleType, str]:
    """A namespace with timm's ``Lars`` and ``Lamb``, from the package or its files, and which."""
    try:
        import timm.optim

        return timm.optim, "import timm.optim"
    except ImportError as e:
        print(f"import timm.optim failed ({e}); loading timm/optim/lars.py and lamb.py by path", file=sys.stderr)
    spec = importlib.util.find_spec("timm")  # locates the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("timm is not installed here")
    for name in [m for m in sys.modules if m == "timm" or m.startswith("timm.")]:
        del sys.modules[name]
    root = Path(next(iter(spec.submodule_search_locations)))
    for name, path in (("timm", root), ("timm.optim", root / "optim")):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(path)]
        sys.modules[name] = pkg
    ns = types.ModuleType("timm_optim")
    ns.Lars = importlib.import_module("timm.optim.lars").Lars  # type: ignore[attr-defined]
    ns.Lamb = importlib.import_module("timm.optim.lamb").Lamb  # type: ignore[attr-defined]
    return ns, "timm/optim/lars.py and lamb.py loaded by path (import timm needs torchvision)"


def build() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model and data: float64 so that only the algorithms, not rounding, can differ."""
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x = torch.randn(16, 4, dtype=torch.float64)
    y = torch.randn(16, 3, dtype=torch.float64)
    return model, x, y


def run(timm: types.ModuleType, cls: str, kwargs: dict[str, Any], one_group: bool) -> dict[str, Any]:
    model, x, y = build()
    params = list(model.parameters())
    kwargs = {**kwargs, "betas": tuple(kwargs["betas"])} if "betas" in kwargs else kwargs
    if one_group:
        groups: list[dict[str, Any]] = [{"params": params}]
    else:
        groups = [
            {"params": [p for p in params if p.ndim > 1]},
            {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
        ]
    opt = getattr(timm, cls)(groups, **kwargs)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "final": {k: v.tolist() for k, v in model.state_dict().items()}}


def main() -> None:
    timm, loaded = timm_optimizers()
    # foreach=None (timm's default) picks the multi-tensor path only for CUDA tensors
    foreach = sys.modules["timm.optim._helpers"]._resolve_foreach(None, lr=0.1, params=[torch.zeros(1)])
    model, x, y = build()
    out: dict[str, Any] = {
        "about": __doc__.strip().splitlines()[0] if __doc__ else "",
        "timm_version": importlib.metadata.version("timm"),
        "torch_version": torch.__version__,
        "timm_loaded": loaded,
        "timm_implementation": "multi-tensor (foreach)" if foreach else "single-tensor",
        "model": "nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)), float64",
        "loss": "mse_loss(model(x), y), zero_grad, backward, step; losses are before each step",
        "steps": STEPS,
        "initial": {k: v.tolist() for k, v in model.state_dict().items()},
        "x": x.tolist(),
        "y": y.tolist(),
        "cases": {},
    }
    for name, (cls, kwargs, grouping, dcls, dkwargs) in CASES.items():
        result = run(timm, cls, kwargs, one_group=grouping == "one group")
        out["cases"][name] = {
            "timm": {"class": cls, "kwargs": kwargs, "param_groups": grouping},
            "dtrain": {"class": dcls, "kwargs": dkwargs},
            **result,
        }
        print(f"{name}: loss {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
