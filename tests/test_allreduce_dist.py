"""Allreduce algorithms over gloo in real processes (tests/_dist.py), against ``native``.

One spawn of 7 processes covers world sizes 1..7: world size P runs on the group
of ranks 0..P-1 (``dist.new_group``; P = 7 on the default group), so the suite pays
torch's start-up for 7 processes instead of 28. Every case runs inside the workers,
for every algorithm (and native, once per input):

* 0, 1, 3, P-1 and P+1 elements: every dtype x op (P+1: more than ranks, not
  divisible by P; P-1 and fewer: some ranks own empty segments);
* BIG = 600011 elements (2.4 MB of float32: two of the ring's default 1 MiB pieces per segment at
  world size 2, one above): every algorithm with float32 sum and with one more
  (dtype, op) pair, the pairs together covering every dtype and op, and the ring
  also with 64 KiB pieces. The full dtype x op cross at this size (~150 large
  collectives per world size, minutes of loopback traffic on 2 cores) is the
  ``slow`` test ``test_full_cross_at_the_big_size`` (``pytest -m slow``);
* hierarchical with ``node_size=2`` (nodes of 2 and, for odd P, a last node of 1).

Checks, in the workers: integers, max and min equal the exact result (computed
from every rank's regenerated input; at BIG: native's) exactly; float
sum and avg lie within ``eps·(P·sum|x_i| + 2|exact|)`` of the exact sum (float64),
as native itself must; all ranks hold bitwise the same result
(hashes compared across ranks); the ring's and native's counters equal
:mod:`dtrain.comm.cost`; a group of non-consecutive ranks works.

A further spawn kills one rank mid-ring: the survivors must raise CommError
naming their rank, the operation and a peer within the timeout.
"""

from __future__ import annotations

import hashlib
import os
import time

import pytest
import torch
from _dist import run_distributed, spawn

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
OPS = ["sum", "avg", "max", "min"]
ALGS = ["ring", "tree", "recursive_doubling", "rabenseifner", "hierarchical"]
BIG = 600011  # the 64 KiB-piece cases below cut every segment into many pieces
TIMEOUT = 60.0  # per wait; generous for a loaded 2-core machine


def _input(rank: int, n: int, dtype: torch.dtype, case: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(104729 * case + rank)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g, dtype=torch.float32).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g, dtype=dtype)


def _digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.contiguous().view(torch.uint8).numpy().tobytes(), digest_size=8).hexdigest()


# at BIG every algorithm runs float32 sum plus one (dtype, op) pair, chosen so that
# together they cover every dtype and op; the ring also runs with 64 KiB pieces
_BIG_EXTRA = {
    "ring": (torch.float64, "max"),
    "tree": (torch.float16, "sum"),
    "recursive_doubling": (torch.bfloat16, "avg"),
    "rabenseifner": (torch.int32, "min"),
    "hierarchical": (torch.int64, "avg"),
}
SMALL_PIECES = 64 << 10


def _cases(world_size: int, big_full: bool = False) -> list[tuple[int, torch.dtype, str, str, int | None]]:
    """(elements, dtype, op, algorithm, ring piece bytes or None for the default)."""
    small = sorted({0, 1, 3, max(world_size - 1, 0), world_size + 1})
    cases = [(n, dt, op, alg, None) for n in small for dt in DTYPES for op in OPS for alg in ALGS]
    if big_full:
        return [(BIG, dt, op, alg, None) for dt in DTYPES for op in OPS for alg in ALGS]
    cases += [(BIG, torch.float32, "sum", alg, None) for alg in ALGS]
    cases += [(BIG, torch.float32, "sum", "ring", SMALL_PIECES), (BIG, torch.float16, "avg", "ring", SMALL_PIECES)]
    cases += [(BIG, *_BIG_EXTRA[alg], alg, None) for alg in ALGS]
    return cases


