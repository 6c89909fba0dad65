"""``dtrain cluster up | down | status``: manage emulated clusters.

Examples::

    dtrain cluster up --hosts 4 --bandwidth 100mbit --name emu --slow 3:2
    dtrain cluster status
    dtrain run --cluster emu --workers 4
    dtrain cluster down --name emu          # idempotent; --all removes every dtrain cluster
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from dtrain.cluster.netns import ClusterError, down, status, up
from dtrain.errors import run_command

__all__ = ["main", "parse_slow"]


def parse_slow(specs: Sequence[str]) -> dict[int, float]:
    """``["2:3", "h1:1.5"]`` -> ``{2: 3.0, 1: 1.5}`` (host index or ``h<index>``, factor >= 1)."""
    out: dict[int, float] = {}
    for spec in specs:
        try:
            host, factor = spec.split(":")
            out[int(host.lower().removeprefix("h"))] = float(factor)
        except ValueError:
            raise ClusterError(f"--slow takes HOST:FACTOR, e.g. 2:3 or h2:3; got {spec!r}") from None
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dtrain cluster", description="Emulated cluster on this machine (needs root).")
    sub = ap.add_subparsers(dest="cmd", metavar="up|down|status", required=True)
    u = sub.add_parser("up", help="create N hosts (network namespaces) joined by a shaped bridge")
    u.add_argument("--hosts", type=int, required=True, help="number of emulated hosts (2..64)")
    u.add_argument("--bandwidth", required=True, help="each host link's rate, tc style: 100mbit, 1gbit")
    u.add_argument("--name", default="default", help="cluster name (default: default)")
    u.add_argument(
        "--slow",
        action="append",
        default=[],
        metavar="HOST:FACTOR",
        help="make a host's compute FACTOR times slower (straggler); repeatable",
    )
    u.add_argument("--latency", default=None, help="per-link delay (needs netem; refused where the kernel lacks it)")
    u.add_argument("--mtu", type=int, default=1500, help="link MTU (default: 1500)")
    d = sub.add_parser("down", help="remove a cluster (idempotent, also after a crash)")
    d.add_argument("--name", default="default", help="cluster name (default: default)")
    d.add_argument("--all", action="store_true", help="remove every dtrain cluster")
    s = sub.add_parser("status", help="list emulated clusters")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    return ap


def _cluster(ns: argparse.Namespace) -> int:
    if ns.cmd == "up":
        c = up(
            ns.name, hosts=ns.hosts, bandwidth=ns.bandwidth, slow=parse_slow(ns.slow), latency=ns.latency, mtu=ns.mtu
        )
        print(f"up: {c.describe()}")
        print(f"run on it: dtrain run --cluster {c.name} --workers {c.hosts}")
    elif ns.cmd == "down":
        removed = down(None if ns.all else ns.name, all_clusters=ns.all)
        what = "every dtrain cluster" if ns.all else f"cluster {ns.name!r}"
        print(f"down: {what}: removed {len(removed)} namespaces" + (f" ({', '.join(removed)})" if removed else ""))
    else:
        rows = status()
        if ns.json:
            print(json.dumps(rows, indent=2))
        elif not rows:
            print("no emulated clusters")
        else:
            for r in rows:
                print(f"[{r['state']}] {r['description']}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ns = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    return run_command("dtrain cluster", lambda: _cluster(ns))


if __name__ == "__main__":
    sys.exit(main())
