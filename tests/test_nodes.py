"""Several machines: `dtrain run --nnodes N --node-rank R --rdzv-endpoint HOST:PORT` on each node.

The parsing and the SLURM environment need nothing. The jobs run on an emulated cluster of 4 hosts
(network namespaces joined by a bridge, 1 Gbit links): every node is its own `python -m dtrain.cli run`
started inside its host's namespace in its own session, as a command on a separate machine would be, and
the nodes find each other only through the endpoint. Needs root (skipped with that reason elsewhere).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _helpers import read_metrics, read_summary
from _patience import patient

from dtrain.cli import build_parser, nodes_from_args
from dtrain.cluster.nodes import NodeArgs, differences, expand_nodelist, from_slurm, parse_endpoint, parse_nnodes
from dtrain.errors import ConfigError

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
HAS_IP = shutil.which("ip") is not None and shutil.which("tc") is not None
needs_root = pytest.mark.skipif(
    not (IS_ROOT and HAS_IP), reason="the emulated hosts need root and iproute2 (network namespaces)"
)
HOSTS = 4
# small and short: the equality holds from the first step, and each run starts 4 nodes of 1 process
COMMON = ["--epochs", "1", "--max-steps", "3", "--no-progress", "--batch-size", "32", "--no-trace"]


# ---------------------------------------------------------------- no processes


def test_nnodes_and_endpoint_parse_as_torchrun_reads_them():
    assert parse_nnodes("4") == (4, 4) and parse_nnodes("3:4") == (3, 4)
    for bad in ("0", "4:3", "x", "2:"):
        with pytest.raises(ConfigError, match="--nnodes"):
            parse_nnodes(bad)
    assert parse_endpoint("node0:1234") == ("node0", 1234)
    assert parse_endpoint("node0") == ("node0", 29400)
    with pytest.raises(ConfigError, match="HOST:PORT"):
        parse_endpoint("node0:99999")


def test_slurm_nodelists_expand():
    assert expand_nodelist("gpu[01-03,07],login") == ["gpu01", "gpu02", "gpu03", "gpu07", "login"]
    assert expand_nodelist("n[8-10]") == ["n8", "n9", "n10"]
    assert expand_nodelist("a,b") == ["a", "b"]


def test_slurm_environment_gives_the_place_of_the_node():
    env = {"SLURM_JOB_ID": "77", "SLURM_NODEID": "2", "SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_NODELIST": "c[3-6]"}
    a = from_slurm(env)
    assert a == NodeArgs(nnodes=4, min_nodes=4, node_rank=2, endpoint="c3:29400", job="slurm-77", source="slurm")
    assert from_slurm({"SLURM_JOB_ID": "77"}) is None  # not inside srun: no node id
    ns = build_parser().parse_args(["run", "--rdzv-endpoint", "c4:5000"])
    assert nodes_from_args(ns, env).endpoint == "c4:5000"  # a flag wins over SLURM
    assert nodes_from_args(build_parser().parse_args(["run"]), {}) is None  # one machine


def test_node_flags_are_checked_before_anything_starts():
    def args(*a):
        return nodes_from_args(build_parser().parse_args(["run", *a]), {})

    with pytest.raises(ConfigError, match="add --nnodes"):
        args("--node-rank", "1")
    with pytest.raises(ConfigError, match="outside the 2 nodes"):
        args("--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1")
    with pytest.raises(ConfigError, match="needs --rdzv-endpoint"):
        args("--nnodes", "2", "--node-rank", "1")
    with pytest.raises(ConfigError, match="--rdzv-id"):
        args("--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-id", "a b")
    with pytest.raises(ConfigError, match="cannot be spread evenly over 4 nodes"):
        NodeArgs(nnodes=4, endpoint="h:1").processes(6)
    with pytest.raises(ConfigError, match="--nproc-per-node 2 on 4 nodes"):
        NodeArgs(nnodes=4, endpoint="h:1", nproc_per_node=2).processes(4)


def test_nproc_per_node_gpu_counts_the_visible_gpus():
    from dtrain.cluster.nodes import parse_nproc

    assert parse_nproc(None) == 0 and parse_nproc("3") == 3
    assert parse_nproc("gpu", gpus=8) == 8
    with pytest.raises(ConfigError, match="has none"):
        parse_nproc("gpu", gpus=0)
    with pytest.raises(ConfigError, match="number >= 1 or gpu"):
        parse_nproc("0")


def test_differences_name_the_key_and_the_nodes():
    recs = {
        0: {"lr": 0.05, "dp": {"algorithm": "ring"}},
        1: {"lr": 0.05, "dp": {"algorithm": "ring"}},
        2: {"lr": 0.1, "dp": {"algorithm": "tree"}},
    }
    assert differences(recs) == [
        'dp.algorithm: nodes 0, 1 = "ring"; node 2 = "tree"',
        "lr: nodes 0, 1 = 0.05; node 2 = 0.1",
    ]
    assert differences({0: {"lr": 1}, 1: {"lr": 1}}) == []


_NODE0 = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
from dtrain.cluster.nodes import Meeting, NodeArgs, NodeError
store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=20), wait_for_workers=False)
print(store.port, flush=True)
args = NodeArgs(nnodes=2, min_nodes=2, node_rank=0, endpoint=f"127.0.0.1:{store.port}", job="j", rdzv_timeout_s=20)
m = Meeting(args, store, say=lambda line: None)
m.open()
try:
    m.arrive({"lr": 0.05})
except NodeError as e:
    print(e, flush=True)
    sys.exit(3)  # the store goes with this process, as it goes with node 0's
"""