Expected = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def _expected(rank: int, P: int, n: int, dt: torch.dtype, op: str, case: int, x: torch.Tensor, kw: dict) -> Expected:
    """(exact result for integer/max/min, float64 exact sum-or-mean, float64 sum-or-mean of |x|).

    Small vectors: computed here from every rank's regenerated input (no
    communication). BIG: exact types take native's result, float sums come from
    native reductions in float64.
    """
    from dtrain.comm import allreduce

    floating_sum = dt.is_floating_point and op in ("sum", "avg")
    if n <= 64:
        xs = torch.stack(
            [_input(r, n, dt, case).to(torch.float64 if dt.is_floating_point else torch.int64) for r in range(P)]
        )
        if floating_sum:
            exact, spread = xs.sum(0), xs.abs().sum(0)
            return (None, exact / P, spread / P) if op == "avg" else (None, exact, spread)
        if op == "max":
            return xs.max(0).values.to(dt), None, None
        if op == "min":
            return xs.min(0).values.to(dt), None, None
        total = xs.sum(0)
        return (torch.div(total, P, rounding_mode="floor") if op == "avg" else total).to(dt), None, None
    if not floating_sum:
        return allreduce(x.clone(), op, "native", **kw), None, None
    exact = allreduce(x.to(torch.float64, copy=True), "sum", "native", **kw)
    spread = allreduce(x.double().abs(), "sum", "native", **kw)
    return (None, exact / P, spread / P) if op == "avg" else (None, exact, spread)


def _mismatch(got: torch.Tensor, exp: Expected, P: int) -> str:
    ref, exact, spread = exp
    if ref is not None:
        return "" if torch.equal(got, ref) else "differs from the exact result"
    assert exact is not None and spread is not None
    if not got.numel():
        return ""
    bound = torch.finfo(got.dtype).eps * (P * spread + 2 * exact.abs())
    excess = ((got.double() - exact).abs() - bound).max().item()
    return "" if excess <= 0 else f"off the exact sum by {excess:g} beyond the bound"


def _check_world(rank: int, P: int, group: object, big_full: bool = False) -> list[str]:
    """Every case on ``group`` (ranks 0..P-1); returns what went wrong, as text."""
    import torch.distributed as dist

    from dtrain.comm import AllreduceOptions, allreduce, cost, get_transport

    problems: list[str] = []
    digests: list[str] = []
    seen: dict[tuple[int, torch.dtype, str], Expected] = {}
    kw = dict(group=group, timeout=TIMEOUT)
    for n, dt, op, alg, piece in _cases(P, big_full):
        case = 31 * n + DTYPES.index(dt)
        x = _input(rank, n, dt, case)
        key = (n, dt, op)
        if key not in seen:
            seen = {k: v for k, v in seen.items() if k[0] == n}  # keep memory small at BIG
            seen[key] = exp = _expected(rank, P, n, dt, op, case, x, kw)
            nat = allreduce(x.clone(), op, "native", **kw)
            why = _mismatch(nat, exp, P)
            if why:
                problems.append(f"P={P} n={n} {dt} {op} native: {why}")
        exp = seen[key]
        y = x.clone()
        opts = AllreduceOptions(piece_bytes=piece) if piece else None
        out = allreduce(y, op, alg, node_size=2 if alg == "hierarchical" else None, options=opts, **kw)
        where = f"P={P} n={n} {dt} {op} {alg}{f' piece={piece}' if piece else ''}"
        if out is not y or y.shape != x.shape:
            problems.append(f"{where}: not in place")
        why = _mismatch(y, exp, P)
        if why:
            problems.append(f"{where}: {why}")
        digests.append(_digest(y))

    # counters against the cost formulas, on the group's cached transport
    t = get_transport(group)
    for alg in ("ring", "native"):
        expect = cost.traffic(alg, P, 4 * BIG)
        before = t.stats.snapshot()
        allreduce(torch.ones(BIG), "sum", alg, **kw)
        d = t.stats - before
        if (d.messages, d.bytes_sent) != (expect.messages[rank], expect.bytes_sent[rank]):
            problems.append(
                f"P={P} {alg}: counted {d.messages}/{d.bytes_sent}, cost says "
                f"{expect.messages[rank]}/{expect.bytes_sent[rank]}"
            )
    if get_transport(group, timeout=7.0).stats is not t.stats or get_transport(group) is not t:
        problems.append(f"P={P}: get_transport does not share one counter per group")

    everyone: list[list[str] | None] = [None] * P
    dist.all_gather_object(everyone, digests, group=group)
    for r, theirs in enumerate(everyone):
        if theirs != digests:
            bad = [i for i, (a, b) in enumerate(zip(theirs or [], digests)) if a != b]
            problems.append(f"P={P}: rank {r} holds other results than rank {rank} in cases {bad[:5]}")
    return problems


