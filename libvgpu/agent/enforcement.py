"""The node agent's backstop check: NVML's view of each shared card's processes against the
slices of this node's pods (:func:`libvgpu.backstop.evaluate`), and its effects (metrics,
Kubernetes Events; the kills are :class:`libvgpu.backstop.Backstop`'s).

A mixin of :class:`libvgpu.agent.app.NodeAgent`, beside :class:`~libvgpu.agent.podview.PodView`.
"""

from __future__ import annotations

from libvgpu.backstop import EVENT_REASONS, Finding, Proc, Slice, evaluate

from .kube import KubeError, ObjectRef
from .pods import process_name
from .usage import RegionMatch, match_regions


class BackstopCheck:
    """The backstop's check of the shared cards."""

    async def _check(self) -> None:
        cards = self._shared_cards()
        processes = self._processes(cards)
        pids = [p.pid for ps in processes.values() for p in ps]
        pod_of_pid = await self._pods_of(pids) if pids else {}
        other_pods = await self._other_pods(pod_of_pid)
        pods = list(self._pods.values())
        match: RegionMatch | None = None
        check_shim = self.backstop.check_shim and self.backend == "native"
        if check_shim:
            match = match_regions(pods, self._read_regions())
        findings: list[Finding] = []
        for g in cards:
            procs = processes.get(g.uuid, [])
            if not procs:
                continue
            slices = {}
            for pod in pods:
                a = pod.allocation
                if a is None or g.uuid not in a.gpu_uuids or pod.phase in ("Succeeded", "Failed"):
                    continue
                slices[a.id] = Slice(
                    allocation_id=a.id,
                    gpu_uuid=g.uuid,
                    limit_bytes=None if a.whole else a.memory_ceiling_mib << 20,  # an elastic slice's limit
                    pod=pod.key,
                    pod_uid=pod.uid,
                    user=a.owner.user,
                    registered=(a.id, g.uuid) in match.registered if match is not None else True,
                )
            views = []
            for p in procs:
                pod = pod_of_pid.get(p.pid)
                if self.backstop.recently_killed(p.pid) or (pod and pod.phase in ("Succeeded", "Failed")):
                    continue  # on its way out: the driver lists a process until it is reaped
                views.append(
                    Proc(
                        pid=p.pid,
                        used_bytes=p.used_bytes,
                        name=process_name(p.pid, self.proc_root),
                        pod=pod.key if pod else "",
                        pod_uid=pod.uid if pod else "",
                        allocation_id=pod.allocation.id if pod and pod.allocation else "",
                        other_pod=other_pods.get(p.pid, ""),
                    )
                )
            findings += evaluate(
                g.uuid,
                g.index,
                views,
                slices,
                tolerance_bytes=self.backstop.tolerance_bytes,
                check_unregistered=self.backstop.check_unregistered,
                check_shim=check_shim,
            )
        await self.backstop.act(findings, _AgentActions(self))


class _AgentActions:
    """The backstop's effects: metrics, Kubernetes Events."""

    def __init__(self, agent: BackstopCheck) -> None:
        self.agent = agent

    def count(self, finding: Finding) -> None:
        self.agent.metrics.violations.labels(self.agent.node_name, finding.gpu_uuid, finding.reason).inc()

    def killed(self, finding: Finding, proc: Proc) -> None:
        self.agent.metrics.kills.labels(self.agent.node_name, finding.gpu_uuid, finding.reason).inc()

    async def record(self, finding: Finding, message: str) -> None:
        agent = self.agent
        if finding.pod:
            namespace, name = finding.pod.split("/", 1)
            about = ObjectRef("Pod", name, namespace, finding.pod_uid)
        else:
            namespace = agent.node_event_namespace
            about = ObjectRef("Node", agent.node_name, "", agent.kube.node_uid)
        try:
            await agent.kube.event(about, EVENT_REASONS[finding.reason], message, namespace=namespace)
        except KubeError as e:
            agent.log.warning("Event not recorded: %s", e)
