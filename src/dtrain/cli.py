"""The ``dtrain`` command: run, bench, plan, cluster, report.

``dtrain run`` flags are generated from :class:`dtrain.config.schema.RunConfig`'s shared
fields and every registered strategy's options dataclass (``batch_size`` ->
``--batch-size``, ``PSOptions.servers`` -> ``--servers``), so the TOML keys and
the flags cannot drift apart; each flag's help is its field's ``help`` metadata. Precedence:
built-in defaults < config file < flags.

``dtrain run --help`` is an overview: the shared flags a line each, then each strategy's
flags on a line with its name. ``dtrain run --strategy NAME --help`` (or ``dtrain run
CONFIG --help``, CONFIG naming a strategy) shows the shared flags and NAME's own, in full.
Every strategy's flags are parsed whatever the strategy: a flag of another one is refused
by the configuration, naming the strategy it belongs to.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import shutil
import sys
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dtrain.errors import DTrainError, run_command

if TYPE_CHECKING:
    from dtrain.cluster.nodes import NodeArgs
    from dtrain.config.schema import RunConfig

# the configuration's modules import torch: they load after main() has started the workers' forkserver
__all__ = ["main", "build_parser", "config_from_args", "nodes_from_args"]


def _choices() -> dict[str, Sequence[str]]:
    from dtrain.config.schema import DEVICES, LR_SCHEDULES, OPTIMIZERS, PRECISIONS
    from dtrain.optim.large_batch import AUTO_RULES, LR_SCALINGS

    return {
        "optimizer": OPTIMIZERS,
        "lr_schedule": LR_SCHEDULES,
        "precision": PRECISIONS,
        "device": DEVICES,
        "lr_scaling": LR_SCALINGS,
        "auto_rule": AUTO_RULES,
    }


# the groups of RunConfig's shared fields in `dtrain run --help`: the first field of each, in RunConfig's order
_GROUPS = {"model": "what to train", "strategy": "how to distribute it", "out": "the run itself"}
_NODES = "several machines (the same command on each node; inside SLURM's srun they come from its environment)"
_NODES_SHORT = "several machines (the same command on each node)"
_RUN_USAGE = "dtrain run [-h] [CONFIG] [--strategy NAME] [FLAG ...]"
_RUN_DESCRIPTION = (
    "Train a model (no argument: 4 local workers, the CNN on digits, data parallel, ring allreduce). "
    "CONFIG: a TOML file of the flags' keys (flags override it)."
)
# subcommands that live in other packages: name -> module with main(argv) -> int
_BENCHES = {
    "allreduce": "dtrain.measure.allreduce",
    "calibrate": "dtrain.planning.calibrate",
    "p2p": "dtrain.measure.p2p",
    "train": "dtrain.measure.train",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_flag(
    p: argparse._ActionsContainer, name: str, default: Any, helptext: str, choices: Sequence[str] | None
) -> None:
    helptext = helptext.replace("%", "%%") if helptext != argparse.SUPPRESS else helptext  # argparse formats help
    if isinstance(default, bool):
        p.add_argument(_flag(name), dest=name, action=argparse.BooleanOptionalAction, default=None, help=helptext)
    else:
        p.add_argument(
            _flag(name),
            dest=name,
            type=type(default),
            default=None,
            choices=choices,
            metavar=None if choices else name.upper(),
            help=helptext,
        )


def _help(f: dataclasses.Field[Any]) -> str:
    """A field's help: its ``help`` metadata, written beside the field."""
    return str(f.metadata.get("help", f"(default: {f.default!r})"))


def _shared_groups() -> list[tuple[str, list[dataclasses.Field[Any]]]]:
    """RunConfig's shared fields in their groups (titled as :data:`_GROUPS`), in RunConfig's order."""
    from dtrain.config.schema import RunConfig

    out: list[tuple[str, list[dataclasses.Field[Any]]]] = []
    for f in RunConfig.shared_fields():
        if f.name in _GROUPS or not out:
            out.append((_GROUPS.get(f.name, "shared options"), []))
        out[-1][1].append(f)
    return out


def _strategy_fields(strategy: str) -> list[dataclasses.Field[Any]]:
    """``strategy``'s options' fields (one whose metadata has ``renamed_to`` is an option's old name)."""
    from dtrain.registry import get

    return list(dataclasses.fields(get(strategy).options))


