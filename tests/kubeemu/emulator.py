"""KubeEmulator: the API server, controllers, scheduler and kubelet in one background thread."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import copy
import gc
import logging
import shutil
import socket
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tornado.httpserver
import tornado.netutil
import yaml

from .controllers import Controllers
from .errors import ApiError
from .images import DEFAULT_IMAGES, Image
from .kubelet import Kubelet
from .rbac import Authorizer
from .resources import BY_KEY, ResourceType, by_plural
from .scheduler import Scheduler, set_condition
from .store import SYSTEM_NAMESPACES, Store, micro_time, rfc3339
from .taints import TaintEviction
from .tls import make_certificates, server_context
from .volumes import STANDARD_CLASS, VolumeController
from .workloads import Workloads

log = logging.getLogger("kubeemu")
_LIVE: weakref.WeakSet[KubeEmulator] = weakref.WeakSet()


@dataclass
class NodeSpec:
    """A node to create: labels, annotations, allocatable resources (capacity defaults to it).

    ``allocatable`` values are quantities, e.g. ``{"nvidia.com/gpu": "2", "cpu": "8"}``;
    cpu, memory, pods and ephemeral-storage get generous defaults when not given.
    """

    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    allocatable: Mapping[str, str | int] = field(default_factory=dict)
    capacity: Mapping[str, str | int] | None = None
    taints: Sequence[Mapping[str, str]] = ()
    unschedulable: bool = False

    def manifest(self) -> dict:
        alloc = {k: str(v) for k, v in self.allocatable.items()}
        cap = {k: str(v) for k, v in (self.capacity or self.allocatable).items()}
        spec: dict[str, Any] = {}
        if self.taints:
            spec["taints"] = [dict(t) for t in self.taints]
        if self.unschedulable:
            spec["unschedulable"] = True
        return {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": self.name, "labels": dict(self.labels),
                             "annotations": dict(self.annotations)},
                "spec": spec, "status": {"allocatable": alloc, "capacity": cap}}


def _as_manifest(node: NodeSpec | Mapping[str, Any] | str) -> dict:
    if isinstance(node, str):
        return NodeSpec(node).manifest()
    if isinstance(node, NodeSpec):
        return node.manifest()
    if "metadata" in node:
        return copy.deepcopy(dict(node))
    known = {"name", "labels", "annotations", "allocatable", "capacity", "taints",
             "unschedulable"}
    unknown = set(node) - known
    if unknown or "name" not in node:
        raise ValueError(f"node spec {dict(node)!r}: needs 'name'; allowed keys are "
                         f"{sorted(known)} (or a full Node manifest with 'metadata'); "
                         f"unknown: {sorted(unknown)}")
    return NodeSpec(**node).manifest()


class KubeEmulator:
    """A Kubernetes API server emulator on loopback, with a scheduler and a local "kubelet".

    Official clients talk to it unchanged through :attr:`kubeconfig_path`. See README.md in
    this folder for the behaviours emulated and the filesystem/network mapping of pods.

    Args:
        nodes: nodes to create at start (NodeSpec, dicts with NodeSpec's fields, full Node
            manifests or names). With no nodes at all, pods run on a virtual node named
            ``default_node_name`` that is not an API object.
        namespaces: namespaces created at start besides the system ones.
        port: TCP port on 127.0.0.1 (0 = any free port).
        data_dir: where pod roots, logs, PVC data and the kubeconfig go (default: a fresh
            temporary directory removed by stop()).
        pod_network: loopback network pod IPs are taken from (from a random start, so
            emulators in parallel test processes rarely share addresses).
        images: image table entries (fnmatch pattern -> ``images.Image``) on top of
            ``images.DEFAULT_IMAGES``; an image no entry matches fails to pull.
        node_mounts: host paths bind-mounted (read-write) into every container, as a
            container runtime injects a node's devices (``/dev/nvidia*``): e.g. the state of a
            GPU test double that every process on the node shares. ``"/path"`` mounts at the
            same path, ``"/host/path:/container/path"`` elsewhere (``"/proc:/run/host-proc"``:
            the host's process view, as a GPU driver has it).
        pod_env: extra environment for every pod process (below the pod's own env).
        gpu_uuids: the node's GPUs (uuids, in device minor order) as its NVIDIA container
            runtime knows them. Given, every container gets a /dev of its own (``devices.py``)
            holding ``/dev/nvidiactl`` and ``/dev/nvidia<minor>`` of the cards its
            ``NVIDIA_VISIBLE_DEVICES`` names only ("all", uuids or minors; unset or "void":
            none), fixed at its start as on a real node. Empty: the host's /dev as it is.
        history_size: watch events kept per resource type at most; older resourceVersions
            get 410.
        watch_cache_capacity, watch_cache_fresh_seconds: as kube-apiserver's watch cache,
            past ``watch_cache_capacity`` events (100) a resource type's history drops events
            older than ``watch_cache_fresh_seconds`` (75 s): a watch from a resourceVersion
            older than what is kept gets 410 Gone "too old resource version".
        bookmark_interval: seconds between BOOKMARK events on watches that allow them.
        restart_backoff_seconds: first container restart delay (doubles, capped at 300 s).
        scheduler_names: spec.schedulerName values this emulator schedules.
    """

    def __init__(self, nodes: Iterable[NodeSpec | Mapping[str, Any] | str] | None = None, *,
                 namespaces: Iterable[str] = (), port: int = 0,
                 data_dir: str | Path | None = None, pod_network: str = "127.64.0.0/10",
                 images: Mapping[str, Image] | None = None, node_mounts: Sequence[str] = (),
                 pod_env: Mapping[str, str] | None = None, gpu_uuids: Sequence[str] = (),
                 history_size: int = 5000,
                 watch_cache_capacity: int = 100, watch_cache_fresh_seconds: float = 75.0,
                 bookmark_interval: float = 5.0, restart_backoff_seconds: float = 10.0,
                 scheduler_names: Sequence[str] = ("default-scheduler",),
                 default_node_name: str = "emu-node", keep_pod_dirs: bool = False) -> None:
        self._initial_nodes = [_as_manifest(n) for n in (nodes or [])]
        self._initial_namespaces = list(namespaces)
        self._port_wanted = port
        self._data_dir_arg = Path(data_dir) if data_dir else None
        self.pod_network = pod_network
        self.images: dict[str, Image] = dict(images or {})  # the test's entries win
        self.node_mounts: tuple[tuple[str, str], ...] = tuple(
            (str(p).split(":", 1)[0], str(p).split(":", 1)[-1]) for p in node_mounts)
        for pattern, image in DEFAULT_IMAGES.items():
            self.images.setdefault(pattern, image)
        self.pod_env = dict(pod_env or {})
        self.gpu_uuids = tuple(gpu_uuids)
        self.bookmark_interval = bookmark_interval
        self.restart_backoff_seconds = restart_backoff_seconds
        self.scheduler_names = tuple(scheduler_names)
        self.default_node_name = default_node_name
        self.keep_pod_dirs = keep_pod_dirs
        self.store = Store(history_size=history_size, cache_capacity=watch_cache_capacity,
                           cache_fresh_seconds=watch_cache_fresh_seconds)
        self.authorizer = Authorizer(self.store)
        self.requests: deque[tuple[str, str, str]] = deque(maxlen=10000)
        #: (method, path, until): such requests arriving before ``until`` are answered then (:meth:`stall`)
        self.stalls: list[tuple[str, str, float]] = []
        self.active_watches = 0
        self.port = 0
        self.data_dir = Path()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: tornado.httpserver.HTTPServer | None = None
        self._tls_server: tornado.httpserver.HTTPServer | None = None
        self.tls_port = 0
        self.ca_path = Path()
        self._owns_data_dir = False
        self.kubelet: Kubelet
        self.scheduler: Scheduler
        self.controllers: Controllers
        self.volumes: VolumeController
        self.taint_eviction: TaintEviction
        self.workloads: Workloads

    # ------------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def https_url(self) -> str:
        """The same API over TLS (the cluster CA is :attr:`ca_path`)."""
        return f"https://127.0.0.1:{self.tls_port}"

    @property
    def kubeconfig_path(self) -> str:
        return str(self.data_dir / "kubeconfig.yaml")

    @property
    def tls_kubeconfig_path(self) -> str:
        """A kubeconfig of the admin token over HTTPS: for Go clients (kubectl, helm), which
        send no token over plain HTTP."""
        return str(self.data_dir / "kubeconfig-tls.yaml")

    def env(self, kubeconfig: str | None = None) -> dict[str, str]:
        """Environment for a subprocess (a hub) that should use this cluster (as the admin, or
        with ``kubeconfig`` from :meth:`kubeconfig_for`)."""
        return {"KUBECONFIG": kubeconfig or self.kubeconfig_path}

    def service_account_token(self, namespace: str, name: str) -> str:
        """A bearer token of the service account ``namespace/name`` (``kubectl create token``),
        made first when it does not exist (``kubectl create serviceaccount``): requests made with
        the token are authorized by the RBAC objects stored here (rbac.py), and refused with 401
        once the account is deleted."""
        if self.get("serviceaccounts", name, namespace) is None:
            try:
                self.create({"metadata": {"name": name}}, "serviceaccounts", namespace)
            except ApiError as e:
                if e.code != 409:  # made meanwhile
                    raise
        return self.authorizer.issue(namespace, name)

    def stall(self, method: str, path: str, seconds: float) -> None:
        """Answer ``method path`` only ``seconds`` from now, as an API server slowed down by load
        (or a partition) does: every such request arriving before then waits until then."""
        self.stalls.append((method, path, time.monotonic() + seconds))

    def stall_left(self, method: str, path: str) -> float:
        now = time.monotonic()
        return max([until - now for m, p, until in self.stalls if (m, p) == (method, path)] + [0.0])

    def kubeconfig_for(self, token: str, namespace: str = "default", tls: bool = False) -> str:
        """Write a kubeconfig that authenticates with ``token`` (over HTTPS with ``tls``);
        returns its path."""
        path = self.data_dir / f"kubeconfig-{token[-12:]}{'-tls' if tls else ''}.yaml"
        self._write_kubeconfig(path, token, namespace, tls)
        return str(path)

    def start(self) -> KubeEmulator:
        if self._thread is not None:
            raise RuntimeError("KubeEmulator already started")
        if self._data_dir_arg is None:
            self.data_dir = Path(tempfile.mkdtemp(prefix="kubeemu-"))
            self._owns_data_dir = True
        else:
            self.data_dir = self._data_dir_arg
            self.data_dir.mkdir(parents=True, exist_ok=True)
        sockets = tornado.netutil.bind_sockets(self._port_wanted, "127.0.0.1",
                                               family=socket.AF_INET)
        self.port = sockets[0].getsockname()[1]
        tls_sockets = tornado.netutil.bind_sockets(0, "127.0.0.1", family=socket.AF_INET)
        self.tls_port = tls_sockets[0].getsockname()[1]
        self.ca_path, cert, key = make_certificates(self.data_dir / "pki")
        self._write_kubeconfig()
        self._write_kubeconfig(self.tls_kubeconfig_path, tls=True)
        self.kubelet = Kubelet(self)
        self.scheduler = Scheduler(self)
        self.controllers = Controllers(self)
        self.volumes = VolumeController(self)
        self.taint_eviction = TaintEviction(self)
        self.workloads = Workloads(self)
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            # this thread is the control plane (API server, scheduler, controllers, kubelet): it
            # runs at this process's niceness, no higher. On one machine it shares the CPUs with
            # the processes it hosts (a hub, its users' servers): a control plane that outweighed
            # them would stall their event loops when the machine is busy; it is kept fast by
            # doing little per start instead (bench/kubeemu_pod_start.py).
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self.loop = loop
            try:
                from .server import make_app

                app = make_app(self)
                self._server = tornado.httpserver.HTTPServer(app)
                self._server.add_sockets(sockets)
                self._tls_server = tornado.httpserver.HTTPServer(
                    app, ssl_options=server_context(cert, key))
                self._tls_server.add_sockets(tls_sockets)
            except BaseException as e:  # report to start()
                failure.append(e)
                ready.set()
                return
            loop.call_soon(ready.set)
            try:
                loop.run_forever()
            finally:
                with contextlib.suppress(Exception):
                    pending = asyncio.all_tasks(loop)
                    for t in pending:
                        t.cancel()
                    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                loop.close()

        self._thread = threading.Thread(target=run, name=f"kubeemu-{self.port}", daemon=True)
        self._thread.start()
        ready.wait(30)
        if failure:
            raise failure[0]
        for ns in list(SYSTEM_NAMESPACES) + self._initial_namespaces:
            with contextlib.suppress(ApiError):
                self.create({"metadata": {"name": ns}}, "namespaces")
        self.store.create(BY_KEY[("storage.k8s.io", "storageclasses")], None, STANDARD_CLASS)
        for node in self._initial_nodes:
            self.store.create(BY_KEY[("", "nodes")], None, node)
        _LIVE.add(self)
        # The control plane shares this process's interpreter: a full collection of the cyclic
        # garbage collector stops its thread as long as it walks every object (the test's and
        # its libraries' too: 127 ms of CPU for 200,000 objects, in the middle of a pod's start).
        # What lives now (modules, classes, the test's setup) is moved out of its walks, once
        # the garbage so far is collected (else it would never be).
        gc.collect()
        gc.freeze()
        log.info("kube emulator listening on %s (data in %s)", self.url, self.data_dir)
        return self

    def stop(self) -> None:
        """Stop every pod process, close watches, stop the server, remove temporary data."""
        if self._thread is None or self.loop is None:
            return
        loop = self.loop

        async def shutdown() -> None:
            await self.kubelet.shutdown()
            self.store.close_watchers()
            if self._server is not None:
                self._server.stop()
            if self._tls_server is not None:
                self._tls_server.stop()
            await asyncio.sleep(0.05)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.close_all_connections(), 2)

        try:
            fut = asyncio.run_coroutine_threadsafe(shutdown(), loop)
            fut.result(15)
        except Exception:
            log.exception("kube emulator shutdown")
        self.kubelet.kill_all()
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(10)
        self._thread = None
        _LIVE.discard(self)
        if self._owns_data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> KubeEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _write_kubeconfig(self, path: str | Path | None = None, token: str = "kubeemu-token",
                          namespace: str = "default", tls: bool = False) -> None:
        cluster = ({"server": self.https_url, "certificate-authority": str(self.ca_path)}
                   if tls else {"server": self.url})
        config = {
            "apiVersion": "v1", "kind": "Config", "preferences": {},
            "clusters": [{"name": "kubeemu", "cluster": cluster}],
            "users": [{"name": "kubeemu", "user": {"token": token}}],
            "contexts": [{"name": "kubeemu", "context": {"cluster": "kubeemu",
                                                         "user": "kubeemu",
                                                         "namespace": namespace}}],
            "current-context": "kubeemu",
        }
        Path(path or self.kubeconfig_path).write_text(yaml.safe_dump(config))

    # ------------------------------------------------------------------ loop helpers

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(fn, *args)

    # ------------------------------------------------------------------ direct access

    @staticmethod
    def _rt(plural: str, group: str = "") -> ResourceType:
        return by_plural(plural, group)

    def create(self, obj: Mapping[str, Any], plural: str | None = None,
               namespace: str | None = None, group: str = "") -> dict:
        """Create an object as a client would (validation, admission, events)."""
        obj = copy.deepcopy(dict(obj))
        if plural is None:
            plural = _plural_of(obj)
            group = (obj.get("apiVersion") or "v1").rpartition("/")[0]
        rt = self._rt(plural, group)
        if rt.namespaced:
            namespace = namespace or obj.get("metadata", {}).get("namespace") or "default"
        return self.store.create(rt, namespace if rt.namespaced else None, obj)

    def get(self, plural: str, name: str, namespace: str | None = "default",
            group: str = "") -> dict | None:
        rt = self._rt(plural, group)
        try:
            return self.store.get(rt, namespace if rt.namespaced else None, name)
        except ApiError as e:
            if e.code == 404:
                return None
            raise

    def list(self, plural: str, namespace: str | None = None, label_selector: str | None = None,
             field_selector: str | None = None, group: str = "") -> list[dict]:
        return self.store.list(self._rt(plural, group), namespace, label_selector,
                               field_selector)[0]

    def patch(self, plural: str, name: str, patch: Any, namespace: str | None = "default",
              patch_type: str = "merge", subresource: str | None = None,
              group: str = "") -> dict:
        rt = self._rt(plural, group)
        return self.store.patch(rt, namespace if rt.namespaced else None, name, patch_type,
                                patch, subresource)

    def delete(self, plural: str, name: str, namespace: str | None = "default",
               grace_period_seconds: int | None = None, propagation_policy: str | None = None,
               group: str = "") -> dict:
        rt = self._rt(plural, group)
        return self.store.delete(rt, namespace if rt.namespaced else None, name,
                                 grace_period_seconds, propagation_policy)[0]

    def add_node(self, name: str, labels: Mapping[str, str] | None = None,
                 annotations: Mapping[str, str] | None = None,
                 allocatable: Mapping[str, str | int] | None = None,
                 capacity: Mapping[str, str | int] | None = None,
                 taints: Sequence[Mapping[str, str]] = (), unschedulable: bool = False) -> dict:
        spec = NodeSpec(name, labels or {}, annotations or {}, allocatable or {}, capacity,
                        taints, unschedulable)
        return self.store.create(BY_KEY[("", "nodes")], None, spec.manifest())

    def remove_node(self, name: str) -> None:
        self.store.delete(BY_KEY[("", "nodes")], None, name)

    @property
    def audit_events(self) -> list[dict]:
        """Audit events that carry annotations (Pod Security ``audit`` mode), oldest first:
        ``{"verb", "objectRef": {"resource", "namespace", "name", "apiVersion"},
        "annotations"}``."""
        return list(self.store.audit)

    def compact(self, resource_version: int | None = None) -> None:
        """Drop watch history (like etcd compaction): older watches get 410 Gone."""
        self.store.compact(resource_version)

    def pod_root(self, name: str, namespace: str = "default") -> Path | None:
        """The running container's '/' as this (root) process can read it, or None."""
        pid = self.pod_pid(name, namespace)
        return Path(f"/proc/{pid}/root") if pid else None

    def pod_log(self, name: str, namespace: str = "default", container: str | None = None,
                previous: bool = False) -> str:
        """The log of the container's current run (``previous``: of the run before), as
        ``pods/log`` answers it; "" when there is none."""
        pod = self.get("pods", name, namespace)
        if pod is None:
            raise KeyError(f"pod {namespace}/{name} does not exist")
        container = container or pod["spec"]["containers"][0]["name"]
        path = self.kubelet.log_path(namespace, name, container, previous)
        if path is None or not path.exists():
            return ""
        return path.read_text(errors="replace")

    def pod_pid(self, name: str, namespace: str = "default") -> int | None:
        """Host pid of the running container's pid 1 (its first process), or None."""
        rt = self.kubelet.runtime_for(namespace, name)
        return rt.pid1 if rt and rt.proc and rt.proc.returncode is None else None

    def network_policy_allows(self, source: tuple[str, str], dest: tuple[str, str], port: int,
                              protocol: str = "TCP") -> bool:
        """Whether the stored NetworkPolicies let pod ``source`` (namespace, name) open
        ``port`` on pod ``dest`` — evaluated by ``netpol.py``; nothing enforces them here."""
        from . import netpol

        pods = {}
        for ns, name in (source, dest):
            pod = self.get("pods", name, ns)
            if pod is None:
                raise KeyError(f"pod {ns}/{name} does not exist")
            pods[(ns, name)] = pod
        policies = self.list("networkpolicies", group="networking.k8s.io")
        namespaces = {n["metadata"]["name"]: n["metadata"].get("labels") or {}
                      for n in self.list("namespaces")}
        return netpol.allowed(policies, pods[source], pods[dest], port, protocol, namespaces)

    def wait_for(self, predicate: Callable[[], Any], timeout: float = 10.0,
                 interval: float = 0.05, message: str = "condition",
                 explain: Callable[[], str] | None = None) -> Any:
        """Poll predicate() until truthy (returned) or raise TimeoutError naming `message`
        (and what ``explain()`` then says, e.g. ``helpers.leftovers``)."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                why = f"\n{explain()}" if explain is not None else ""
                raise TimeoutError(f"timed out after {timeout}s waiting for {message}{why}")
            time.sleep(interval)

    async def async_wait_for(self, predicate: Callable[[], Any | Awaitable[Any]],
                             timeout: float = 10.0, interval: float = 0.05,
                             message: str = "condition") -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if asyncio.iscoroutine(value) or isinstance(value, Awaitable):
                value = await value
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout}s waiting for {message}")
            await asyncio.sleep(interval)

    def wait_for_pod_phase(self, name: str, phases: str | Sequence[str],
                           namespace: str = "default", timeout: float = 10.0) -> dict:
        wanted = (phases,) if isinstance(phases, str) else tuple(phases)

        def check() -> dict | None:
            pod = self.get("pods", name, namespace)
            if pod and pod.get("status", {}).get("phase") in wanted:
                return pod
            return None

        return self.wait_for(check, timeout, message=f"pod {namespace}/{name} phase in {wanted}")

    # ------------------------------------------------------------------ internal services

    def record_event(self, obj: dict, reason: str, message: str, type: str = "Normal",
                     component: str = "kubelet", host: str | None = None,
                     field_path: str | None = None) -> None:
        meta = obj["metadata"]
        ns = meta.get("namespace") or "default"
        now = time.time()
        involved = {"kind": obj.get("kind", "Pod"), "namespace": meta.get("namespace"),
                    "name": meta["name"], "uid": meta.get("uid"),
                    "apiVersion": obj.get("apiVersion", "v1"),
                    "resourceVersion": meta.get("resourceVersion")}
        if field_path:
            involved["fieldPath"] = field_path
        event = {
            "metadata": {"name": f"{meta['name']}.{time.time_ns():x}", "namespace": ns},
            "involvedObject": involved, "reason": reason, "message": message, "type": type,
            "source": {"component": component, **({"host": host} if host else {})},
            "firstTimestamp": rfc3339(now), "lastTimestamp": rfc3339(now), "count": 1,
            "eventTime": None, "reportingComponent": component,
            "reportingInstance": host or "",
        }
        try:
            self.store.create(BY_KEY[("", "events")], ns, event)
        except ApiError:
            pass  # e.g. namespace terminating

    def bind_pod(self, namespace: str, name: str, binding: Any) -> None:
        """POST pods/<name>/binding: what a scheduler does."""
        from . import errors as E

        target = (binding or {}).get("target") or {}
        node = target.get("name")
        if not node:
            raise E.bad_request("Binding target name is required")
        pods = BY_KEY[("", "pods")]
        current = self.store.get(pods, namespace, name)
        if current["spec"].get("nodeName"):
            raise E.conflict("pods", "", name,
                             f'pod {name} is already assigned to node "'
                             f'{current["spec"]["nodeName"]}"')

        def bind(p: dict) -> None:
            p["spec"]["nodeName"] = node
            set_condition(p, "PodScheduled", "True")

        self.store.mutate(pods, namespace, name, bind)


def _plural_of(obj: Mapping[str, Any]) -> str:
    kind = obj.get("kind")
    api_version = obj.get("apiVersion") or "v1"
    group = api_version.rpartition("/")[0]
    for rt in BY_KEY.values():
        if rt.kind == kind and rt.group == group:
            return rt.plural
    raise ValueError(f"cannot tell the resource of kind {kind!r} (apiVersion {api_version!r});"
                     " pass plural= explicitly")


@atexit.register
def _kill_leftovers() -> None:
    for emu in list(_LIVE):
        with contextlib.suppress(Exception):
            emu.kubelet.kill_all()


__all__ = ["KubeEmulator", "NodeSpec", "micro_time"]