class _SlowReads:
    """A store whose reads take a while: node 1 on a loaded machine."""

    def __init__(self, store, delay: float) -> None:
        self.store, self.delay = store, delay

    def get(self, key):
        time.sleep(self.delay)
        return self.store.get(key)

    def __getattr__(self, name):
        return getattr(self.store, name)


@pytest.mark.procs
def test_node_0_keeps_the_store_until_a_slow_node_has_read_what_differs():
    from datetime import timedelta

    import torch.distributed as dist

    from dtrain.cluster.nodes import Meeting, NodeError

    node0 = subprocess.Popen([sys.executable, "-c", _NODE0], stdout=subprocess.PIPE, text=True)
    try:
        port = int(node0.stdout.readline())
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))
        args = NodeArgs(nnodes=2, min_nodes=2, node_rank=1, endpoint=f"127.0.0.1:{port}", job="j", rdzv_timeout_s=20)
        m = Meeting(args, _SlowReads(store, 0.5), say=lambda line: None)
        m.open()
        with pytest.raises(NodeError, match="lr: node 0 = 0.05; node 1 = 0.1"):
            m.arrive({"lr": 0.1})
        m.close()
        assert node0.wait(timeout=30) == 3
        assert "lr: node 0 = 0.05; node 1 = 0.1" in node0.stdout.read()
    finally:
        node0.kill()
        node0.wait()


# ---------------------------------------------------------------- what listens


