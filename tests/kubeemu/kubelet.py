"""The "kubelet": runs each pod as a container on this machine (see README.md in this folder).

* **Container.** ``runtime.py`` starts the first container in its own mount, uts, ipc and pid
  namespaces (pid 1 is the container's first process, the hostname is the pod name), on a
  copy-on-write overlay of this machine's root filesystem (the test environment is the
  image; ``images.py`` says which user, home and environment each image name has, and
  unknown images fail to pull). Volumes are materialised under the pod directory and
  bind-mounted at their mountPath (``readOnly``, ``subPath``); the pod's ``/etc/hosts`` names
  the pod and the Services; ``runAsUser``/``runAsGroup``/``fsGroup``/``runAsNonRoot`` and
  ``resources.limits.memory`` (a memory cgroup, ``OOMKilled``) are honoured.
* **Network.** Each pod gets its own loopback address from ``pod_network`` (127.0.0.0/8 all
  routes to ``lo`` on Linux), reported as ``status.podIP``; ``netshim.c``, preloaded into
  every container, makes binds to 0.0.0.0/127.0.0.1 bind that address, so ports never
  collide between pods and a pod's "localhost" is its own.
* Only the first container runs a process; other containers are reported running and ready.
  Init containers with a command run to completion first. Readiness and liveness probes
  (httpGet, tcpSocket, exec) reach only the pod's own processes.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import gc
import ipaddress
import json
import logging
import math
import os
import random
import re
import shutil
import signal
import sys
import urllib.error
import urllib.request
import uuid
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import cgroups, quantity
from . import container as ctr
from .cgroups import MemoryCgroup
from .devices import visible_minors
from .errors import ApiError
from .images import Image, lookup, pull_error
from .podstart import Timeline, now
from .quota import is_terminal
from .resources import BY_KEY, ResourceType
from .runtime import schedstat
from .scheduler import insufficient, matches_node_selector, set_condition
from .store import Event, clone, rfc3339

if TYPE_CHECKING:
    from .emulator import KubeEmulator

log = logging.getLogger("kubeemu.kubelet")
PODS = BY_KEY[("", "pods")]
SECRETS = BY_KEY[("", "secrets")]
CONFIGMAPS = BY_KEY[("", "configmaps")]
BASE_ENV_KEYS = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "PYTHONPATH", "VIRTUAL_ENV",
                 "TMPDIR", "LD_LIBRARY_PATH", "PYTHONDONTWRITEBYTECODE", "COVERAGE_PROCESS_START")


class PrepareError(Exception):
    """A container cannot start yet (missing secret, failed mount); retried like the kubelet."""

    def __init__(self, reason: str, message: str, event_reason: str = "Failed") -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.event_reason = event_reason


def go_quote(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _field_ref(pod: dict, path: str) -> str:
    meta = pod["metadata"]
    status = pod.get("status") or {}
    spec = pod.get("spec") or {}
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    if path in ("metadata.labels", "metadata.annotations"):
        items = meta.get(path.split(".")[1]) or {}
        return "\n".join(f"{k}={go_quote(v)}" for k, v in sorted(items.items()))
    simple = {
        "metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"), "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.hostIP": status.get("hostIP"), "status.podIP": status.get("podIP"),
        "status.hostIPs": ",".join(i["ip"] for i in status.get("hostIPs") or []),
        "status.podIPs": ",".join(i["ip"] for i in status.get("podIPs") or []),
    }
    if path not in simple:
        raise PrepareError("CreateContainerConfigError",
                           f"unsupported fieldRef fieldPath: {path}")
    return simple[path] or ""


def _resource_ref(pod: dict, ref: dict, default_container: str, node: dict | None) -> str:
    cname = ref.get("containerName") or default_container
    container = next((c for c in pod["spec"]["containers"] if c["name"] == cname), None)
    if container is None:
        raise PrepareError("CreateContainerConfigError",
                           f"resourceFieldRef: container {cname} not found")
    res = ref.get("resource", "")
    kind, _, name = res.partition(".")
    value = ((container.get("resources") or {}).get(kind) or {}).get(name)
    if value is None:
        alloc = ((node or {}).get("status") or {}).get("allocatable") or {}
        value = alloc.get(name, "0") if kind == "limits" else "0"
    q = quantity.parse(value)
    divisor = quantity.parse(ref.get("divisor") or "1")
    if divisor == 0:
        divisor = Fraction(1)
    return str(math.ceil(q / divisor))


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion: known vars are substituted, $$ escapes, others stay."""
    out, i = [], 0
    while i < len(value):
        if value.startswith("$$", i):
            out.append("$")
            i += 2
        elif value.startswith("$(", i):
            end = value.find(")", i + 2)
            if end == -1:
                out.append(value[i:])
                break
            name = value[i + 2:end]
            out.append(env[name] if name in env else value[i:end + 1])
            i = end + 1
        else:
            out.append(value[i])
            i += 1
    return "".join(out)


