"""Starting processes: worker processes through torch's elastic agent (torchrun as a library).

* :mod:`.agent` -- :func:`~.agent.launch`: N processes on this machine, or this node's share of a
  job over several, with restarts and a timeout on every wait;
* :mod:`.worker` -- what runs in each worker process: its environment, process group and exit;
* :mod:`.store` -- the job's store, where the agents meet and the workers form their process group;
* :mod:`.forkserver` -- workers forked from a server that imported torch once.

``dtrain.launch.launch(fn, args, nprocs=4)`` is :func:`.agent.launch`.
"""

from dtrain.launch.agent import LaunchError, LaunchInterrupted, launch, threads_per_worker

__all__ = ["LaunchError", "LaunchInterrupted", "launch", "threads_per_worker"]
