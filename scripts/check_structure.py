"""Check the source tree's shape: module and function lengths, import cycles, strategy branches.

Usage: ``python scripts/check_structure.py [SRC_DIR]`` (default ``src/dtrain``); prints
each finding and exits 1 if there is any. tests/test_structure.py runs it.

* no module longer than 600 lines, no function longer than 80 (def line to last line);
* no import cycle among dtrain's modules: every ``import`` statement counts, at module
  level or inside a function, except under ``if TYPE_CHECKING:``; importing ``a.b.c``
  is an edge to ``a.b.c`` and to the packages ``a.b`` and ``a`` whose ``__init__`` runs
  (but not to the importer's own enclosing packages, which are initializing already);
* no ``strategy ==`` comparison outside ``dtrain/strategies/`` (strategies are registry
  entries, not branches).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return lines


def _imports(tree: ast.AST, me: str, is_package: bool, known: set[str]) -> set[str]:
    skip = _type_checking_lines(tree)
    out: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", 0) in skip:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = me.split(".") if is_package else me.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        mine = {".".join(me.split(".")[:i]) for i in range(1, me.count(".") + 1)}  # already initializing
        for n in names:
            parts = n.split(".")
            for i in range(1, len(parts) + 1):  # the packages whose __init__ runs, and the module
                cand = ".".join(parts[:i])
                if cand in known and cand != me and cand not in mine:
                    out.add(cand)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def check(root: Path) -> list[str]:
    """Every finding in the tree under ``root`` (a package folder), as lines of text."""
    findings: list[str] = []
    files = sorted(root.rglob("*.py"))
    trees = {p: ast.parse(p.read_text(), filename=str(p)) for p in files}
    names = {p: _module_name(root, p) for p in files}
    known = set(names.values())
    graph: dict[str, set[str]] = {}
    for p, tree in trees.items():
        lines = p.read_text().count("\n")
        if lines > MAX_MODULE_LINES:
            findings.append(f"{p}: module of {lines} lines (max {MAX_MODULE_LINES})")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    findings.append(f"{p}:{node.lineno}: function {node.name} of {n} lines (max {MAX_FUNCTION_LINES})")
        if "strategies" not in p.parts:
            for i, line in enumerate(p.read_text().splitlines(), 1):
                if "strategy ==" in line:
                    findings.append(f"{p}:{i}: a strategy branch outside the registry: {line.strip()}")
        graph[names[p]] = _imports(tree, names[p], p.name == "__init__.py", known)
    for comp in _cycles(graph):
        findings.append("import cycle among: " + ", ".join(comp))
    return findings


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else "src/dtrain")
    findings = check(root)
    for f in findings:
        print(f)
    print(f"{len(findings)} finding(s) in {root}")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
