"""What the packages say of themselves stays true: every module a package's docstring names (``:mod:`.x```)
is in that package, and the packages whose docstring lists its modules name every public one; and
``dtrain.models``, a public name, imports."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "dtrain"

# packages whose docstring is a list of their modules: each public module of the folder is named in it
LISTED = (
    "training",
    "observe",
    "checkpoint",
    "pipeline",
    "measure",
    "planning",
    "job",
    "config",
    "hybrid_parallel",
    "launch",
    "rundir",
    "workloads",
)


def _docstring(package: Path) -> str:
    return ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""


def _named(doc: str) -> set[str]:
    """The relative modules a docstring names: ``:mod:`.x``` and ``:class:`~.x.Y``` give ``x``."""
    return set(re.findall(r":\w+:`~?\.(\w+)", doc))


def _modules(package: Path) -> set[str]:
    return {p.stem for p in package.glob("*.py") if p.stem != "__init__"} | {
        p.name for p in package.iterdir() if (p / "__init__.py").exists()
    }


@pytest.mark.parametrize("package", sorted(p.name for p in SRC.iterdir() if (p / "__init__.py").exists()))
def test_every_module_a_package_docstring_names_is_in_that_package(package: str) -> None:
    folder = SRC / package
    missing = _named(_docstring(folder)) - _modules(folder)
    assert not missing, f"dtrain/{package}/__init__.py names module(s) it does not hold: {sorted(missing)}"


@pytest.mark.parametrize("package", LISTED)
def test_a_listing_docstring_names_every_public_module(package: str) -> None:
    folder = SRC / package
    public = {m for m in _modules(folder) if not m.startswith("_")}
    unnamed = public - _named(_docstring(folder))
    assert not unnamed, f"dtrain/{package}/__init__.py does not name its module(s) {sorted(unnamed)}"


def test_the_checker_of_names_sees_a_stale_name(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('"""* :mod:`.here` -- one; :class:`~.gone.Thing` -- another."""\n')
    (pkg / "here.py").write_text("")
    assert _named(_docstring(pkg)) - _modules(pkg) == {"gone"}


def test_dtrain_models_imports_and_is_the_workloads_models() -> None:
    import dtrain

    models = importlib.import_module("dtrain.models")
    impl = importlib.import_module("dtrain.workloads.models")
    assert dtrain.models is models
    for name in impl.__all__:
        assert getattr(models, name) is getattr(impl, name), name
    assert models.build_gpt is impl.build_gpt  # a name not listed is looked up there
    assert models.build_model("mlp", (1, 8, 8)).__class__.__name__ == "Sequential"
