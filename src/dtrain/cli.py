"""The ``dtrain`` command: run, bench, plan, cluster, report.

``dtrain run`` flags are generated from :class:`dtrain.job.config.RunConfig`'s shared
fields and every registered strategy's options dataclass (``batch_size`` ->
``--batch-size``, ``PSOptions.servers`` -> ``--servers``), so the TOML keys and
the flags cannot drift apart. Precedence: built-in defaults < config file < flags.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dtrain.errors import DTrainError, run_command

if TYPE_CHECKING:
    from dtrain.cluster.nodes import NodeArgs
    from dtrain.job.config import RunConfig

# the configuration's modules import torch: they load after main() has started the workers' forkserver
__all__ = ["main", "build_parser", "config_from_args", "nodes_from_args"]


def _choices() -> dict[str, Sequence[str]]:
    from dtrain.job.config import DEVICES, LR_SCHEDULES, OPTIMIZERS, PRECISIONS
    from dtrain.training.large_batch import AUTO_RULES, LR_SCALINGS

    return {"optimizer": OPTIMIZERS, "lr_schedule": LR_SCHEDULES, "precision": PRECISIONS, "device": DEVICES,
            "lr_scaling": LR_SCALINGS, "auto_rule": AUTO_RULES}
_HELP = {
    "workers": "worker processes (default: 4)",
    "device": "cpu, or cuda: each worker on GPU (local rank mod the GPUs); dp and ddp. NCCL where every worker has "
              "a GPU of its own, else gloo, whose collectives carry CUDA tensors through host memory (so 4 workers "
              "can share one GPU) (default: cpu)",
    "lr_schedule": "learning rate over the run: constant, or cosine from --lr down to 0 at the last step "
                   "(default: constant)",
    "batch_size": "global batch size, summed over workers",
    "optimizer": "sgd | adam | adamw | lars (You et al. 2017) | lamb (You et al. 2019) (default: sgd)",
    "precision": "compute precision: fp32, or bf16 / fp16 under torch autocast with float32 master weights; fp16 "
    "scales the loss (dynamic, the overflow skip agreed by every rank of a step); gradients travel in "
    "16 bits (default: fp32)",
    "lr_scaling": "scale --lr with the global batch: linear (lr x B / base batch, Goyal et al. 2017), sqrt, or "
    "none (default: none)",
    "base_batch": "the global batch --lr was tuned for (default: 0, the run's first global batch)",
    "warmup_steps": "gradual warmup over N steps: from --lr to the scaled rate (Goyal et al.), or from near 0 "
    "without scaling (default: 0)",
    "warmup_epochs": "the warmup in epochs instead (default: 0)",
    "batch_schedule": 'grow the global batch: "0:256,5:512" (from epoch: batch), or auto (double it while the '
    "measured gradient noise scale exceeds it; dp) (default: none)",
    "max_batch": "the largest batch --batch-schedule auto grows to (default: 0, a quarter of the training set)",
    "auto_every": "--batch-schedule auto decides every N steps, inside epochs too (default: 0, at the start of "
    "each epoch)",
    "auto_rule": "--batch-schedule auto doubles the batch while the noise scale exceeds twice it (noise), or while "
    "the noise scale times the step's fixed time over its batch's compute time does (time: the batch that "
    "reaches a loss soonest; McCandlish et al.'s step count times the step time) (default: noise)",
    "noise_scale": "log the gradient noise scale B_simple every step (McCandlish et al. 2018; dp, 2+ workers; "
    "one extra scalar all-reduce) (default: off)",
    "noise_beta": "the decay of the noise scale's moving averages of |G|^2 and tr(Sigma), a memory of about "
    "1/(1-BETA) steps: a long one lags where |G|^2 falls fast, early in training (default: 0.99)",
    "straggler": "RANK:FACTOR: that rank's own work per step (data, forward, backward) takes FACTOR times its "
                 "usual time (median of its last 50 steps); communication is not slowed",
    "strategy": "how to distribute: one of the registered strategies (default: dp)",
    "cluster": "run on an emulated cluster made by `dtrain cluster up --name NAME`",
    "out": "run folder (default: runs/<timestamp>-<strategy>); one that holds files is refused unless --overwrite",
    "overwrite": "replace the earlier run in --out: everything in that folder is deleted first (default: off)",
    "tensorboard": "write the evaluating rank's per-step loss, lr, samples/s (loss scale, noise scale when present) "
                   "and each evaluation's metric as TensorBoard event files in RUN/tensorboard (needs the tensorboard "
                   "package) (default: off)",
    "skip_nonfinite": "skip up to N steps whose loss or gradients are not finite, on every rank that shares the "
                      "step (no optimizer step); the next one stops the run (default: 0, stop at the first)",
    "max_steps": "stop after this many steps (0: no limit)",
    "max_restarts": "when a process dies, restart every process from the run folder's newest complete checkpoint, "
                    "up to N times (torch's elastic agent; needs --checkpoint-every) (default: 0, the run fails)",
    "min_workers": "with --max-restarts: a restart leaves out the worker that failed (its host taken as lost, as "
                   "Horovod's elastic mode blacklists it) while at least N workers remain, and the run goes on with "
                   "fewer from the newest checkpoint, resharded; the global batch stays (it must divide over every "
                   "count from N up) (default: 0, restart on every worker)",
    "trace_steps": "trace only steps FIRST-LAST, e.g. 20-40 (default: all steps, up to 100,000 events a rank)",
    "checkpoint_every": "save a checkpoint to RUN/checkpoints every N steps and at the end (default: 0, never)",
    "resume": "continue from a checkpoint folder, or a run folder's newest intact checkpoint (its files "
              "checked against the checkpoint's manifest)",
    "model": "cnn | mlp (classifiers) | gpt-tiny | gpt-small | gpt-medium | gpt (gpt-small's shape, resized by "
             "--layers --d-model --heads) (default: cnn)",
    "dataset": "digits (scikit-learn's 1,797 8x8 digits) | synthetic (a random teacher's labels, --samples) | "
               "pytext (the Python documentation text shipped with CPython, pydoc_data.topics: about 465 KB of "
               "English as byte tokens, 90%% train / 10%% validation; for gpt models) (default: digits)",
    "seq_len": "tokens per pytext window and the gpt's context (default: 64)",
    "layers": "gpt blocks (default: 0, the preset's)",
    "d_model": "gpt width (default: 0, the preset's)",
    "heads": "gpt attention heads (default: 0, the preset's)",
    "dropout": "gpt dropout (default: 0, none: runs are deterministic)",
    "target": "stop when the metric reaches it: test accuracy >= TARGET, or a language model's validation loss "
              "(nats/token) <= TARGET; summary.json records time_to_target_s (default: 0, no target)",
    "eval_every": "evaluate every N steps (default: 0, after each epoch)",
    "eval_samples": "evaluate on the first N test samples or validation windows (default: 0, all)",
}
# subcommands that live in other packages: name -> module with main(argv) -> int
_BENCHES = {
    "allreduce": "dtrain.measure.allreduce",
    "calibrate": "dtrain.measure.calibrate",
    "p2p": "dtrain.measure.p2p",
    "train": "dtrain.measure.train",
}


def _add_flag(p: argparse._ActionsContainer, name: str, default: Any, helptext: str,
              choices: Sequence[str] | None) -> None:  # fmt: skip
    flag = "--" + name.replace("_", "-")
    if isinstance(default, bool):
        p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=helptext)
    else:
        p.add_argument(flag, dest=name, type=type(default), default=None, choices=choices,
                       metavar=None if choices else name.upper(), help=helptext)  # fmt: skip


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    from dtrain.job.config import RunConfig, option_fields
    from dtrain.registry import registered

    known = _choices()
    for f in RunConfig.shared_fields():
        choices = tuple(registered()) if f.name == "strategy" else known.get(f.name)
        _add_flag(p, f.name, f.default, _HELP.get(f.name, f"(default: {f.default!r})"), choices)
    g = p.add_argument_group("strategy options (each belongs to the strategies named; TOML: a [STRATEGY] table)")
    for name, owners in option_fields().items():
        f = owners[0][1]
        default = f.default
        helptext = f.metadata.get("help", f"(default: {default!r})") + f" [{', '.join(s for s, _ in owners)}]"
        _add_flag(g, name, default, helptext, f.metadata.get("choices"))
        if "switch" in f.metadata:  # a short flag for one value: --async is --mode async
            flag, value = f.metadata["switch"]
            g.add_argument(f"--{flag}", dest=name, action="store_const", const=value, help=f"--{name} {value}")


def _add_node_flags(p: argparse.ArgumentParser) -> None:
    """torchrun's launch flags, with its meaning (per node, so not keys of the configuration)."""
    g = p.add_argument_group("several machines (the same command on each node; inside SLURM's srun they come from "
                             "its environment)")  # fmt: skip
    g.add_argument("--nnodes", metavar="N|MIN:MAX", help="nodes in the job; MIN:MAX lets it go on with fewer "
                   "(default: 1, this machine alone)")
    g.add_argument("--node-rank", type=int, metavar="R", help="this node, 0..N-1; node 0 hosts the job's store "
                   "on --rdzv-endpoint, and node R holds global ranks R*k..R*k+k-1 (default: 0)")
    g.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="node 0's address and a free port there "
                   "(default port: 29400)")
    g.add_argument("--rdzv-id", metavar="JOB", help="the job's id, the same on every node; a node with another is "
                   "refused (default: dtrain)")
    g.add_argument("--nproc-per-node", metavar="K|gpu", help="processes per node, or gpu: one per visible GPU "
                   "(with --device cuda; NCCL) (default: the run's processes over the nodes, which must divide evenly)")
    g.add_argument("--rdzv-timeout", type=float, metavar="S", help="how long a node waits for the others to "
                   "arrive before it stops, naming the missing node ranks (default: 300)")
    g.add_argument("--iface", metavar="NAME", help="the network interface for gloo and NCCL (default: the one "
                   "that routes to the endpoint)")


