"""ElasticGPUSpawner: KubeSpawner with fractional GPUs, queueing and quotas (Kubernetes mode)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from kubernetes_asyncio.client import models as k8s
from kubespawner import KubeSpawner
from traitlets import Dict, Float, List, TraitError, Unicode, validate

from ..gpu_spawner import GPUSpawnerMixin, GPUSpawnError, check_forged_options
from ..requests import check_profile_limits, profile_gpu_section, validate_gpu_section
from .objects import HOST_CLAIM, PodDelivery, apply_gpu_to_pod
from .status import unschedulable_message


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
        (libvgpu.so, ld.so.preload, the node regions), mounted into 'native' GPU pods (lib/ and
        regions/ by subPath; the whole directory read-only in their init container).
        The chart creates it, bound to a hostPath PersistentVolume of nodeAgent.hostLibDir, as
        <fullname>-host: so GPU pods carry no hostPath volume and the users' namespace can
        enforce Pod Security "baseline". Default: 'elastic-gpu-host' (a release named elastic-gpu).""",
    )

    gpu_unschedulable_seconds = Float(
        60.0,
        config=True,
        help="""Seconds a GPU notebook's pod may stay Unschedulable (kube-scheduler finds no room on the
        node admission chose: a taint the pod does not tolerate, CPU or memory, a cordoned node)
        before the spawn fails with the scheduler's message and the GPU slice goes back to the
        pool. 0: wait for KubeSpawner's start_timeout. Default: 60.""",
    )

    # ---- profiles: group filtering and forged options -------------------------------------

    @validate("profile_list")
    def _validate_gpu_profiles(self, proposal: Any) -> Any:
        """The ``gpu`` sections of a profile list given as data (KubeSpawner checks the rest at
        spawn time): each section and choice, and the limits of every combination of choices."""
        value = proposal.value
        if callable(value):
            return value
        try:
            for i, p in enumerate(value.values() if isinstance(value, Mapping) else value or []):
                if not isinstance(p, Mapping):
                    continue
                where = f"profile '{p.get('slug') or p.get('display_name') or i}'"
                if p.get("gpu") is not None:
                    validate_gpu_section(p["gpu"], where)
                for name, option in (p.get("profile_options") or {}).items():
                    for cname, choice in ((option or {}).get("choices") or {}).items():
                        if isinstance(choice, Mapping) and choice.get("gpu") is not None:
                            validate_gpu_section(choice["gpu"], f"{where} option '{name}' choice '{cname}'")
                check_profile_limits(p, where)
        except (ValueError, AttributeError, TypeError) as e:
            raise TraitError(f"ElasticGPUSpawner.profile_list: {e}") from None
        return value

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
        self.__dict__.pop("_gpu_unschedulable_since", None)
        return super().start()

    def is_pod_running(self, pod: dict | None) -> bool:
        """KubeSpawner's check, polled while the pod starts; a GPU pod Unschedulable for longer
        than gpu_unschedulable_seconds ends the start (``_start`` then releases the slice)."""
        self._gpu_check_schedulable(pod)
        return super().is_pod_running(pod)

    def _gpu_check_schedulable(self, pod: dict | None) -> None:
        if self.gpu_allocation is None or not self.gpu_unschedulable_seconds or not pod:
            return
        why = unschedulable_message(pod)
        if why is None:
            self.__dict__.pop("_gpu_unschedulable_since", None)
            return
        since = self.__dict__.setdefault("_gpu_unschedulable_since", time.monotonic())
        waited = time.monotonic() - since
        if waited < self.gpu_unschedulable_seconds:
            return
        node = self.gpu_allocation.node
        self.log.warning("GPU pod of %s unschedulable on %s for %.0f s: %s", self.user.name, node, waited, why)
        raise GPUSpawnError(
            f"Your server could not be scheduled on GPU node {node} (waited {waited:.0f} s): {why} "
            "Its GPU slice was given back. Try again later; if it keeps failing, ask an admin "
            "(the node may be cordoned, tainted or out of CPU or memory).",
            409,
        )

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

    def pod_delivery(self) -> PodDelivery:
        """How this server's pod receives its slice; its GPU kernels' pods receive theirs alike
        (``KubernetesKernelLauncher.server_ref``)."""
        return PodDelivery(
            backend=self.gpu_backend,
            runtime_class=self.gpu_runtime_class,
            priority_class_prefix=self.gpu_priority_class_prefix,
            host_claim=self.gpu_host_claim,
        )

    async def get_pod_manifest(self) -> k8s.V1Pod:
        pod = await super().get_pod_manifest()
        allocation = self.gpu_allocation
        if allocation is None:
            return pod
        delivery = self.pod_delivery()
        apply_gpu_to_pod(
            pod,
            allocation,
            backend=delivery.backend,
            section=self._gpu_section(),
            priority_value=self.gpu_allocator.priority_value(allocation.priority_class),
            priority_class_name=delivery.priority_class_prefix + allocation.priority_class,
            runtime_class=delivery.runtime_class,
            host_claim=delivery.host_claim,
            server=self.name or "",
            tolerations=[dict(t) for t in self.gpu_tolerations],
        )
        return pod

    def _gpu_section(self) -> dict:
        profile = self.gpu_selected_profile()
        return (profile_gpu_section(profile, self.user_options or {}) if profile else None) or {}