def _add_run_flags(p: argparse.ArgumentParser, only: str | None = None) -> None:
    """``dtrain run``'s flags: the shared ones, then every strategy's options (``only``: that strategy's),
    then the node flags. Every flag of every strategy is parsed; ``--help`` shows what ``only`` selects."""
    from dtrain.config.schema import option_fields
    from dtrain.registry import registered

    p.add_argument(
        "-h",
        "--help",
        action=_RunHelp,
        help="this help; with --strategy NAME (or a CONFIG that names "
        "one): the flags of a NAME run, each with its full help",
    )
    p.add_argument("config", nargs="?", metavar="CONFIG", help="a TOML file with the same keys as the flags")
    known = _choices()
    for title, group in _shared_groups():
        g = p.add_argument_group(title)
        for f in group:
            choices = tuple(registered()) if f.name == "strategy" else known.get(f.name)
            _add_flag(g, f.name, f.default, _help(f), choices)
            if f.name == "model":
                g.add_argument(
                    "--model-arg",
                    dest="model_arg",
                    action="append",
                    metavar="KEY=VALUE",
                    help="a keyword argument of --model (repeatable; VALUE read as a TOML value: 2, "
                    '0.1, true, "gelu"; a bare word is a string); TOML: a [model_args] table',
                )
    if only is None:
        g = p.add_argument_group("strategy options (each belongs to the strategies named; TOML: a [STRATEGY] table)")
        fields = {name: [f for _, f in owners] for name, owners in option_fields().items()}
        owned = {name: [s for s, _ in owners] for name, owners in option_fields().items()}
    else:
        g = p.add_argument_group(f"{only} options (TOML: a [{only}] table)")
        fields = {f.name: [f] for f in _strategy_fields(only)}
        owned = {name: [only] for name in fields}
    for name, fs in fields.items():
        f = fs[0]
        if "table" in f.metadata:  # a TOML table of the strategy's (``[tensor.plan]``), not a flag
            continue
        if "renamed_to" in f.metadata:  # an option's old name: still read, never shown
            _add_flag(g, name, f.default, argparse.SUPPRESS, None)
            continue
        choices = [c for x in fs for c in x.metadata.get("choices", ())]
        helptext = _help(f) + (f" [{', '.join(owned[name])}]" if only is None else "")
        _add_flag(g, name, f.default, helptext, tuple(dict.fromkeys(choices)) or None)
        if "switch" in f.metadata:  # a short flag for one value: --async is --mode async
            flag, value = f.metadata["switch"]
            g.add_argument(f"--{flag}", dest=name, action="store_const", const=value, help=f"--{name} {value}")
    _add_node_flags(p)


def _strategy_of(ns: argparse.Namespace) -> str | None:
    """The strategy a ``--help`` is about: ``--strategy``'s, else CONFIG's (None: neither names one)."""
    if getattr(ns, "strategy", None):
        return str(ns.strategy)
    if getattr(ns, "config", None):
        from dtrain.config.files import load_toml
        from dtrain.registry import registered

        try:
            name = load_toml(ns.config).get("strategy")
        except DTrainError:
            return None
        return name if isinstance(name, str) and name in registered() else None
    return None


def run_help(strategy: str | None = None) -> str:
    """``dtrain run --help``: every flag on a line of its own, each strategy's options on one line with its
    name; with ``strategy``: the shared flags and that strategy's, each with its full help."""
    from dtrain.registry import get, registered

    if strategy is not None:
        usage = _RUN_USAGE.replace("[--strategy NAME]", f"--strategy {strategy}")
        about = f"{_RUN_DESCRIPTION} The flags of a --strategy {strategy} run ({get(strategy).help})."
        p = argparse.ArgumentParser(prog="dtrain run", usage=usage, description=about, add_help=False)
        _add_run_flags(p, only=strategy)
        return p.format_help()
    width = max(min(shutil.get_terminal_size().columns, 120) - 2, 60)

    def wrap(text: str, indent: int, first: str = "") -> list[str]:
        return textwrap.wrap(
            text,
            width,
            initial_indent=f"  {first:<{indent - 3}} " if first else " " * indent,
            subsequent_indent=" " * indent,
            break_on_hyphens=False,
        )

    def entry(flag: str, text: str) -> str:
        head = f"  {flag:<21} " if len(flag) <= 21 else f"  {flag} "
        return head + _fit(text, width - len(head))

    def flag(f: dataclasses.Field[Any]) -> str:
        return _flag(f.name).replace("--", "--[no-]") if isinstance(f.default, bool) else _flag(f.name)

    # (each flag in full: the title of the strategies' options says how)
    out = [f"usage: {_RUN_USAGE}", "", *textwrap.wrap(_RUN_DESCRIPTION, width)]
    for title, group in _shared_groups():
        out += ["", f"{title}:", *(entry(flag(f), _help(f)) for f in group)]
    out += ["", "strategy options (each in full: dtrain run --strategy NAME --help):"]
    indent = max(map(len, registered())) + 4
    for name in registered():
        flags = [
            (f"[{name}.{f.name}]" if "table" in f.metadata else flag(f))  # a table: in TOML only
            + (f" --{f.metadata['switch'][0]}" if "switch" in f.metadata else "")
            for f in _strategy_fields(name)
            if "renamed_to" not in f.metadata
        ]
        out += wrap(" ".join(flags) or "(none)", indent, name)
    nodes = argparse.ArgumentParser(add_help=False)
    _add_node_flags(nodes)
    out += [
        "",
        *textwrap.wrap(
            f"{_NODES_SHORT}: " + " ".join(a.option_strings[0] for a in nodes._actions),
            width,
            subsequent_indent="  ",
            break_on_hyphens=False,
        ),
    ]
    return "\n".join(out) + "\n"


