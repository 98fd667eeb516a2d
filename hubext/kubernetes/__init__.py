"""Kubernetes mode: KubeSpawner with slices, the pool of GPU nodes and labelled pods, kernel pods.

- ``spawner``: :class:`ElasticGPUSpawner` (``c.JupyterHub.spawner_class``);
- ``pool``: :class:`KubernetesPool` (entry point ``kubernetes`` of ``elastic_gpu.pools``);
- ``launcher``: :class:`KubernetesKernelLauncher` (GPU kernels as pods);
- ``objects``: pure builders of the pods, secrets and policies; ``bootstrap.py``: the kernel pod's start.
"""
