"""Running a job: ``dtrain run`` from its configuration to its processes.

* :mod:`.config` -- :class:`~.config.RunConfig`, what every run shares plus the strategy's options;
* :mod:`.files` -- reading TOML files (run configurations, cluster descriptions) with errors that name them;
* :mod:`.worker` -- the parent process of ``dtrain run`` and each worker's entry point;
* :mod:`.launch` -- starting worker processes through torch's elastic agent (torchrun as a library);
* :mod:`.store` -- the job's store, where the agents meet and the workers form their process group;
* :mod:`.forkserver` -- workers forked from a server that imported torch once.

This package imports nothing itself.
"""
