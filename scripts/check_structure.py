"""Check the source tree's shape: module and function lengths, import cycles (of modules and of packages),
private names, strategy names outside the registry.

Usage: ``python scripts/check_structure.py [SRC_DIR]`` (default ``src/dtrain``); prints
each finding and exits 1 if there is any. tests/test_structure.py runs it.
``--picture`` prints the packages and their imports, lowest first; ``--write-picture [DOC]``
puts that picture into ``docs/architecture.md`` (tests/test_structure.py checks it is current).

* no module longer than 600 lines, no function longer than 80 (def line to last line);
* at most 8 modules at the top of the package (``__init__.py`` not counted): the rest live in
  packages named for what they hold;
* no import cycle among dtrain's modules: every ``import`` statement counts, at module
  level or inside a function, under ``if TYPE_CHECKING:`` too (a type-only import is still an
  arrow between two modules that a reader follows), and so does ``importlib.import_module``
  with a literal name; importing ``a.b.c`` is an edge to ``a.b.c`` and to the packages ``a.b``
  and ``a`` whose ``__init__`` runs (but not to the importer's own enclosing packages, which
  are initializing already);
* no import cycle among dtrain's packages (and top modules) either: a package that imports
  another through one module may not be imported by it through another (``job.run ->
  observe.report`` while ``observe.report_data -> ... -> job``), so the packages stand in layers,
  each importing only lower ones; an arrow that points up a layer of the picture is named;
* no import of a private name (``_x``, or anything from a module ``_m``) that belongs to
  another package: a package's private modules and names are for that package's modules
  (and its sub-packages') only;
* no strategy named outside ``dtrain/strategies/`` and the registry's own module: what differs
  between strategies is asked of their registry entry, so that a strategy is one module and a
  new one touches no other file. The names are those registered in the tree (every
  ``Strategy(name="...")`` with a literal name). A name is an error where it decides something:

  - a comparison (``==``, ``!=``, ``in``, ``not in``) between a registered name (alone, or in a
    tuple, list or set literal) and an expression whose text holds ``strategy``
    (``cfg.strategy == "dp"``, ``e["strategy"] in ("ps", "easgd")``), or any such comparison with
    a registered name inside a function whose name holds ``strategy`` (``parse_strategy``'s
    ``parts[0] == "dp"``);
  - a tuple, list or set literal holding two or more registered names (``CUDA = ("dp", "ddp")``),
    whatever it is compared with later.

  Narrowed so that the same words in other meanings pass: several names are also ordinary
  values of other options (``--batch-schedule auto``, a ``"pipeline"`` section of the report,
  ``"tensor"`` of a profile's kind), and those are compared with expressions that do not say
  ``strategy`` and listed beside words that are not strategy names. A lone name passed as an
  argument (``Choice("dp", n)``, a CLI default) is not looked at.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from pathlib import Path

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_TOP_MODULES = 8


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, me: str, is_package: bool) -> str:
    base = node.module or ""
    if node.level:
        pkg = me.split(".") if is_package else me.split(".")[:-1]
        pkg = pkg[: len(pkg) - (node.level - 1)]
        base = ".".join([*pkg, base] if base else pkg)
    return base


def _imported_names(tree: ast.AST, me: str, is_package: bool) -> list[str]:
    """Every dotted name the module imports: ``import a.b``, ``from a import b`` (as ``a`` and
    ``a.b``), and ``importlib.import_module("a.b")`` with a literal name."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, me, is_package)
            names += [base] + [f"{base}.{a.name}" for a in node.names]
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func).split(".")[-1] == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.append(node.args[0].value)
    return names


def _imports(tree: ast.AST, me: str, is_package: bool, known: set[str]) -> set[str]:
    out: set[str] = set()
    mine = {".".join(me.split(".")[:i]) for i in range(1, me.count(".") + 1)}  # already initializing
    for n in _imported_names(tree, me, is_package):
        parts = n.split(".")
        for i in range(1, len(parts) + 1):  # the packages whose __init__ runs, and the module
            cand = ".".join(parts[:i])
            if cand in known and cand != me and cand not in mine:
                out.add(cand)
    return out


