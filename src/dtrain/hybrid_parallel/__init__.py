"""Data, pipeline and tensor parallelism on one set of processes.

* :mod:`.mesh` -- :class:`~.mesh.Mesh`, the DP x PP x TP process-group layout on torch's DeviceMesh;
* :mod:`.engine` -- ``dtrain.hybrid(model, mesh)``, the engine that trains on it.

This package imports nothing itself (``dtrain.hybrid`` is the function, re-exported by ``dtrain``).
"""
