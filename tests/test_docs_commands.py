"""Every ``dtrain`` command in the README's and the docs' ``bash`` blocks is one that dtrain accepts.

Each line is parsed by the very parser ``dtrain`` uses for it, and a ``dtrain run`` line's configuration is
resolved and validated as ``dtrain run`` does before any process starts (so a renamed flag, a value out of
range or a combination dtrain refuses fails here). They are not trained: the pages' commands together run
for hours (several train to a target, some need a GPU, root or a second machine); a test of each topic
trains its own small case.
"""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
from collections.abc import Callable
from pathlib import Path

import pytest

from dtrain.checkpoint.layout import CheckpointError
from dtrain.cli import build_parser, config_from_args
from dtrain.errors import ConfigError
from dtrain.job.validate import validate

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)


def commands(md: Path) -> list[str]:
    """The ``dtrain ...`` lines of a page's bash blocks (after ``srun ...``, ``sudo``), comments cut, lines
    joined at a trailing backslash."""
    out = []
    for block in BLOCK.findall(md.read_text(encoding="utf-8")):
        for line in re.split(r"\n|&&|;", block.replace("\\\n", " ")):
            words = shlex.split(line, comments=True)
            while words and (words[0] in ("sudo", "srun") or words[0].startswith("--") or "=" in words[0]):
                words = words[1:]  # srun's own flags, VAR=value prefixes
            if words[:1] == ["dtrain"]:
                out.append(shlex.join(words[1:]))
    return out


def _delegated(module: str) -> Callable[[], argparse.ArgumentParser]:
    return lambda: importlib.import_module(module)._parser()


# subcommands that parse their own arguments: their parsers
PARSERS = {
    "plan": _delegated("dtrain.planning.cli"),
    "cluster": _delegated("dtrain.cluster.cli"),
    "bench allreduce": _delegated("dtrain.measure.allreduce"),
    "bench p2p": _delegated("dtrain.measure.p2p"),
    "sweep": lambda: importlib.import_module("dtrain.search.cli").build_parser(),
}


def check(line: str, tmp: Path) -> None:
    """Raise (SystemExit from argparse, ConfigError from validation) where dtrain would refuse ``line``.

    A configuration file the page names but does not ship (``my.toml``, ``CONFIG.toml``) is read as an
    empty one (the flags of the line carry the example); a ``--resume`` of a run the page made earlier
    may not find it (the refusal must say so), nor the reader's own data that a ``--dataset PATH`` names, nor
    their own model (``--model FILE.py:FN``, ``--model hf:./DIR``)."""
    words = shlex.split(line)
    key = " ".join(words[:2]) if words[:1] == ["bench"] else words[0]
    if key in PARSERS:
        try:
            PARSERS[key]().parse_args(words[2:] if key.startswith("bench") else words[1:])
        except SystemExit as e:
            if not (e.code == 0 and {"-h", "--help"} & set(words)):
                raise
        return
    try:
        ns = build_parser().parse_args(words)
    except SystemExit as e:
        if e.code == 0 and {"-h", "--help"} & set(words):
            return  # a help line: printed, exit 0
        raise
    if ns.command == "run":
        if ns.config and not (ROOT / ns.config).is_file():
            (tmp / "empty.toml").write_text("", encoding="utf-8")
            ns.config = str(tmp / "empty.toml")
        try:
            validate(config_from_args(ns))
        except (ConfigError, CheckpointError) as e:
            if "--device cuda" in line and "cuda" in str(e).lower():
                return  # this machine has no GPU: refused before any process starts, naming it
            if "--resume" in line and "does not exist" in str(e):
                return  # the run it resumes is the page's earlier command
            if "--dataset" in line and "does not exist" in str(e) and ns.dataset in str(e):
                return  # the reader's own data, which the page names but does not ship
            model = ns.model or ""
            if f"model file {model.rpartition(':')[0]!r} does not exist" in str(e) or (
                model.startswith("hf:./") and "nor a folder holding config.json" in str(e)
            ):
                return  # the reader's own model (a file, a checkpoint folder), which the page names but does not ship
            raise


CASES = [(md, line) for md in PAGES for line in commands(md)]


def test_the_pages_have_commands() -> None:
    pages = {md.name for md, _ in CASES}
    assert len(CASES) >= 40 and {"README.md", "data-parallel.md", "several-machines.md"} <= pages, pages


@pytest.mark.parametrize(("md", "line"), CASES, ids=[f"{md.name}:{i}" for i, (md, _) in enumerate(CASES)])
def test_command_is_accepted(md: Path, line: str, tmp_path: Path) -> None:
    try:
        check(line, tmp_path)
    except SystemExit as e:
        pytest.fail(f"{md.name}: `dtrain {line}`: argparse refused it (exit {e.code})")


def test_a_wrong_command_is_refused(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\ndtrain run --workers 4 --no-such-flag  # x\n"
        "sudo dtrain cluster up --hosts 4 --bandwidth 1gbit\n"
        "srun --ntasks-per-node=1 dtrain run --lr -1 \\\n  --epochs 2\n```\n",
        encoding="utf-8",
    )
    lines = commands(page)
    assert lines == [
        "run --workers 4 --no-such-flag",
        "cluster up --hosts 4 --bandwidth 1gbit",
        "run --lr -1 --epochs 2",
    ]
    with pytest.raises(SystemExit):
        check(lines[0], tmp_path)
    check("run --strategy pipeline --help", tmp_path)
    with pytest.raises(SystemExit):  # the help of a strategy that does not exist: refused
        check("run --strategy nope --help", tmp_path)
    check(lines[1], tmp_path)
    with pytest.raises(ConfigError, match="lr"):
        check(lines[2], tmp_path)