class PodRuntime:
    """One pod instance (one uid) on the emulated node."""

    def __init__(self, kubelet: Kubelet, pod: dict) -> None:
        self.kubelet = kubelet
        self.emu = kubelet.emu
        meta = pod["metadata"]
        self.ns, self.name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.node = pod["spec"]["nodeName"]
        self.dir = self.emu.data_dir / "pods" / self.ns / f"{self.name}-{self.uid[:8]}"
        self.ip: str | None = None
        self.proc: ctr.RuntimeProcess | None = None  # the runtime of the container
        self.pid1: int | None = None  # host pid of the running container's pid 1
        self.cgroup: MemoryCgroup | None = None
        self.run_ctx: dict[str, Any] | None = None  # env, identity ... for exec and probes
        self.hosts_path = self.dir / "etc-hosts"
        self.attempt = 0
        self.runs: dict[str, int] = {}  # containers started, per container name
        self.sa_token: str | None = None
        self.pulled: set[str] = set()
        self.terminating = asyncio.Event()
        self.kill_at: float | None = None
        self.finished = False
        self.phase = "Pending"
        self.reason: str | None = None
        self.message: str | None = None
        self.start_time = rfc3339()
        self.cstatus: dict[str, dict] = {}
        self.init_status: dict[str, dict] = {}
        self.initialized = False
        self.task: asyncio.Task | None = None
        self._probe_tasks: list[asyncio.Task] = []
        self.proc_pids: tuple[int, int] | None = None
        self._last_event: dict[str, str] = {}
        self.timeline = kubelet.timeline_for(pod)
        spec = pod["spec"]
        self.containers = [c["name"] for c in spec.get("containers") or []]
        for c in spec.get("containers") or []:
            self.cstatus[c["name"]] = self._waiting(c, "ContainerCreating")
        for c in spec.get("initContainers") or []:
            self.init_status[c["name"]] = self._waiting(c, "PodInitializing")

    # ------------------------------------------------------------ helpers

    @staticmethod
    def _waiting(c: dict, reason: str, message: str | None = None) -> dict:
        state: dict[str, Any] = {"reason": reason}
        if message:
            state["message"] = message
        return {"name": c["name"], "image": c.get("image", ""), "imageID": "", "ready": False,
                "started": False, "restartCount": 0, "state": {"waiting": state},
                "lastState": {}}

    def pod(self) -> dict | None:
        try:
            pod = self.emu.store.get(PODS, self.ns, self.name)
        except ApiError:
            return None
        return pod if pod["metadata"]["uid"] == self.uid else None

    def log_path(self, container: str, previous: bool = False) -> Path | None:
        """The log of the container's current run (previous: the run before), or None. As the
        kubelet, only those two are kept."""
        n = self.runs.get(container, 0) - (1 if previous else 0)
        return self.dir / "logs" / f"{container}-{n}.log" if n >= 1 else None

    def event(self, reason: str, message: str, type: str = "Normal",
              container: str | None = None, once: bool = False) -> None:
        if once and self._last_event.get(reason) == message:
            return
        self._last_event[reason] = message
        pod = self.emu.store.raw_object("pods", self.ns, self.name)  # read only: no copy
        if pod is not None and pod["metadata"]["uid"] == self.uid:
            self.emu.record_event(pod, reason, message, type=type, component="kubelet",
                                  host=self.node,
                                  field_path=f"spec.containers{{{container}}}" if container
                                  else None)

    def push_status(self) -> None:
        def fn(p: dict) -> None:
            st = p.setdefault("status", {})
            st["phase"] = self.phase
            if self.reason:
                st["reason"] = self.reason
                st["message"] = self.message or ""
            st["hostIP"] = self.kubelet.host_ip
            st["hostIPs"] = [{"ip": self.kubelet.host_ip}]
            if self.ip:
                st["podIP"] = self.ip
                st["podIPs"] = [{"ip": self.ip}]
            st["startTime"] = self.start_time
            st["containerStatuses"] = [copy.deepcopy(self.cstatus[n]) for n in self.containers]
            if self.init_status:
                st["initContainerStatuses"] = [copy.deepcopy(s) for s in
                                               self.init_status.values()]
            ready = self.phase == "Running" and all(
                s["ready"] for s in self.cstatus.values())
            set_condition(p, "PodReadyToStartContainers", "True" if self.ip else "False")
            set_condition(p, "Initialized", "True" if self.initialized else "False",
                          None if self.initialized else "ContainersNotInitialized",
                          None if self.initialized else "containers with incomplete status: ["
                          + " ".join(self.init_status) + "]")
            not_ready = [n for n in self.containers if not self.cstatus[n]["ready"]]
            reason = None if ready else ("PodCompleted" if self.phase in ("Succeeded", "Failed")
                                         else "ContainersNotReady")
            msg = None if ready or reason == "PodCompleted" else (
                "containers with unready status: [" + " ".join(not_ready) + "]")
            set_condition(p, "Ready", "True" if ready else "False", reason, msg)
            set_condition(p, "ContainersReady", "True" if ready else "False", reason, msg)
            set_condition(p, "PodScheduled", "True")
            order = ["PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady",
                     "PodScheduled"]
            st["conditions"].sort(key=lambda c: order.index(c["type"])
                                  if c["type"] in order else len(order))

        self.emu.store.mutate(PODS, self.ns, self.name, fn, uid=self.uid, result=False)
        if self.phase == "Running":
            t = self.timeline
            t.running = t.running or now()
            if t.ready is None and all(s["ready"] for s in self.cstatus.values()):
                t.ready = now()

    # ------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        try:
            await self._run()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("kubelet failed running pod %s/%s", self.ns, self.name)
        finally:
            await self._stop_probes()
            await self._kill_group(force=True)
            self.finished = True
            self.kubelet.release_ip(self.ip)
            pod = self.pod()
            if pod is not None and pod["metadata"].get("deletionTimestamp"):
                # The kubelet's final delete once the containers are gone.
                with contextlib.suppress(ApiError):
                    self.emu.store.delete(PODS, self.ns, self.name, 0,
                                          preconditions={"uid": self.uid})
            self.kubelet.start_done(self.uid)
            self.kubelet.runtime_done(self)

    async def _run(self) -> None:
        pod = self.pod()
        if pod is None:
            return
        if not self._admit(pod):
            return
        self.timeline.steps["kubelet"] = now()
        self.timeline.loop_mark("begin", schedstat("thread-self"))
        self.kubelet.starting.add(self.uid)
        self.ip = self.kubelet.allocate_ip()
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "logs").mkdir(exist_ok=True)
        self.push_status()
        spec = pod["spec"]
        # volumes and mounts (retry until they can be set up)
        while True:
            if self.terminating.is_set():
                return
            pod = self.pod()
            if pod is None:
                return
            try:
                self.materialize_volumes(pod)
                break
            except PrepareError as e:
                self.event(e.event_reason, e.message, "Warning", once=True)
                await self._sleep(1.0)
        self.write_hosts()
        self.timeline.steps["volumes"] = now()
        # init containers
        for c in spec.get("initContainers") or []:
            ok = await self._run_init(c)
            if not ok:
                return
        self.initialized = True
        container = spec["containers"][0]
        policy = spec.get("restartPolicy", "Always")
        backoff = self.emu.restart_backoff_seconds
        restarts = 0
        while not self.terminating.is_set():
            started = await self._start_main(container, restarts)
            if started is None:
                return  # terminating while waiting for config
            code, reason, message, started_at = started
            if self.terminating.is_set():
                self._set_terminated(container, code, reason, started_at, message)
                return
            self._set_terminated(container, code, reason, started_at, message)
            restart = policy == "Always" or (policy == "OnFailure" and code != 0)
            if not restart:
                for n in self.containers[1:]:
                    self._set_terminated({"name": n}, 0, "Completed", started_at)
                self.phase = "Succeeded" if code == 0 else "Failed"
                self.push_status()
                return
            restarts += 1
            st = self.cstatus[container["name"]]
            st["lastState"] = {"terminated": st["state"]["terminated"]}
            st["restartCount"] = restarts
            delay = min(backoff * (2 ** (restarts - 1)), 300.0)
            st["state"] = {"waiting": {
                "reason": "CrashLoopBackOff",
                "message": f"back-off {int(delay)}s restarting failed container="
                           f"{container['name']} pod={self.name}_{self.ns}({self.uid})"}}
            st["ready"] = False
            st["started"] = False
            self.push_status()
            self.event("BackOff", f"Back-off restarting failed container {container['name']} "
                       f"in pod {self.name}_{self.ns}({self.uid})", "Warning",
                       container["name"])
            await self._sleep(delay)

    def _admit(self, pod: dict) -> bool:
        """Kubelet admission: a pod bound straight to a node must fit on it."""
        node = self.kubelet.node(self.node)
        if node is None:
            return True
        reason = message = None
        if not matches_node_selector(pod, node):
            reason, message = ("NodeAffinity",
                               "Pod was rejected: Predicate NodeAffinity failed: node(s) didn't "
                               "match Pod's node affinity/selector")
        else:
            with self.emu.store.lock:
                pods = [p for p in self.emu.store.raw_objects("pods")]
                short = insufficient(pod, node, pods)
            if short:
                res, req, used, cap = short[0]
                reason = f"OutOf{res}"
                message = (f"Pod was rejected: Node didn't have enough resource: {res}, "
                           f"requested: {quantity.fmt(req)}, used: {quantity.fmt(used)}, "
                           f"capacity: {quantity.fmt(cap)}")
        if reason is None:
            return True
        self.phase, self.reason, self.message = "Failed", reason, message
        for c in pod["spec"]["containers"]:
            self.cstatus[c["name"]] = self._waiting(c, "ContainerCreating")
            self.cstatus[c["name"]]["state"] = {}
        self.push_status()
        self.event(reason, message, "Warning")
        return False

    async def _pull(self, c: dict, statuses: dict[str, dict]) -> Image | None:
        """The container's image from the image table; ErrImagePull/ImagePullBackOff until then."""
        name, ref = c["name"], c.get("image", "")
        delay = self.emu.restart_backoff_seconds
        while not self.terminating.is_set():
            image = lookup(self.emu.images, ref)
            if image is not None:
                if ref not in self.pulled:
                    self.pulled.add(ref)
                    self.event("Pulled", f'Container image "{ref}" already present on machine',
                               container=name)
                return image
            self.event("Pulling", f'Pulling image "{ref}"', container=name)
            msg = pull_error(ref)
            statuses[name]["state"] = {"waiting": {"reason": "ErrImagePull", "message": msg}}
            self.push_status()
            self.event("Failed", msg, "Warning", name)
            self.event("Failed", "Error: ErrImagePull", "Warning", name)
            await self._sleep(delay)
            if self.terminating.is_set() or lookup(self.emu.images, ref) is not None:
                continue
            statuses[name]["state"] = {"waiting": {
                "reason": "ImagePullBackOff", "message": f'Back-off pulling image "{ref}"'}}
            self.push_status()
            self.event("BackOff", f'Back-off pulling image "{ref}"', "Normal", name)
            self.event("Failed", "Error: ImagePullBackOff", "Warning", name)
            await self._sleep(delay)
            delay = min(delay * 2, 300.0)
        return None

    def _end_container(self) -> None:
        self.pid1 = None
        if self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None

    async def _probe_loop(self, container: dict, probe: dict, kind: str) -> None:
        name = container["name"]
        await asyncio.sleep(probe.get("initialDelaySeconds", 0))
        successes = failures = 0
        period = max(probe.get("periodSeconds", 10), 0.1)
        while True:
            probed_at = now()
            ok, why = await self._probe_once(container, probe)
            st = self.cstatus[name]
            if ok:
                successes, failures = successes + 1, 0
                if (kind == "Readiness" and not st["ready"]
                        and successes >= probe.get("successThreshold", 1)):
                    st["ready"] = True
                    if self.timeline.ready is None:
                        self.timeline.probe = probed_at
                    self.push_status()
            else:
                failures, successes = failures + 1, 0
                self.event("Unhealthy", f"{kind} probe failed: {why}", "Warning", name)
                threshold = probe.get("failureThreshold", 3)
                if kind == "Readiness" and st["ready"] and failures >= threshold:
                    st["ready"] = False
                    self.push_status()
                if kind == "Liveness" and failures >= threshold:
                    self.event("Killing", f"Container {name} failed liveness probe, will be "
                               "restarted", container=name)
                    pod = self.pod() or {}
                    grace = (pod.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
                    self.kill_at = asyncio.get_running_loop().time() + grace
                    await self._kill_group(force=False)
                    return
            await asyncio.sleep(period)

    async def exec(self, argv: list[str], stdin: bool = False, merge_stderr: bool = False
                   ) -> asyncio.subprocess.Process | None:
        """A command in the running container (None when no container runs)."""
        ctx, pid1 = self.run_ctx, self.pid1
        if ctx is None or not pid1 or self.proc is None or self.proc.returncode is not None:
            return None
        return await ctr.exec_process(
            pid1, argv, ctx["env"], ctx["uid"], ctx["gid"], ctx["groups"], ctx["cwd"],
            str(self.cgroup.path) if self.cgroup else None, self.dir / "exec", stdin=stdin,
            merge_stderr=merge_stderr)

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.terminating.wait(), seconds)

    async def _run_init(self, c: dict) -> bool:
        name = c["name"]
        image = await self._pull(c, self.init_status)
        if image is None:
            return False
        while not self.terminating.is_set():
            pod = self.pod()
            if pod is None:
                return False
            try:
                run = self.prepare(pod, c, image)
            except PrepareError as e:
                self.init_status[name] = self._waiting(c, e.reason, e.message)
                self.push_status()
                self.event(e.event_reason, "Error: " + e.message, "Warning", name, once=True)
                await self._sleep(1.0)
                continue
            started_at = rfc3339()
            code = 0
            if run["argv"]:
                try:
                    proc, _ = await self._spawn(run, name, init=True)
                except ctr.StartFailed as e:
                    code = 128
                    self.event("Failed", f"Error: {e}", "Warning", name)
                else:
                    # as the kubelet reports an init container while it runs
                    self.init_status[name]["state"] = {"running": {"startedAt": started_at}}
                    self.push_status()
                    waiter = asyncio.ensure_future(proc.wait())
                    term = asyncio.ensure_future(self.terminating.wait())
                    await asyncio.wait({waiter, term}, return_when=asyncio.FIRST_COMPLETED)
                    term.cancel()
                    if not waiter.done():
                        await self._kill_group(force=False)
                        return False
                    code = waiter.result()
                    self.timeline.loop_mark("begin", schedstat("thread-self"))
                    self.timeline.ended(name, proc.exited)
                    self._end_container()
            st = self.init_status[name]
            st["state"] = {"terminated": {"exitCode": code,
                                          "reason": "Completed" if code == 0 else "Error",
                                          "startedAt": started_at, "finishedAt": rfc3339()}}
            if code == 0:
                st["ready"] = True
                self.push_status()
                return True
            if (pod["spec"].get("restartPolicy") or "Always") == "Never":
                self.phase = "Failed"
                self.push_status()
                return False
            st["restartCount"] += 1
            self.push_status()
            await self._sleep(self.emu.restart_backoff_seconds)
        return False

    async def _start_main(self, container: dict, restarts: int
                          ) -> tuple[int, str, str | None, str] | None:
        name = container["name"]
        image = await self._pull(container, self.cstatus)
        if image is None:
            return None
        while True:
            if self.terminating.is_set():
                return None
            pod = self.pod()
            if pod is None:
                return None
            try:
                run = self.prepare(pod, container, image)
                break
            except PrepareError as e:
                st = self.cstatus[name]
                st["state"] = {"waiting": {"reason": e.reason, "message": e.message}}
                self.push_status()
                self.event(e.event_reason, "Error: " + e.message, "Warning", name, once=True)
                await self._sleep(1.0)
        self._last_event.pop("Failed", None)
        self.event("Created", f"Created container: {name}", container=name)
        started_at = rfc3339()
        cid = "containerd://" + uuid.uuid4().hex
        if not run["argv"]:  # no command: a pause container (runs until stopped)
            run["argv"] = [sys.executable, "-I", "-S", "-c",
                           "import signal\nsignal.signal(signal.SIGTERM, lambda *a: exit(0))\n"
                           "while True: signal.pause()\n"]
        try:
            self.proc, self.pid1 = await self._spawn(run, name)
        except ctr.StartFailed as e:
            msg = ("failed to create containerd task: failed to create shim task: OCI runtime "
                   "create failed: runc create failed: unable to start container process: "
                   f"{e}: unknown")
            self.event("Failed", f"Error: {msg}", "Warning", name)
            self._end_container()
            return 128, "StartError", msg, started_at
        self.event("Started", f"Started container {name}", container=name)
        readiness = container.get("readinessProbe")
        for n in self.containers:
            st = self.cstatus[n]
            st["state"] = {"running": {"startedAt": started_at}}
            st["started"] = True
            st["ready"] = not (n == name and readiness)
            st["containerID"] = cid if n == name else "containerd://" + uuid.uuid4().hex
            st["imageID"] = f"docker.io/library/{st['image']}@sha256:" + "0" * 64
        self.phase = "Running"
        self.push_status()
        self._probe_tasks = []
        if readiness:
            self._probe_tasks.append(asyncio.ensure_future(
                self._probe_loop(container, readiness, "Readiness")))
        if container.get("livenessProbe"):
            self._probe_tasks.append(asyncio.ensure_future(
                self._probe_loop(container, container["livenessProbe"], "Liveness")))
        proc = self.proc
        waiter = asyncio.ensure_future(proc.wait())
        term = asyncio.ensure_future(self.terminating.wait())
        await asyncio.wait({waiter, term}, return_when=asyncio.FIRST_COMPLETED)
        term.cancel()
        if not waiter.done():
            await self._kill_group(force=False)
        code = await waiter
        await self._stop_probes()
        await self._kill_group(force=True)  # the container's other processes go with it
        oom = self.cgroup is not None and self.cgroup.oom_kills() > 0
        self._end_container()
        if code < 0:
            code = 128 - code  # the runtime itself was killed
        if oom:
            return 137, "OOMKilled", None, started_at
        reason = "Completed" if code == 0 else "Error"
        return code, reason, None, started_at

    def _set_terminated(self, container: dict, code: int, reason: str, started_at: str,
                        message: str | None = None) -> None:
        st = self.cstatus[container["name"]]
        term = {"exitCode": code, "reason": reason, "startedAt": started_at,
                "finishedAt": rfc3339(), "containerID": st.get("containerID", "")}
        if message:
            term["message"] = message
        st["state"] = {"terminated": term}
        st["ready"] = False
        st["started"] = False
        self.push_status()

    async def _spawn(self, run: dict, container: str, init: bool = False) -> tuple[ctr.RuntimeProcess, int]:
        """Start a container through the runtime; (its runtime, host pid of its pid 1)."""
        self.attempt += 1
        cdir = self.dir / "containers" / f"{container}-{self.attempt}"
        cdir.mkdir(parents=True, exist_ok=True)
        limit = run.pop("memory_limit", None)
        self.cgroup = None
        base = self.kubelet.cgroup_base
        if base is not None and limit:  # without a limit, nothing to enforce nor to report:
            # no cgroup to make, join (cgroup v1 waits for an RCU grace period) and remove
            self.cgroup = MemoryCgroup(base / f"{self.uid[:8]}-{self.attempt}", limit)
        elif limit:
            log.warning("pod %s/%s: no memory cgroup available; its limit is not enforced",
                        self.ns, self.name)
        spec = {**run, "rootfs": str(cdir / "rootfs"), "upper": str(cdir / "upper"),
                "work": str(cdir / "work"), "hostname": run["hostname"],
                "cgroup": str(self.cgroup.path) if self.cgroup else None}
        self.runs[container] = self.runs.get(container, 0) + 1
        logfile = self.dir / "logs" / f"{container}-{self.runs[container]}.log"
        logfile.parent.mkdir(parents=True, exist_ok=True)
        (logfile.parent / f"{container}-{self.runs[container] - 2}.log").unlink(missing_ok=True)
        spawned_at = now()
        self.timeline.loop_mark("spawn", schedstat("thread-self"))
        proc, pid1 = await ctr.start(self.kubelet.runtime_server, spec, cdir / "spec.json", logfile)
        self.timeline.started(container, init, spawned_at, proc.started, proc.marks, proc.sched)
        if not init:
            self.kubelet.start_done(self.uid)
        self.kubelet.pgids.add(proc.pid)
        self.proc_pids = (proc.pid, pid1)
        self.run_ctx = run
        log.info("pod %s/%s: started %s (pid %s) on %s", self.ns, self.name, run["argv"][0],
                 pid1, self.ip)
        return proc, pid1

    async def _kill_group(self, force: bool) -> None:
        proc = self.proc
        if proc is None:
            return
        pgid = proc.pid
        pid1 = self.pid1

        async def kill_all() -> None:
            # SIGKILL to the pid namespace's init takes everything in the container with it;
            # the runtime then reaps it and exits (killing the runtime first would leave pid 1
            # to the host's init, a zombie until that reaps it).
            # Once the runtime has exited, pid 1 is reaped (its pid may be reused): hands off.
            if proc.returncode is not None:
                return
            if pid1:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid1, signal.SIGKILL)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(proc.wait(), 3)
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, signal.SIGKILL)

        if force:
            if proc.returncode is None:
                await kill_all()
            if proc.returncode is None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(proc.wait(), 5)
            self.kubelet.pgids.discard(pgid)
            return
        # SIGTERM to the container's pid 1 only (through the runtime), as a runtime does
        loop = asyncio.get_running_loop()
        state = ctr.signal_state(pid1) if pid1 else None
        if state is not None and signal.SIGTERM not in state["caught"]:
            # as on a node, the kernel drops it (container.signal_state): say so, for whoever
            # wonders why the pod takes its whole grace period to go
            log.warning("pod %s/%s: its container's pid 1 (host pid %s, %s) has no SIGTERM "
                        "handler (yet) and does not get the SIGTERM; it is killed when its grace "
                        "period ends, in %.1fs", self.ns, self.name, pid1, state["state"],
                        max(0.0, (self.kill_at or loop.time()) - loop.time()))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pgid, signal.SIGTERM)
        while proc.returncode is None:
            remaining = (self.kill_at or loop.time()) - loop.time()
            if remaining <= 0:
                await kill_all()
                await proc.wait()
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(proc.wait(), min(remaining, 0.2))

    def request_termination(self, grace: float) -> None:
        loop = asyncio.get_running_loop()
        at = loop.time() + max(grace, 0)
        if self.kill_at is None or at < self.kill_at:
            self.kill_at = at
        if not self.terminating.is_set():
            self.terminating.set()
            for n in self.containers:
                if "running" in self.cstatus[n]["state"]:
                    self.event("Killing", f"Stopping container {n}", container=n)

    # ------------------------------------------------------------ probes and exec

    async def _probe_once(self, container: dict, probe: dict) -> tuple[bool, str]:
        timeout = probe.get("timeoutSeconds", 1)

        def port_of(port: Any) -> int:
            if isinstance(port, int):
                return port
            for p in container.get("ports") or []:
                if p.get("name") == port:
                    return int(p["containerPort"])
            return int(port)

        def refused(host: str, port: int) -> str | None:
            # Only the pod's own sockets answer on its address: something of another pod or
            # of the host listening on 0.0.0.0 must not make this pod look alive.
            if host == self.ip and self.ip and not ctr.listens(self.ip, port):
                return f"dial tcp {host}:{port}: connect: connection refused"
            return None

        try:
            if "httpGet" in probe:
                hg = probe["httpGet"]
                host = hg.get("host") or self.ip or ""
                port = port_of(hg.get("port"))
                why = refused(host, port)
                if why:
                    return False, f'Get "http://{host}:{port}{hg.get("path", "/")}": {why}'
                scheme = (hg.get("scheme") or "HTTP").lower()
                url = f"{scheme}://{host}:{port}{hg.get('path', '/')}"
                headers = {h["name"]: h["value"] for h in hg.get("httpHeaders") or []}

                def get() -> int:
                    req = urllib.request.Request(url, headers=headers)
                    import ssl
                    ctx = ssl._create_unverified_context()
                    try:
                        with urllib.request.urlopen(req, timeout=timeout, context=ctx) as r:
                            return r.status
                    except urllib.error.HTTPError as e:
                        return e.code

                code = await asyncio.get_running_loop().run_in_executor(None, get)
                if 200 <= code < 400:
                    return True, ""
                return False, f"HTTP probe failed with statuscode: {code}"
            if "tcpSocket" in probe:
                ts = probe["tcpSocket"]
                host = ts.get("host") or self.ip or ""
                port = port_of(ts.get("port"))
                why = refused(host, port)
                if why:
                    return False, why
                _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
                writer.close()
                return True, ""
            if "exec" in probe:
                argv = list(probe["exec"].get("command") or [])
                proc = await self.exec(argv, merge_stderr=True)
                if proc is None:
                    return False, "container is not running"
                try:
                    out, _ = await asyncio.wait_for(proc.communicate(), timeout)
                except asyncio.TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    await proc.wait()
                    return False, f"command {argv!r} timed out"
                err = ctr.exec_error(proc)
                if err:
                    return False, f"OCI runtime exec failed: exec failed: {err}: unknown"
                return proc.returncode == 0, out.decode(errors="replace")
        except Exception as e:  # connection refused, timeout ...
            return False, f"{type(e).__name__}: {e}"
        return True, ""

    async def _stop_probes(self) -> None:
        tasks, self._probe_tasks = self._probe_tasks, []
        for task in tasks:
            if task is asyncio.current_task():
                continue
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # ------------------------------------------------------------ files and env

    def _secret(self, name: str, optional: bool) -> dict[str, bytes] | None:
        try:
            s = self.emu.store.get(SECRETS, self.ns, name)
        except ApiError:
            if optional:
                return None
            raise PrepareError("CreateContainerConfigError", f'secret "{name}" not found',
                               ) from None
        return {k: base64.b64decode(v) for k, v in (s.get("data") or {}).items()}

    def _configmap(self, name: str, optional: bool) -> dict[str, bytes] | None:
        try:
            c = self.emu.store.get(CONFIGMAPS, self.ns, name)
        except ApiError:
            if optional:
                return None
            raise PrepareError("CreateContainerConfigError", f'configmap "{name}" not found',
                               ) from None
        out = {k: str(v).encode() for k, v in (c.get("data") or {}).items()}
        out.update({k: base64.b64decode(v) for k, v in (c.get("binaryData") or {}).items()})
        return out

    def build_env(self, pod: dict, container: dict) -> dict[str, str]:
        env: dict[str, str] = {}
        for src in container.get("envFrom") or []:
            prefix = src.get("prefix") or ""
            if src.get("configMapRef"):
                ref = src["configMapRef"]
                data = self._configmap(ref["name"], bool(ref.get("optional")))
            elif src.get("secretRef"):
                ref = src["secretRef"]
                data = self._secret(ref["name"], bool(ref.get("optional")))
            else:
                data = None
            for k, v in (data or {}).items():
                env[prefix + k] = v.decode(errors="replace")
        node = self.kubelet.node(self.node)
        for item in container.get("env") or []:
            name = item["name"]
            if "valueFrom" not in item or item.get("valueFrom") is None:
                env[name] = expand(item.get("value") or "", env)
                continue
            vf = item["valueFrom"]
            if vf.get("fieldRef"):
                env[name] = _field_ref(pod, vf["fieldRef"]["fieldPath"])
            elif vf.get("resourceFieldRef"):
                env[name] = _resource_ref(pod, vf["resourceFieldRef"], container["name"], node)
            elif vf.get("secretKeyRef") or vf.get("configMapKeyRef"):
                is_secret = bool(vf.get("secretKeyRef"))
                ref = vf["secretKeyRef"] if is_secret else vf["configMapKeyRef"]
                optional = bool(ref.get("optional"))
                data = (self._secret if is_secret else self._configmap)(ref["name"], optional)
                if data is None:
                    continue
                if ref["key"] not in data:
                    if optional:
                        continue
                    kind = "Secret" if is_secret else "ConfigMap"
                    raise PrepareError("CreateContainerConfigError",
                                       f"couldn't find key {ref['key']} in {kind} "
                                       f"{self.ns}/{ref['name']}")
                env[name] = data[ref["key"]].decode(errors="replace")
        return env

    def prepare(self, pod: dict, container: dict, image: Image) -> dict[str, Any]:
        """What the runtime needs to start a container: argv, env, identity, mounts ..."""
        spec_env = self.build_env(pod, container)
        try:
            uid, gid, groups = ctr.identity(pod, container, image)
        except ValueError as e:
            raise PrepareError("CreateContainerConfigError", str(e)) from None
        own_fs = image.rootfs is not None  # the image's filesystem, not this machine's
        if own_fs:  # only what the image says (containerd's default PATH when it says none)
            base = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
        else:
            base = {k: os.environ[k] for k in BASE_ENV_KEYS if k in os.environ}
            bindir = os.path.dirname(sys.executable)
            base["PATH"] = bindir + os.pathsep + base.get("PATH", os.defpath)
        hostname = pod["spec"].get("hostname") or self.name
        # the API server's address, as the kubelet injects it for in-cluster clients
        api = {"KUBERNETES_SERVICE_HOST": "127.0.0.1",
               "KUBERNETES_SERVICE_PORT": str(self.emu.tls_port),
               "KUBERNETES_SERVICE_PORT_HTTPS": str(self.emu.tls_port),
               "KUBERNETES_PORT": f"tcp://127.0.0.1:{self.emu.tls_port}"}
        env = {**base, "HOME": image.home, "HOSTNAME": hostname, **image.env,
               **self.emu.pod_env, **api, **spec_env}
        env.update({
            "KUBEEMU_POD_IP": self.ip or "", "KUBEEMU_POD_NAME": self.name,
            "KUBEEMU_POD_NAMESPACE": self.ns, "KUBEEMU_POD_UID": self.uid,
            "KUBEEMU_NODE_NAME": self.node,
        })
        command = [expand(a, env) for a in container.get("command") or []]
        args = [expand(a, env) for a in container.get("args") or []]
        argv = image.argv(command, args) if own_fs else command + args
        if own_fs and not argv:
            raise PrepareError("CreateContainerError", "failed to generate container spec: no command specified")
        mounts = [{"source": src, "target": dst} for src, dst in self.emu.node_mounts]
        mounts += self._mounts(pod, container)
        mounts.append({"source": str(self.hosts_path), "target": "/etc/hosts"})
        shim = self.kubelet.netshim
        if own_fs:  # the pod network library, where the container's preload names it
            mounts.append({"source": os.path.dirname(shim), "target": os.path.dirname(shim), "readOnly": True})
        files = []
        if any(m["target"] == "/etc/ld.so.preload" for m in mounts):
            env["LD_PRELOAD"] = shim + (":" + env["LD_PRELOAD"] if env.get("LD_PRELOAD") else "")
        else:
            host = ""
            with contextlib.suppress(OSError):
                host = Path(image.rootfs or "/", "etc/ld.so.preload").read_text()
            files.append({"path": "/etc/ld.so.preload",
                          "content": (host.rstrip("\n") + "\n" if host.strip() else "") + shim
                          + "\n"})
        files.append({"path": "/etc/hostname", "content": hostname + "\n"})
        limit = ((container.get("resources") or {}).get("limits") or {}).get("memory")
        gpu_minors = None
        if self.emu.gpu_uuids:  # the NVIDIA runtime's hook: the cards named at the container's start
            try:
                gpu_minors = visible_minors(env.get("NVIDIA_VISIBLE_DEVICES"), self.emu.gpu_uuids)
            except ValueError as e:
                raise PrepareError("RunContainerError", f"failed to create containerd task: {e}") from None
        return {
            "gpu_minors": gpu_minors,
            "argv": argv, "env": env, "cwd": container.get("workingDir") or image.workdir,
            "uid": uid, "gid": gid, "groups": groups, "hostname": hostname,
            "mounts": mounts, "files": files, "hide": [] if own_fs else [str(self.emu.data_dir)],
            "dirs": [{"path": image.home, "uid": image.uid, "gid": image.gid}],
            "traverse": [] if own_fs else self.kubelet.interpreter_dirs, "lower": image.rootfs,
            "readOnlyRoot": ctr.read_only_root(container),
            "memory_limit": int(quantity.parse(limit)) if limit else None,
        }

    def volume_dir(self, name: str) -> Path:
        return self.dir / "volumes" / name

    def materialize_volumes(self, pod: dict, only: set[str] | None = None) -> None:
        for v in pod["spec"].get("volumes") or []:
            kinds = [k for k in ("secret", "configMap", "downwardAPI", "projected")
                     if v.get(k) is not None]
            if only is not None and not (set(kinds) & only):
                continue
            self._materialize(pod, v)
            self._set_ownership(pod, v)

    def _set_ownership(self, pod: dict, v: dict) -> None:
        """emptyDir is world-writable; with fsGroup, volumes belong to that group (setgid)."""
        path = self.volume_dir(v["name"])
        if v.get("hostPath") is not None or self._host_path_claim(v):
            return  # the kubelet manages no hostPath volume's ownership (nor a hostPath PV's)
        writable = not any(v.get(k) is not None for k in ("secret", "configMap", "downwardAPI",
                                                            "projected"))
        if v.get("emptyDir") is not None or not (set(v) - {"name"}):
            os.chmod(path, 0o777)
        group = (pod["spec"].get("securityContext") or {}).get("fsGroup")
        if group is None:
            return
        real = path.resolve()
        for dirpath, _dirs, filenames in os.walk(real):
            os.chown(dirpath, -1, int(group))
            os.chmod(dirpath, os.stat(dirpath).st_mode | (0o2070 if writable else 0o2050))
            for f in filenames:
                fp = os.path.join(dirpath, f)
                if os.path.islink(fp):
                    continue
                os.chown(fp, -1, int(group))
                os.chmod(fp, os.stat(fp).st_mode | (0o060 if writable else 0o040))

    def _write_files(self, target: Path, files: dict[str, tuple[bytes, int]]) -> None:
        target.mkdir(parents=True, exist_ok=True)
        for rel, (data, mode) in files.items():
            path = target / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_bytes(data)
            os.chmod(tmp, mode)
            os.replace(tmp, path)

    def _keyed_files(self, data: dict[str, bytes], items: list[dict] | None, default_mode: int,
                     what: str, optional: bool) -> dict[str, tuple[bytes, int]]:
        if not items:
            return {k: (v, default_mode) for k, v in data.items()}
        out = {}
        for item in items:
            if item["key"] not in data:
                if optional:
                    continue
                raise PrepareError("FailedMount", f"references non-existent {what} key: "
                                   f"{item['key']}", "FailedMount")
            out[item["path"]] = (data[item["key"]], item.get("mode") or default_mode)
        return out

    def _downward_files(self, pod: dict, items: list[dict], default_mode: int
                        ) -> dict[str, tuple[bytes, int]]:
        out = {}
        node = self.kubelet.node(self.node)
        for item in items or []:
            if item.get("fieldRef"):
                value = _field_ref(pod, item["fieldRef"]["fieldPath"])
            else:
                value = _resource_ref(pod, item.get("resourceFieldRef") or {},
                                      pod["spec"]["containers"][0]["name"], node)
            out[item["path"]] = (value.encode(), item.get("mode") or default_mode)
        return out

    def _materialize(self, pod: dict, v: dict) -> None:
        target = self.volume_dir(v["name"])
        fail = f'MountVolume.SetUp failed for volume "{v["name"]}" : '
        try:
            if v.get("secret") is not None:
                s = v["secret"]
                data = self._secret(s["secretName"], bool(s.get("optional")))
                files = self._keyed_files(data or {}, s.get("items"), s.get("defaultMode", 0o644),
                                          "secret", bool(s.get("optional")))
                self._write_files(target, files)
            elif v.get("configMap") is not None:
                c = v["configMap"]
                data = self._configmap(c["name"], bool(c.get("optional")))
                files = self._keyed_files(data or {}, c.get("items"),
                                          c.get("defaultMode", 0o644), "configmap",
                                          bool(c.get("optional")))
                self._write_files(target, files)
            elif v.get("downwardAPI") is not None:
                d = v["downwardAPI"]
                self._write_files(target, self._downward_files(pod, d.get("items") or [],
                                                               d.get("defaultMode", 0o644)))
            elif v.get("projected") is not None:
                pr = v["projected"]
                mode = pr.get("defaultMode", 0o644)
                files: dict[str, tuple[bytes, int]] = {}
                for src in pr.get("sources") or []:
                    if src.get("secret"):
                        s = src["secret"]
                        data = self._secret(s["name"], bool(s.get("optional")))
                        files.update(self._keyed_files(data or {}, s.get("items"), mode,
                                                       "secret", bool(s.get("optional"))))
                    elif src.get("configMap"):
                        c = src["configMap"]
                        data = self._configmap(c["name"], bool(c.get("optional")))
                        files.update(self._keyed_files(data or {}, c.get("items"), mode,
                                                       "configmap", bool(c.get("optional"))))
                    elif src.get("downwardAPI"):
                        files.update(self._downward_files(pod, src["downwardAPI"].get("items"),
                                                          mode))
                    elif src.get("serviceAccountToken"):
                        files[src["serviceAccountToken"].get("path", "token")] = (
                            self._service_account_token(pod).encode(), mode)
                self._write_files(target, files)
            elif v.get("hostPath") is not None:
                self._host_path(v, target)
            elif v.get("persistentVolumeClaim") is not None:
                claim = v["persistentVolumeClaim"]["claimName"]
                try:
                    pvc = self.emu.store.get(BY_KEY[("", "persistentvolumeclaims")], self.ns,
                                             claim)
                except ApiError:
                    raise PrepareError("FailedMount",
                                       f'persistentvolumeclaim "{claim}" not found',
                                       "FailedMount") from None
                pv = self._bound_volume(pvc)
                if pv is not None and (pv.get("spec") or {}).get("hostPath") is not None:
                    # a hostPath PersistentVolume: the directory of the node the pod runs on
                    self._host_path({"hostPath": pv["spec"]["hostPath"]}, target)
                    return
                real = (self.emu.data_dir / "pvcs" / self.ns
                        / f"{claim}-{pvc['metadata']['uid'][:8]}")
                real.mkdir(parents=True, exist_ok=True)
                self._link(target, real)
            else:
                target.mkdir(parents=True, exist_ok=True)  # emptyDir and the rest
        except PrepareError as e:
            if e.reason == "CreateContainerConfigError":
                raise PrepareError("FailedMount", fail + e.message, "FailedMount") from None
            if not e.message.startswith("MountVolume"):
                raise PrepareError(e.reason, fail + e.message, e.event_reason) from None
            raise

    def _service_account_token(self, pod: dict) -> str:
        """The pod's projected token: its service account's, authorized by RBAC (one per pod,
        as the kubelet's TokenRequest for the pod)."""
        if self.sa_token is None:
            sa = pod["spec"].get("serviceAccountName") or "default"
            self.sa_token = self.emu.authorizer.issue(self.ns, sa)
        return self.sa_token

    def _host_path_claim(self, v: dict) -> bool:
        """Whether volume ``v`` is a claim bound to a hostPath PersistentVolume."""
        if v.get("persistentVolumeClaim") is None:
            return False
        try:
            pvc = self.emu.store.get(BY_KEY[("", "persistentvolumeclaims")], self.ns,
                                     v["persistentVolumeClaim"]["claimName"])
            pv = self._bound_volume(pvc)
        except (ApiError, PrepareError):
            return False
        return pv is not None and (pv.get("spec") or {}).get("hostPath") is not None

    def _bound_volume(self, pvc: dict) -> dict | None:
        """The PersistentVolume a claim names in spec.volumeName (static binding), or None for a
        dynamically provisioned claim (the emulator gives those a directory of their own)."""
        name = (pvc.get("spec") or {}).get("volumeName")
        if not name:
            return None
        try:
            pv = self.emu.store.get(BY_KEY[("", "persistentvolumes")], None, name)
        except ApiError:
            raise PrepareError("FailedMount", f'persistentvolume "{name}" not found',
                               "FailedMount") from None
        ref = (pv.get("spec") or {}).get("claimRef")
        if ref and (ref.get("namespace"), ref.get("name")) != (self.ns, pvc["metadata"]["name"]):
            raise PrepareError("FailedMount", f'persistentvolume "{name}" is reserved for claim '
                               f'{ref.get("namespace")}/{ref.get("name")}', "FailedMount")
        return pv

    def _host_path(self, v: dict, target: Path) -> None:
        hp = v["hostPath"]
        path, typ = hp["path"], hp.get("type") or ""
        real = Path(path)
        if not real.exists():
            checks = {"Directory": "is not a directory", "File": "is not a file",
                      "Socket": "is not a socket", "CharDevice": "is not a character device",
                      "BlockDevice": "is not a block device"}
            if typ in checks:
                raise PrepareError("FailedMount",
                                   f"hostPath type check failed: {path} {checks[typ]}",
                                   "FailedMount")
            real = self.emu.data_dir / "hostfs" / self.node / path.lstrip("/")
            if typ == "FileOrCreate":
                real.parent.mkdir(parents=True, exist_ok=True)
                real.touch()
            else:
                real.mkdir(parents=True, exist_ok=True)
        self._link(target, real)

    @staticmethod
    def _link(link: Path, real: Path) -> None:
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink():
            if Path(os.readlink(link)) == real:
                return
            link.unlink()
        elif link.is_dir():
            shutil.rmtree(link)
        link.symlink_to(real)

    def _mounts(self, pod: dict, container: dict) -> list[dict[str, Any]]:
        """Each volumeMount as a bind mount (parents before children)."""
        kinds = {v["name"]: next((k for k in v if k != "name"), "emptyDir")
                 for v in pod["spec"].get("volumes") or []}
        out = []
        for m in sorted(container.get("volumeMounts") or [], key=lambda m: len(m["mountPath"])):
            source = self.volume_dir(m["name"])
            if not source.exists():
                source.mkdir(parents=True, exist_ok=True)
            source = source.resolve()
            if m.get("subPath"):
                source = source / m["subPath"]
                if not source.exists():
                    source.mkdir(parents=True, exist_ok=True)
            always_ro = kinds.get(m["name"]) in ("secret", "configMap", "downwardAPI",
                                                 "projected")
            out.append({"source": str(source), "target": m["mountPath"],
                        "readOnly": bool(m.get("readOnly")) or always_ro})
        return out

    def write_hosts(self) -> None:
        pod = self.pod()
        if pod is None or not self.ip:
            return
        self.hosts_path.parent.mkdir(parents=True, exist_ok=True)
        ctr.write_in_place(self.hosts_path,
                           ctr.hosts_file(pod, self.ip, self.kubelet.service_addresses()))


