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

from dtrain.cli import build_parser, nodes_from_args
from dtrain.cluster.nodes import NodeArgs, differences, expand_nodelist, from_slurm, parse_endpoint, parse_nnodes
from dtrain.errors import ConfigError

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
HAS_IP = shutil.which("ip") is not None and shutil.which("tc") is not None
needs_root = pytest.mark.skipif(not (IS_ROOT and HAS_IP),
                                reason="the emulated hosts need root and iproute2 (network namespaces)")  # fmt: skip
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


def test_differences_name_the_key_and_the_nodes():
    recs = {0: {"lr": 0.05, "dp": {"algorithm": "ring"}}, 1: {"lr": 0.05, "dp": {"algorithm": "ring"}},
            2: {"lr": 0.1, "dp": {"algorithm": "tree"}}}  # fmt: skip
    assert differences(recs) == ['dp.algorithm: nodes 0, 1 = "ring"; node 2 = "tree"',
                                 "lr: nodes 0, 1 = 0.05; node 2 = 0.1"]
    assert differences({0: {"lr": 1}, 1: {"lr": 1}}) == []


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
        return ".".join(str(int(ip[i:i + 2], 16)) for i in (6, 4, 2, 0)) + f":{int(port, 16)}"
    return f"[{ip}]:{int(port, 16)}"  # IPv6, as the kernel writes it (all zeros: every interface)


def listening(root: int) -> set[str]:
    """The local addresses the processes under ``root`` listen on (TCP, IPv4 and IPv6), from /proc."""
    found: set[str] = set()
    for pid in _tree(root):
        try:
            inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] for fd in os.listdir(f"/proc/{pid}/fd")
                      if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")}  # fmt: skip
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
    p = subprocess.Popen([sys.executable, "-m", "dtrain.cli", "run", "--workers", "2", "--epochs", "1", "--max-steps",
                          "30", "--no-progress", "--out", str(tmp_path / "run")], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)  # fmt: skip
    seen: set[str] = set()
    try:
        while p.poll() is None:
            seen |= listening(p.pid)
            time.sleep(0.1)
    finally:
        if p.poll() is None:
            p.kill()
        out = p.communicate(timeout=120)[0]
    assert p.returncode == 0, out[-3000:]
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
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(env or {})})  # fmt: skip


def _finish(procs: list[subprocess.Popen], logs: list[Path], timeout: float,
            listens: dict[int, set[str]] | None = None) -> list[tuple[int | None, float, str]]:  # fmt: skip
    """Each node's (exit code, seconds from its arrival at the job's store to its exit, output); past
    ``timeout`` a node is killed (code None). The arrival is when it prints its "dtrain: node R of N" line,
    after its own start-up (an interpreter importing torch). ``listens``: filled with what each node's
    processes listen on while they run."""
    t0 = time.monotonic()
    ends: dict[int, float] = {}
    arrived: dict[int, float] = {}
    while len(ends) < len(procs) and time.monotonic() - t0 < timeout:
        for i, p in enumerate(procs):
            if i not in arrived and b"dtrain: node " in logs[i].read_bytes():
                arrived[i] = time.monotonic()
            if i not in ends and p.poll() is not None:
                ends[i] = time.monotonic() - arrived.get(i, t0)
            elif listens is not None and i not in ends:
                listens.setdefault(i, set()).update(listening(p.pid))
        time.sleep(0.05)
    out = []
    for i, p in enumerate(procs):
        code = p.poll()
        if code is None:
            os.killpg(p.pid, 9)
            p.wait(10)
        out.append((code, ends.get(i, timeout), logs[i].read_text(errors="replace")))
    return out


def _job(c, out: Path, flags: list[str], *, timeout: float = 150, nnodes: int = HOSTS, nodes: list[int] | None = None,
         per_node: dict[int, list[str]] | None = None,
         listens: dict[int, set[str]] | None = None) -> list[tuple[int | None, float, str]]:  # fmt: skip
    """A job of ``nnodes`` nodes, one per host (``nodes``: only those start); the nodes' (code, seconds, output)."""
    port = random.randint(20000, 40000)
    job = f"t{port}"
    procs, logs = [], []
    for h in nodes if nodes is not None else range(nnodes):
        log = out.parent / f"{out.name}.node{h}.log"
        argv = [*COMMON, *flags, "--out", str(out), "--nnodes", str(nnodes), "--node-rank", str(h),
                "--rdzv-endpoint", f"{c.address(0)}:{port}", "--rdzv-id", job, *(per_node or {}).get(h, [])]
        procs.append(_node(c, h, argv, log))
        logs.append(log)
    return _finish(procs, logs, timeout, listens)


_ONE: dict[str, Path] = {}  # one-machine runs of this module, by strategy: the references, made once


def _one_machine(name: str, root: Path) -> Path:
    """The one-machine run of ``STRATEGIES[name]`` (``--workers 4`` on this machine), made on first use."""
    if name not in _ONE:
        out = root / f"one-{name}"
        p = subprocess.run([sys.executable, "-m", "dtrain.cli", "run", *COMMON, *STRATEGIES[name], "--out", str(out)],
                           capture_output=True, text=True, timeout=150)  # fmt: skip
        assert p.returncode == 0, p.stderr[-3000:]
        _ONE[name] = out
    return _ONE[name]


def _losses(out: Path) -> dict[tuple[int, int], float]:
    return {(r["step"], r["rank"]): r["loss"] for r in read_metrics(out) if "loss" in r and "step" in r}


