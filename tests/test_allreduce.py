"""Allreduce algorithms in one process: ranks are threads over ThreadTransport.

Every algorithm, for world sizes 1..9, element counts 0, 1, 3, P-1, P+1 and a
larger one, every dtype and op, against a float64 (int64) reference computed with
torch over the stacked inputs. Tolerances:

* integers, ``max`` and ``min``: exact;
* float ``sum``: ``|result - exact| <= eps·(P·sum_i |x_i| + |exact|)``, the bound of
  P-1 roundings in the dtype plus the final representation (eps = the dtype's
  machine epsilon: 2^-23 float32, 2^-52 float64, 2^-10 float16, 2^-7 bfloat16);
* float ``avg``: the same bound divided by P, plus one more rounding.

Each case also checks that every rank holds bitwise the same result and that the
messages and bytes each rank sent equal :func:`dtrain.comm.cost.traffic`.
"""

from __future__ import annotations

import pytest
import torch

from dtrain.comm import ALGORITHMS, AllreduceOptions, allreduce, allreduce_over, cost
from dtrain.comm.transport import ThreadTransport, run_threads
from dtrain.errors import CommError, CommTimeoutError, ConfigError

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
OPS = ["sum", "avg", "max", "min"]
LARGE = 1000

# (algorithm, options): the ring with several (capped) pieces per segment and a
# one-receive window; hierarchical with consecutive nodes of 3 (the last one
# smaller) whose leaders' ring runs in pieces, and with interleaved nodes. The
# default ring options (one piece at these sizes, window 2) run in
# test_comm_cost.py and, over gloo, in test_allreduce_dist.py.
VARIANTS = [
    ("ring", AllreduceOptions(piece_bytes=128, max_pieces=5, window=1)),
    ("tree", AllreduceOptions()),
    ("recursive_doubling", AllreduceOptions()),
    ("rabenseifner", AllreduceOptions()),
    ("hierarchical", AllreduceOptions(node_size=3, piece_bytes=128)),
    ("hierarchical", None),  # nodes = r % 3, set per world size below
]


def sizes(p: int) -> list[int]:
    return sorted({0, 1, 3, max(p - 1, 0), p + 1, LARGE})


def make_input(rank: int, n: int, dtype: torch.dtype, case: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * case + rank)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g, dtype=dtype)


