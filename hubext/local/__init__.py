"""Single-machine mode: local processes with slices of this machine's GPUs.

- ``spawner``: :class:`LocalGPUSpawner` / :class:`HubUserGPUSpawner` (``c.JupyterHub.spawner_class``);
- ``pool``: :class:`LocalPool` (entry point ``local`` of ``elastic_gpu.pools``);
- ``launcher``: :class:`LocalKernelLauncher` (GPU kernels as local processes);
- ``ledger``: the one SQLite ledger (allocations and kernels); ``processes``: liveness and stopping;
- ``inventory``: NVML and the shim's library.
"""
