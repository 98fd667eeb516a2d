"""How a 'native' GPU pod receives the shim's files, and which of them it may write.

From the node agent's host directory (the PersistentVolumeClaim ``host_claim``, which the chart
binds to a hostPath PersistentVolume of that one directory):

- ``lib/`` (libvgpu.so and its helpers) is mounted read-only at :data:`SHIM_LIB_DIR`;
- ``regions/`` (the node regions, one per card) read-only at ``REGION_DIR/node``: the pod reads
  the other pods' entries there, and the node agent writes its own from its container region
  (:mod:`libvgpu.agent.relay`), so no pod writes a file another pod reads.

The pod's own files live in a pod-private ``emptyDir`` (``elastic-gpu-region``, in memory), which
the init container ``elastic-gpu-region`` fills before the pod's containers start. It runs as
:data:`REGION_OWNER_UID`, never the pod's user, and

1. waits until the agent has written ``ld.so.preload`` on the node (a pod that lands before the
   agent waits here, saying so, instead of running its code without the shim);
2. copies that file to ``etc/ld.so.preload``, which the container mounts at ``/etc/ld.so.preload``
   (no file of the host directory is mounted by subPath: for a missing one the kubelet would make
   a directory there, which ld.so ignores and the agent cannot replace);
3. makes ``region/`` (mode 0755, its own) and in it the container region and the activity file
   with the shim's own code (:data:`libvgpu.regions.PREPARE_SOURCE`, libvgpu.so preloaded), mode
   0666. The container mounts ``region/`` at :data:`REGION_DIR`: its processes write the shim's
   counters, but the directory is not theirs, so they can neither unlink, rename nor replace
   the region (a region of their own would be a fresh limit).
"""

from __future__ import annotations

from kubernetes_asyncio.client import models as k8s

import libvgpu
from libvgpu.regions import PREPARE_SOURCE

from ..gpu_spawner import GPUSpawnError

#: where the host directory's parts appear in a 'native' GPU container
SHIM_LIB_DIR = "/usr/local/lib/elastic-gpu"
REGION_DIR = "/var/run/libvgpu"
#: the account of the init container that makes the pod's region: not the pod's user, so the
#: region's directory is not the user's to write (65532: "nonroot" of distroless images)
REGION_OWNER_UID = 65532
#: the volume of the pod's own files (region/, etc/ld.so.preload) and its init container
POD_VOLUME = "elastic-gpu-region"
INIT_CONTAINER = "elastic-gpu-region"
_AGENT_MOUNT = "/var/run/elastic-gpu-agent"  # the host directory, read-only, in the init container
_POD_MOUNT = "/var/run/elastic-gpu-pod"  # the pod's volume in the init container

# $0: PREPARE_SOURCE. Every step fails the init container with the failing command's message.
_SCRIPT = f"""set -e
agent={_AGENT_MOUNT} pod={_POD_MOUNT}
if [ ! -f "$agent/ld.so.preload" ]; then
  echo "Waiting for the elastic-gpu node agent to install the GPU shim on this node ($agent/ld.so.preload) ..."
  until [ -f "$agent/ld.so.preload" ]; do sleep 1; done
fi
mkdir -p "$pod/region" "$pod/etc"
chmod 0755 "$pod/region" "$pod/etc"
cp "$agent/ld.so.preload" "$pod/etc/.ld.so.preload.tmp"
chmod 0644 "$pod/etc/.ld.so.preload.tmp"
mv -f "$pod/etc/.ld.so.preload.tmp" "$pod/etc/ld.so.preload"
if grep -q . "$pod/etc/ld.so.preload"; then
  LD_PRELOAD="$agent/lib/{libvgpu.LIBRARY}" python3 -I -S -c "$0" "$pod/region/container.region" "$pod/region/activity"
fi
"""


def _run_as_user(context: object) -> int | None:
    """runAsUser of a security context, as a model or as the dict KubeSpawner may leave there."""
    if isinstance(context, dict):
        return context.get("runAsUser", context.get("run_as_user"))
    return getattr(context, "run_as_user", None)