def _tree(root: int) -> set[int]:
    """``root`` and every process below it (from /proc/*/stat)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, grew = {root}, True
    while grew:
        grew = False
        for pid, pp in parent.items():
            if pp in tree and pid not in tree:
                tree.add(pid)
                grew = True
    return tree


def _addr(hexaddr: str) -> str:
    ip, port = hexaddr.split(":")
    if len(ip) == 8:  # IPv4, little-endian
        return ".".join(str(int(ip[i : i + 2], 16)) for i in (6, 4, 2, 0)) + f":{int(port, 16)}"
    return f"[{ip}]:{int(port, 16)}"  # IPv6, as the kernel writes it (all zeros: every interface)


def listening(root: int) -> set[str]:
    """The local addresses the processes under ``root`` listen on (TCP, IPv4 and IPv6), from /proc."""
    found: set[str] = set()
    for pid in _tree(root):
        try:
            inodes = {
                os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1]
                for fd in os.listdir(f"/proc/{pid}/fd")
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")
            }
            for table in ("tcp", "tcp6"):
                for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                    f = line.split()
                    if f[3] == "0A" and f[9] in inodes:  # LISTEN
                        found.add(_addr(f[1]))
        except OSError:  # the process ended meanwhile
            continue
    return found


@pytest.mark.procs
def test_a_one_machine_run_listens_on_loopback_only(tmp_path):
    _one_machine("dp", tmp_path)  # the reference of the jobs on several nodes, sampled as it ran
    seen = _LISTENING["dp"]
    assert seen, "no listening socket seen: the sampling missed the run"  # the job's store listens all along
    assert all(a.startswith("127.0.0.1:") for a in seen), seen


# ---------------------------------------------------------------- on the emulated hosts


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    if not (IS_ROOT and HAS_IP):
        pytest.skip("the emulated hosts need root and iproute2 (network namespaces)")
    from dtrain.cluster import down, up

    os.environ["DTRAIN_CLUSTER_DIR"] = str(tmp_path_factory.mktemp("clusters"))
    name = f"nd{os.getpid() % 100000}"
    c = up(name, hosts=HOSTS, bandwidth="1gbit")
    yield c
    down(name)


def _node(c, h: int, argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Host ``h``'s node: `python -m dtrain.cli run ARGV` in its namespace and its own session."""
    cmd = ["ip", "netns", "exec", c.host_ns(h), sys.executable, "-m", "dtrain.cli", "run", *argv]
    # OMP_NUM_THREADS=1: the emulated hosts share this machine's cores (as dtrain run --cluster sets it)
    return subprocess.Popen(
        cmd,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def _finish(
    procs: list[subprocess.Popen], logs: list[Path], timeout: float, listens: dict[int, set[str]] | None = None
) -> list[tuple[int | None, float, str]]:
    """Each node's (exit code, seconds from its arrival at the job's store to its exit, output); past
    ``timeout`` a node is killed (code None). The arrival is when it prints its "dtrain: node R of N" line,
    after its own start-up (an interpreter importing torch). ``listens``: filled with what each node's
    processes listen on while they run. ``timeout`` is for this machine's usual speed (``_patience``)."""
    timeout = patient(timeout)
    t0 = time.monotonic()
    ends: dict[int, float] = {}
    arrived: dict[int, float] = {}
    while len(ends) < len(procs) and time.monotonic() - t0 < timeout:
        for i, p in enumerate(procs):
            if i not in arrived and b"dtrain: node " in logs[i].read_bytes():
                arrived[i] = time.monotonic()
            if i not in ends and p.poll() is not None:
                ends[i] = time.monotonic() - arrived.get(i, t0)
            elif listens is not None and i not in ends and int(time.monotonic() * 4) % 2 == 0:
                listens.setdefault(i, set()).update(listening(p.pid))  # every other 0.25 s: /proc is not free
        time.sleep(0.05)
    out = []
    for i, p in enumerate(procs):
        code = p.poll()
        if code is None:
            os.killpg(p.pid, 9)
            p.wait(10)
        out.append((code, ends.get(i, timeout), logs[i].read_text(errors="replace")))
    return out


def _job(
    c,
    out: Path,
    flags: list[str],
    *,
    timeout: float = 150,
    nnodes: int = HOSTS,
    nodes: list[int] | None = None,
    per_node: dict[int, list[str]] | None = None,
    listens: dict[int, set[str]] | None = None,
) -> list[tuple[int | None, float, str]]:
    """A job of ``nnodes`` nodes, one per host (``nodes``: only those start); the nodes' (code, seconds, output)."""
    port = random.randint(20000, 40000)
    job = f"t{port}"
    procs, logs = [], []
    for h in nodes if nodes is not None else range(nnodes):
        log = out.parent / f"{out.name}.node{h}.log"
        argv = [
            *COMMON,
            *flags,
            "--out",
            str(out),
            "--nnodes",
            str(nnodes),
            "--node-rank",
            str(h),
            "--rdzv-endpoint",
            f"{c.address(0)}:{port}",
            "--rdzv-id",
            job,
            *(per_node or {}).get(h, []),
        ]
        procs.append(_node(c, h, argv, log))
        logs.append(log)
    return _finish(procs, logs, timeout, listens)


_ONE: dict[str, Path] = {}  # one-machine runs of this module, by strategy: the references, made once


_LISTENING: dict[str, set[str]] = {}  # what each one-machine run's processes listened on, sampled as it ran


def _one_machine(name: str, root: Path) -> Path:
    """The one-machine run of ``STRATEGIES[name]`` (``--workers 4`` on this machine), made on first use; what
    its processes listen on is sampled while it runs (``_LISTENING``)."""
    if name not in _ONE:
        out = root / f"one-{name}"
        p = subprocess.Popen(
            [sys.executable, "-m", "dtrain.cli", "run", *COMMON, *STRATEGIES[name], "--out", str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        seen: set[str] = set()
        deadline = time.monotonic() + patient(150)
        try:
            while p.poll() is None and time.monotonic() < deadline:
                seen |= listening(p.pid)
                time.sleep(0.25)
        finally:
            if p.poll() is None:
                p.kill()
            log = p.communicate(timeout=60)[0]
        assert p.returncode == 0, log[-3000:]
        _ONE[name], _LISTENING[name] = out, seen
    return _ONE[name]


def _as_uninterrupted(out: Path, flags: list[str], ref: Path, rows: int) -> None:
    """``out``'s losses, step by step and rank by rank, are those of the same run on one machine, uninterrupted;
    ``rows``: every step once (a restart's redone steps' rows were dropped)."""
    p = subprocess.run(
        [sys.executable, "-m", "dtrain.cli", "run", *COMMON, *flags, "--out", str(ref)],
        capture_output=True,
        text=True,
        timeout=patient(150),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = _losses(out), _losses(ref)
    assert a.keys() == b.keys() and len(a) == rows
    assert max(abs(a[k] - b[k]) for k in a) < 1e-6


def _losses(out: Path) -> dict[tuple[int, int], float]:
    return {(r["step"], r["rank"]): r["loss"] for r in read_metrics(out) if "loss" in r and "step" in r}


STRATEGIES = {
    "dp": ["--strategy", "dp", "--workers", "4"],
    "ps-bsp": ["--strategy", "ps", "--workers", "3", "--servers", "1"],
    "sharded-stage2": ["--strategy", "dp", "--workers", "4", "--shard", "gradients"],
    "pipeline-1f1b": ["--strategy", "pipeline", "--workers", "4", "--schedule", "1f1b", "--microbatches", "4"],
    "hybrid-dp2xpp2": ["--strategy", "hybrid", "--workers", "4", "--dp", "2", "--pp", "2"],
}


# each 4-node job starts 4 interpreters and 4 forkservers (about 35 s of CPU on 2 cores): dp runs by default
# (test_four_nodes_of_a_job_by_flags_and_by_slurm_train_as_one_machine), the other strategies with -m slow
# (their processes are the same on one machine and on several; each passed here)
@pytest.mark.procs
@pytest.mark.slow
@needs_root
@pytest.mark.parametrize("name", [n for n in STRATEGIES if n != "dp"])
def test_four_nodes_train_as_one_machine(hosts, tmp_path, name):
    flags = STRATEGIES[name]
    res = _job(hosts, tmp_path / "nodes", flags)
    for h, (code, _, log) in enumerate(res):
        assert code == 0, f"node {h}:\n{log[-3000:]}"
    assert f"node 0 of 4: 1 process(es), interface eth0 ({hosts.address(0)})" in res[0][2]
    assert "node 0 writes the summary" in res[1][2]
    one = _one_machine(name, tmp_path)
    a, b = _losses(tmp_path / "nodes"), _losses(one)
    assert a and a.keys() == b.keys()
    assert max(abs(a[k] - b[k]) for k in a) < 1e-6
    s = read_summary(tmp_path / "nodes")
    assert s["world_size"] == 4 and s["steps"] == read_summary(one)["steps"]


@pytest.mark.procs
@needs_root
def test_four_nodes_of_a_job_by_flags_and_by_slurm_train_as_one_machine(hosts, tmp_path):
    """One job of 4 nodes, dp: nodes 0 and 1 started with the launch flags, nodes 2 and 3 with SLURM's
    environment alone (as `srun --ntasks-per-node=1 dtrain run` sets it). While the job runs, a node of another
    job reaches the endpoint and is refused, and node 0 says so. The per-step losses equal the one-machine
    run's; every node listens only on its own host's address."""
    port = random.randint(20000, 40000)
    job = f"slurm-{port}"
    argv = [*COMMON, *STRATEGIES["dp"], "--out", str(tmp_path / "run")]
    slurm = {
        "SLURM_JOB_ID": str(port),
        "SLURM_JOB_NUM_NODES": "4",
        "MASTER_PORT": str(port),
        "SLURM_JOB_NODELIST": ",".join(hosts.address(i) for i in range(4)),
    }
    logs = [tmp_path / f"node{h}.log" for h in range(4)] + [tmp_path / "intruder.log"]

    def start(h: int) -> subprocess.Popen:
        if h < 2:
            flags = [
                "--nnodes",
                "4",
                "--node-rank",
                str(h),
                "--rdzv-endpoint",
                f"{hosts.address(0)}:{port}",
                "--rdzv-id",
                job,
            ]
            return _node(hosts, h, [*argv, *flags], logs[h])
        return _node(hosts, h, argv, logs[h], {**slurm, "SLURM_NODEID": str(h)})

    # the intruder needs only its own start-up to be refused; the job needs four nodes' start-up and training
    procs = [start(h) for h in range(4)]
    intruder = _node(
        hosts,
        3,
        [
            *COMMON,
            *STRATEGIES["dp"],
            "--out",
            str(tmp_path / "other"),
            "--nnodes",
            "4",
            "--node-rank",
            "3",
            "--rdzv-endpoint",
            f"{hosts.address(0)}:{port}",
            "--rdzv-id",
            "another",
        ],
        logs[4],
    )
    listens: dict[int, set[str]] = {}
    res = _finish(procs, logs[:4], 150, listens)
    assert intruder.wait(30) != 0
    for h, (code, _, log) in enumerate(res):
        assert code == 0, f"node {h}:\n{log[-3000:]}"
    assert f"node 0 of 4: 1 process(es), interface eth0 ({hosts.address(0)}), job '{job}'" in res[0][2]
    assert f"node 2 of 4: 1 process(es), interface eth0 ({hosts.address(2)}), job '{job}' at " in res[2][2]
    assert "(from SLURM)" in res[2][2] and "node 0 writes the summary" in res[3][2]
    refused = f"serves job '{job}', and this node was started with --rdzv-id 'another': refused"
    assert refused in logs[4].read_text(), logs[4].read_text()[-2000:]
    assert "refused a node of another job" in res[0][2] and "--rdzv-id another" in res[0][2]
    assert not (tmp_path / "other").exists()
    # only on the chosen interface: node 0's store and every node's gloo, on the host's own address
    assert any(listens.values()), "no listening socket seen"
    for h, addrs in listens.items():
        assert all(a.startswith(f"{hosts.address(h)}:") for a in addrs), (h, addrs)
    one = _one_machine("dp", tmp_path)
    a, b = _losses(tmp_path / "run"), _losses(one)
    assert a and a.keys() == b.keys() and max(abs(a[k] - b[k]) for k in a) < 1e-6
    s = read_summary(tmp_path / "run")
    assert s["world_size"] == 4 and s["steps"] == read_summary(one)["steps"]


@pytest.mark.procs
@needs_root
def test_a_node_that_never_starts_stops_the_others_naming_it(hosts, tmp_path):
    res = _job(
        hosts,
        tmp_path / "run",
        ["--strategy", "dp", "--workers", "3"],
        nnodes=3,
        nodes=[0, 2],
        timeout=60,
        per_node={h: ["--rdzv-timeout", "5"] for h in range(3)},
    )
    for code, seconds, log in res:
        assert code not in (0, None), log[-2000:]
        assert seconds < 5 + 10, log[-2000:]  # from its arrival: the timeout, and less than 10 s more
        assert "2 of 3 nodes arrived within 5 s; missing node rank(s): 1" in log, log[-2000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.procs
@needs_root
def test_a_node_with_another_learning_rate_stops_every_node_naming_lr(hosts, tmp_path):
    res = _job(
        hosts,
        tmp_path / "run",
        ["--strategy", "dp", "--workers", "2"],
        nnodes=2,
        per_node={1: ["--lr", "0.1"]},
        timeout=60,
    )
    for code, _, log in res:
        assert code not in (0, None), log[-2000:]
        assert "lr: node 0 = 0.05; node 1 = 0.1" in log, log[-2000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# the restarts across nodes: with -m slow (about 50 s each here; the one-machine restarts run by default)
@pytest.mark.procs
@pytest.mark.slow
@needs_root
def test_a_worker_killed_on_one_node_restarts_every_node_from_the_checkpoint(hosts, tmp_path):
    """Under --max-restarts 2, a SIGKILLed worker on node 1: both nodes' agents re-form the group in a new
    rendezvous round and resume from the newest checkpoint; the losses equal the uninterrupted run's."""
    from _procs import holder, past_checkpoint

    flags = ["--strategy", "dp", "--workers", "2", "--max-steps", "12", "--checkpoint-every", "4", "--timeout-s", "60"]
    out = tmp_path / "run"
    port = random.randint(20000, 40000)
    logs = [tmp_path / f"node{h}.log" for h in range(2)]
    procs = [
        _node(
            hosts,
            h,
            [
                *COMMON,
                *flags,
                "--max-restarts",
                "2",
                "--out",
                str(out),
                "--nnodes",
                "2",
                "--node-rank",
                str(h),
                "--rdzv-endpoint",
                f"{hosts.address(0)}:{port}",
                "--rdzv-id",
                f"r{port}",
            ],
            logs[h],
        )
        for h in range(2)
    ]
    ready = past_checkpoint(out, 4, 1, steps=2)
    deadline = time.monotonic() + patient(120)
    pid = None
    while time.monotonic() < deadline and not (pid and ready()):
        pid = pid or holder((out / "metrics.rank1.jsonl").resolve())
        assert all(p.poll() is None for p in procs), "a node ended before the kill"
        time.sleep(0.02)
    assert pid and ready(), "rank 1 never got past the step-4 checkpoint"
    os.kill(pid, 9)
    res = _finish(procs, logs, 150)
    for h, (code, _, log) in enumerate(res):
        assert code == 0, f"node {h}:\n{log[-3000:]}"
    assert "dtrain: rank 1 died (SIGKILL)" in res[1][2] and "from the checkpoint at step" in res[1][2], res[1][2]
    _as_uninterrupted(out, flags, tmp_path / "one", rows=2 * 12)


@pytest.mark.procs
@pytest.mark.slow
@needs_root
def test_with_nnodes_3_to_4_a_lost_node_leaves_the_job_on_3(hosts, tmp_path):
    """--nnodes 3:4: node 3 and its processes SIGKILLed after the step-4 checkpoint; the others restart in a
    rendezvous round of 3 nodes, from that checkpoint, and finish; the summary records the world sizes."""
    from _procs import holder, past_checkpoint

    flags = [
        "--strategy",
        "dp",
        "--workers",
        "4",
        "--batch-size",
        "48",
        "--max-steps",
        "10",
        "--checkpoint-every",
        "4",
        "--max-restarts",
        "2",
        "--timeout-s",
        "60",
    ]
    out = tmp_path / "run"
    port = random.randint(20000, 40000)
    logs = [tmp_path / f"node{h}.log" for h in range(4)]
    procs = [
        _node(
            hosts,
            h,
            [
                *COMMON[:-4],
                *flags,
                "--out",
                str(out),
                "--nnodes",
                "3:4",
                "--node-rank",
                str(h),
                "--rdzv-endpoint",
                f"{hosts.address(0)}:{port}",
                "--rdzv-id",
                f"e{port}",
            ],
            logs[h],
        )
        for h in range(4)
    ]
    ready = past_checkpoint(out, 4, 3, steps=2)
    deadline = time.monotonic() + patient(120)
    while time.monotonic() < deadline and not (holder((out / "metrics.rank3.jsonl").resolve()) and ready()):
        assert all(p.poll() is None for p in procs), "a node ended before the kill"
        time.sleep(0.05)
    assert ready(), "rank 3 never got past the step-4 checkpoint"
    os.killpg(procs[3].pid, 9)  # the whole node: its dtrain process, torch's agent, the worker
    res = _finish(procs[:3], logs[:3], 150)
    for h, (code, _, log) in enumerate(res):
        assert code == 0, f"node {h}:\n{log[-3000:]}"
    s = read_summary(out)
    assert s["world_size"] == 3 and s["steps"] == 10
    assert s["world_sizes"] == [{"from_step": 0, "workers": 4}, {"from_step": 4, "workers": 3}], s["world_sizes"]
    rows = _losses(out)
    assert {k for k in rows if k[0] >= 4} == {(step, r) for step in range(4, 10) for r in range(3)}
    assert {k for k in rows if k[0] < 4} == {(step, r) for step in range(4) for r in range(4)}


@pytest.mark.procs
@pytest.mark.slow
@needs_root
def test_a_node_killed_and_started_again_rejoins_and_the_job_ends_as_the_uninterrupted_one(hosts, tmp_path):
    """Under --max-restarts 2: node 1 of 2 and all its processes SIGKILLed after the step-4 checkpoint, then its
    command started again (as an operator or SLURM's requeue would). It takes its place back (its earlier
    process is gone: no heartbeat), both nodes re-form in a new rendezvous round and resume from the checkpoint;
    the losses of every step equal the uninterrupted run's."""
    from _procs import past_checkpoint

    flags = ["--strategy", "dp", "--workers", "2", "--max-steps", "12", "--checkpoint-every", "4", "--timeout-s", "60"]
    out = tmp_path / "run"
    port = random.randint(20000, 40000)
    logs = [tmp_path / "node0.log", tmp_path / "node1.log", tmp_path / "node1-again.log"]

    def start(h: int, log: Path) -> subprocess.Popen:
        return _node(
            hosts,
            h,
            [
                *COMMON,
                *flags,
                "--max-restarts",
                "2",
                "--out",
                str(out),
                "--nnodes",
                "2",
                "--node-rank",
                str(h),
                "--rdzv-endpoint",
                f"{hosts.address(0)}:{port}",
                "--rdzv-id",
                f"k{port}",
            ],
            log,
        )

    procs = [start(0, logs[0]), start(1, logs[1])]
    ready = past_checkpoint(out, 4, 1, steps=2)
    deadline = time.monotonic() + patient(120)
    while time.monotonic() < deadline and not ready():
        assert all(p.poll() is None for p in procs), "a node ended before the kill"
        time.sleep(0.02)
    assert ready(), "rank 1 never got past the step-4 checkpoint"
    os.killpg(procs[1].pid, 9)  # the whole node: its dtrain process, torch's agent, the worker
    procs[1].wait(10)
    again = start(1, logs[2])
    res = _finish([procs[0], again], [logs[0], logs[2]], 150)
    for name, (code, _, log) in zip(("node 0", "node 1 again"), res):
        assert code == 0, f"{name}:\n{log[-3000:]}"
    assert "node 1 of job" in res[1][2] and "rejoins it" in res[1][2], res[1][2][-2000:]
    _as_uninterrupted(out, flags, tmp_path / "one", rows=2 * 12)