def nodes_from_args(ns: argparse.Namespace, env: dict[str, str] | None = None) -> NodeArgs | None:
    """This node's place: the flags, over SLURM's environment where ``srun`` set it; None for one machine."""
    import os

    from dtrain.cluster.nodes import DEFAULT_RDZV_TIMEOUT_S, NodeArgs, from_slurm, parse_nnodes, parse_nproc

    base = from_slurm(os.environ if env is None else env)
    given = {k: getattr(ns, k, None) for k in ("nnodes", "node_rank", "rdzv_endpoint", "rdzv_id", "nproc_per_node",
                                               "rdzv_timeout", "iface")}  # fmt: skip
    if base is None and given["nnodes"] is None:
        if any(v is not None for v in given.values()):
            flags = ", ".join("--" + k.replace("_", "-") for k, v in given.items() if v is not None)
            from dtrain.errors import ConfigError

            raise ConfigError(f"{flags} belong to a job on several nodes: add --nnodes N (and --node-rank, "
                              "--rdzv-endpoint)")  # fmt: skip
        return None
    a = base or NodeArgs()
    lo, hi = parse_nnodes(given["nnodes"]) if given["nnodes"] is not None else (a.min_nodes, a.nnodes)
    return NodeArgs(
        nnodes=hi, min_nodes=lo,
        node_rank=given["node_rank"] if given["node_rank"] is not None else a.node_rank,
        endpoint=given["rdzv_endpoint"] or a.endpoint,
        job=given["rdzv_id"] or a.job,
        nproc_per_node=parse_nproc(given["nproc_per_node"]),
        rdzv_timeout_s=given["rdzv_timeout"] if given["rdzv_timeout"] is not None else DEFAULT_RDZV_TIMEOUT_S,
        iface=given["iface"] or "",
        source=a.source if base is not None else "flags",
    ).check()  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dtrain", description="Distributed training strategies for PyTorch.")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    r = sub.add_parser("run", help="train a model (no argument: the embedded default)",
                       description="Train a model. With no argument: 4 local workers, the CNN on digits, "
                                   "data parallel with ring allreduce.")
    r.add_argument("config", nargs="?", help="a TOML file with the same keys as the flags")
    _add_run_flags(r)
    _add_node_flags(r)
    b = sub.add_parser("bench", help="side-by-side benchmarks: " + ", ".join(_BENCHES))
    b.add_argument("name", choices=sorted(_BENCHES))
    b.add_argument("args", nargs=argparse.REMAINDER)
    pl = sub.add_parser("plan", help="rank strategies by predicted step time", add_help=False)
    pl.add_argument("args", nargs=argparse.REMAINDER)
    cl = sub.add_parser("cluster", help="emulated cluster: up | down | status", add_help=False)
    cl.add_argument("args", nargs=argparse.REMAINDER)
    rp = sub.add_parser("report", help="summary of finished runs and report.html (several: compared with the first)")
    rp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    rp.add_argument("--out", help="where report.html goes: a file or a folder (default: the first run folder)")
    rp.add_argument("--predict", action="store_true", help="add the performance model's predicted step for each "
                    "run's strategy (calibrates this machine once per process count, then a few seconds)")
    sm = sub.add_parser("sample", help="text from a finished language-model run", add_help=False)
    sm.add_argument("args", nargs=argparse.REMAINDER)
    return ap


