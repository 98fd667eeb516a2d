"""The Kubernetes emulator's own share of a pod's start, quiet and with the CPUs busy.

    python bench/kubeemu_pod_start.py [--pods 20] [--hogs 2] [--kinds host,image,init,gpu]

Pods of three kinds, each started and stopped one after another, ``--pods`` of each:

- ``host``: one container of an image the emulator maps to this machine's environment, running
  ``sleep`` (no readiness probe);
- ``image``: one container of an image with a filesystem of its own (a small one made of this
  machine's sh and sleep, tests/kubeemu/helpers.py tiny_image: the container's root is an overlay
  of that image), its ENTRYPOINT ``sh -c`` with ``exec sleep 600``;
- ``init``: as ``image``, after an init container of the same image that runs ``true``, as our GPU
  pods have one;
- ``gpu``: as ``init``, shaped like the end-to-end test's kernel pod (tests/helm/test_z2jh_e2e.py):
  the node's card by ``NVIDIA_VISIBLE_DEVICES`` (the emulator's NVIDIA runtime gives the container
  a /dev of its own), a memory limit, uid 1000, a ConfigMap volume and the service account's
  token, while a client process watches the namespace's pods and events as KubeSpawner's
  reflectors do.

For each pod the kubelet's timeline (tests/kubeemu/podstart.py, which defines what counts as the
emulator's share) gives the emulator's seconds from the create call to the container's process
(an init container's own run excluded, printed apart as ``init_program``), and from Running to
Ready; the steps of the create -> process part are printed too: API server and scheduler until
the kubelet takes the pod (``to_kubelet``), its volumes and hosts file (``volumes``), until it
asks the runtime for the container (``to_runtime``: image, environment, mounts; init containers
between), the runtime until the program runs (``runtime``; Timeline.split); the runtime's part by
its own steps (``runtime_steps``: the server forking it, its namespaces, pid 1's fork and the
root's mounts, pid 1 until the exec, and of that how long after the root was mounted pid 1 had
joined its memory cgroup (its fork included); Timeline.runtime_split); and CPU against run-queue wait (``sched``:
the kubelet's thread, the runtimes and pid 1s; Timeline.sched): a wait near the step's wall time
says the machine's CPUs were taken, not that the emulator computed. All of it quiet, then again
with ``--hogs`` processes of ``yes >/dev/null`` on the CPUs (``busy``; in this process's session,
as a CI run's other test processes are in the test's). Lines:

    kubeemu_pod_start <host|image|init> <quiet|busy> create_to_process_p50_s=... p95_s=... max_s=...
        running_to_ready_max_s=... init_program_p50_s=... full_collections_in_starts=N/M
        steps_p50_s=to_kubelet:...,volumes:...,...
        runtime_steps_p50_s=server:...,namespaces:...,rootfs:...,pid1:...,cgroup_late:...
        sched_p50_s=kubelet_cpu:...,kubelet_wait:...,runtime_cpu:...,runtime_wait:...
      slowest: <that kind's slowest pod's own line, Timeline.line>

and the ratios busy/quiet of the create -> process p50 of each kind. ``full_collections_in_starts``:
of the M full collections of the interpreter's cyclic garbage collector while that kind's pods
ran (this process's, which the emulator shares), the N that began inside a pod's create ->
process (each stops the kubelet's thread while it walks every object).
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.kubeemu import KubeEmulator  # noqa: E402
from tests.kubeemu.helpers import http, pod, tiny_image  # noqa: E402
from tests.kubeemu.podstart import Timeline, now  # noqa: E402

TINY = "registry.bench/tiny:1"
KINDS = ("host", "image", "init", "gpu")
CARD = "GPU-00000000-0000-0000-0000-00000000be7c"


def manifest(kind: str, name: str) -> dict:
    if kind == "host":
        return pod(name, ["sleep", "600"])
    m = pod(name)
    m["spec"]["containers"][0] = {"name": "main", "image": TINY, "args": ["exec sleep 600"]}
    if kind in ("init", "gpu"):
        m["spec"]["initContainers"] = [{"name": "prepare", "image": TINY, "args": ["true"]}]
    if kind == "gpu":
        m["spec"]["securityContext"] = {"runAsUser": 1000, "runAsGroup": 100, "fsGroup": 100}
        m["spec"]["volumes"] = [{"name": "settings", "configMap": {"name": "settings"}}]
        m["spec"]["containers"][0].update({
            "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": CARD},
                    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
            "resources": {"limits": {"memory": "1Gi"}},
            "volumeMounts": [{"name": "settings", "mountPath": "/etc/settings"}]})
    return m


#: a client process (as the hub) watching the namespace's pods and events, as KubeSpawner's reflectors
WATCHER = """
import sys, threading, kubernetes
api = kubernetes.config.new_client_from_config(sys.argv[1])
core = kubernetes.client.CoreV1Api(api)

def watch(list_fn):
    while True:
        for _ in kubernetes.watch.Watch().stream(list_fn, "default", timeout_seconds=30):
            pass

for fn in (core.list_namespaced_pod, core.list_namespaced_event):
    threading.Thread(target=watch, args=(fn,), daemon=True).start()