STRATEGIES = {
    "dp": ["--strategy", "dp", "--workers", "4"],
    "ps-bsp": ["--strategy", "ps", "--workers", "3", "--servers", "1"],
    "sharded-stage2": ["--strategy", "dp", "--workers", "4", "--shard", "gradients"],
    "pipeline-1f1b": ["--strategy", "pipeline", "--workers", "4", "--schedule", "1f1b", "--microbatches", "4"],
    "hybrid-dp2xpp2": ["--strategy", "hybrid", "--workers", "4", "--dp", "2", "--pp", "2"],
}


# each 4-node job starts 4 interpreters and 4 forkservers (about 35 s of CPU here): dp runs by default, the
# other strategies with -m slow (every strategy's processes are the same on one machine and on several)
@pytest.mark.procs
@needs_root
@pytest.mark.parametrize("name", [n if n == "dp" else pytest.param(n, marks=pytest.mark.slow) for n in STRATEGIES])
def test_four_nodes_train_as_one_machine(hosts, tmp_path, name):
    flags = STRATEGIES[name]
    listens: dict[int, set[str]] = {}
    res = _job(hosts, tmp_path / "nodes", flags, listens=listens if name == "dp" else None)
    for h, (code, _, log) in enumerate(res):
        assert code == 0, f"node {h}:\n{log[-3000:]}"
    if name == "dp":  # only on the chosen interface: node 0's store, everyone's gloo, on the host's own address
        assert any(listens.values()), "no listening socket seen"
        for h, addrs in listens.items():
            assert all(a.startswith(f"{hosts.address(h)}:") for a in addrs), (h, addrs)
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
def test_slurm_environment_alone_starts_the_job(hosts, tmp_path):
    """As `srun --ntasks-per-node=1 dtrain run CONFIG` would on 2 nodes: no launch flag, SLURM's variables
    only; 2 processes a node, the same run as 4 workers on one machine."""
    port = random.randint(20000, 40000)
    procs, logs = [], []
    for h in range(2):
        env = {"SLURM_JOB_ID": f"4{port}", "SLURM_NODEID": str(h), "SLURM_JOB_NUM_NODES": "2",
               "SLURM_JOB_NODELIST": ",".join(hosts.address(i) for i in range(2)), "MASTER_PORT": str(port)}
        log = tmp_path / f"node{h}.log"
        procs.append(_node(hosts, h, [*COMMON, *STRATEGIES["dp"], "--out", str(tmp_path / "run")], log, env))
        logs.append(log)
    res = _finish(procs, logs, 150)
    for h, (code, _, log) in enumerate(res):
        assert code == 0, f"node {h}:\n{log[-3000:]}"
    assert "node 0 of 2: 2 process(es)" in res[0][2]
    assert "(from SLURM)" in res[0][2] and f"job 'slurm-4{port}'" in res[0][2]
    a, b = _losses(tmp_path / "run"), _losses(_one_machine("dp", tmp_path))
    assert a.keys() == b.keys() and max(abs(a[k] - b[k]) for k in a) < 1e-6


@pytest.mark.procs
@needs_root
def test_a_node_that_never_starts_stops_the_others_naming_it(hosts, tmp_path):
    res = _job(hosts, tmp_path / "run", STRATEGIES["dp"], nodes=[0, 1, 3], timeout=60,
               per_node={h: ["--rdzv-timeout", "5"] for h in range(4)})  # fmt: skip
    for code, seconds, log in res:
        assert code not in (0, None), log[-2000:]
        assert seconds < 5 + 10, log[-2000:]  # from its arrival: the timeout, and less than 10 s more
        assert "3 of 4 nodes arrived within 5 s; missing node rank(s): 2" in log, log[-2000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.procs
@needs_root
def test_a_node_with_another_learning_rate_stops_every_node_naming_lr(hosts, tmp_path):
    res = _job(hosts, tmp_path / "run", ["--strategy", "dp", "--workers", "3"], nnodes=3,
               per_node={1: ["--lr", "0.1"]}, timeout=60)  # fmt: skip
    for code, _, log in res:
        assert code not in (0, None), log[-2000:]
        assert "lr: nodes 0, 2 = 0.05; node 1 = 0.1" in log, log[-2000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.procs
@needs_root
def test_a_node_of_another_job_is_refused_on_both_sides(hosts, tmp_path):
    """Node 0 of job A waits for node 1; a node of job B reaches its endpoint meanwhile and is refused
    (node 0 says so too); then node 1 comes and job A runs on its 2 nodes."""
    port = random.randint(20000, 40000)
    base = [*COMMON, "--strategy", "dp", "--workers", "2", "--nnodes", "2", "--rdzv-endpoint",
            f"{hosts.address(0)}:{port}"]  # fmt: skip
    logs = [tmp_path / f"node{h}.log" for h in range(2)] + [tmp_path / "intruder.log"]

    def start(h: int, rank: int, job: str, out: str) -> subprocess.Popen:
        argv = [*base, "--out", str(tmp_path / out), "--node-rank", str(rank), "--rdzv-id", job]
        return _node(hosts, h, argv, logs[rank] if job == "jobA" else logs[2])

    procs = [start(0, 0, "jobA", "run")]
    intruder = start(2, 1, "jobB", "other")
    assert intruder.wait(60) != 0
    procs.append(start(1, 1, "jobA", "run"))
    res = _finish(procs, logs[:2], 150)
    for h, (code, _, log) in enumerate(res):
        assert code == 0, f"node {h}:\n{log[-3000:]}"
    assert "serves job 'jobA', and this node was started with --rdzv-id 'jobB': refused" in logs[2].read_text()
    assert "refused a node of another job" in res[0][2] and "--rdzv-id jobB" in res[0][2]
    assert read_summary(tmp_path / "run")["world_size"] == 2
    assert not (tmp_path / "other").exists()