def config_from_args(ns: argparse.Namespace) -> RunConfig:
    """TOML file (if any), then the flags that were given: shared keys and flat strategy options."""
    from dtrain.job.config import RunConfig, option_fields
    from dtrain.job.files import load_toml

    values: dict[str, Any] = load_toml(ns.config) if getattr(ns, "config", None) else {}
    for name in [f.name for f in RunConfig.shared_fields()] + list(option_fields()):
        v = getattr(ns, name, None)
        if v is not None:
            values[name] = v
    return RunConfig.from_mapping(values)


def _delegate(module: str, argv: list[str]) -> int:
    return int(importlib.import_module(module).main(argv))


def _cmd_run(ns: argparse.Namespace) -> int:
    from dtrain.job.launch import LaunchInterrupted
    from dtrain.job.worker import run

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
        print(f"node {nodes.node_rank if nodes else 0}: done; node 0 writes the summary to {out / 'summary.json'}")
        return 0
    print(f"strategy {summary['strategy']}, {summary['workers']} workers, {summary['steps']} steps, "
          f"{summary['samples_per_s']:.0f} samples/s, {summary['wall_s']:.1f}s")
    if "applied_samples_per_s" in summary:
        print(f"parameter server: {summary['computed_samples_per_s']:.0f} samples/s computed, "
              f"{summary['applied_samples_per_s']:.0f} applied to the parameters")
    if summary.get("val_loss") is not None:
        print(f"validation loss: {summary['val_loss']:.4f} nats/token (perplexity {summary['perplexity']:.2f})")
    elif summary.get("test_accuracy") is not None:
        print(f"test accuracy: {summary['test_accuracy']:.4f}")
    if summary.get("target") is not None:
        t = summary.get("time_to_target_s")
        print(f"target {summary['target']:g}: " + (f"reached at step {summary['target_step']} after {t:.1f}s"
                                                   if t is not None else "not reached"))
    if summary.get("attribution"):  # who the others waited for, what bounds the step (dtrain.observe.attribution)
        print(summary["attribution"]["line"])
    if (out / "model.pt").is_file():
        from dtrain.workloads.sample import sample_run

        print("sample (dtrain sample RUN_DIR for more):\n" + sample_run(out, tokens=160))
    print(f"run folder: {out}")
    return 0


def _cmd_report(ns: argparse.Namespace) -> int:
    from dtrain.observe.report_html import report_runs

    print(report_runs(ns.run_dirs, ns.out, predict=ns.predict))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # (not for a node of several: its meeting comes first, and a node that fails it starts no forkserver)
    if argv[:1] == ["run"] and not {"-h", "--help", "--cluster", "--nnodes"} & set(argv):
        from dtrain.job.launch import prestart

        prestart()  # the workers' forkserver imports torch while this process reads the configuration
    ap = build_parser()
    if not argv:
        ap.print_help()
        return 0
    # delegated subcommands parse their own arguments (argparse's REMAINDER would swallow no --help)
    delegated = {"plan": "dtrain.planning.cli", "cluster": "dtrain.cluster.cli", "sample": "dtrain.workloads.sample"}
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