def reference(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    wide = torch.float64 if xs[0].is_floating_point() else torch.int64
    s = torch.stack([x.to(wide) for x in xs])
    if op == "max":
        return s.max(0).values
    if op == "min":
        return s.min(0).values
    total = s.sum(0)
    if op == "avg":
        return total / len(xs) if total.is_floating_point() else torch.div(total, len(xs), rounding_mode="floor")
    return total


def check(result: torch.Tensor, xs: list[torch.Tensor], op: str) -> None:
    ref = reference(xs, op)
    if not result.is_floating_point() or op in ("max", "min"):
        assert torch.equal(result, ref.to(result.dtype)), f"{op} differs from the reference"
        return
    p = len(xs)
    eps = torch.finfo(result.dtype).eps
    spread = torch.stack([x.double().abs() for x in xs]).sum(0)
    if op == "avg":
        spread = spread / p
    bound = eps * (p * spread + 2 * ref.abs())
    err = (result.double() - ref).abs()
    worst = (err - bound).max().item() if err.numel() else 0.0
    assert worst <= 0, f"{op} error exceeds the bound by {worst:g} (max err {err.max().item():g})"


def options_for(variant: AllreduceOptions | None, p: int) -> AllreduceOptions:
    return variant if variant is not None else AllreduceOptions(nodes=tuple(r % 3 for r in range(p)))


@pytest.mark.parametrize("world_size", range(1, 10))
@pytest.mark.parametrize("variant", range(len(VARIANTS)), ids=lambda i: f"{VARIANTS[i][0]}-{i}")
def test_algorithm_matches_reference(world_size: int, variant: int) -> None:
    algorithm, v = VARIANTS[variant]
    opts = options_for(v, world_size)
    cases = [(n, dt, op) for n in sizes(world_size) for dt in DTYPES for op in OPS]

    def rank_fn(t: ThreadTransport) -> list[tuple[torch.Tensor, int, int]]:
        out = []
        for c, (n, dt, op) in enumerate(cases):
            x = make_input(t.rank, n, dt, c)
            before = t.stats.snapshot()
            y = allreduce_over(t, x, op, algorithm, opts)
            assert y is x
            d = t.stats - before
            out.append((x, d.messages, d.bytes_sent))
        return out

    results = run_threads(world_size, rank_fn, timeout=30)
    for c, (n, dt, op) in enumerate(cases):
        where = f"{algorithm} P={world_size} n={n} {dt} {op}"
        xs = [make_input(r, n, dt, c) for r in range(world_size)]
        first = results[0][c][0]
        try:
            check(first, xs, op)
        except AssertionError as e:
            raise AssertionError(f"{where}: {e}") from None
        expect = cost.traffic(
            algorithm,
            world_size,
            n * first.element_size(),
            itemsize=first.element_size(),
            piece_bytes=opts.piece_bytes,
            max_pieces=opts.max_pieces,
            node_size=opts.node_size or (world_size if opts.nodes is None else None),
            nodes=opts.nodes,
        )
        for r in range(world_size):
            got, msgs, nbytes = results[r][c]
            assert torch.equal(got, first), f"{where}: rank {r} differs from rank 0"
            assert (msgs, nbytes) == (expect.messages[r], expect.bytes_sent[r]), (
                f"{where}: rank {r} sent {msgs} msgs / {nbytes} B, cost.traffic says "
                f"{expect.messages[r]} / {expect.bytes_sent[r]}"
            )


def test_shapes_are_kept_and_reduced_elementwise() -> None:
    xs = [torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) * (r + 1) for r in range(3)]

    def fn(t: ThreadTransport) -> torch.Tensor:
        return allreduce_over(t, xs[t.rank].clone(), "sum", "rabenseifner")

    for got in run_threads(3, fn):
        assert got.shape == (2, 3, 4)
        assert torch.equal(got, xs[0] * 6)


def test_integer_avg_is_floor_division() -> None:
    vals = [torch.tensor([-3, 0, 5, 7], dtype=torch.int64), torch.tensor([0, 1, 0, 0], dtype=torch.int64)]

    def fn(t: ThreadTransport) -> torch.Tensor:
        return allreduce_over(t, vals[t.rank].clone(), "avg", "ring")

    for got in run_threads(2, fn):
        assert got.tolist() == [-2, 0, 2, 3]  # floor(-3/2) = -2, floor(1/2) = 0


def test_ring_reuses_its_receive_buffers() -> None:
    from dtrain.comm._reduce import BUFFERS

    opts = AllreduceOptions(piece_bytes=64, window=2)

    def fn(t: ThreadTransport) -> None:
        allreduce_over(t, torch.ones(999, dtype=torch.float64), "sum", "ring", opts)

    def cached() -> set[int]:
        return {b.data_ptr() for b in BUFFERS._free.get((torch.float64, "cpu"), [])}

    run_threads(3, fn)
    first = cached()
    assert first, "the ring gave no receive buffer back to the cache"
    for _ in range(3):
        run_threads(3, fn)
    assert cached() <= first | set(), "later calls allocated new buffers instead of reusing"


def test_ring_scratch_holds_a_piece_per_posted_receive() -> None:
    from dtrain.comm._reduce import BUFFERS

    opts = AllreduceOptions(piece_bytes=64, max_pieces=4, window=2)  # 999 over 2 ranks: segments of 500, pieces of 125
    BUFFERS._free.pop((torch.float32, "cpu"), None)
    run_threads(2, lambda t: allreduce_over(t, torch.ones(999), "sum", "ring", opts))
    sizes = [b.numel() for b in BUFFERS._free[(torch.float32, "cpu")]]
    assert len(sizes) == 2 and max(sizes) < 3 * 125, f"each rank's scratch: {sizes} elements, window 2 x 125"