def _worker(rank: int, world_size: int, big_full: bool = False) -> dict[int, list[str]]:
    import torch.distributed as dist

    from dtrain.comm import allreduce

    found: dict[int, list[str]] = {}
    for P in range(1, world_size + 1):
        # every rank takes part in creating every group, as torch requires
        group = None if P == world_size else dist.new_group(list(range(P)))
        if rank < P:
            found[P] = _check_world(rank, P, group, big_full)
        dist.barrier()

    if big_full:
        return found
    # a group of non-consecutive ranks, with hierarchical's default and one-rank nodes
    members = list(range(0, world_size, 2))
    group = dist.new_group(members)
    found[0] = []
    if rank in members:
        x = _input(rank, 1001, torch.float32, 99)
        nat = allreduce(x.clone(), "max", "native", group=group, timeout=TIMEOUT)
        for alg in ALGS:
            for node_size in (None, 1):
                y = allreduce(x.clone(), "max", alg, group=group, timeout=TIMEOUT, node_size=node_size)
                if not torch.equal(y, nat):
                    found[0].append(f"group {members} {alg} node_size={node_size}: differs from native")
    return found


@pytest.fixture(scope="module")
def dist_results() -> list[dict[int, list[str]]]:
    return run_distributed(_worker, 7, timeout=600, pg_timeout=120)


@pytest.mark.procs
@pytest.mark.parametrize("world_size", range(1, 8))
def test_every_algorithm_matches_native(dist_results: list[dict[int, list[str]]], world_size: int) -> None:
    for rank in range(world_size):
        problems = dist_results[rank][world_size]
        assert not problems, f"rank {rank}:\n" + "\n".join(problems[:20])


@pytest.mark.slow
def test_full_cross_at_the_big_size() -> None:
    """Every algorithm x dtype x op at BIG elements, world sizes 1..7 (minutes on 2 cores)."""
    results = run_distributed(_worker, 7, True, timeout=3000, pg_timeout=300)
    for P in range(1, 8):
        for rank in range(P):
            problems = results[rank][P]
            assert not problems, f"P={P} rank {rank}:\n" + "\n".join(problems[:20])


@pytest.mark.procs
def test_non_consecutive_group(dist_results: list[dict[int, list[str]]]) -> None:
    for rank, found in enumerate(dist_results):
        assert not found[0], f"rank {rank}:\n" + "\n".join(found[0])


# ----------------------------------------------------------------------------- failures


def _dying_worker(rank: int, world_size: int, victim: int, timeout: float) -> dict[str, object]:
    from dtrain.comm import TorchTransport, allreduce
    from dtrain.comm.allreduce import ALGORITHMS

    class DyingTransport(TorchTransport):
        """The victim's transport: the process exits for good after a few sends."""

        sends = 0

        def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0):  # type: ignore[no-untyped-def]
            self.sends += 1
            if self.sends > 3:
                os._exit(17)
            return super().isend(tensor, dst, tag)

    x = torch.ones(3 << 20)  # 12 MB: 4 pieces per segment, 16 sends per rank
    if rank == victim:
        ALGORITHMS["ring"](DyingTransport(timeout=timeout), x, "sum")
        return {"error": "victim survived"}
    t0 = time.monotonic()
    try:
        allreduce(x, "sum", "ring", timeout=timeout)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {
            "type": type(e).__name__,
            "msg": str(e),
            "elapsed": time.monotonic() - t0,
            "is_comm": _is_comm_error(e),
            "peer": getattr(e, "peer", None),
        }
    return {"error": "allreduce completed although a rank died", "elapsed": time.monotonic() - t0}


def _is_comm_error(e: BaseException) -> bool:
    from dtrain.errors import CommError

    return isinstance(e, CommError)


