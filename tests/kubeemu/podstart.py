"""The emulator's own share of a pod's start, from the kubelet's timeline of each pod.

Every moment is CLOCK_BOOTTIME seconds (the clock of ``/proc/<pid>/stat`` start times):

- ``created``: the API server stored the pod (its ADDED event);
- per container the kubelet ran, init containers first: ``started``, the moment its pid 1
  executed the container's program (the runtime sees its exec), and ``exited``, the moment
  that process ended (the runtime reaped it);
- ``running``: the kubelet wrote the pod Running; ``probe``: the start of the first readiness
  probe that succeeded; ``ready``: the kubelet wrote the Ready condition True.

What counts as the emulator's (API server, scheduler, kubelet, runtime) and what is the
programs' own:

- create -> process: from ``created`` to the first container's ``started``, plus, for each
  container after it, from the previous one's ``exited`` to its ``started``. What an init
  container's program does between its ``started`` and ``exited`` is that program's time
  (``init_program_s``), not the emulator's.
- running -> ready: without a readiness probe, ``ready - running`` (the same status write:
  0). With one, ``ready - probe``: the successful probe's own round trip and the status write.
  Until that probe, the pod waits for its program to answer, probing every
  ``periodSeconds`` as the kubelet does: the program's time and the pod's probe settings.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import pairwise


def now() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


@dataclass
class Timeline:
    """One pod's start as the kubelet saw it (module docstring)."""

    namespace: str
    name: str
    created: float
    runs: list[dict] = field(default_factory=list)  # {"container", "init", "started", "exited"}
    running: float | None = None
    probe: float | None = None
    ready: float | None = None
    steps: dict[str, float] = field(default_factory=dict)  # "kubelet", "volumes": the kubelet's steps
    #: the kubelet's (the emulator's event loop thread's) (CPU, run-queue wait) seconds so far
    #: (runtime.schedstat) at the starts and ends of its share: (what, cpu, wait), ``what``
    #: "begin" when it took the pod or saw an init container end, "spawn" when it asked the
    #: runtime for the next container (:meth:`loop_mark`)
    loop_sched: list[tuple[str, float, float]] = field(default_factory=list)

    def loop_mark(self, what: str, sched: tuple[float, float]) -> None:
        """The kubelet's thread's ``sched`` (runtime.schedstat) at ``what`` ("begin", "spawn"),
        kept until the pod's first container has started once."""
        if not any(not run["init"] for run in self.runs):
            self.loop_sched.append((what, *sched))

    def started(self, container: str, init: bool, spawned: float, started: float | None,
                marks: dict[str, float] | None = None, sched: dict | None = None) -> None:
        """The runtime of ``container`` was asked for at ``spawned``; its program ran at ``started``
        (kept until the pod's first container has started once). ``marks``: the runtime's own
        moments (``runtime``: forked by the runtime server, ``namespaces``: unshared, ``pid1``:
        forked, ``rootfs``: mounted, and pid 1's ``cgroup``: joined, ``exec``: about to exec);
        ``sched``: the runtime's and pid 1's (CPU, run-queue wait) seconds until ``started``."""
        if not any(not run["init"] for run in self.runs):
            self.runs.append({"container": container, "init": init, "spawned": spawned,
                              "started": started or now(), "exited": None, "marks": marks or {},
                              "sched": sched or {}})

    def ended(self, container: str, exited: float | None) -> None:
        """``container``'s program ended at ``exited``."""
        for run in reversed(self.runs):
            if run["container"] == container and run["exited"] is None:
                run["exited"] = exited or now()
                break

    def _until_main(self) -> list[dict]:
        out = []
        for run in self.runs:
            out.append(run)
            if not run["init"]:
                break
        return out

    def create_to_process(self) -> tuple[float, float] | None:
        """(the emulator's seconds, the init containers' programs' seconds) from the pod's
        creation to its (first) container's process; None before that process started."""
        runs = self._until_main()
        if not runs or runs[-1]["init"] or runs[-1]["started"] is None:
            return None
        emulator = program = 0.0
        previous_end = self.created
        for run in runs:
            if run["started"] is None or (run["init"] and run["exited"] is None):
                return None
            emulator += run["started"] - previous_end
            if run["init"]:
                program += run["exited"] - run["started"]
                previous_end = run["exited"]
        return emulator, program

    def split(self) -> dict[str, float] | None:
        """The create -> process part by step: the API server and scheduler until the kubelet
        takes the pod (``to_kubelet``), its volumes and hosts file (``volumes``), the kubelet until
        it asks the runtime for each container (``to_runtime``: image, environment, mounts, and
        after an init container its end), the runtime until each program runs (``runtime``).
        None before the process started."""
        runs = self._until_main()
        if self.create_to_process() is None or not {"kubelet", "volumes"} <= set(self.steps):
            return None
        return {
            "to_kubelet": self.steps["kubelet"] - self.created,
            "volumes": self.steps["volumes"] - self.steps["kubelet"],
            "to_runtime": runs[0]["spawned"] - self.steps["volumes"]
            + sum(b["spawned"] - a["exited"] for a, b in pairwise(runs)),
            "runtime": sum(r["started"] - r["spawned"] for r in runs),
        }

    def runtime_split(self) -> dict[str, float] | None:
        """:meth:`split`'s ``runtime`` by step, summed over the containers until the first one:
        the runtime server until the container's runtime is forked (``server``), that runtime
        until it has its namespaces (``namespaces``), until it has forked pid 1 and mounted the
        container's root (``rootfs``), pid 1 until it calls exec (``pid1``: its fork once the root is
        mounted, its cgroup, its root and user), its exec until the runtime sees it done
        (``exec``); and ``cgroup_late``: how long after the root was mounted pid 1 had joined its
        cgroup (its fork included; part of ``pid1``). None where the runtime did not say (:meth:`started`'s
        ``marks``)."""
        runs = self._until_main()
        keys = ("runtime", "namespaces", "pid1", "rootfs")
        if self.create_to_process() is None or not all(set(keys) <= set(r.get("marks") or {}) for r in runs):
            return None
        out = dict.fromkeys(("server", "namespaces", "rootfs", "pid1", "exec", "cgroup_late"), 0.0)
        for r in runs:
            m = r["marks"]
            out["server"] += m["runtime"] - r["spawned"]
            out["namespaces"] += m["namespaces"] - m["runtime"]
            out["rootfs"] += m["rootfs"] - m["namespaces"]
            execs = min(max(m.get("exec", r["started"]), m["rootfs"]), r["started"])
            out["pid1"] += execs - m["rootfs"]
            out["exec"] += r["started"] - execs
            out["cgroup_late"] += max(0.0, m.get("cgroup", m["rootfs"]) - m["rootfs"])
        return out

    def sched(self) -> dict[str, float] | None:
        """CPU against run-queue wait, in seconds, of the emulator's share: ``kubelet_cpu`` and
        ``kubelet_wait`` of the kubelet's thread from taking the pod to asking for its first
        container, and from each init container's end to asking for the next (that thread also
        serves the API and other pods meanwhile), ``runtime_cpu`` and
        ``runtime_wait`` of the containers' runtimes and pid 1s until each program ran (summed
        over the containers until the first one; the runtime and its pid 1 run side by side).
        A wait near the wall time says the machine's CPUs were busy, not that the step
        computed. None where not measured."""
        runs = self._until_main()
        if (self.create_to_process() is None or not self.loop_sched
                or not all({"runtime", "pid1"} <= set(r.get("sched") or {}) for r in runs)):
            return None
        cpu = wait = 0.0
        begun = None
        for what, c, w in self.loop_sched:
            if what == "begin":
                begun = (c, w)
            elif begun is not None:
                cpu, wait, begun = cpu + c - begun[0], wait + w - begun[1], None
        return {"kubelet_cpu": cpu, "kubelet_wait": wait,
                "runtime_cpu": sum(r["sched"]["runtime"][0] + r["sched"]["pid1"][0] for r in runs),
                "runtime_wait": sum(r["sched"]["runtime"][1] + r["sched"]["pid1"][1] for r in runs)}

    def running_to_ready(self) -> float | None:
        """The emulator's seconds from Running to Ready (module docstring), or None."""
        if self.running is None or self.ready is None:
            return None
        return self.ready - (self.probe if self.probe is not None else self.running)

    def line(self) -> str | None:
        """``kubeemu_pod_start NAME create_to_process_s=E init_program_s=P
        running_to_ready_s=R steps_s=to_kubelet:..,volumes:..,to_runtime:..,runtime:..
        runtime_steps_s=server:..,... sched_s=kubelet_cpu:..,...`` (R: '-' before Ready; the
        steps: :meth:`split`, :meth:`runtime_split` and :meth:`sched`, the last two where
        measured), or None before the process started."""
        parts = self.create_to_process()
        split = self.split()
        if parts is None or split is None:
            return None
        ready = self.running_to_ready()
        line = (f"kubeemu_pod_start {self.name} create_to_process_s={parts[0]:.3f} "
                f"init_program_s={parts[1]:.3f} "
                f"running_to_ready_s={'-' if ready is None else f'{ready:.3f}'} steps_s="
                + ",".join(f"{k}:{v:.3f}" for k, v in split.items()))
        for name, values in (("runtime_steps_s", self.runtime_split()), ("sched_s", self.sched())):
            if values is not None:
                line += f" {name}=" + ",".join(f"{k}:{v:.3f}" for k, v in values.items())
        return line


def report(timelines: list[Timeline]) -> list[str]:
    """:meth:`Timeline.line` of each pod whose process started, by pod name."""
    return [line for t in sorted(timelines, key=lambda t: (t.namespace, t.name)) if (line := t.line())]