def _private_imports(tree: ast.AST, me: str, is_package: bool, packages: set[str]) -> list[str]:
    """``from X import _y`` or an import of ``P._m...`` where the private name belongs to a package
    that is neither the importer's own nor one of its enclosing packages."""
    own = me if is_package else me.rpartition(".")[0]
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = _resolve(node, me, is_package)
            full = [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            full = [a.name for a in node.names]
        else:
            continue
        for name in full:
            parts = name.split(".")
            private = [i for i, seg in enumerate(parts) if seg.startswith("_") and not seg.startswith("__")]
            if not private or parts[0] != me.split(".")[0]:
                continue
            owner = ".".join(parts[: private[0]])  # the package, or the module, the private name is in
            if owner not in packages:
                owner = owner.rpartition(".")[0]
            if not (own == owner or own.startswith(owner + ".")):
                out.append(f"{name} (private to {owner})")
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


def module_graph(root: Path) -> dict[str, set[str]]:
    """Each module of the tree under ``root`` and the modules it imports (the arrows :func:`check` counts)."""
    files = sorted(root.rglob("*.py"))
    names = {p: _module_name(root, p) for p in files}
    known = set(names.values())
    return {
        names[p]: _imports(ast.parse(p.read_text(), filename=str(p)), names[p], p.name == "__init__.py", known)
        for p in files
    }


def package_graph(root: Path) -> dict[tuple[str, str], list[str]]:
    """The arrows between the packages (and top modules) under ``root``: for each pair, the module
    arrows that make it (an import of a package whose ``__init__`` imports nothing is not one)."""
    graph = module_graph(root)
    empty_inits = {m for m in graph if (root.parent / m.replace(".", "/") / "__init__.py").exists() and not graph[m]}

    def part(m: str) -> str:
        return m.split(".")[1] if m.count(".") else ""

    arrows: dict[tuple[str, str], list[str]] = {}
    for mod, targets in graph.items():
        for t in sorted(targets - empty_inits):
            if part(mod) and part(t) and part(mod) != part(t):
                arrows.setdefault((part(mod), part(t)), []).append(f"{mod} -> {t}")
    for mod in graph:
        if part(mod):
            arrows.setdefault((part(mod), part(mod)), [])
    return arrows


def _layers(
    arrows: dict[tuple[str, str], list[str]],
) -> tuple[list[str], dict[str, set[str]], dict[str, int], list[tuple[str, str]]]:
    """The packages, what each imports, each one's layer, and the arrows that point up (see :func:`package_picture`)."""
    names = sorted({a for a, _ in arrows})
    deps = {n: {b for (a, b) in arrows if a == n and b != n} for n in names}
    placed: dict[str, int] = {}
    upward: list[tuple[str, str]] = []
    while len(placed) < len(names):
        ready = [n for n in names if n not in placed and deps[n] <= set(placed)]
        if not ready:  # a loop among the rest: place the package with the fewest arrows into it
            rest = [n for n in names if n not in placed]
            n = min(rest, key=lambda n: (sum(len(arrows[(n, d)]) for d in deps[n] if d not in placed), n))
            upward += [(n, d) for d in sorted(deps[n]) if d not in placed]
            ready = [n]
        for n in ready:
            placed[n] = 1 + max((placed[d] for d in deps[n] if d in placed), default=-1)
    return names, deps, placed, upward


def package_findings(root: Path) -> list[str]:
    """The package-level rules: no cycle among the packages (and top modules), and so no import that points
    up a layer of the picture; each named with the module arrows that make it."""
    arrows = package_graph(root)
    names, deps, _, upward = _layers(arrows)
    out = [f"package import cycle among: {', '.join(comp)}" for comp in _cycles(deps)]
    out += [f"an import points up a layer: {a} -> {b}: " + "; ".join(arrows[(a, b)]) for a, b in upward]
    return out


def package_picture(root: Path) -> str:
    """The packages (and top modules) under ``root`` and their imports, lowest layer first.

    Layers are peeled from the bottom: a package goes in once everything it imports is placed. Where
    packages import each other (through different modules) none can go first; the one with the fewest
    module arrows into the rest is placed, and its arrows that point up are listed at the end."""
    arrows = package_graph(root)
    names, deps, placed, upward = _layers(arrows)
    width = max(len(n) for n in names)
    lines = [
        f"src/{root.name}/: each package (or top module) and what it imports; layer 0 imports nothing of {root.name}"
    ]
    for n in sorted(names, key=lambda n: (placed[n], n)):
        below = sorted((d for d in deps[n] if (n, d) not in upward), key=lambda d: (placed[d], d))
        lines.append(f"{placed[n]:>2}  {n:<{width}}  {'-> ' + ', '.join(below) if below else ''}".rstrip())
    if upward:
        lines += ["", "imports that point up (packages that import each other through different modules):"]
        for a, b in upward:
            lines.append(f"    {a} -> {b}: " + "; ".join(arrows[(a, b)]))
    return "\n".join(lines) + "\n"


def strategy_names(trees: Iterable[ast.AST]) -> set[str]:
    """The strategies registered in ``trees``: the literal ``name=`` of every ``Strategy(...)`` call."""
    out = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "Strategy":
                out |= {
                    k.value.value
                    for k in node.keywords
                    if k.arg == "name" and isinstance(k.value, ast.Constant) and isinstance(k.value.value, str)
                }
    return out


def _may_name_strategies(root: Path, path: Path) -> bool:
    rel = path.relative_to(root).parts
    return rel[0] == "strategies" or rel == ("registry.py",)


def strategy_names_used(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """Where ``tree`` decides something by a strategy's name (the module docstring's two rules), as
    ``(line, source)``."""

    def named(node: ast.AST) -> bool:
        return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names

    def names_in(node: ast.AST) -> int:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return sum(named(e) for e in node.elts)
        return int(named(node))

    in_strategy_function = {
        id(n)
        for f in ast.walk(tree)
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and "strategy" in f.name.lower()
        for n in ast.walk(f)
    }
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and all(
            isinstance(o, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for o in node.ops
        ):
            sides = [node.left, *node.comparators]
            if any(
                names_in(s)
                and (
                    id(node) in in_strategy_function
                    or any("strategy" in ast.unparse(o).lower() for o in sides if o is not s)
                )
                for s in sides
            ):
                out.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and names_in(node) >= 2:
            out.append((node.lineno, ast.unparse(node)))
    return sorted(set(out))


def check(root: Path) -> list[str]:
    """Every finding in the tree under ``root`` (a package folder), as lines of text."""
    findings: list[str] = []
    files = sorted(root.rglob("*.py"))
    trees = {p: ast.parse(p.read_text(), filename=str(p)) for p in files}
    names = {p: _module_name(root, p) for p in files}
    known = set(names.values())
    packages = {names[p] for p in files if p.name == "__init__.py"}
    top = [p.name for p in files if p.parent == root and p.name != "__init__.py"]
    strategies = strategy_names(trees.values())
    if len(top) > MAX_TOP_MODULES:
        findings.append(f"{root}: {len(top)} modules at the top (max {MAX_TOP_MODULES}): {', '.join(top)}")
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
        if not _may_name_strategies(root, p):
            for line, text in strategy_names_used(tree, strategies):
                findings.append(f"{p}:{line}: a strategy named outside strategies/ (ask its registry entry): {text}")
        graph[names[p]] = _imports(tree, names[p], p.name == "__init__.py", known)
        for what in _private_imports(tree, names[p], p.name == "__init__.py", packages):
            findings.append(f"{p}: imports a private name of another package: {what}")
    for comp in _cycles(graph):
        findings.append("import cycle among: " + ", ".join(comp))
    return findings + package_findings(root)


PICTURE_START, PICTURE_END = "<!-- package picture: start -->", "<!-- package picture: end -->"


def write_picture(root: Path, doc: Path) -> bool:
    """Put :func:`package_picture` between the markers in ``doc``; True if it changed."""
    text = doc.read_text()
    head, _, rest = text.partition(PICTURE_START)
    _, _, tail = rest.partition(PICTURE_END)
    new = f"{head}{PICTURE_START}\n```\n{package_picture(root)}```\n{PICTURE_END}{tail}"
    if new != text:
        doc.write_text(new)
    return new != text


def main(argv: list[str]) -> int:
    if argv[:1] == ["--picture"]:
        print(package_picture(Path(argv[1] if len(argv) > 1 else "src/dtrain")), end="")
        return 0
    if argv[:1] == ["--write-picture"]:
        changed = write_picture(Path("src/dtrain"), Path(argv[1] if len(argv) > 1 else "docs/architecture.md"))
        print("updated" if changed else "current")
        return 0
    root = Path(argv[0] if argv else "src/dtrain")
    findings = check(root)
    for f in findings:
        print(f)
    print(f"{len(findings)} finding(s) in {root}")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