print("watching", flush=True)
threading.Event().wait()
"""


#: the interpreter's full collections (CLOCK_BOOTTIME moments each began): the emulator shares
#: this process, and one walks all its objects with the kubelet's thread stopped
FULL_COLLECTIONS: list[float] = []


def _on_collection(phase: str, info: dict) -> None:
    if phase == "start" and info["generation"] == 2:
        FULL_COLLECTIONS.append(now())


def full_collections(timelines: list[Timeline]) -> tuple[int, int]:
    """(full collections that began inside a pod's create -> process, all of them) while
    ``timelines``' pods ran."""
    windows = [(t.created, t.created + sum(t.create_to_process())) for t in timelines]
    during = [c for c in FULL_COLLECTIONS if windows[0][0] <= c <= timelines[-1].ready]
    inside = [c for c in during if any(a <= c <= b for a, b in windows)]
    return len(inside), len(during)


def watchers(emu: KubeEmulator) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", WATCHER, emu.kubeconfig_path], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "watching"
    return proc


def measure(emu: KubeEmulator, kind: str, count: int, tag: str) -> list[Timeline]:
    emu.gpu_uuids = (CARD,) if kind == "gpu" else ()  # the node's NVIDIA runtime, for that kind
    client = watchers(emu) if kind == "gpu" else None
    try:
        return _measure(emu, kind, count, tag)
    finally:
        if client is not None:
            client.kill()
            client.wait()


def _measure(emu: KubeEmulator, kind: str, count: int, tag: str) -> list[Timeline]:
    """Each pod created and deleted through the API server (as a client process would: the
    emulator's thread does the work, not this one, which holds no lock and no GIL meanwhile)."""
    out = []
    pods = "/api/v1/namespaces/default/pods"
    for i in range(count):
        name = f"{kind}-{tag}-{i}"
        code, created = http(emu, "POST", pods, manifest(kind, name))
        assert code == 201, (code, created)
        uid = created["metadata"]["uid"]

        def ready(uid: str = uid) -> Timeline | None:
            t = emu.kubelet.timelines.get(uid)
            return t if t is not None and t.ready is not None else None

        out.append(emu.wait_for(ready, timeout=60, interval=0.05, message=f"{name} to be ready"))
        code, _ = http(emu, "DELETE", f"{pods}/{name}", {"gracePeriodSeconds": 0})
        assert code == 200, code
        emu.wait_for(lambda n=name: http(emu, "GET", f"{pods}/{n}")[0] == 404, timeout=60, interval=0.05,
                     message=f"{name} to go")
    return out


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def report(kind: str, tag: str, timelines: list[Timeline]) -> float:
    parts = [t.create_to_process() for t in timelines]
    emulator = [e for e, _ in parts]
    program = [prog for _, prog in parts]
    to_ready = [t.running_to_ready() for t in timelines]
    p50 = statistics.median(emulator)
    line = (f"kubeemu_pod_start {kind} {tag} create_to_process_p50_s={p50:.3f} p95_s={p(emulator, 0.95):.3f} "
            f"max_s={max(emulator):.3f} running_to_ready_max_s={max(to_ready):.3f} "
            f"init_program_p50_s={statistics.median(program):.3f} "
            "full_collections_in_starts={}/{}".format(*full_collections(timelines)))
    for name, parts in (("steps", [t.split() for t in timelines]),
                        ("runtime_steps", [t.runtime_split() for t in timelines]),
                        ("sched", [t.sched() for t in timelines])):
        parts = [x for x in parts if x is not None]
        if parts:
            line += f" {name}_p50_s=" + ",".join(
                f"{k}:{statistics.median(x[k] for x in parts):.3f}" for k in parts[0])
    print(line, flush=True)
    slowest = max(timelines, key=lambda t: t.create_to_process()[0])
    print(f"  slowest: {slowest.line()}", flush=True)
    return p50


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pods", type=int, default=20)
    ap.add_argument("--hogs", type=int, default=2)
    ap.add_argument("--kinds", default=",".join(KINDS), help="of " + ", ".join(KINDS))
    args = ap.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    if not kinds or set(kinds) - set(KINDS):
        ap.error(f"--kinds: a comma-separated list of {', '.join(KINDS)}")
    # grace 0 deletes: the kubelet's note that a pid 1 without a SIGTERM handler is killed is moot
    logging.getLogger("kubeemu.kubelet").setLevel(logging.ERROR)
    gc.callbacks.append(_on_collection)
    p50s: dict[tuple[str, str], float] = {}
    with KubeEmulator() as emu, tempfile.TemporaryDirectory() as tmp:
        emu.images[TINY] = tiny_image(Path(tmp) / "rootfs", ("sh", "sleep", "true"))
        emu.create({"metadata": {"name": "settings"}, "data": {"limit": "5Gi"}}, "configmaps")
        for kind in kinds:
            measure(emu, kind, 1, "warm")  # the netshim build, first imports, the image's pages
        for kind in kinds:
            p50s[kind, "quiet"] = report(kind, "quiet", measure(emu, kind, args.pods, "quiet"))
        hogs = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(args.hogs)]
        try:
            for kind in kinds:
                p50s[kind, "busy"] = report(kind, "busy", measure(emu, kind, args.pods, "busy"))
        finally:
            for h in hogs:
                h.kill()
                h.wait()
    for kind in kinds:
        ratio = p50s[kind, "busy"] / p50s[kind, "quiet"]
        print(f"kubeemu_pod_start {kind} busy/quiet create_to_process_p50={ratio:.2f}")


if __name__ == "__main__":
    main()
