"""The "kubelet": runs each pod's first container as a local process on its own 127.x address.

How a pod maps onto the machine (see README.md in this folder):

* **Network.** Each pod gets its own loopback address from ``pod_network`` (127.0.0.0/8 all
  routes to ``lo`` on Linux), reported as ``status.podIP``. A container that binds "all
  interfaces" would collide with every other pod, so ``0.0.0.0`` in the container's command,
  args and env values is replaced by the pod IP (what a network namespace gives a real pod).
* **Files.** Each pod has a root directory ``<data_dir>/pods/<ns>/<name>-<uid8>/root``
  (``KUBEEMU_ROOT`` in its env). Every volume is materialised under the pod directory and
  linked at ``<root><mountPath>``; every occurrence of a mountPath (and of the configured
  ``rewrite_paths`` and the ``workingDir``) in command, args and env values is rewritten to
  ``<root><mountPath>``. So ``--config=/etc/app/c.py`` reads the mounted file.
* **Image.** The "image" is the test environment itself: the process gets PATH (the running
  interpreter's bin directory first), LANG, PYTHONPATH ... from the emulator's environment,
  then the pod's env. An empty command and args is a container that just runs (a pause).
* Only the first container runs a process; other containers are reported running and ready.
  Init containers with a command run to completion first. Readiness probes (httpGet,
  tcpSocket, exec) are honoured; liveness and startup probes are not.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import ipaddress
import json
import logging
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import quantity
from .errors import ApiError
from .quota import is_terminal
from .resources import BY_KEY, ResourceType
from .scheduler import insufficient, matches_node_selector, set_condition
from .store import Event, rfc3339

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


_PATH_END = frozenset(" \t\n\"',:;=)]}")


class PathMap:
    """Rewrites container paths (mountPaths ...) in strings to paths under the pod root."""

    def __init__(self, root: Path, container_paths: list[str], pod_ip: str | None,
                 rewrite_any: bool) -> None:
        self.root = root
        paths = sorted({p.rstrip("/") for p in container_paths if p and p != "/"},
                       key=len, reverse=True)
        self._rx = (re.compile(r"(?<![\w.\-/])(" + "|".join(re.escape(p) for p in paths)
                               + r")(?=$|[/\s\"',:;=)\]}])") if paths else None)
        self._ip = pod_ip if rewrite_any else None

    def host(self, container_path: str) -> Path:
        return self.root / container_path.lstrip("/")

    def _replace(self, m: re.Match) -> str:
        # A longer path that exists on this machine (the interpreter under a "/work" mount,
        # say) is a host path, not a container path: leave it alone.
        end = m.end()
        text = m.string
        while end < len(text) and text[end] not in _PATH_END:
            end += 1
        token = text[m.start():end]
        if len(token.rstrip("/")) > len(m.group(1)) and os.path.exists(token):
            return m.group(0)
        return str(self.host(m.group(1)))

    def __call__(self, s: str) -> str:
        if self._rx is not None:
            s = self._rx.sub(self._replace, s)
        if self._ip:
            s = re.sub(r"(?<![\d.])0\.0\.0\.0(?![\d.])", self._ip, s)
        return s


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
        self.root = self.dir / "root"
        self.ip: str | None = None
        self.proc: asyncio.subprocess.Process | None = None
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
        self.path_map: PathMap | None = None
        self.task: asyncio.Task | None = None
        self._probe_task: asyncio.Task | None = None
        self._last_event: dict[str, str] = {}
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

    def log_path(self, container: str) -> Path:
        return self.dir / "logs" / f"{container}.log"

    def event(self, reason: str, message: str, type: str = "Normal",
              container: str | None = None, once: bool = False) -> None:
        if once and self._last_event.get(reason) == message:
            return
        self._last_event[reason] = message
        pod = self.pod()
        if pod is not None:
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

        self.emu.store.mutate(PODS, self.ns, self.name, fn, uid=self.uid)

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
            self.kubelet.runtime_done(self)

    async def _run(self) -> None:
        pod = self.pod()
        if pod is None:
            return
        if not self._admit(pod):
            return
        self.ip = self.kubelet.allocate_ip()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.root.mkdir(parents=True, exist_ok=True)
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

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.terminating.wait(), seconds)

    async def _run_init(self, c: dict) -> bool:
        name = c["name"]
        while not self.terminating.is_set():
            pod = self.pod()
            if pod is None:
                return False
            try:
                argv, env, cwd = self.prepare(pod, c)
            except PrepareError as e:
                self.init_status[name] = self._waiting(c, e.reason, e.message)
                self.push_status()
                self.event(e.event_reason, "Error: " + e.message, "Warning", name, once=True)
                await self._sleep(1.0)
                continue
            started_at = rfc3339()
            code = 0
            if argv:
                try:
                    proc = await self._spawn(argv, env, cwd, name)
                except OSError as e:
                    code = 128
                    self.event("Failed", f"Error: {e}", "Warning", name)
                else:
                    waiter = asyncio.ensure_future(proc.wait())
                    term = asyncio.ensure_future(self.terminating.wait())
                    await asyncio.wait({waiter, term}, return_when=asyncio.FIRST_COMPLETED)
                    term.cancel()
                    if not waiter.done():
                        await self._kill_group(force=False)
                        return False
                    code = waiter.result()
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
        while True:
            if self.terminating.is_set():
                return None
            pod = self.pod()
            if pod is None:
                return None
            try:
                argv, env, cwd = self.prepare(pod, container)
                break
            except PrepareError as e:
                st = self.cstatus[name]
                st["state"] = {"waiting": {"reason": e.reason, "message": e.message}}
                self.push_status()
                self.event(e.event_reason, "Error: " + e.message, "Warning", name, once=True)
                await self._sleep(1.0)
        self._last_event.pop("Failed", None)
        if restarts == 0:
            self.event("Pulled", f'Container image "{container.get("image", "")}" already '
                       "present on machine", container=name)
        self.event("Created", f"Created container: {name}", container=name)
        started_at = rfc3339()
        cid = "containerd://" + uuid.uuid4().hex
        try:
            self.proc = await self._spawn(argv, env, cwd, name) if argv else None
        except OSError as e:
            msg = ("failed to create containerd task: failed to create shim task: OCI runtime "
                   "create failed: runc create failed: unable to start container process: "
                   f'exec: "{argv[0]}": {e.strerror or e}: unknown')
            self.event("Failed", f"Error: {msg}", "Warning", name)
            return 128, "StartError", msg, started_at
        self.event("Started", f"Started container {name}", container=name)
        probe = container.get("readinessProbe")
        for n in self.containers:
            st = self.cstatus[n]
            st["state"] = {"running": {"startedAt": started_at}}
            st["started"] = True
            st["ready"] = not (n == name and probe)
            st["containerID"] = cid if n == name else "containerd://" + uuid.uuid4().hex
            st["imageID"] = f"docker.io/library/{st['image']}@sha256:" + "0" * 64
        self.phase = "Running"
        self.push_status()
        if probe:
            self._probe_task = asyncio.ensure_future(self._readiness(container, probe, env))
        if self.proc is None:  # no command: runs until stopped, like a pause container
            await self.terminating.wait()
            await self._stop_probes()
            return 0, "Completed", None, started_at
        waiter = asyncio.ensure_future(self.proc.wait())
        term = asyncio.ensure_future(self.terminating.wait())
        await asyncio.wait({waiter, term}, return_when=asyncio.FIRST_COMPLETED)
        term.cancel()
        if not waiter.done():
            await self._kill_group(force=False)
        code = await waiter
        await self._stop_probes()
        await self._kill_group(force=True)  # the container's other processes go with it
        if code < 0:
            code = 128 - code  # killed by a signal: 137 for SIGKILL, 143 for SIGTERM
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

    async def _spawn(self, argv: list[str], env: dict[str, str], cwd: Path,
                     container: str) -> asyncio.subprocess.Process:
        logfile = self.log_path(container)
        logfile.parent.mkdir(parents=True, exist_ok=True)
        with logfile.open("ab") as out:
            proc = await asyncio.create_subprocess_exec(
                *argv, env=env, cwd=str(cwd), stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True)
        self.kubelet.pgids.add(proc.pid)
        log.info("pod %s/%s: started %s (pid %s) on %s", self.ns, self.name, argv[0], proc.pid,
                 self.ip)
        return proc

    async def _kill_group(self, force: bool) -> None:
        proc = self.proc
        if proc is None:
            return
        pgid = proc.pid
        if force:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
            if proc.returncode is None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(proc.wait(), 5)
            self.kubelet.pgids.discard(pgid)
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
        loop = asyncio.get_running_loop()
        while proc.returncode is None:
            remaining = (self.kill_at or loop.time()) - loop.time()
            if remaining <= 0:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, signal.SIGKILL)
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

    # ------------------------------------------------------------ readiness

    async def _readiness(self, container: dict, probe: dict, env: dict[str, str]) -> None:
        name = container["name"]
        await asyncio.sleep(probe.get("initialDelaySeconds", 0))
        successes = failures = 0
        period = max(probe.get("periodSeconds", 10), 0.1)
        while True:
            ok, why = await self._probe_once(container, probe, env)
            st = self.cstatus[name]
            if ok:
                successes, failures = successes + 1, 0
                if not st["ready"] and successes >= probe.get("successThreshold", 1):
                    st["ready"] = True
                    self.push_status()
            else:
                failures, successes = failures + 1, 0
                self.event("Unhealthy", f"Readiness probe failed: {why}", "Warning", name)
                if st["ready"] and failures >= probe.get("failureThreshold", 3):
                    st["ready"] = False
                    self.push_status()
            await asyncio.sleep(period)

    async def _probe_once(self, container: dict, probe: dict, env: dict[str, str]
                          ) -> tuple[bool, str]:
        timeout = probe.get("timeoutSeconds", 1)

        def port_of(port: Any) -> int:
            if isinstance(port, int):
                return port
            for p in container.get("ports") or []:
                if p.get("name") == port:
                    return int(p["containerPort"])
            return int(port)

        try:
            if "httpGet" in probe:
                hg = probe["httpGet"]
                host = hg.get("host") or self.ip
                scheme = (hg.get("scheme") or "HTTP").lower()
                url = f"{scheme}://{host}:{port_of(hg.get('port'))}{hg.get('path', '/')}"
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
                host = ts.get("host") or self.ip
                _, writer = await asyncio.wait_for(
                    asyncio.open_connection(host, port_of(ts.get("port"))), timeout)
                writer.close()
                return True, ""
            if "exec" in probe:
                argv = [self.path_map(a) if self.path_map else a
                        for a in probe["exec"].get("command") or []]
                proc = await asyncio.create_subprocess_exec(
                    *argv, env=env, cwd=str(self.root), stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL)
                code = await asyncio.wait_for(proc.wait(), timeout)
                return code == 0, f"command exited with {code}"
        except Exception as e:  # connection refused, timeout ...
            return False, f"{type(e).__name__}: {e}"
        return True, ""

    async def _stop_probes(self) -> None:
        task, self._probe_task = self._probe_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # ------------------------------------------------------------ files and env

    def _paths(self, pod: dict, container: dict) -> PathMap:
        paths = [m["mountPath"] for c in (pod["spec"].get("containers") or [])
                 + (pod["spec"].get("initContainers") or []) for m in c.get("volumeMounts") or []]
        paths += list(self.emu.rewrite_paths)
        if container.get("workingDir"):
            paths.append(container["workingDir"])
        return PathMap(self.root, paths, self.ip, self.emu.bind_any_to_pod_ip)

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

    def prepare(self, pod: dict, container: dict) -> tuple[list[str], dict[str, str], Path]:
        """argv, environment and working directory for a container's process."""
        self.path_map = pm = self._paths(pod, container)
        spec_env = self.build_env(pod, container)
        spec_env = {k: pm(v) for k, v in spec_env.items()}
        base = {k: os.environ[k] for k in BASE_ENV_KEYS if k in os.environ}
        bindir = os.path.dirname(sys.executable)
        base["PATH"] = bindir + os.pathsep + base.get("PATH", os.defpath)
        home = self.root / "root"
        home.mkdir(parents=True, exist_ok=True)
        env = {**base, "HOME": str(home), "HOSTNAME": self.name, **self.emu.pod_env, **spec_env}
        env.update({
            "KUBEEMU_ROOT": str(self.root), "KUBEEMU_POD_IP": self.ip or "",
            "KUBEEMU_POD_NAME": self.name, "KUBEEMU_POD_NAMESPACE": self.ns,
            "KUBEEMU_POD_UID": self.uid, "KUBEEMU_NODE_NAME": self.node,
        })
        argv = [pm(expand(a, env)) for a in (container.get("command") or [])
                + (container.get("args") or [])]
        cwd = self.root
        if container.get("workingDir"):
            cwd = pm.host(container["workingDir"])
            cwd.mkdir(parents=True, exist_ok=True)
        for p in self.emu.rewrite_paths:
            pm.host(p).mkdir(parents=True, exist_ok=True)
        self._mount(pod, container)
        return argv, env, cwd

    def volume_dir(self, name: str) -> Path:
        return self.dir / "volumes" / name

    def materialize_volumes(self, pod: dict, only: set[str] | None = None) -> None:
        for v in pod["spec"].get("volumes") or []:
            kinds = [k for k in ("secret", "configMap", "downwardAPI", "projected")
                     if v.get(k) is not None]
            if only is not None and not (set(kinds) & only):
                continue
            self._materialize(pod, v)

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
                            b"kubeemu-token", mode)
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

    def _mount(self, pod: dict, container: dict) -> None:
        """Link each volumeMount at <root><mountPath> (parents before children)."""
        for m in sorted(container.get("volumeMounts") or [], key=lambda m: len(m["mountPath"])):
            source = self.volume_dir(m["name"])
            if not source.exists():
                source.mkdir(parents=True, exist_ok=True)
            if m.get("subPath"):
                source = source / m["subPath"]
                if not source.exists():
                    source.mkdir(parents=True, exist_ok=True)
            target = self.root / m["mountPath"].lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.is_symlink():
                if Path(os.readlink(target)) == source.resolve():
                    continue
                target.unlink()
            elif target.is_dir():
                if any(target.iterdir()):
                    continue  # already populated by a nested mount's parents: keep it
                target.rmdir()
            elif target.exists():
                target.unlink()
            target.symlink_to(source.resolve())


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
        self.store.subscribe(self._on_event)

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

    def log_path(self, ns: str, name: str, container: str) -> Path | None:
        rt = self.dirs.get((ns, name))
        return rt.log_path(container) if rt else None

    def is_running(self, ns: str, name: str, uid: str) -> bool:
        rt = self.runtimes.get(uid)
        return rt is not None and not rt.finished

    # ------------------------------------------------------------ events

    def _on_event(self, srt: ResourceType, ev: Event) -> None:
        if srt.kind in ("Pod", "Secret", "ConfigMap", "Node"):
            self.emu.call_soon(self._handle, srt, ev)

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
                pod = copy.deepcopy(self.store.by_uid(uid))
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
        if not self.emu.keep_pod_dirs:
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

    def kill_all(self) -> None:
        for pgid in list(self.pgids):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        self.pgids.clear()