def _fit(text: str, width: int) -> str:
    """``text`` on one line of ``width``: whole, else its first clause, else cut at a word with an ellipsis."""
    if len(text) <= width:
        return text
    depth = 0
    for i, ch in enumerate(text[:width]):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        after = text[i + 1 : i + 3]  # a clause ends at "; " or at ". " before a capital (not at "e.g. 20")
        if depth == 0 and (ch == ";" and after[:1] == " " or ch == "." and after[:1] == " " and after[1:].isupper()):
            return text[:i]
    return text[: text.rfind(" ", 0, width - 3)] + " ..."


class _RunHelp(argparse.Action):
    """``dtrain run --help``: the overview, or a strategy's flags where ``--strategy`` or CONFIG names one."""

    def __init__(
        self,
        option_strings: Sequence[str],
        dest: str = argparse.SUPPRESS,
        default: Any = argparse.SUPPRESS,
        help: str | None = None,
    ) -> None:
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        parser._print_message(run_help(_strategy_of(namespace)), sys.stdout)
        parser.exit()


def _add_node_flags(p: argparse.ArgumentParser) -> None:
    """torchrun's launch flags, with its meaning (per node, so not keys of the configuration)."""
    g = p.add_argument_group(_NODES)
    g.add_argument(
        "--nnodes",
        metavar="N|MIN:MAX",
        help="nodes in the job; MIN:MAX lets it go on with fewer (default: 1, this machine alone)",
    )
    g.add_argument(
        "--node-rank",
        type=int,
        metavar="R",
        help="this node, 0..N-1; node 0 hosts the job's store "
        "on --rdzv-endpoint, and node R holds global ranks R*k..R*k+k-1 (default: 0)",
    )
    g.add_argument(
        "--rdzv-endpoint", metavar="HOST:PORT", help="node 0's address and a free port there (default port: 29400)"
    )
    g.add_argument(
        "--rdzv-id",
        metavar="JOB",
        help="the job's id, the same on every node; a node with another is refused (default: dtrain)",
    )
    g.add_argument(
        "--nproc-per-node",
        metavar="K|gpu",
        help="processes per node, or gpu: one per visible GPU "
        "(with --device cuda; NCCL) (default: the run's processes over the nodes, which must divide evenly)",
    )
    g.add_argument(
        "--rdzv-timeout",
        type=float,
        metavar="S",
        help="how long a node waits for the others to "
        "arrive before it stops, naming the missing node ranks (default: 300)",
    )
    g.add_argument(
        "--iface",
        metavar="NAME",
        help="the network interface for gloo and NCCL (default: the one that routes to the endpoint)",
    )


