"""The documentation's own checks: its links and paths name files that exist, the README stays a short guide
with a contents list of every docs page, every docs page opens with a summary, and no tracked file points at
a design document outside the repository.

Pure file reads: no process starts (the tracked files come from reading ``.git/index``, not from running git),
so these run in the quick tier too.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
CHECKED = [README, ROOT / "BENCHMARKS.md", *DOCS]

README_MAX_LINES = 200
# backticked text starting with one of these is a path in the repository (from its root)
PATH_PREFIXES = ("docs/", "benchmarks/", "scripts/", "src/", "tests/")
# `tests/test_faults*.py`, `runs/<folder>`, `checkpoints/step_NNNNNN/`: globs and placeholders stand for many
# files (or for none yet); they are not checked
PLACEHOLDER = re.compile(r"[<>*]|NNN")

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
FENCE = re.compile(r"^\s*(```|~~~)")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a link or a backticked path inside a code block is an example)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def links(text: str) -> list[str]:
    """Targets of ``[text](target)`` links outside code blocks and code spans (the text may span lines)."""
    return LINK.findall("\n".join(CODE_SPAN.sub("", line) for line in prose_lines(text)))


def backticked_paths(text: str) -> list[str]:
    """The first word of each code span that starts with a repository folder (``scripts/test.sh --quick``)."""
    found = []
    for line in prose_lines(text):
        for _, span in CODE_SPAN.findall(line):
            words = span.strip().split()
            if words and words[0].startswith(PATH_PREFIXES):
                found.append(words[0].rstrip(".,;:"))
    return found


def broken_paths(md: Path) -> list[str]:
    """Relative links (from the page's folder) and backticked paths (from the root) that name nothing."""
    text = md.read_text(encoding="utf-8")
    bad = []
    for target in links(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (https:, mailto:) or an anchor on the same page
        path = target.split("#", 1)[0]
        if PLACEHOLDER.search(path):
            continue
        if not (md.parent / path).exists():
            bad.append(f"link ({target})")
    for span in backticked_paths(text):
        if PLACEHOLDER.search(span):
            continue
        path, _, test = span.partition("::")  # a pytest node id: the file, and the test in it
        for one in expand_braces(path):
            if not (ROOT / one).exists():
                bad.append(f"`{one}`" if one == span else f"`{one}` (from `{span}`)")
            elif test and not re.search(
                rf"^\s*(async )?def {re.escape(test.split('[')[0])}\b", (ROOT / one).read_text(encoding="utf-8"), re.M
            ):
                bad.append(f"`{span}` (no such test)")
    return bad


def expand_braces(path: str) -> list[str]:
    """``results/a_{x,y}.txt`` -> ``results/a_x.txt``, ``results/a_y.txt`` (the shell's expansion, one level)."""
    match = re.search(r"\{([^{}]*,[^{}]*)\}", path)
    if not match:
        return [path]
    head, tail = path[: match.start()], path[match.end() :]
    return [p for alt in match.group(1).split(",") for p in expand_braces(head + alt + tail)]


@pytest.mark.parametrize("md", CHECKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_paths_exist(md: Path) -> None:
    assert broken_paths(md) == [], f"{md.relative_to(ROOT)} names files that do not exist"


def test_path_check_catches_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "See [x](missing.md), `docs/missing.md` and `scripts/test.sh --quick`; `runs/<folder>`;\n"
        "`tests/test_docs.py::test_no_such_test`, `docs/{architecture,nothing}.md`.\n"
        "```\n[in a block](also-missing.md)\n```\n",
        encoding="utf-8",
    )
    assert broken_paths(page) == [
        "link (missing.md)",
        "`docs/missing.md`",
        "`tests/test_docs.py::test_no_such_test` (no such test)",
        "`docs/nothing.md` (from `docs/{architecture,nothing}.md`)",
    ]


def heading_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def contents_section(text: str) -> str:
    match = re.search(r"^## Contents\n(.*?)(?=^## )", text, re.S | re.M)
    assert match, "README.md has no '## Contents' section"
    return match.group(1)


def test_readme_is_a_short_guide() -> None:
    text = README.read_text(encoding="utf-8")
    n = len(text.splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move detail to docs/"
    contents = links(contents_section(text))
    missing = [f"docs/{p.name}" for p in DOCS if f"docs/{p.name}" not in contents]
    assert missing == [], f"README.md's contents list does not link {missing}"
    anchors = {heading_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", "\n".join(prose_lines(text)), re.M)}
    dangling = [t for t in contents if t.startswith("#") and t[1:] not in anchors]
    assert dangling == [], f"README.md's contents list links sections it does not have: {dangling}"


def opens_with_summary(md: Path) -> bool:
    """A ``# Title`` line, then a prose line (not a code block, table, heading or list) within 3 lines."""
    head = md.read_text(encoding="utf-8").splitlines()[:3]
    if not head or not head[0].startswith("# "):
        return False
    return any(line.strip() and not re.match(r"\s*(```|~~~|\||#|[-*+] |\d+\. )", line) for line in head[1:])


@pytest.mark.parametrize("md", DOCS, ids=lambda p: p.name)
def test_docs_page_opens_with_a_summary(md: Path) -> None:
    assert opens_with_summary(md), f"docs/{md.name} should open with '# Title' and two lines saying what it covers"


def test_summary_check_catches_a_page_without_one(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.md", tmp_path / "bad.md"
    good.write_text("# Title\n\nWhat this page covers.\n", encoding="utf-8")
    bad.write_text("# Title\n\n```bash\ndtrain run\n```\n", encoding="utf-8")
    assert opens_with_summary(good) and not opens_with_summary(bad)


def tracked_files(root: Path) -> list[str]:
    """The paths ``git ls-files`` lists, read from the index (versions 2-4) without starting git."""
    data = (root / ".git" / "index").read_bytes()
    magic, version, count = struct.unpack(">4sII", data[:12])
    assert magic == b"DIRC" and version in (2, 3, 4), f"unknown git index (version {version})"
    pos, paths, previous = 12, dict[str, None](), b""
    for _ in range(count):
        start = pos
        mode = struct.unpack(">I", data[pos + 24 : pos + 28])[0]
        flags = struct.unpack(">H", data[pos + 60 : pos + 62])[0]
        pos += 62 + (2 if version >= 3 and flags & 0x4000 else 0)
        if version == 4:  # the name is the previous one less N trailing bytes, plus a suffix
            strip, byte = data[pos] & 0x7F, data[pos]
            pos += 1
            while byte & 0x80:
                byte = data[pos]
                strip = ((strip + 1) << 7) | (byte & 0x7F)
                pos += 1
            end = data.index(b"\0", pos)
            name = previous[: len(previous) - strip] + data[pos:end]
            pos = end + 1
        else:  # NUL-terminated, padded with NULs to a multiple of 8 bytes
            end = data.index(b"\0", pos)
            name = data[pos:end]
            pos = start + ((end - start) // 8 + 1) * 8
        previous = name
        if mode >> 12 in (0o10, 0o12):  # regular files and links, not submodules; each once (merge stages)
            paths[name.decode()] = None
    return list(paths)


def test_no_tracked_file_points_at_a_design_document() -> None:
    if not (ROOT / ".git" / "index").is_file():
        pytest.skip("not a git checkout (an unpacked archive): no list of tracked files")
    banned = "DESIGN" + ".md"  # spelled in two pieces so that this file does not name it
    hits = []
    for rel in tracked_files(ROOT):
        path = ROOT / rel
        if not path.is_file():
            continue  # deleted in the work tree
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        if banned.lower() in data.decode("utf-8", "replace").lower():
            hits.append(rel)
    assert hits == [], f"these tracked files mention {banned}, which is not part of the repository: {hits}"


# the team's own bookkeeping, which belongs in commit messages: its issue numbers, its numbered work periods,
# result files named after when they were made (``_s18``, ``run28``); spelled so that this file matches none
INTERNAL = re.compile(
    "|".join(
        [
            r"\bissues?\s+#?\d+",
            r"\bsessions?\s+#?\d+",
            r"\bwork\s+periods?\b",
            r"\bstops?\s+\d+\b",
            r"_s\d\d\b",
            r"\brun\d\d\b",
            r"_(before|after)\.txt\b",
        ]
    ),
    re.I,
)


def internal_numbers(text: str) -> list[str]:
    return [m.group(0) for m in INTERNAL.finditer(text)]


def test_internal_number_check_catches_them() -> None:
    # the bookkeeping words are built from pieces, so that this file itself names none of them
    bad = [
        "iss" + "ue 17",
        "Sess" + "ion 4",
        "work" + " period",
        "st" + "op 46",
        "_s" + "18",
        "ru" + "n28",
        "_af" + "ter.txt",
    ]
    text = (
        f"fixed in {bad[0]}; {bad[1]}'s figures; a {bad[2]}; {bad[3]}; coding_cpu{bad[4]}.txt; {bad[5]}; "
        f"compression_traced_50mbit{bad[6]}. Fine: pytorch#135712, local_sgd period 8, s16 = 2, run_all.py"
    )
    assert internal_numbers(text) == bad


def test_no_tracked_file_names_the_teams_internal_numbers() -> None:
    if not (ROOT / ".git" / "index").is_file():
        pytest.skip("not a git checkout (an unpacked archive): no list of tracked files")
    hits = []
    for rel in tracked_files(ROOT):
        path = ROOT / rel
        if not path.is_file() or rel == "tests/test_docs.py":
            continue  # deleted in the work tree; this file spells the patterns out
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        found = internal_numbers(data.decode("utf-8", "replace"))
        if found:
            hits.append(f"{rel}: {', '.join(sorted(set(found)))}")
    assert hits == [], "these tracked files name the team's internal numbers:\n" + "\n".join(hits)


def test_tracked_files_are_read_from_the_index() -> None:
    if not (ROOT / ".git" / "index").is_file():
        pytest.skip("not a git checkout (an unpacked archive): no list of tracked files")
    files = tracked_files(ROOT)
    assert {"README.md", "pyproject.toml", "tests/conftest.py", "docs/report.png"} <= set(files)
    assert len(files) == len(set(files))
    assert all(not f.startswith(".venv/") and "__pycache__" not in f for f in files)
