"""One emulated host's node process: ``python -m dtrain.cluster._node PAYLOAD``.

Started inside the host's network namespace by
:func:`dtrain.cluster.run_on_cluster`; reads the pickled payload, runs
:func:`dtrain.launch.agent.launch` with the host's :class:`~dtrain.launch.agent.NodeSpec` and
pickles ``(True, {rank: value})`` or ``(False, message)`` next to the payload.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path


def _load_main(script: str) -> None:
    """Stand the caller's script in for ``__main__`` so functions defined there unpickle.

    The script is executed under the name ``__mp_main__`` (its ``if __name__ ==
    "__main__"`` block does not run), as multiprocessing's spawn does; workers
    spawned from here find it the same way.
    """
    import runpy
    import types

    mod = types.ModuleType("__mp_main__")
    mod.__dict__.update(runpy.run_path(script, run_name="__mp_main__"))
    mod.__file__ = script
    sys.modules["__mp_main__"] = mod
    sys.modules["__main__"] = mod


def main(path: str, script: str = "") -> int:
    from dtrain.launch.agent import NodeSpec, launch

    if script:
        _load_main(script)
    p = pickle.loads(Path(path).read_bytes())
    node = NodeSpec(
        nnodes=p["nnodes"],
        rdzv_endpoint=p["endpoint"],
        is_host=p["is_host"],
        local_addr=p["local_addr"],
        env=p["env"],
    )
    out: tuple[bool, object]
    try:
        result = launch(p["fn"], p["args"], nprocs=p["nprocs"], node=node, threads=p["threads"], run_id=p["run_id"])
        out = (True, result)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        out = (False, f"{type(e).__name__}: {e}")
    Path(p["result"]).write_bytes(pickle.dumps(out))
    return 0 if out[0] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else ""))
