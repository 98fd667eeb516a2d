"""The Kubernetes emulator's own share of a pod's start, idle and with the CPUs busy.

    python bench/kubeemu_pod_start.py [--pods 10] [--hogs 2]

For each pod (one container, no readiness probe, run as a container by the emulator's
kubelet) it measures, in one run:

- create -> process: from the create call to the start of the container's first process
  (its ``/proc/<pid>/stat`` start time, kernel clock ticks since boot, compared with
  ``CLOCK_BOOTTIME``): the API server, scheduler and kubelet's part, before the program runs;
- running -> ready: from the moment the kubelet writes the pod Running to the moment it writes
  the Ready condition True (both seen through the store's event hook).

Then the same with ``--hogs`` processes spinning on the CPUs ("busy"), and idle again with pods
of an image that has its own filesystem (a small one made of this machine's sh and sleep,
tests/kubeemu/helpers.py tiny_image: the container's root is an overlay of that image, "image").
The last lines are ``kubeemu_pod_start <idle|busy|image> create_to_process_p50_s=... p90_s=...
max_s=... running_to_ready_max_s=...`` and the ratios busy/idle and image/idle of the p50s.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.kubeemu import KubeEmulator  # noqa: E402
from tests.kubeemu.helpers import pod, py, tiny_image  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def _boottime() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def _process_start(pid: int) -> float:
    """Start of a process in CLOCK_BOOTTIME seconds (10 ms resolution)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[19]) / TICKS


def _spin() -> None:
    while True:
        pass


TINY = "registry.bench/tiny:1"


def measure(emu: KubeEmulator, count: int, tag: str, image: bool = False) -> tuple[list[float], list[float]]:
    seen: dict[str, dict[str, float]] = {}

    def on_event(srt, ev) -> None:
        if srt.kind != "Pod" or ev.type != "MODIFIED":
            return
        name = ev.obj["metadata"]["name"]
        status = ev.obj.get("status") or {}
        marks = seen.setdefault(name, {})
        if status.get("phase") == "Running" and "running" not in marks:
            marks["running"] = _boottime()
        ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                    for c in status.get("conditions") or [])
        if ready and "ready" not in marks:
            marks["ready"] = _boottime()

    emu.store.subscribe(on_event)
    to_process, to_ready = [], []
    for i in range(count):
        name = f"{tag}-{i}"
        t0 = _boottime()
        manifest = pod(name, py("import time; time.sleep(600)"))
        if image:  # the image's ENTRYPOINT (sh -c) with these args
            manifest["spec"]["containers"][0].update(image=TINY, args=["exec sleep 600"])
            del manifest["spec"]["containers"][0]["command"]
        emu.create(manifest)
        emu.wait_for(lambda n=name: emu.pod_pid(n), timeout=60, interval=0.005,
                     message=f"{name}'s process")
        to_process.append(_process_start(emu.pod_pid(name)) - t0)
        emu.wait_for(lambda n=name: "ready" in seen.get(n, {}), timeout=60, interval=0.005,
                     message=f"{name} to be ready")
        to_ready.append(seen[name]["ready"] - seen[name]["running"])
        emu.delete("pods", name, grace_period_seconds=0)
    return to_process, to_ready


def report(tag: str, to_process: list[float], to_ready: list[float]) -> float:
    ordered = sorted(to_process)
    p50 = statistics.median(ordered)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    print(f"kubeemu_pod_start {tag} create_to_process_p50_s={p50:.3f} p90_s={p90:.3f} "
          f"max_s={ordered[-1]:.3f} running_to_ready_max_s={max(to_ready):.3f}")
    return p50


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pods", type=int, default=10)
    ap.add_argument("--hogs", type=int, default=2)
    args = ap.parse_args()
    with KubeEmulator() as emu, tempfile.TemporaryDirectory() as tmp:
        emu.images[TINY] = tiny_image(Path(tmp) / "rootfs", ("sh", "sleep"))
        measure(emu, 1, "warm")  # the netshim build and first imports
        idle = report("idle", *measure(emu, args.pods, "idle"))
        hogs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.hogs)]
        for h in hogs:
            h.start()
        try:
            busy = report("busy", *measure(emu, args.pods, "busy"))
        finally:
            for h in hogs:
                h.terminate()
                h.join()
        image = report("image", *measure(emu, args.pods, "image", image=True))
    print(f"kubeemu_pod_start busy/idle create_to_process_p50={busy / idle:.2f}")
    print(f"kubeemu_pod_start image/idle create_to_process_p50={image / idle:.2f}")


if __name__ == "__main__":
    main()