class Kubelet:
    def __init__(self, emu: KubeEmulator) -> None:
        self.emu = emu
        self.store = emu.store
        self.runtimes: dict[str, PodRuntime] = {}
        self.dirs: dict[tuple[str, str], PodRuntime] = {}
        self.pgids: set[int] = set()
        self.retired: set[str] = set()  # uids whose runtime ended: never started again
        self.stopping = False
        self.host_ip = "127.0.0.1"
        net = ipaddress.ip_network(emu.pod_network)
        if not net.is_loopback or net.num_addresses < 4:
            raise ValueError(f"pod_network {emu.pod_network!r}: must be a loopback network "
                             "(inside 127.0.0.0/8) with room for pods, e.g. '127.64.0.0/10'")
        self._base = int(net.network_address) + 1
        self._size = net.num_addresses - 2
        # A random start: emulators in other test processes (or earlier runs, whose sockets
        # may sit in TIME_WAIT) most likely use other addresses.
        self._next = random.randrange(self._size)
        self._used: set[str] = set()
        ctr.check_host()
        self.netshim = ctr.netshim_path()
        self.interpreter_dirs = ctr.interpreter_dirs()
        self.cgroup_base = cgroups.base_dir(uuid.uuid4().hex[:8])
        self._hosts_refresh: asyncio.TimerHandle | None = None
        self._created: dict[str, float] = {}  # pod uid -> the moment the store added it
        self.timelines: dict[str, Timeline] = {}  # pod uid -> its start (podstart.py), latest 5000
        self.runtime_server = ctr.RuntimeServer()
        self.store.subscribe(self._on_event)
        self.starting: set[str] = set()  # uids of the pods between taken and their process started
        self.full_collections = 0  # the interpreter's full collections made between starts

    # ------------------------------------------------------------ the garbage collector

    def start_done(self, uid: str) -> None:
        """The pod ``uid``'s process started (or its run ended). Where no pod is starting and
        the interpreter's cyclic garbage collector has a full collection due (its oldest
        generation's count at its threshold), that collection is made now, once the pod's status
        is written, rather than inside the next pod's start: it walks every object the emulator
        (and its test) made since the start (40 ms of CPU for 56,000 objects, after 120 pods'
        starts; many times that on a busy machine), with the kubelet's thread stopped."""
        self.starting.discard(uid)
        if self._between_starts():
            with contextlib.suppress(RuntimeError):  # no loop running here: nothing to put off
                asyncio.get_running_loop().call_soon(self._collect_between_starts)

    def starting_now(self) -> set[str]:
        """The uids of the pods starting: created and not yet taken, or taken and their process
        not yet started."""
        return self.starting | set(self._created)

    def _between_starts(self) -> bool:
        """No pod is starting, and a full collection is due."""
        return (not self.starting and not self._created and gc.isenabled()
                and gc.get_count()[2] >= gc.get_threshold()[2])

    def _collect_between_starts(self) -> None:
        if self._between_starts():
            gc.collect()
            self.full_collections += 1

    # ------------------------------------------------------------ addresses

    def allocate_ip(self) -> str:
        for _ in range(min(self._size, 1 << 16)):
            ip = str(ipaddress.ip_address(self._base + self._next % self._size))
            self._next += 1
            if ip not in self._used and ip != "127.0.0.1":
                self._used.add(ip)
                return ip
        raise RuntimeError(f"pod network {self.emu.pod_network} is exhausted")

    def release_ip(self, ip: str | None) -> None:
        if ip:
            self._used.discard(ip)

    # ------------------------------------------------------------ queries

    def node(self, name: str) -> dict | None:
        try:
            return self.store.get(BY_KEY[("", "nodes")], None, name)
        except ApiError:
            return None

    def serves(self, node_name: str) -> bool:
        return node_name == self.emu.default_node_name or self.node(node_name) is not None

    def runtime_for(self, ns: str, name: str) -> PodRuntime | None:
        return self.dirs.get((ns, name))

    def log_path(self, ns: str, name: str, container: str, previous: bool = False
                 ) -> Path | None:
        rt = self.dirs.get((ns, name))
        return rt.log_path(container, previous) if rt else None

    def is_running(self, ns: str, name: str, uid: str) -> bool:
        rt = self.runtimes.get(uid)
        return rt is not None and not rt.finished

    # ------------------------------------------------------------ events

    def timeline_for(self, pod: dict) -> Timeline:
        """A new timeline of ``pod``'s start (podstart.py), kept in :attr:`timelines`."""
        meta = pod["metadata"]
        timeline = Timeline(meta["namespace"], meta["name"], self._created.pop(meta["uid"], None) or now())
        self.timelines[meta["uid"]] = timeline
        while len(self.timelines) > 5000:
            self.timelines.pop(next(iter(self.timelines)))
        return timeline

    def _on_event(self, srt: ResourceType, ev: Event) -> None:
        if srt.kind == "Pod" and ev.type in ("ADDED", "DELETED"):  # in the writer's thread
            uid = ev.obj["metadata"]["uid"]
            if ev.type == "ADDED":
                self._created[uid] = now()
            elif self._created.pop(uid, None) is not None and self._between_starts():
                # deleted before it was taken: no start of its own ends to make the due collection
                self.emu.call_soon(self._collect_between_starts)
        if srt.kind in ("Pod", "Secret", "ConfigMap", "Node"):
            self.emu.call_soon(self._handle, srt, ev)
        if srt.kind in ("Pod", "Service", "Endpoints"):
            self.emu.call_soon(self._schedule_hosts_refresh)

    # ------------------------------------------------------------ names (/etc/hosts)

    def _schedule_hosts_refresh(self) -> None:
        if self._hosts_refresh is None and self.emu.loop is not None:
            self._hosts_refresh = self.emu.loop.call_later(0.1, self._refresh_hosts)

    def _refresh_hosts(self) -> None:
        self._hosts_refresh = None
        for rt in list(self.runtimes.values()):
            if not rt.finished and rt.ip:
                with contextlib.suppress(OSError):
                    rt.write_hosts()

    def service_addresses(self) -> list[tuple[str, str, str]]:
        """(namespace, name, address) of each Service a pod can reach by name.

        Cluster IPs are not routable here, so a name resolves to a ready endpoint's address
        (a selected pod's IP, or the Endpoints of a Service without selector) when that
        address is on this machine's loopback network; the port is the endpoint's.
        """
        out = []
        with self.store.lock:
            services = self.store.raw_objects("services")  # read only (never edited in place)
            pods = [p for p in self.store.raw_objects("pods")]
            ready = [p for p in pods if (p.get("status") or {}).get("podIP") and any(
                c.get("type") == "Ready" and c.get("status") == "True"
                for c in (p.get("status") or {}).get("conditions") or [])]
            endpoints = {(e["metadata"]["namespace"], e["metadata"]["name"]): e
                         for e in self.store.raw_objects("endpoints")}
        for svc in services:
            ns, name = svc["metadata"]["namespace"], svc["metadata"]["name"]
            selector = (svc.get("spec") or {}).get("selector")
            addr = None
            if selector:
                for p in sorted(ready, key=lambda p: p["metadata"]["name"]):
                    labels = p["metadata"].get("labels") or {}
                    if p["metadata"]["namespace"] == ns and all(
                            labels.get(k) == v for k, v in selector.items()):
                        addr = p["status"]["podIP"]
                        break
            else:
                ep = endpoints.get((ns, name)) or {}
                for subset in ep.get("subsets") or []:
                    for a in subset.get("addresses") or []:
                        addr = addr or a.get("ip")
            if addr and ipaddress.ip_address(addr).is_loopback:
                out.append((ns, name, addr))
        return out

    def _handle(self, srt: ResourceType, ev: Event) -> None:
        try:
            if srt.kind == "Pod":
                self._pod_event(ev)
            elif srt.kind in ("Secret", "ConfigMap") and ev.type != "DELETED":
                self._refresh_sources(srt.kind, ev.obj)
            elif srt.kind == "Node" and ev.type == "ADDED":
                self._adopt(ev.obj["metadata"]["name"])
        except Exception:
            log.exception("kubelet failed handling %s %s", ev.type, srt.kind)

    def _adopt(self, node_name: str) -> None:
        for pod in self.store.iter_objects("pods"):
            if (pod.get("spec") or {}).get("nodeName") == node_name:
                self._pod_event(Event(0, "MODIFIED", pod, None))

    def _pod_event(self, ev: Event) -> None:
        pod = ev.obj
        meta = pod["metadata"]
        uid = meta["uid"]
        rt = self.runtimes.get(uid)
        if ev.type == "DELETED":
            if rt is not None:
                rt.request_termination(0)
            self.dirs.pop((meta["namespace"], meta["name"]), None)
            if rt is None or rt.finished:
                self._cleanup_dir(meta["namespace"], meta["name"], uid)
            return
        node = (pod.get("spec") or {}).get("nodeName")
        if not node:
            return
        if rt is None:
            if self.stopping:
                return
            with self.store.lock:
                pod = clone(self.store.by_uid(uid))
            if pod is None or uid in self.runtimes:
                return
            if pod["metadata"].get("deletionTimestamp"):
                # Nothing runs for it here: finish the deletion (the kubelet, or the pod
                # garbage collector for pods bound to a node that does not exist).
                with contextlib.suppress(ApiError):
                    self.store.delete(PODS, meta["namespace"], meta["name"], 0,
                                      preconditions={"uid": uid})
                return
            if is_terminal(pod) or not self.serves(node) or uid in self.retired:
                return
            rt = PodRuntime(self, pod)
            self.runtimes[uid] = rt
            self.dirs[(rt.ns, rt.name)] = rt
            rt.task = asyncio.ensure_future(rt.run())
            return
        if meta.get("deletionTimestamp"):
            rt.request_termination(meta.get("deletionGracePeriodSeconds") or 0)
        elif ev.old is not None and (ev.old["metadata"].get("labels") != meta.get("labels")
                                     or ev.old["metadata"].get("annotations")
                                     != meta.get("annotations")):
            with contextlib.suppress(PrepareError, OSError):
                rt.materialize_volumes(pod, only={"downwardAPI", "projected"})

    def _refresh_sources(self, kind: str, obj: dict) -> None:
        ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        key = "secret" if kind == "Secret" else "configMap"
        for rt in list(self.runtimes.values()):
            if rt.ns != ns or rt.finished:
                continue
            pod = rt.pod()
            if pod is None:
                continue
            uses = False
            for v in pod["spec"].get("volumes") or []:
                src = v.get(key) or {}
                if src.get("secretName" if key == "secret" else "name") == name:
                    uses = True
                for p in (v.get("projected") or {}).get("sources") or []:
                    if (p.get(key) or {}).get("name") == name:
                        uses = True
            if uses:
                with contextlib.suppress(PrepareError, OSError):
                    rt.materialize_volumes(pod, only={key, "projected"})

    def runtime_done(self, rt: PodRuntime) -> None:
        self.retired.add(rt.uid)
        self.runtimes.pop(rt.uid, None)
        if self.dirs.get((rt.ns, rt.name)) is not rt:
            self._cleanup_dir(rt.ns, rt.name, rt.uid, rt)

    def _cleanup_dir(self, ns: str, name: str, uid: str, rt: PodRuntime | None = None) -> None:
        path = self.emu.data_dir / "pods" / ns / f"{name}-{uid[:8]}"
        if self.emu.keep_pod_dirs:
            return
        try:  # off the event loop: a pod's layers take tens of ms to remove, others' starts wait
            asyncio.get_running_loop().run_in_executor(None, shutil.rmtree, path, True)
        except RuntimeError:  # no loop running here
            shutil.rmtree(path, ignore_errors=True)

    async def shutdown(self, grace: float = 2.0) -> None:
        self.stopping = True
        runtimes = list(self.runtimes.values())
        for rt in runtimes:
            rt.request_termination(grace)
        tasks = [rt.task for rt in runtimes if rt.task is not None]
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=grace + 3)
            for t in pending:
                t.cancel()
        self.kill_all()
        cgroups.remove_base(self.cgroup_base)

    def kill_all(self) -> None:
        for rt in list(self.runtimes.values()):
            if rt.pid1 and rt.proc is not None and rt.proc.returncode is None:
                # a running container's init: its whole pid namespace goes with it
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(rt.pid1, signal.SIGKILL)
        for pgid in list(self.pgids):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        self.pgids.clear()
        self.runtime_server.stop()

