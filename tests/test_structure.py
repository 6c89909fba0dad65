"""The source tree keeps its shape (scripts/check_structure.py): modules <= 600 lines, functions
<= 80 lines, no import cycle, no strategy branch outside the registry."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _checker():
    spec = importlib.util.spec_from_file_location("check_structure", ROOT / "scripts" / "check_structure.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_source_tree_shape():
    assert _checker().check(ROOT / "src" / "dtrain") == []


def test_checker_finds_what_it_looks_for(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n" + "    x = 1\n" * 90)
    (pkg / "b.py").write_text("import pkg.a\nif cfg.strategy == 'x':\n    pass\n" + "\n" * 600)
    found = "\n".join(_checker().check(pkg))
    assert "function f of 92 lines" in found and "module of 603 lines" in found
    assert "import cycle among: pkg.a, pkg.b" in found and "strategy branch" in found