def nodes_from_args(ns: argparse.Namespace, env: dict[str, str] | None = None) -> NodeArgs | None:
    """This node's place: the flags, over SLURM's environment where ``srun`` set it; None for one machine."""
    import os

    from dtrain.cluster.nodes import DEFAULT_RDZV_TIMEOUT_S, NodeArgs, from_slurm, parse_nnodes, parse_nproc

    base = from_slurm(os.environ if env is None else env)
    given = {
        k: getattr(ns, k, None)
        for k in ("nnodes", "node_rank", "rdzv_endpoint", "rdzv_id", "nproc_per_node", "rdzv_timeout", "iface")
    }
    if base is None and given["nnodes"] is None:
        if any(v is not None for v in given.values()):
            flags = ", ".join("--" + k.replace("_", "-") for k, v in given.items() if v is not None)
            from dtrain.errors import ConfigError

            raise ConfigError(
                f"{flags} belong to a job on several nodes: add --nnodes N (and --node-rank, --rdzv-endpoint)"
            )
        return None
    a = base or NodeArgs()
    lo, hi = parse_nnodes(given["nnodes"]) if given["nnodes"] is not None else (a.min_nodes, a.nnodes)
    return NodeArgs(
        nnodes=hi,
        min_nodes=lo,
        node_rank=given["node_rank"] if given["node_rank"] is not None else a.node_rank,
        endpoint=given["rdzv_endpoint"] or a.endpoint,
        job=given["rdzv_id"] or a.job,
        nproc_per_node=parse_nproc(given["nproc_per_node"]),
        rdzv_timeout_s=given["rdzv_timeout"] if given["rdzv_timeout"] is not None else DEFAULT_RDZV_TIMEOUT_S,
        iface=given["iface"] or "",
        source=a.source if base is not None else "flags",
    ).check()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dtrain", description="Distributed training strategies for PyTorch.")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    r = sub.add_parser(
        "run",
        help="train a model (no argument: the embedded default)",
        add_help=False,
        usage=_RUN_USAGE,
        description=_RUN_DESCRIPTION,
    )
    _add_run_flags(r)
    b = sub.add_parser("bench", help="side-by-side benchmarks: " + ", ".join(_BENCHES))
    b.add_argument("name", choices=sorted(_BENCHES))
    b.add_argument("args", nargs=argparse.REMAINDER)
    pl = sub.add_parser("plan", help="rank strategies by predicted step time", add_help=False)
    pl.add_argument("args", nargs=argparse.REMAINDER)
    cl = sub.add_parser("cluster", help="emulated cluster: up | down | status", add_help=False)
    cl.add_argument("args", nargs=argparse.REMAINDER)
    rp = sub.add_parser(
        "report",
        help="summary of finished runs and report.html (several: compared with the first; a sweep folder: its trials)",
    )
    rp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    rp.add_argument("--out", help="where report.html goes: a file or a folder (default: the first run folder)")
    rp.add_argument(
        "--predict",
        action="store_true",
        help="add the performance model's predicted step for each "
        "run's strategy (calibrates this machine once per process count, then a few seconds)",
    )
    sm = sub.add_parser("sample", help="text from a finished language-model run", add_help=False)
    sm.add_argument("args", nargs=argparse.REMAINDER)
    sw = sub.add_parser(
        "sweep", help="search hyper-parameters on Ray Tune, each trial a run (the tune extra)", add_help=False
    )
    sw.add_argument("args", nargs=argparse.REMAINDER)
    return ap


def config_from_args(ns: argparse.Namespace) -> RunConfig:
    """TOML file (if any), then the flags that were given: shared keys and flat strategy options."""
    from dtrain.config.files import load_toml
    from dtrain.config.schema import RunConfig, option_fields

    values: dict[str, Any] = load_toml(ns.config) if getattr(ns, "config", None) else {}
    options = option_fields()
    for name in [f.name for f in RunConfig.shared_fields()] + list(options):
        v = getattr(ns, name, None)
        if v is not None:
            values[name] = v
            # the flag wins over the file's value under the option's old name too (e.g. checkpoint -> recompute)
            for old in (o for o, owners in options.items() if owners[0][1].metadata.get("renamed_to") == name):
                values.pop(old, None)
                table = values.get(str(values.get("strategy", "dp")))
                if isinstance(table, dict):
                    table.pop(old, None)
    if getattr(ns, "model_arg", None):
        from dtrain.config.files import parse_model_args

        values["model_args"] = {**dict(values.get("model_args") or {}), **parse_model_args(ns.model_arg)}
    return RunConfig.from_mapping(values)


def _model_preload(argv: Sequence[str]) -> tuple[str, ...]:
    """The modules of ``--model hf:TYPE``'s architecture, for the forkserver to import once for every worker
    (each would take seconds of its own); nothing for another model."""
    for i, a in enumerate(argv):
        spec = (
            a.partition("=")[2]
            if a.startswith("--model=")
            else argv[i + 1]
            if a == "--model" and i + 1 < len(argv)
            else ""
        )
        if spec.startswith("hf:"):
            kind = spec[3:].replace("-", "_")
            return (
                ("transformers", f"transformers.models.{kind}.modeling_{kind}")
                if kind.isidentifier()
                else ("transformers",)
            )
    return ()


def _delegate(module: str, argv: list[str]) -> int:
    return int(importlib.import_module(module).main(argv))


