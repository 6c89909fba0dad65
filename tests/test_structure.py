"""The source tree keeps its shape (scripts/check_structure.py): modules <= 600 lines, functions
<= 80 lines, at most 8 modules at the top, no import cycle (type-only and ``import_module`` arrows
count), no cycle among packages (nor an import pointing up a layer), no private name imported from
another package, no strategy named outside strategies/; and the performance model stays pure
(importing it starts nothing: no launcher, cluster, training loop, benchmark or planning)."""

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]

# what measures or starts processes; dtrain.perfmodel must import none of it
IMPURE = (
    "dtrain.job.run",
    "dtrain.training",
    "dtrain.launch.agent",
    "dtrain.cluster",
    "dtrain.measure",
    "dtrain.planning",
)


def _checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_structure", ROOT / "scripts" / "check_structure.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.procs
def test_source_tree_shape() -> None:
    assert _checker().check(ROOT / "src" / "dtrain") == []


def test_checker_finds_what_it_looks_for(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n" + "    x = 1\n" * 90)
    (pkg / "b.py").write_text("import pkg.a\n" + "\n" * 602)
    found = "\n".join(_checker().check(pkg))
    assert "function f of 92 lines" in found and "module of 603 lines" in found
    assert "import cycle among: pkg.a, pkg.b" in found


def test_checker_finds_a_strategy_named_outside_strategies(tmp_path: Path) -> None:
    """A registered name compared with the strategy, listed with another, or compared inside a function about
    strategies is found outside strategies/; the same words meaning something else, and the registering
    package itself, pass."""
    pkg = tmp_path / "pkg"
    (pkg / "strategies").mkdir(parents=True)
    for init in (pkg / "__init__.py", pkg / "strategies" / "__init__.py"):
        init.write_text("")
    (pkg / "strategies" / "mine.py").write_text(
        "register(Strategy(name='dp', options=O, help=''))\nregister(Strategy(name='auto', options=O, help=''))\n"
        "register(Strategy(name='pipeline', options=O, help=''))\nif cfg.strategy == 'dp':\n    pass\n"
    )
    (pkg / "planted.py").write_text(
        "if cfg.strategy == 'dp':\n    pass\n"  # 1: compared with the strategy
        "CUDA = ('dp', 'auto')\n"  # 3: two names listed
        "ok = run.summary['strategy'] in ['pipeline']\n"  # 4: in a list, against the strategy
        "def parse_strategy(parts):\n    return parts[0] != 'pipeline'\n"  # 6: in a function about strategies
        "if cfg.batch_schedule == 'auto':\n    pass\n"  # another option's value
        "section('pipeline', 'Pipeline schedule')\n"  # a word, passed along
        "FLAGS = ('exact_only', 'pipeline', 'mesh')\n"  # one name among other words
        "if cfg.strategy == 'x':\n    pass\n"
    )  # not a registered name
    found = [f for f in _checker().check(pkg) if "a strategy named" in f]
    assert [f.split(":")[1] for f in found if "planted.py" in f] == ["1", "3", "4", "6"], found
    assert not any("mine.py" in f for f in found)


def test_checker_counts_type_only_and_literal_imports_private_names_and_top_modules(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "other").mkdir()
    for init in (pkg / "__init__.py", pkg / "sub" / "__init__.py", pkg / "other" / "__init__.py"):
        init.write_text("")
    # a cycle through a type-only import, another through importlib.import_module("...")
    (pkg / "sub" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub import b\n"
    )
    (pkg / "sub" / "b.py").write_text("import pkg.sub.a\n")
    (pkg / "other" / "c.py").write_text("import importlib\ndef f():\n    importlib.import_module('pkg.other.d')\n")
    (pkg / "other" / "d.py").write_text("from pkg.other import c\n")
    # private names: of another package (found), of one's own package or an enclosing one (allowed)
    (pkg / "sub" / "_hidden.py").write_text("x = 1\n_y = 2\n")
    (pkg / "sub" / "e.py").write_text("from pkg.sub._hidden import x\nfrom pkg.sub.b import _z\n")
    (pkg / "other" / "f.py").write_text("from pkg.sub._hidden import x\nfrom pkg.sub.b import _z\n")
    for i in range(9):
        (pkg / f"top{i}.py").write_text("")
    found = "\n".join(_checker().check(pkg))
    assert "import cycle among: pkg.sub.a, pkg.sub.b" in found
    assert "import cycle among: pkg.other.c, pkg.other.d" in found
    assert "f.py: imports a private name of another package: pkg.sub._hidden.x (private to pkg.sub)" in found
    assert "f.py: imports a private name of another package: pkg.sub.b._z (private to pkg.sub)" in found
    assert "e.py: imports a private" not in found
    assert "9 modules at the top (max 8)" in found


def test_architecture_page_holds_the_current_package_picture() -> None:
    checker = _checker()
    page = (ROOT / "docs" / "architecture.md").read_text()
    start, end = page.index(checker.PICTURE_START), page.index(checker.PICTURE_END)
    shown = page[start + len(checker.PICTURE_START) : end].strip().removeprefix("```").removesuffix("```").strip()
    assert shown == checker.package_picture(ROOT / "src" / "dtrain").strip(), (
        "docs/architecture.md's package picture is stale: python scripts/check_structure.py --write-picture"
    )


def test_package_picture_layers_and_names_the_imports_that_point_up(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    for sub in ("low", "mid", "high"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("")
    (pkg / "mid" / "b.py").write_text("from pkg.low import a\n")
    (pkg / "mid" / "e.py").write_text("")
    (pkg / "high" / "c.py").write_text("from pkg.mid import b, e\n")
    # mid and high import each other; mid's one arrow up is the exception, high's two the rule
    (pkg / "mid" / "d.py").write_text("from pkg.high import c\n")
    picture = _checker().package_picture(pkg)
    lines = picture.splitlines()
    assert " 0  low" in lines and any(line.startswith(" 1  mid") and line.endswith("-> low") for line in lines)
    assert any(line.startswith(" 2  high") and line.endswith("-> mid") for line in lines)
    assert "    mid -> high: pkg.mid.d -> pkg.high.c" in lines


def test_checker_finds_a_package_cycle_and_the_import_that_points_up(tmp_path: Path) -> None:
    """Three packages in a loop through different modules (no module cycle): the loop is found, and so is the
    arrow that points up once the packages are layered (the package with the fewest arrows into the loop goes
    first: low, whose one arrow is the exception); the tree without that arrow passes both rules."""
    pkg = tmp_path / "pkg"
    for sub in ("low", "mid", "high"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("")
    (pkg / "mid" / "b.py").write_text("from pkg.low import a\n")
    (pkg / "mid" / "e.py").write_text("from pkg.low import a\n")
    (pkg / "high" / "c.py").write_text("from pkg.mid import b\n")
    (pkg / "high" / "d.py").write_text("from pkg.mid import e\n")
    (pkg / "low" / "up.py").write_text("from pkg.high import c\n")  # low -> high: the loop low -> high -> mid -> low
    found = _checker().check(pkg)
    assert "package import cycle among: high, low, mid" in found
    assert "an import points up a layer: low -> high: pkg.low.up -> pkg.high.c" in found
    assert not any(f.startswith("import cycle") for f in found)  # the modules themselves have no cycle
    (pkg / "low" / "up.py").unlink()
    assert _checker().check(pkg) == []


@pytest.mark.procs
def test_perfmodel_imports_nothing_that_starts_processes() -> None:
    folder = ROOT / "src" / "dtrain" / "perfmodel"
    modules = ["dtrain.perfmodel"] + sorted(
        f"dtrain.perfmodel.{p.stem}" for p in folder.glob("*.py") if p.stem != "__init__"
    )
    assert "dtrain.perfmodel.predict" in modules and "dtrain.perfmodel.fit" in modules
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        f"print(sorted(m for m in sys.modules if any(m == p or m.startswith(p + '.') for p in {IMPURE!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"dtrain.perfmodel pulled in: {out.stdout.strip()}"