def _runs_as(pod: k8s.V1Pod, container: k8s.V1Container) -> int | None:
    own = _run_as_user(container.security_context)
    return own if own is not None else _run_as_user(pod.spec.security_context)


def region_init_container(image: str, pull_policy: str | None) -> k8s.V1Container:
    """The init container that makes the pod's region and preload file (module docstring); Pod
    Security 'restricted' as the kernel pods are."""
    return k8s.V1Container(
        name=INIT_CONTAINER,
        image=image,
        image_pull_policy=pull_policy,
        command=["/bin/sh", "-c", _SCRIPT, PREPARE_SOURCE],
        resources=k8s.V1ResourceRequirements(requests={"cpu": "10m", "memory": "32Mi"},
                                             limits={"cpu": "1", "memory": "256Mi"}),
        security_context=k8s.V1SecurityContext(
            run_as_user=REGION_OWNER_UID,
            run_as_group=REGION_OWNER_UID,
            run_as_non_root=True,
            allow_privilege_escalation=False,
            capabilities=k8s.V1Capabilities(drop=["ALL"]),
            seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault"),
        ),
        volume_mounts=[
            k8s.V1VolumeMount(name="elastic-gpu-host", mount_path=_AGENT_MOUNT, read_only=True),
            k8s.V1VolumeMount(name=POD_VOLUME, mount_path=_POD_MOUNT),
        ],
    )


def add_shim_files(pod: k8s.V1Pod, host_claim: str, limits_annotation: str) -> None:
    """Give the pod's first container the shim's files (module docstring): its volumes, its
    mounts and the init container that prepares the pod's own files.

    Raises :class:`GPUSpawnError` when the container runs as :data:`REGION_OWNER_UID` (the
    region's directory would be its own to write)."""
    spec = pod.spec
    container = spec.containers[0]
    if _runs_as(pod, container) == REGION_OWNER_UID:
        raise GPUSpawnError(
            f"This GPU server's containers run as uid {REGION_OWNER_UID}, the account that owns "
            "their GPU slice's files: its processes could replace them and escape the slice. "
            "Ask an admin to run them as another uid.",
            500,
        )
    spec.volumes = list(spec.volumes or []) + [
        k8s.V1Volume(
            name="elastic-gpu-limits",
            downward_api=k8s.V1DownwardAPIVolumeSource(
                default_mode=0o444,
                items=[
                    k8s.V1DownwardAPIVolumeFile(
                        path="limits.conf",
                        field_ref=k8s.V1ObjectFieldSelector(field_path=f"metadata.annotations['{limits_annotation}']"),
                    )
                ],
            ),
        ),
        k8s.V1Volume(
            name="elastic-gpu-host",
            persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(claim_name=host_claim),
        ),
        k8s.V1Volume(name=POD_VOLUME, empty_dir=k8s.V1EmptyDirVolumeSource(medium="Memory")),
    ]
    spec.init_containers = list(spec.init_containers or []) + [
        region_init_container(container.image, container.image_pull_policy)
    ]
    container.volume_mounts = list(container.volume_mounts or []) + [
        k8s.V1VolumeMount(name="elastic-gpu-limits", mount_path="/etc/libvgpu", read_only=True),
        k8s.V1VolumeMount(name="elastic-gpu-host", mount_path=SHIM_LIB_DIR, sub_path="lib", read_only=True),
        k8s.V1VolumeMount(name=POD_VOLUME, mount_path="/etc/ld.so.preload", sub_path="etc/ld.so.preload",
                          read_only=True),
        k8s.V1VolumeMount(name="elastic-gpu-host", mount_path=f"{REGION_DIR}/node", sub_path="regions",
                          read_only=True),
        k8s.V1VolumeMount(name=POD_VOLUME, mount_path=REGION_DIR, sub_path="region"),
    ]