def _cmd_run(ns: argparse.Namespace) -> int:
    from dtrain.job.run import run
    from dtrain.launch.agent import LaunchInterrupted

    cfg = config_from_args(ns)
    nodes = nodes_from_args(ns)
    try:
        summary, out = run(cfg, nodes=nodes)
    except LaunchInterrupted as e:  # Ctrl-C / SIGTERM: the workers are stopped; where to resume from
        lead = "\n" if cfg.progress else ""  # a stopped worker's progress bar ends without a newline
        print(f"{lead}dtrain: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:  # Ctrl-C while no worker was running
        print("dtrain: interrupted", file=sys.stderr)
        return 130
    if not summary:  # a node other than 0 of a job on several: node 0 writes the summary
        from dtrain.rundir.files import SUMMARY

        print(f"node {nodes.node_rank if nodes else 0}: done; node 0 writes the summary to {out / SUMMARY}")
        return 0
    print(
        f"strategy {summary['strategy']}, {summary['workers']} workers, {summary['steps']} steps, "
        f"{summary['samples_per_s']:.0f} samples/s, {summary['wall_s']:.1f}s"
    )
    if "applied_samples_per_s" in summary:
        print(
            f"parameter server: {summary['computed_samples_per_s']:.0f} samples/s computed, "
            f"{summary['applied_samples_per_s']:.0f} applied to the parameters"
        )
    if summary.get("val_loss") is not None:
        print(f"validation loss: {summary['val_loss']:.4f} nats/token (perplexity {summary['perplexity']:.2f})")
    elif summary.get("test_accuracy") is not None:
        print(f"test accuracy: {summary['test_accuracy']:.4f}")
    if summary.get("target") is not None:
        t = summary.get("time_to_target_s")
        print(
            f"target {summary['target']:g}: "
            + (f"reached at step {summary['target_step']} after {t:.1f}s" if t is not None else "not reached")
        )
    if summary.get("attribution"):  # who the others waited for, what bounds the step (dtrain.observe.attribution)
        print(summary["attribution"]["line"])
    from dtrain.workloads.models.specs import is_builtin

    if (out / "model.pt").is_file() and is_builtin(cfg.model):  # dtrain's gpt on bytes: a few lines of its text
        from dtrain.observe.sample import sample_run

        print("sample (dtrain sample RUN_DIR for more):\n" + sample_run(out, tokens=160))
    print(f"run folder: {out}")
    return 0


def _cmd_report(ns: argparse.Namespace) -> int:
    from dtrain.observe.report_html import report_runs
    from dtrain.observe.report_sweep import is_sweep, write_sweep_report

    if len(ns.run_dirs) == 1 and is_sweep(ns.run_dirs[0]):  # a sweep folder: its trials, best, lineage
        path, text = write_sweep_report(ns.run_dirs[0], ns.out)
        print(f"{text}\nreport.html     {path}")
        return 0
    print(report_runs(ns.run_dirs, ns.out, predict=ns.predict))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # (not for a node of several: its meeting comes first, and a node that fails it starts no forkserver)
    if argv[:1] == ["run"] and not {"-h", "--help", "--cluster", "--nnodes"} & set(argv):
        from dtrain.launch.agent import prestart
        from dtrain.launch.forkserver import PRELOAD

        # the workers' forkserver imports torch (and transformers for an hf: model) while this process reads the
        # configuration
        prestart((*PRELOAD, *_model_preload(argv)))
    if argv[:1] == ["run"]:  # --help last: it shows the strategy that --strategy or CONFIG names, wherever they are
        argv = [a for a in argv if a not in ("-h", "--help")] + [a for a in argv if a in ("-h", "--help")][:1]
    ap = build_parser()
    if not argv:
        ap.print_help()
        return 0
    # delegated subcommands parse their own arguments (argparse's REMAINDER would swallow no --help)
    delegated = {
        "plan": "dtrain.planning.cli",
        "cluster": "dtrain.cluster.cli",
        "sample": "dtrain.observe.sample",
        "sweep": "dtrain.search.cli",
    }
    if argv[0] in delegated or (argv[0] == "bench" and len(argv) > 1 and argv[1] in _BENCHES):
        module = delegated.get(argv[0]) or _BENCHES[argv[1]]
        rest = argv[1:] if argv[0] in delegated else argv[2:]
        return run_command("dtrain", lambda: _delegate(module, rest))
    ns = ap.parse_args(argv)
    return run_command("dtrain", lambda: _dispatch(ap, ns))


def _dispatch(ap: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    try:
        if ns.command == "run":
            return _cmd_run(ns)
        if ns.command == "bench":
            return _delegate(_BENCHES[ns.name], ns.args)
        if ns.command == "plan":
            return _delegate("dtrain.planning.cli", ns.args)
        if ns.command == "cluster":
            return _delegate("dtrain.cluster.cli", ns.args)
        if ns.command == "report":
            return _cmd_report(ns)
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("dtrain."):
            raise DTrainError(f"{ns.command} needs {e.name}, which this build does not have") from None
        raise
    ap.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