def test_buffer_cache_serves_a_slightly_larger_request_from_the_buffer_it_left() -> None:
    from dtrain.comm._reduce import BufferCache, size_class

    cache = BufferCache()
    first = cache.take(3_049_344, torch.float32, torch.device("cpu"))
    ptr = first.data_ptr()
    cache.give(first)
    again = cache.take(3_049_728, torch.float32, torch.device("cpu"))  # the same bucket, rebuilt a little larger
    assert again.data_ptr() == ptr and again.numel() == 3_049_728
    cache.give(again)
    assert len(cache._free[(torch.float32, "cpu")]) == 1
    for n in (1, 16, 17, 1000, 2**20, 2**20 + 1, 3_049_344):
        assert n <= size_class(n) <= n * 1.125, n


# ----------------------------------------------------------------------------- bad input


def test_unknown_algorithm_lists_choices() -> None:
    t = ThreadTransport.create(1)[0]
    with pytest.raises(ConfigError) as e:
        allreduce_over(t, torch.ones(3), "sum", "butterfly")
    for name in ALGORITHMS:
        assert name in str(e.value)
    with pytest.raises(ConfigError):
        allreduce(torch.ones(3), algorithm="butterfly")


def test_unknown_op_lists_choices() -> None:
    t = ThreadTransport.create(1)[0]
    with pytest.raises(ConfigError) as e:
        allreduce_over(t, torch.ones(3), "prod", "ring")
    for op in OPS:
        assert op in str(e.value)
    with pytest.raises(ConfigError):
        allreduce(torch.ones(3), op="mean")


def test_non_contiguous_tensor_is_rejected() -> None:
    x = torch.ones(4, 6).t()
    with pytest.raises(ConfigError, match="contiguous"):
        allreduce(x)
    t = ThreadTransport.create(2)[0]
    with pytest.raises(ConfigError, match="contiguous"):
        allreduce_over(t, x, "sum", "tree")


def test_meta_and_unsupported_dtypes_are_rejected() -> None:
    with pytest.raises(ConfigError, match="meta"):
        allreduce(torch.empty(3, device="meta"))
    with pytest.raises(ConfigError, match="dtype"):
        allreduce(torch.ones(3, dtype=torch.complex64))
    with pytest.raises(ConfigError, match="Tensor"):
        allreduce([1.0, 2.0])  # type: ignore[arg-type]


def test_native_needs_a_process_group_transport() -> None:
    def fn(t: ThreadTransport) -> None:
        allreduce_over(t, torch.ones(3), "sum", "native")

    with pytest.raises(ConfigError, match="TorchTransport"):
        run_threads(2, fn)


def test_bad_options_say_what_to_change() -> None:
    with pytest.raises(ConfigError, match="piece_bytes"):
        AllreduceOptions(piece_bytes=0)
    with pytest.raises(ConfigError, match="max_pieces"):
        AllreduceOptions(max_pieces=0)
    with pytest.raises(ConfigError, match="window"):
        AllreduceOptions(window=0)
    with pytest.raises(ConfigError, match="node_size"):
        AllreduceOptions(node_size=0)

    def fn(t: ThreadTransport) -> None:
        allreduce_over(t, torch.ones(3), "sum", "hierarchical", AllreduceOptions(nodes=(0, 1)))

    with pytest.raises(ConfigError, match="one per rank"):
        run_threads(3, fn)


def test_without_process_group_world_of_one_is_identity() -> None:
    x = torch.arange(5.0)
    assert allreduce(x, op="avg", algorithm="tree") is x
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_silent_peer_times_out_naming_rank_op_and_peer() -> None:
    ts = ThreadTransport.create(3, timeout=0.3)

    def fn(t: ThreadTransport) -> None:
        if t.rank == 2:
            return  # never joins
        allreduce_over(t, torch.ones(30), "sum", "ring")

    with pytest.raises(CommTimeoutError) as e:
        run_threads(3, fn, timeout=0.3, transports=ts)
    assert isinstance(e.value, CommError)
    assert "allreduce(ring) recv" in str(e.value)
    assert e.value.peer is not None and e.value.rank in (0, 1)
