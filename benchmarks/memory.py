"""Memory of ZeRO's stages, tensor parallelism and their peers as the process sees it, beside the closed form.

Each configuration runs in fresh processes (one launch of ``--nprocs`` gloo processes on loopback a
configuration and round): inside :class:`dtrain.measure.memory.ProcessMemory`, whose baseline is taken before
the model is built, a rank builds the system of ``benchmarks/sharded.py`` (the same model, seed, Adam and
batches) and trains ``--steps`` steps. The figure is the largest rank's peak resident set above its
baseline, in MiB, beside:

- the live tensors after the last step: every tensor storage the garbage collector reaches, each once (what is
  held whether a wrapper lists it or not; not memory outside tensors, nor tensors only C++ holds);
- the wrapper's count after the last step (``memory_stats``: parameters, gradients, optimizer state and, at
  stage 3, the most gathered units at once), for dtrain's systems;
- the closed form of the model states for ``Psi`` float32 parameters, Adam and ``N`` ranks (Rajbhandari
  et al., "ZeRO", SC 2020, sec. 5): ``16 Psi``, ``8 Psi + 8 Psi/N``, ``4 Psi + 12 Psi/N``, ``16 Psi/N`` plus
  the two largest adjacent units gathered; and the same plus the activations (the bytes autograd saves for
  backward in one more step, counted by saved-tensor hooks).

Tensor parallelism (``dtrain tp1``, ``tp2``, ``tp4``, ``tp4 sp``: ``tensor_parallel.py``'s Megatron plan, with
sequence parallelism for the last) runs in a launch of ``tp`` processes, every rank training the whole batch of
``--tp-batch`` samples with Adam; its closed form is 16 bytes a parameter the rank holds (its ``1/tp`` of the
split ones, all of the replicated ones), plus the activations as above. Its optimizer's ``zero_grad`` frees the
gradients before each forward and backward frees the activations as it makes the gradients, so its step's
peak is also given as 12 bytes a held parameter plus the larger of the activations and the gradients.

The process holds more than the model states and activations: the runtime's own memory (what a launch
allocates after the baseline whatever the model: imported code, the process group's and autograd's buffers,
the allocator's arenas), measured as the same system's process memory beyond its closed form and activations
on ``--fixed-model`` (gpt-tiny: 137K parameters, about 2 MiB of states) in the same round, and the
collectives' buffers and the allocator's slack, which grow with the model. The harness's ratios are closed
form + activations (+ the fixed cost) / process, against "within 10%".

``--allocator return`` measures the same with glibc told (``mallopt(M_MMAP_THRESHOLD, 64 KiB)`` in each
process, before its baseline) to serve every block of 64 KiB or more from its own mapping, so that freeing it
gives it back to the kernel at once: glibc's default raises that threshold up to 32 MiB as large blocks are
freed and keeps what is freed below it for reuse, so the resident set's peak also holds freed memory (each
step's activations and gathered units, the whole model ZeRO-3 built before sharding it). The two runs differ
only in what the allocator keeps.

Run::

    python benchmarks/memory.py                            # gpt-small, 4 processes, every system, 5 rounds
    python benchmarks/memory.py --out benchmarks/results/memory_sharded.json
    python benchmarks/memory.py --allocator return --out benchmarks/results/memory_sharded_return.json
    python benchmarks/memory.py --model hf-llama-small --nprocs 2 --seq-len 128 --fixed-model none --rounds 7 \
        --systems 'dtrain dp,dtrain z3,torch ddp,torch fsdp2' \
        --out benchmarks/results/memory_sharded_hf_llama_small.json
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any

import sharded
import tensor_parallel
import torch
from _loopback import launch_loopback
from _models import HF_MODELS, LANGUAGE, preload

#: tensor parallelism: (tp, sequence parallel); every rank trains the whole batch of ``--tp-batch`` samples
TENSOR = {"dtrain tp1": (1, False), "dtrain tp2": (2, False), "dtrain tp4": (4, False), "dtrain tp4 sp": (4, True)}
SYSTEMS = ("dtrain dp", "dtrain z1", "dtrain z2", "dtrain z3", "torch ddp", "torch ddp+zero", "torch fsdp2", *TENSOR)
MIB = 2**20
#: tensor parallelism's step-peak form: parameters and Adam's moments (12 bytes a held parameter) and the larger
#: of the activations (held at the end of forward) and the gradients (at the end of backward): the optimizer's
#: zero_grad frees the gradients before the forward, and backward frees the activations as it makes them
PEAK = "parameters + Adam + max(activations, gradients)"
NOTES = (
    "A system's figure is its largest rank's. Live tensors after the last step are the closed form's "
    "states, plus dtrain dp's ring piece pool; the fixed cost is what the same system costs on a model of "
    "next to nothing. What the process holds beyond both grows with the model: the gradients of a bucket in "
    "flight and the allocator's keeping of freed memory (the whole model built before ZeRO-3 shards it, each "
    "step's activations and gathered units; docs/sharded.md). FSDP2's closed form here is 16 Psi / N without "
    "its gathered units; DDP's buckets are C++-held, outside the census."
)

NOTES_RETURN = (
    "The same systems and figures as the default allocator's table, each process with glibc's mmap "
    "threshold fixed at 64 KiB: a freed block of 64 KiB or more goes back to the kernel at once, so "
    "the peak holds what was live at one time, not what the allocator kept. The fixed cost is "
    "measured under the same setting."
)


NOTES_UNFIXED = " This run measured no fixed cost (--fixed-model none)."
NOTES_HF = (
    " The model is a transformers Llama dtrain did not write (benchmarks/_models.py); every process imports "
    "transformers before its baseline, so its code is not in the figures; FSDP2 shards each decoder layer, "
    "then the root; dtrain's units are its defaults."
)


class _Tensor:
    """dtrain's tensor parallelism on gpt (Megatron's split, ``tensor_parallel.py``'s plan) with Adam; at tp 1,
    the unsplit model."""

    def __init__(self, name: str, args: dict[str, Any]) -> None:
        import dtrain.tensor_parallel as tp

        self.tp, (size, self.sp) = tp, TENSOR[name]
        self.net = sharded._model(args)
        self.model = (
            self.net
            if size == 1
            else tp.parallelize(
                self.net, tp.plans.gpt_sequence_parallel() if self.sp else tp.plans.gpt, None, sequence_parallel=self.sp
            )
        )
        self.opt = torch.optim.Adam(self.model.parameters(), lr=args["lr"])
        self.size = size

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.opt.zero_grad()
        if self.size == 1:
            loss = torch.nn.functional.cross_entropy(self.model(x).reshape(-1, sharded.VOCAB), y.reshape(-1))
        else:
            loss = self.tp.vocab_parallel_cross_entropy(self.model(x), y, self.model.head)
        loss.backward()
        if self.sp:
            self.tp.sync_replicated_grads(self.model)
        self.opt.step()

    def memory(self) -> None:
        return None

    def close(self) -> None:
        return None


def tensor_state_bytes(args: dict[str, Any], tp: int) -> float:
    """The closed form of a tensor-parallel rank's model states with Adam: 16 bytes a parameter it holds, its
    share ``1/tp`` of the split ones (the plan's: embedding, qkv, proj and fc2 weights, fc1, head) and all of
    the replicated ones (positions, norms, proj and fc2 biases)."""
    split = replicated = 0
    for n, p in sharded._model(args).named_parameters():
        if n.endswith(tensor_parallel.SPLIT):
            split += p.numel()
        else:
            replicated += p.numel()
    return 16 * (split / tp + replicated)


def return_freed_blocks(threshold: int = 64 << 10) -> None:
    """glibc: serve every block of ``threshold`` bytes or more from its own mapping (``M_MMAP_THRESHOLD``; a
    fixed threshold also stops glibc raising it as blocks are freed), so that freeing one unmaps it."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if libc.mallopt(-3, threshold) != 1:  # M_MMAP_THRESHOLD; 1 on success
        raise SystemExit("--allocator return: glibc's mallopt refused M_MMAP_THRESHOLD")


def _worker(name: str, args: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from dtrain.measure.memory import ProcessMemory

    torch.set_num_threads(1)
    if args["allocator"] == "return":
        return_freed_blocks()
    preload(args["model"])  # transformers' code before the baseline: the figure is the model's, not the import's
    if name in TENSOR:  # every rank the whole batch
        data = sharded._batches({**args, "batch_size": args["tp_batch"]}, 0, 1)
    else:
        data = sharded._batches(args, dist.get_rank(), dist.get_world_size())
    with ProcessMemory() as mem:
        s: Any = _Tensor(name, args) if name in TENSOR else sharded._System(name, args)
        for k in range(args["steps"]):
            s.step(*data[k % len(data)])
        counted = s.memory()
    live = live_tensor_bytes()
    # one more step, outside the block: what autograd keeps for backward (a DTensor by its local shard)
    saved = tensor_parallel._SavedBytes(s.model) if name in TENSOR else sharded._SavedBytes(s.net)
    with saved.hooks():
        s.step(*data[0])
    dp = getattr(s, "dp", None)
    units = [(u.name, u.numel, u.padded) for u in dp.units] if getattr(dp, "units", None) else None
    s.close()
    return {
        "process": mem.peak_bytes,
        "reset": mem.reset,
        "counted": counted,
        "units": units,
        "activations": saved.total,
        "live": live,
    }


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage the garbage collector reaches now, each storage once (a DTensor by its
    local shard): a count of what is held that no wrapper keeps (it misses memory outside tensors, and
    tensors held only by C++, such as DDP's buckets)."""
    import gc

    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on torch.distributed's deprecated reduce_op warns
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and not o.is_meta]
    for o in tensors:
        t = o.to_local() if isinstance(o, DTensor) else o
        st = t.untyped_storage()
        if st.data_ptr():
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _measure(name: str, args: dict[str, Any], psi: int, nprocs: int) -> dict[str, float]:
    """One launch of system ``name`` on ``args``'s model: its figures in MiB (the largest rank's)."""
    ranks = launch_loopback(_worker, (name, args), TENSOR[name][0] if name in TENSOR else nprocs)
    if not all(v["reset"] for v in ranks.values()):
        raise SystemExit("the kernel refused to reset the resident set's high-water mark")
    counted = [sum(v["counted"].values()) for v in ranks.values() if v["counted"]]
    if name in TENSOR:
        closed = tensor_state_bytes(args, TENSOR[name][0])
    elif name in sharded.DTRAIN:
        closed = sharded._closed_memory(name, psi, nprocs, ranks[0]["units"] or [])
    else:  # DDP: stage 0's; with ZeroRedundancyOptimizer, stage 1's; FSDP2: stage 3's less its gathered units
        closed = {"torch ddp": 16 * psi, "torch ddp+zero": 8 * psi + 8 * psi / nprocs}.get(name, 16 * psi / nprocs)
    activations = max(v["activations"] for v in ranks.values())
    out = {
        "process": max(v["process"] for v in ranks.values()) / MIB,
        "live tensors": max(v["live"] for v in ranks.values()) / MIB,
        "wrapper": max(counted) / MIB if counted else float("nan"),
        "closed form": closed / MIB,
        "closed form + activations": (closed + activations) / MIB,
    }
    if name in TENSOR:  # zero_grad frees the gradients: a step's peak holds activations or gradients, not both
        out[PEAK] = (0.75 * closed + max(activations, 0.25 * closed)) / MIB
    return out


def main(argv: list[str] | None = None) -> int:
    from dtrain.measure.harness import Bar, Benchmark, add_result_flags, command

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nprocs", type=int, default=4)
    ap.add_argument(
        "--model",
        default="gpt-small",
        choices=LANGUAGE,
        help="dtrain's gpt-small (default) or a model dtrain did not write (hf-llama-small)",
    )
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16, help="global batch (default: 16)")
    ap.add_argument("--steps", type=int, default=3, help="Adam steps in each process (default: 3)")
    ap.add_argument(
        "--tp-batch",
        type=int,
        default=4,
        help="tensor parallelism: samples every rank trains (default: 4, a ZeRO rank's share of the global batch)",
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument(
        "--fixed-model",
        default="gpt-tiny",
        help="the model whose process memory beyond its closed "
        "form and activations is the runtime's fixed cost (default: gpt-tiny, 137K parameters; none: "
        "not measured, half the launches)",
    )
    ap.add_argument(
        "--allocator",
        choices=("default", "return"),
        default="default",
        help="return: glibc gives every freed block of 64 KiB or more back at once (mallopt)",
    )
    add_result_flags(ap)
    a = ap.parse_args(argv)
    names = [s for s in a.systems.split(",") if s]
    bad = [s for s in names if s not in SYSTEMS]
    if bad:
        ap.error(f"unknown system(s) {bad}; choose from {','.join(SYSTEMS)}")
    args = dict(
        model=a.model,
        seq_len=a.seq_len,
        batch_size=a.batch_size,
        steps=a.steps,
        lr=1e-3,
        seed=0,
        algorithm="ring",
        overlap="backward",
        nprocs=a.nprocs,
        tp_batch=a.tp_batch,
        allocator=a.allocator,
    )
    psi = sum(p.numel() for p in sharded._model(args).parameters())
    returning = a.allocator == "return"
    user = f"_{a.model.replace('-', '_')}" if a.model in HF_MODELS else ""  # its own result file
    bench = Benchmark(
        ("memory_sharded_return" if returning else "memory_sharded") + user,
        title="Memory as the process sees it: ZeRO, tensor parallelism"
        + (", glibc returning freed blocks" if returning else "")
        + (f", {a.model}" if user else ""),
        family="sharded data parallelism",
        workload=f"{a.model} (Psi = {psi:,} parameters), seq_len {a.seq_len}, global batch "
        f"{a.batch_size}, Adam, {a.nprocs} processes (tensor parallelism: tp processes, "
        f"each the whole batch of {a.tp_batch}); {a.steps} steps in fresh processes"
        + ("; glibc's mmap threshold fixed at 64 KiB in every process (mallopt)" if returning else ""),
        metric="MiB",
        higher_is_better=False,
        repeats=a.rounds,
        quick=a.quick,
        command=command("benchmarks/memory.py", argv),
    )
    tiny = {**args, "model": a.fixed_model}
    fixing = a.fixed_model != "none"
    tiny_psi = sum(p.numel() for p in sharded._model(tiny).parameters()) if fixing else 0
    samples: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    bench.start()
    for r in range(a.rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            got = _measure(name, args, psi, a.nprocs)
            for kind, v in got.items():
                samples[name].setdefault(kind, []).append(v)
            fixed = float("nan")
            if fixing:  # the runtime's own: a model of next to nothing
                small = _measure(name, tiny, tiny_psi, a.nprocs)
                fixed = small["process"] - small["closed form + activations"]
                samples[name].setdefault("closed form + activations + fixed cost", []).append(
                    got["closed form + activations"] + fixed
                )
            if fixing and PEAK in got:  # its own fixed cost: gpt-tiny's process beyond the same form
                samples[name].setdefault(f"{PEAK} + fixed cost", []).append(got[PEAK] + small["process"] - small[PEAK])
            print(
                f"round {r + 1}/{a.rounds}: {name:<13} process {got['process']:7.1f} MiB, live tensors "
                f"{got['live tensors']:7.1f}, closed form + activations {got['closed form + activations']:7.1f}"
                + (f", fixed cost ({a.fixed_model}) {fixed:5.1f}" if fixing else ""),
                flush=True,
            )
    bench.stop()
    for name in names:
        got = {k: v for k, v in samples[name].items() if not any(x != x for x in v)}  # no wrapper count: left out
        compare = [("process", "closed form + activations", Bar.within(0.10))]
        if fixing:
            compare.append(("process", "closed form + activations + fixed cost", Bar.within(0.10)))
        if f"{PEAK} + fixed cost" in got:
            compare.append(("process", f"{PEAK} + fixed cost", Bar.within(0.10)))
        bench.add_case(name, samples=got, compare=compare, headline=False)
    for ours, peer, what in (
        ("dtrain dp", "torch ddp", "stage 0"),
        ("dtrain z1", "torch ddp+zero", "stage 1"),
        ("dtrain z3", "torch fsdp2", "stage 3"),
    ):
        if ours in names and peer in names:  # the same rounds: each round's pair ran one after the other
            bench.add_case(
                f"{what}, process memory",
                samples={ours: samples[ours]["process"], peer: samples[peer]["process"]},
                compare=[(ours, peer, Bar.at_least(1.0))],
            )
    bench.notes = (NOTES_RETURN if returning else NOTES) + ("" if fixing else NOTES_UNFIXED)
    if a.model in HF_MODELS:
        bench.notes += NOTES_HF
    bench.report(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
