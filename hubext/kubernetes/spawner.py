"""ElasticGPUSpawner: KubeSpawner with fractional GPUs, queueing and quotas (Kubernetes mode)."""

from __future__ import annotations

from kubernetes_asyncio.client import models as k8s
from kubespawner import KubeSpawner
from traitlets import Dict, List, Unicode

from ..gpu_spawner import GPUSpawnerMixin, GPUSpawnError, check_forged_options, profile_gpu_section
from .objects import HOST_CLAIM, apply_gpu_to_pod


class ElasticGPUSpawner(GPUSpawnerMixin, KubeSpawner):
    """A KubeSpawner whose profiles may carry a ``gpu`` section (see hubext.gpu_spawner)."""

    gpu_backend = Unicode(
        "native",
        config=True,
        help="""How slices reach the card: 'native' (libvgpu shim; the pod is pinned to the node
        admission chose by a required node affinity, and kube-scheduler still checks it fits),
        'hami' (HAMi's nvidia.com/gpumem and gpucores resources), 'mig'
        (nvidia.com/mig-<profile> resource) or 'whole' (plain nvidia.com/gpu).""",
    )
    gpu_runtime_class = Unicode(
        "nvidia",
        config=True,
        help="runtimeClassName of GPU pods with the 'native' backend (empty: none). Default: 'nvidia'.",
    )
    gpu_priority_class_prefix = Unicode(
        "elastic-gpu-",
        config=True,
        help="Prefix of the Kubernetes PriorityClass made for each admission priority class (the chart creates them).",
    )
    gpu_tolerations = List(
        Dict(),
        [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        config=True,
        help="""Tolerations added to GPU notebook pods only (CPU notebooks keep off GPU nodes), on top
        of KubeSpawner's `tolerations` (z2jh: its dedicated-user tolerations and
        singleuser.extraTolerations). Kubernetes' form: key, operator, value, effect. Default:
        the nvidia.com/gpu:NoSchedule taint that GPU node pools carry (GKE, the GPU operator).""",
    )
    gpu_host_claim = Unicode(
        HOST_CLAIM,
        config=True,
        help="""PersistentVolumeClaim (in the pods' namespace) of the node agent's host directory
        (libvgpu.so, ld.so.preload, the node regions), mounted into 'native' GPU pods by subPath.
        The chart creates it, bound to a hostPath PersistentVolume of nodeAgent.hostLibDir, as
        <fullname>-host: so GPU pods carry no hostPath volume and the users' namespace can
        enforce Pod Security "baseline". Default: 'elastic-gpu-host' (a release named elastic-gpu).""",
    )

    # ---- profiles: group filtering and forged options -------------------------------------

    def _get_initialized_profile_list(self, profile_list: list) -> list:
        visible = [p for p in profile_list or [] if self.gpu_profile_visible(p)]
        if profile_list and not visible:
            raise GPUSpawnError(
                "No server profile is available to you. Ask an admin to add you to a group that may use one."
            )
        return super()._get_initialized_profile_list(visible)

    def _validate_user_options(self, profile_list: list) -> None:
        try:
            super()._validate_user_options(profile_list)
        except ValueError as e:  # KubeSpawner's "No such profile: x. Options include: ..."
            raise GPUSpawnError(str(e)) from None
        slug = (self.user_options or {}).get("profile")
        if slug:
            check_forged_options(self._get_profile(slug, profile_list), self.user_options)

    def gpu_selected_profile(self) -> dict | None:
        return self.__dict__.get("_gpu_profile")

    async def load_user_options(self) -> None:
        """KubeSpawner's overrides first, then GPU admission (after the overrides, so they count)."""
        profile_list = self._sorted_dict_values(self.profile_list)
        await super().load_user_options()
        profile = None
        if profile_list:
            if callable(profile_list):
                from tornado.gen import maybe_future

                profile_list = await maybe_future(profile_list(self))
            initialized = self._get_initialized_profile_list(profile_list)
            if initialized:
                profile = self._get_profile((self.user_options or {}).get("profile"), initialized)
        self.__dict__["_gpu_profile"] = profile
        await self.gpu_admit()

    # ---- start/stop keep KubeSpawner's contract ---------------------------------------------

    def start(self):
        self.gpu_reset_progress()
        return super().start()

    async def _start(self):
        try:
            return await super()._start()
        except BaseException:
            await self.gpu_release("spawn failed")
            raise

    async def progress(self):
        async for event in self.gpu_progress_events():
            yield event
        if self.gpu_allocation is not None:
            yield {"message": "Waiting for pod", "progress": 25}
        async for event in super().progress():
            yield event

    def get_state(self) -> dict:
        return self.gpu_get_state(super().get_state())

    def load_state(self, state: dict) -> None:
        super().load_state(state)
        self.gpu_load_state(state)

    # ---- the pod ----------------------------------------------------------------------------

    async def get_pod_manifest(self) -> k8s.V1Pod:
        pod = await super().get_pod_manifest()
        allocation = self.gpu_allocation
        if allocation is None:
            return pod
        apply_gpu_to_pod(
            pod,
            allocation,
            backend=self.gpu_backend,
            section=self._gpu_section(),
            priority_value=self.gpu_allocator.priority_value(allocation.priority_class),
            priority_class_name=self.gpu_priority_class_prefix + allocation.priority_class,
            runtime_class=self.gpu_runtime_class,
            host_claim=self.gpu_host_claim,
            server=self.name or "",
            tolerations=[dict(t) for t in self.gpu_tolerations],
        )
        return pod

    def _gpu_section(self) -> dict:
        profile = self.gpu_selected_profile()
        return (profile_gpu_section(profile, self.user_options or {}) if profile else None) or {}