@pytest.mark.procs
def test_rank_killed_mid_ring_makes_survivors_fail_fast() -> None:
    world, victim, timeout = 3, 1, 5.0
    outs = spawn(_dying_worker, world, victim, timeout, timeout=120, pg_timeout=30)
    assert outs[victim].status == "died" and outs[victim].exitcode == 17, outs[victim]
    for o in outs:
        if o.rank == victim:
            continue
        assert o.status == "ok", f"rank {o.rank}: {o.status} {o.error}"
        v = o.value
        assert "error" not in v, f"rank {o.rank}: {v}"
        assert v["is_comm"], f"rank {o.rank} raised {v['type']}, not a CommError: {v['msg']}"
        msg = str(v["msg"])
        assert f"rank {o.rank}:" in msg and "allreduce(ring)" in msg, msg
        assert v["peer"] is not None and f"with rank {v['peer']}" in msg, msg
        # a wait gives up after `timeout`; allow for a loaded machine
        assert v["elapsed"] < timeout + 20, f"rank {o.rank} took {v['elapsed']:.1f}s to fail"


def _post_to_a_gone_peer(rank: int, world_size: int) -> list[tuple[str, str, bool, object, str]]:
    """Rank 1 exits once its connection to rank 0 is up; rank 0 then posts a receive and a send to it: each
    fails (gloo refuses the post itself once it has seen the connection close, or the wait) with a
    CommError naming the peer: (op, type, is CommError, peer, where it failed)."""
    from dtrain.comm import TorchTransport

    t = TorchTransport(timeout=20)
    x = torch.ones(4)
    if rank == 1:
        t.isend(x, 0).wait()
        os._exit(5)
    t.irecv(x, 1).wait()
    time.sleep(1.0)  # the peer is gone and its connection closed
    out = []
    for op in ("recv", "send"):
        at = "post"
        try:
            w = t.irecv(torch.empty(4), 1, tag=1) if op == "recv" else t.isend(x, 1, tag=2)
            at = "wait"
            w.wait()
            out.append((op, "none", False, None, "completed"))
        except Exception as e:  # noqa: BLE001 - reported to the test
            out.append((op, type(e).__name__, _is_comm_error(e), getattr(e, "peer", None), at))
    return out


@pytest.mark.procs
def test_a_send_or_receive_posted_to_a_gone_peer_is_a_comm_error_naming_it() -> None:
    outs = spawn(_post_to_a_gone_peer, 2, timeout=60, pg_timeout=30)
    assert outs[1].status == "died" and outs[1].exitcode == 5, outs[1]
    assert outs[0].status == "ok", outs[0].error
    for op, kind, is_comm, peer, at in outs[0].value:
        assert is_comm and peer == 1, f"{op} raised {kind} at its {at}, not a CommError naming rank 1"


def _device_worker(rank: int, world_size: int, device: str) -> str:
    from dtrain.comm import allreduce
    from dtrain.errors import ConfigError

    try:
        allreduce(torch.ones(4, device=device))
    except ConfigError as e:
        return str(e)
    return "no error"


@pytest.mark.procs
def test_tensor_on_a_wrong_device_is_rejected() -> None:
    (msg,) = run_distributed(_device_worker, 1, "meta", timeout=120)
    assert "meta device" in msg and "holds no data" in msg, msg


def _on_device_worker(rank: int, world_size: int, device: str) -> dict[str, list[float] | str]:
    from dtrain.comm import allreduce

    out: dict[str, list[float] | str] = {}
    for alg in [*ALGS, "native"]:
        for dtype in (torch.float32, torch.float16):
            t = torch.arange(7, dtype=torch.float32).mul(rank + 1).to(dtype).to(device)
            got = allreduce(t, "sum", alg, node_size=2 if alg == "hierarchical" else None)
            out[f"{alg} {dtype}"] = got.tolist() if got.device.type == device and got is t else f"on {got.device}"
    return out


# CUDA tensors over gloo go through host memory (TorchTransport stages them; native is gloo's own CUDA
# allreduce): where CUDA is present, 3 processes share the GPU; the CPU case is the same check on gloo's home
@pytest.mark.procs
@pytest.mark.parametrize("device", ["cpu", *(["cuda"] if torch.cuda.is_available() else [])])
def test_every_algorithm_reduces_tensors_on_the_device_in_place(device: str) -> None:
    world = 3
    want = [float(i * sum(range(1, world + 1))) for i in range(7)]  # rank r holds i * (r + 1)
    for rank, got in enumerate(run_distributed(_on_device_worker, world, device, timeout=180)):
        assert len(got) == 2 * (len(ALGS) + 1)
        for case, values in got.items():
            assert values == want, (rank, case, values)
