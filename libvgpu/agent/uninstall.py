"""Uninstall: the chart's pre-delete hook and the node agents clean the GPU nodes together.

``python -m libvgpu.agent.uninstall --release R`` (the hook, a Job that runs before Helm deletes
anything, so every agent and its rights still exist) annotates each GPU node
``elastic-gpu.jupyter.org/uninstall=R``. Each node's agent sees it at once through its watch of
its Node (else at its next inventory read, ``NodeAgent.inventory_interval_seconds``) and
:func:`withdraw`\\ s: it removes its host files
(``lib/``, ``ld.so.preload``, ``regions/`` of ``--host-lib-dir``) unless GPU pods still run there
(a new process in them would then start without the shim, unlimited: the files stay and the
answer says so), removes the node's label and inventory annotation, stops publishing, and answers
``done: ...`` in the annotation. The hook waits for every answer (``--timeout-seconds``), then
removes the label and annotations itself from nodes whose agent did not answer, and prints one
line per node. It never fails the uninstall: a node it could not clean is named, with what to do.

RBAC of the hook: nodes get, list, patch (cluster).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from typing import Any

from libvgpu import contract as L

from .install import remove_shim


async def withdraw(agent: Any) -> None:
    """The agent's part (called from its inventory publication when the node carries the
    uninstall annotation; its watch of the Node wakes that publication at once): host files, then
    the node's label and inventory, then the answer."""
    pods = [
        p
        for p in await agent.kube.node_pods(agent.pod_namespace)
        if not p.metadata.deletion_timestamp and (p.status.phase if p.status else "") not in ("Succeeded", "Failed")
    ]
    if agent.backend != "native" or not agent.install_shim:
        answer = "done: no host files (not the native backend)"
    elif pods:
        names = ", ".join(sorted(f"{p.metadata.namespace}/{p.metadata.name}" for p in pods)[:5])
        answer = (
            f"done: host files kept in {agent.host_lib_dir}: {len(pods)} GPU pod(s) still run ({names}); "
            "remove the directory after they end"
        )
    else:
        removed = remove_shim(agent.host_lib_dir)
        answer = f"done: removed {', '.join(removed) or 'nothing (already gone)'} from {agent.host_lib_dir}"
    await agent.kube.withdraw_inventory(answer)
    agent.publish_inventory = False
    agent.log.info("Uninstall of node %s: %s", agent.node_name, answer)


# ---- the hook -------------------------------------------------------------------------------


def _ours(node: Any) -> bool:
    meta = node.metadata
    return L.NODE_GPU_LABEL in (meta.labels or {}) or L.NODE_GPUS_ANNOTATION in (meta.annotations or {})


async def run_hook(release: str, timeout_seconds: float, poll_seconds: float = 1.0) -> list[str]:
    """Ask every GPU node's agent to withdraw, wait for their answers, clean up after the silent
    ones; one line per node (what the hook prints)."""
    from kubernetes_asyncio import client

    from .kube import load_client_config

    await load_client_config()
    async with client.ApiClient() as api:
        core = client.CoreV1Api(api)
        nodes = [n.metadata.name for n in (await core.list_node()).items if _ours(n)]
        for name in nodes:
            await core.patch_node(name, {"metadata": {"annotations": {L.NODE_UNINSTALL_ANNOTATION: release}}})
        answers: dict[str, str] = {}
        deadline = time.monotonic() + timeout_seconds
        while len(answers) < len(nodes) and time.monotonic() < deadline:
            await asyncio.sleep(poll_seconds)
            for name in nodes:
                if name not in answers:
                    node = await core.read_node(name)
                    value = (node.metadata.annotations or {}).get(L.NODE_UNINSTALL_ANNOTATION, "")
                    if value.startswith("done"):
                        answers[name] = value
        lines = []
        for name in nodes:
            body = {
                "metadata": {
                    "labels": {L.NODE_GPU_LABEL: None},
                    "annotations": {L.NODE_GPUS_ANNOTATION: None, L.NODE_GPU_HEALTH_ANNOTATION: None,
                                    L.NODE_UNINSTALL_ANNOTATION: None},
                }
            }
            await core.patch_node(name, body)
            if name in answers:
                lines.append(f"node {name}: {answers[name]}")
            else:
                lines.append(
                    f"node {name}: its agent did not answer within {timeout_seconds:g} s; label and inventory "
                    "removed, host files left (remove the node agent's host directory by hand)"
                )
        return lines


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m libvgpu.agent.uninstall",
        description="The chart's pre-delete hook: have every GPU node's agent remove its host files, "
        "label and inventory (see the module's docstring).",
    )
    parser.add_argument("--release", required=True, help="the Helm release being uninstalled")
    parser.add_argument(
        "--timeout-seconds", type=float, default=90.0, help="how long to wait for the agents (default 90)"
    )
    args = parser.parse_args(argv)
    try:
        lines = asyncio.run(run_hook(args.release, args.timeout_seconds))
    except Exception as e:  # the uninstall goes on: say what was not done
        print(f"elastic-gpu uninstall hook: could not clean the GPU nodes ({e}); remove the node label "
              f"{L.NODE_GPU_LABEL} and annotation {L.NODE_GPUS_ANNOTATION} by hand", file=sys.stderr)
        return
    print("\n".join(lines) or "no GPU node carried the elastic-gpu inventory")


if __name__ == "__main__":
    main()
