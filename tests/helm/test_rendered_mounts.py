"""What of the node agent's host directory GPU pods reach, over the rendered chart (its hostPath
PersistentVolume and the claim) and the pods the spawner and the launcher write (a notebook pod
and a kernel pod, each with its init container): no file of the agent's directory is mounted by
subPath (for a file missing at the pod's start the kubelet makes a directory, which ld.so ignores
and the agent cannot replace), and no GPU pod writes any of it: what two users' pods share they
only read (the node regions in ``regions/`` are written by the node agent's relay; the emulator
tests in tests/kubeemu/test_gpu_pod_mounts.py attack them)."""

from __future__ import annotations

import os
from collections.abc import Mapping

import pytest

from tests.helm import tools
from tests.hubext.test_gpu_pod_sandbox import gpu_notebook, kernel_pod, no_allocator, notebook_pod  # noqa: F401

try:
    tools.helm_path()
except tools.HelmMissing as e:
    pytest.skip(str(e), allow_module_level=True)


def host_mounts(pod: Mapping, volumes: Mapping[str, str]) -> list[tuple[str, str, bool]]:
    """(host path, subPath, writable) of every mount of a hostPath-backed volume, init containers
    included; ``volumes``: claim name -> host path of the PersistentVolume bound to it."""
    by_name = {}
    for v in pod["spec"].get("volumes") or []:
        if "hostPath" in v:
            by_name[v["name"]] = v["hostPath"]["path"]
        elif "persistentVolumeClaim" in v and v["persistentVolumeClaim"]["claimName"] in volumes:
            by_name[v["name"]] = volumes[v["persistentVolumeClaim"]["claimName"]]
    out = []
    for c in [*(pod["spec"].get("initContainers") or []), *pod["spec"]["containers"]]:
        for m in c.get("volumeMounts") or []:
            if m["name"] in by_name:
                sub = m.get("subPath") or ""
                out.append((os.path.normpath(os.path.join(by_name[m["name"]], sub)), sub, not m.get("readOnly")))
    return out


@pytest.fixture(scope="module")
def host_volumes() -> dict[str, str]:
    docs = tools.render()
    pvs = {d["metadata"]["name"]: d for d in tools.find(docs, "PersistentVolume")}
    out = {}
    for claim in tools.find(docs, "PersistentVolumeClaim"):
        pv = pvs.get(claim["spec"].get("volumeName"))
        if pv and "hostPath" in pv["spec"]:
            out[claim["metadata"]["name"]] = pv["spec"]["hostPath"]["path"]
    assert out, "the chart renders no claim of the agent's host directory"
    return out


def gpu_pods(claim: str) -> list[dict]:
    from hubext.kubernetes.launcher import KubernetesKernelLauncher

    notebook = gpu_notebook(notebook_pod(uid=1000, fs_gid=100))
    kernel = kernel_pod(KubernetesKernelLauncher(namespace="jhub", image="kernel:1", gpu_host_claim=claim))
    for pod in (notebook, kernel):  # the chart's claim, as the spawner and the launcher name it
        for v in pod["spec"]["volumes"]:
            if "persistentVolumeClaim" in v and v["name"] == "elastic-gpu-host":
                v["persistentVolumeClaim"]["claimName"] = claim
    return [notebook, kernel]


def test_no_file_of_the_agents_directory_is_mounted_by_subpath(host_volumes, no_allocator):  # noqa: F811
    [claim] = host_volumes
    agent_dir = host_volumes[claim]
    for pod in gpu_pods(claim):
        mounts = host_mounts(pod, host_volumes)
        assert mounts, pod["metadata"]
        subpaths = {sub for _path, sub, _w in mounts}
        # lib/ and regions/ are directories the agent makes; the whole directory is read-only
        assert subpaths <= {"lib", "regions", ""}, subpaths
        assert all(path.startswith(agent_dir) for path, _s, _w in mounts)


def test_no_gpu_pod_writes_the_agents_host_directory(host_volumes, no_allocator):  # noqa: F811
    """What two users' GPU pods both mount of the host (the node regions: every pod's entry on a
    card) neither may write: a pod that can would rewrite the other pods' entries."""
    [claim] = host_volumes
    notebook, kernel = gpu_pods(claim)
    paths = [{p for p, _s, _w in host_mounts(pod, host_volumes)} for pod in (notebook, kernel)]
    shared = paths[0] & paths[1]
    assert os.path.join(host_volumes[claim], "regions") in shared
    written = {(path, sub) for pod in (notebook, kernel) for path, sub, w in host_mounts(pod, host_volumes) if w}
    assert not written, f"GPU pods write these of the node agent's host directory: {written}"
