"""Rerun the headline benchmarks, each writing its result file, then re-render BENCHMARKS.md.

Each entry is one benchmark script with the flags of its headline figure; ``--quick`` gives fewer steps
(still 5 rounds, so that every ratio has a spread and a verdict) and marks the result files as quick, which
the page shows. The emulated-cluster entries need root (network namespaces), and the pipeline with a core per
stage needs 4 physical cores; without them, they are left out with a line saying so and their result files keep
their last figures.

Run::

    python benchmarks/run_all.py                 # the full set (about an hour and a half on 2 cores)
    python benchmarks/run_all.py --quick         # 20 minutes or less on 2 cores
    python benchmarks/run_all.py --only dp_vs_ddp,local_sgd_vs_torch
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


def physical_cores() -> int:
    """How many physical cores this process may run on."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    from pipeline_bubble_cores import physical_cores as cores

    return len(cores())


@dataclass(frozen=True)
class Entry:
    name: str  # the result file's name (benchmarks/results/NAME.json)
    script: str
    full: tuple[str, ...]
    quick: tuple[str, ...]
    root: bool = False
    cores: int = 0  # physical cores it needs (pinned stages); left out on a smaller machine


LLAMA = ("--model", "hf-llama-small", "--nprocs", "2", "--seq-len", "128", "--batch-size", "16")
LLAMA_QUICK = ("--model", "hf-llama-small", "--nprocs", "2", "--seq-len", "64", "--batch-size", "16")
LLAMA_SHARDED = ("--deepspeed", "off", "--systems", "dtrain dp,dtrain z3,torch ddp,torch fsdp2")
LLAMA_MEMORY = ("--fixed-model", "none", "--systems", "dtrain dp,dtrain z3,torch ddp,torch fsdp2")

ENTRIES = (
    Entry(
        "dp_vs_ddp",
        "dp_vs_ddp.py",
        ("--algorithms", "ring", "--repeats", "7"),
        ("--algorithms", "ring", "--steps", "80", "--warmup", "10", "--repeats", "5"),
    ),
    Entry(
        "dp_vs_ddp_gpt",
        "dp_vs_ddp.py",
        (
            "--model",
            "gpt-small",
            "--batch-size",
            "16",
            "--algorithms",
            "ring",
            "--steps",
            "20",
            "--warmup",
            "3",
            "--repeats",
            "7",
        ),
        (
            "--model",
            "gpt-small",
            "--batch-size",
            "16",
            "--algorithms",
            "ring",
            "--steps",
            "5",
            "--warmup",
            "2",
            "--repeats",
            "5",
        ),
    ),
    Entry(
        "sharded_vs_torch",
        "sharded.py",
        ("--deepspeed", "off", "--steps", "14", "--rounds", "7"),
        ("--deepspeed", "off", "--steps", "5", "--rounds", "5", "--seq-len", "32"),
    ),
    Entry(
        "pipeline_vs_torch",
        "pipeline_vs_torch.py",
        ("--workloads", "gpt", "--pairs", "gpipe,1f1b,interleaved", "--steps", "14", "--rounds", "7"),
        ("--workloads", "mlp", "--pairs", "gpipe,1f1b,interleaved"),
    ),  # --quick: 5 rounds of a step
    Entry(
        "tensor_vs_dtensor_tp2",
        "tensor_parallel.py",
        ("--tp", "2", "--steps", "14", "--rounds", "7"),
        ("--tp", "2", "--steps", "5", "--rounds", "5", "--seq-len", "32"),
    ),
    Entry(
        "tensor_vs_dtensor_tp4",
        "tensor_parallel.py",
        ("--tp", "4", "--steps", "14", "--rounds", "7"),
        ("--tp", "4", "--steps", "5", "--rounds", "5", "--seq-len", "32"),
    ),
    Entry("local_sgd_vs_torch", "local_sgd_vs_torch.py", ("--repeats", "7"), ("--steps", "80", "--repeats", "5")),
    Entry(
        "pipeline_bubble_sleep",
        "pipeline_bubble_sleep.py",
        ("--rounds", "7", "--steps", "2"),
        ("--rounds", "5", "--steps", "1"),
    ),
    Entry(
        "pipeline_bubble_cores",
        "pipeline_bubble_cores.py",
        ("--rounds", "7"),
        ("--rounds", "5", "--steps", "1"),
        cores=4,
    ),
    Entry(
        "memory_sharded",
        "memory.py",
        ("--rounds", "5"),
        ("--rounds", "5", "--seq-len", "32", "--steps", "2", "--systems", "dtrain dp,dtrain z3,torch ddp,torch fsdp2"),
    ),
    Entry(
        "memory_sharded_return",
        "memory.py",
        ("--allocator", "return", "--rounds", "5"),
        (
            "--allocator",
            "return",
            "--rounds",
            "5",
            "--seq-len",
            "32",
            "--steps",
            "2",
            "--systems",
            "dtrain dp,dtrain z3,torch ddp,torch fsdp2",
        ),
    ),
    # a model dtrain did not write (a transformers Llama of gpt-small's size), 2 processes of 8 windows of 128 tokens
    Entry(
        "dp_vs_ddp_hf_llama_small",
        "dp_vs_ddp.py",
        (*LLAMA, "--algorithms", "ring,native", "--steps", "8", "--warmup", "2", "--repeats", "7"),
        (*LLAMA_QUICK, "--algorithms", "ring", "--steps", "3", "--warmup", "1", "--repeats", "5"),
    ),
    Entry(
        "sharded_vs_torch_hf_llama_small",
        "sharded.py",
        (*LLAMA, *LLAMA_SHARDED, "--steps", "14", "--rounds", "7"),
        (*LLAMA_QUICK, *LLAMA_SHARDED, "--steps", "5", "--rounds", "5"),
    ),
    Entry(
        "memory_sharded_hf_llama_small",
        "memory.py",
        (*LLAMA, *LLAMA_MEMORY, "--rounds", "7"),
        (*LLAMA_QUICK, *LLAMA_MEMORY, "--rounds", "5", "--steps", "2"),
    ),
    Entry(
        "compression_vs_ddp",
        "compression_vs_ddp.py",
        ("--repeats", "5"),
        ("--repeats", "5", "--max-steps", "300"),
        root=True,
    ),
    Entry(
        "token_file_memory",
        "token_file_memory.py",
        ("--rounds", "5"),
        ("--rounds", "5", "--big-gib", "0.5", "--max-steps", "10"),
    ),
    Entry("allocator_cost", "allocator_cost.py", ("--repeats", "5"), ("--steps", "15", "--repeats", "5")),
    Entry(
        "model_held_out",
        "model_held_out.py",
        ("--rounds", "5"),
        ("--rounds", "5", "--bandwidths", "1gbit", "--steps", "5", "--window", "1"),
        root=True,
    ),
    Entry(
        "model_held_out_gpt_medium",
        "model_held_out.py",
        ("--models", "gpt-medium", "--rounds", "5"),
        ("--models", "gpt-medium", "--rounds", "5", "--bandwidths", "1gbit", "--steps", "5", "--window", "1"),
        root=True,
    ),
    Entry(
        "nodes_launch",
        "nodes_launch.py",
        ("--repeats", "9", "--steps", "2000"),
        ("--strategies", "dp", "--steps", "150", "--from", "30", "--repeats", "5"),
        root=True,
    ),
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps; the page marks the figures as quick")
    ap.add_argument("--only", default="", help="comma-separated result names (default: all)")
    ap.add_argument("--no-render", action="store_true", help="leave BENCHMARKS.md as it is")
    a = ap.parse_args(argv)
    names = [e.name for e in ENTRIES]
    only = [s for s in a.only.split(",") if s]
    unknown = [s for s in only if s not in names]
    if unknown:
        ap.error(f"unknown benchmark(s) {unknown}; choose from {','.join(names)}")
    failed = []
    t_all = time.perf_counter()
    for e in ENTRIES:
        if only and e.name not in only:
            continue
        if e.root and os.geteuid() != 0:
            print(f"== {e.name}: left out (needs root for network namespaces); its result file is unchanged")
            continue
        if e.cores and (have := physical_cores()) < e.cores:
            print(
                f"== {e.name}: left out (needs {e.cores} physical cores, this machine has {have}); its result "
                f"file is unchanged"
            )
            continue
        # paths relative to the repository's root (the command recorded in the result file is rerunnable there)
        cmd = [
            sys.executable,
            f"benchmarks/{e.script}",
            *(e.quick if a.quick else e.full),
            "--out",
            f"benchmarks/results/{e.name}.json",
            *(["--quick"] if a.quick else []),
        ]
        print(f"== {e.name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, cwd=HERE.parent).returncode
        print(f"== {e.name}: exit {rc}, {time.perf_counter() - t0:.0f} s", flush=True)
        if rc:
            failed.append(e.name)
    if not a.no_render:
        subprocess.run([sys.executable, "benchmarks/render.py"], cwd=HERE.parent, check=True)
    print(f"all: {time.perf_counter() - t_all:.0f} s" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
