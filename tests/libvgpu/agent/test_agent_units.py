"""The node agent's pieces without processes: names, cgroups, inventory, usage matching, the
backstop's rules and episodes, the host install, config errors and the metrics' names."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from libvgpu.agent import inventory
from libvgpu.agent.app import AgentError, NodeAgent
from libvgpu.agent.install import install_shim
from libvgpu.agent.metrics import AgentMetrics, Snapshot
from libvgpu.agent.nvml import GPUInfo, GPUProcess, GPUSample, MigInstance, mig_profile_of, model_name, sm_count_for
from libvgpu.agent.pods import PodInfo, parse_cgroup, pod_info
from libvgpu.agent.usage import allocation_usage, match_regions
from libvgpu.backstop import NO_SHIM, OVER_LIMIT, UNREGISTERED, Backstop, Finding, Proc, Slice, evaluate, to_kill
from libvgpu.regions import NodeContainer, NodeGPU
from quotas import Allocation, ConfigError, Owner

MIB = 1 << 20
REPO = Path(__file__).resolve().parents[3]


# ---- model names ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "memory_mib", "model"),
    [
        ("NVIDIA H100 80GB HBM3", 81559, "H100-80GB"),
        ("NVIDIA A100-SXM4-40GB", 40960, "A100-40GB"),
        ("NVIDIA A100-PCIE-80GB", 81920, "A100-80GB"),
        ("Tesla T4", 15360, "T4-16GB"),
        ("NVIDIA L40S", 46068, "L40S-48GB"),
        ("NVIDIA A10G", 23028, "A10G-24GB"),
        ("NVIDIA H100 NVL", 95830, "H100-94GB"),  # not the table's 80 GB card
        ("NVIDIA GeForce RTX 4090", 24564, "RTX-4090-24GB"),
        ("NVIDIA RTX A6000", 49140, "RTX-A6000-48GB"),
        ("Tesla V100-SXM2-32GB", 32768, "V100-32GB"),
    ],
)
def test_nvml_names_become_the_pools_model_strings(name, memory_mib, model):
    assert model_name(name, memory_mib) == model


def test_sm_counts_come_from_the_model_table_and_mig_profiles_from_names():
    assert sm_count_for("H100-80GB") == 132
    assert sm_count_for("A100-40GB") == 108
    assert sm_count_for("RTX-4090-24GB") == 0
    assert mig_profile_of("NVIDIA A100-SXM4-40GB MIG 3g.20gb") == "3g.20gb"
    assert mig_profile_of("NVIDIA H100 80GB HBM3 MIG 1g.10gb+me") == "1g.10gb+me"


# ---- cgroups ------------------------------------------------------------------------------------

UID = "1a2b3c4d-5e6f-4a8b-9c0d-1e2f3a4b5c6d"
CID = "0123456789abcdef" * 4


@pytest.mark.parametrize(
    "text",
    [
        # cgroup v2, systemd driver, containerd
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice/"
        f"cri-containerd-{CID}.scope\n",
        # cgroup v2, cgroupfs driver
        f"0::/kubepods/besteffort/pod{UID}/{CID}\n",
        # cgroup v1, Guaranteed QoS, several hierarchies
        f"12:pids:/kubepods/pod{UID}/{CID}\n11:memory:/kubepods/pod{UID}/{CID}\n1:name=systemd:/\n",
        # CRI-O, systemd driver
        f"0::/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/crio-{CID}.scope\n",
        # seen from inside a cgroup namespace (paths relative to the agent's own cgroup)
        f"0::/../../kubepods-besteffort-pod{UID.replace('-', '_')}.slice/docker-{CID}.scope\n",
    ],
)
def test_a_pods_process_is_found_from_its_cgroup_in_every_layout(text):
    found = parse_cgroup(text)
    assert found is not None
    assert found.pod_uid == UID and found.container_id == CID


@pytest.mark.parametrize("text", ["0::/system.slice/containerd.service\n", "0::/user.slice/user-0.slice\n", "", "x"])
def test_processes_outside_pods_have_no_pod(text):
    assert parse_cgroup(text) is None


# ---- inventory ------------------------------------------------------------------------------------

GPUS = [
    GPUInfo(0, "GPU-aaa", "NVIDIA H100 80GB HBM3", "H100-80GB", 81559, 132),
    GPUInfo(1, "GPU-bbb", "NVIDIA H100 80GB HBM3", "H100-80GB", 81559, 132, mig_enabled=True,
            mig_instances=(MigInstance("MIG-1", "3g.40gb", 40192, 60), MigInstance("MIG-2", "3g.40gb", 40192, 60))),
    GPUInfo(2, "GPU-ccc", "NVIDIA H100 80GB HBM3", "H100-80GB", 81559, 132),
]


def test_inventory_objects_use_the_documented_keys_and_the_pool_accepts_them():
    objs = inventory.gpu_objects(GPUS, memory_oversub=1.5, overrides={"2": {"mode": "whole"},
                                                                      "GPU-aaa": {"cores_oversub": 2.0}})
    inventory.validate("n1", objs)
    assert [o["mode"] for o in objs] == ["shared", "mig", "whole"]
    assert objs[1]["mig_profiles"] == ["3g.40gb", "3g.40gb"]
    assert objs[0]["cores_oversub"] == 2.0 and objs[0]["memory_oversub"] == 1.5
    assert {k for o in objs for k in o} == {"uuid", "model", "memory_mib", "sm_count", "mode", "mig_profiles",
                                           "index", "memory_oversub", "cores_oversub"}
    # MIG mode comes from the hardware, whatever the overrides say
    assert inventory.gpu_objects(GPUS, overrides={"1": {"mode": "shared"}})[1]["mode"] == "mig"


def test_inventory_the_pool_would_refuse_names_the_key():
    objs = inventory.gpu_objects(GPUS, overrides={"0": {"mode": "sliced"}})
    with pytest.raises(ConfigError, match=r"nodes\[0\]\.gpus\[0\]\.mode"):
        inventory.validate("n1", objs)
    with pytest.raises(ConfigError, match=r"NodeAgent\.gpu_overrides\.0: unknown key\(s\) speed"):
        inventory.check_overrides({"0": {"speed": 2}})


# ---- per-allocation usage from node regions -------------------------------------------------------


def _pod(name: str, alloc_id: str, memory_mib: int, uuids=("GPU-aaa",), phase="Running", whole=False) -> PodInfo:
    a = Allocation(id=alloc_id, owner=Owner(user=f"u-{name}", namespace="ns", workspace="ws"), node="n1",
                   gpu_uuids=tuple(uuids), memory_mib=memory_mib, cores_percent=50, priority_class="default",
                   whole=whole, kind="kernel")
    return PodInfo(name=name, namespace="jhub", uid=f"uid-{name}", phase=phase, allocation=a)


def _entry(i: int, name: str, limit_mib: int | None, used_mib: int, alive: bool | None = True,
           last: float | None = 1000.0) -> NodeContainer:
    return NodeContainer(index=i, container_id=0x100 + i, name=name, priority=0, cores_percent=None,
                         memory_limit_bytes=None if limit_mib is None else limit_mib * MIB,
                         memory_used_bytes=used_mib * MIB, last_launch_at=last, held_since=None, attached_at=1.0,
                         alive=alive)


def _regions(*entries: NodeContainer, uuid="GPU-aaa") -> dict[str, NodeGPU]:
    return {uuid: NodeGPU(uuid=uuid, path="/x", containers=tuple(entries))}


def test_region_entries_are_matched_by_name_then_by_a_unique_limit():
    pods = [_pod("a", "alloc-a", 1024), _pod("b", "alloc-b", 2048), _pod("c", "alloc-c", 512)]
    regions = _regions(_entry(0, "alloc-a", 1024, 100), _entry(1, "", 2048, 200), _entry(2, "", 4096, 300),
                       _entry(3, "alloc-c", 512, 50, alive=False))
    m = match_regions(pods, regions)
    assert [e.index for e in m.entries[("alloc-a", "GPU-aaa")]] == [0]
    assert [e.index for e in m.entries[("alloc-b", "GPU-aaa")]] == [1]
    assert ("alloc-c", "GPU-aaa") not in m.entries  # its only entry is dead
    assert m.registered == {("alloc-a", "GPU-aaa"), ("alloc-b", "GPU-aaa")}
    assert [e.index for e in m.unmatched["GPU-aaa"]] == [2]

    usage = {u.allocation_id: u for u in allocation_usage(
        pods, regions, {"GPU-aaa": [GPUProcess(7, "GPU-aaa", 60 * MIB)]}, {7: pods[2]}, m)}
    assert (usage["alloc-a"].used_bytes, usage["alloc-a"].limit_bytes, usage["alloc-a"].source) == (
        100 * MIB, 1024 * MIB, "shim")
    assert usage["alloc-a"].last_activity == 1000.0 and usage["alloc-a"].user == "u-a"
    # no shim entry: NVML's per-process figure for the pod's processes
    assert (usage["alloc-c"].used_bytes, usage["alloc-c"].source, usage["alloc-c"].last_activity) == (
        60 * MIB, "nvml", None)
    stray = usage[f"container-{0x102:016x}"]
    assert (stray.used_bytes, stray.pod, stray.workspace) == (300 * MIB, "", "")


def test_same_limit_allocations_are_registered_but_not_told_apart():
    pods = [_pod("a", "alloc-a", 1024), _pod("b", "alloc-b", 1024)]
    m = match_regions(pods, _regions(_entry(0, "", 1024, 10), _entry(1, "", 1024, 20)))
    assert m.registered == {("alloc-a", "GPU-aaa"), ("alloc-b", "GPU-aaa")}
    assert m.entries == {} and len(m.unmatched["GPU-aaa"]) == 2
    # none registered when no entry has their limit; finished pods hold nothing
    m = match_regions(pods + [_pod("z", "alloc-z", 64, phase="Succeeded")], _regions(_entry(0, "alloc-z", 64, 1)))
    assert m.registered == set() and [e.name for e in m.unmatched["GPU-aaa"]] == ["alloc-z"]


def test_whole_card_allocations_match_entries_without_a_limit():
    pods = [_pod("w", "alloc-w", 0, whole=True)]
    m = match_regions(pods, _regions(_entry(0, "", None, 5000)))
    [u] = allocation_usage(pods, _regions(_entry(0, "", None, 5000)), {}, {}, m)
    assert (u.allocation_id, u.used_bytes, u.limit_bytes) == ("alloc-w", 5000 * MIB, None)


def test_pod_info_reads_the_allocation_from_labels_and_annotations():
    from libvgpu import contract as L

    a = _pod("a", "alloc-a", 1024).allocation
    raw = {"metadata": {"name": "p", "namespace": "jhub", "uid": "U-1", "labels": L.allocation_labels(a),
                        "annotations": L.allocation_annotations(a)}, "status": {"phase": "Running"}}
    info = pod_info(raw)
    assert (info.key, info.uid, info.allocation.id, info.allocation.memory_mib) == ("jhub/p", "u-1", "alloc-a", 1024)
    assert pod_info({"metadata": {"name": "x", "labels": {}}}).allocation is None


# ---- the backstop's rules ------------------------------------------------------------------------


def _slice(alloc_id: str, limit_mib: int | None, registered=True) -> Slice:
    return Slice(alloc_id, "GPU-aaa", None if limit_mib is None else limit_mib * MIB, f"jhub/{alloc_id}",
                 f"uid-{alloc_id}", user="ada", registered=registered)


def _proc(pid: int, used_mib: int, alloc_id: str = "", pod: str = "") -> Proc:
    return Proc(pid=pid, used_bytes=used_mib * MIB, name="python", pod=pod, pod_uid=f"uid-{pod}" if pod else "",
                allocation_id=alloc_id)


def test_a_slice_is_exceeded_only_past_the_tolerance_summed_over_its_processes():
    slices = {"a": _slice("a", 1024)}
    tol = 64 * MIB
    assert evaluate("GPU-aaa", 0, [_proc(1, 600, "a"), _proc(2, 480, "a")], slices, tolerance_bytes=tol) == []
    [f] = evaluate("GPU-aaa", 0, [_proc(1, 600, "a"), _proc(2, 500, "a")], slices, tolerance_bytes=tol)
    assert (f.reason, f.used_bytes, f.limit_bytes, f.pod, f.user) == (OVER_LIMIT, 1100 * MIB, 1024 * MIB, "jhub/a",
                                                                       "ada")
    assert [p.pid for p in f.processes] == [1, 2]  # largest first
    assert [p.pid for p in to_kill(f, tol)] == [1]  # 500 MiB left fits the slice
    # a whole-card allocation has no memory limit to exceed
    assert evaluate("GPU-aaa", 0, [_proc(1, 70000, "w")], {"w": _slice("w", None)}, tolerance_bytes=tol) == []


def test_processes_without_a_slice_of_the_card_are_unregistered():
    slices = {"a": _slice("a", 1024)}
    procs = [_proc(1, 300), _proc(2, 10), _proc(3, 400, "other-card", pod="jhub/b")]
    found = evaluate("GPU-aaa", 0, procs, slices, tolerance_bytes=64 * MIB)
    assert [(f.reason, f.processes[0].pid, f.pod) for f in found] == [(UNREGISTERED, 1, ""),
                                                                     (UNREGISTERED, 3, "jhub/b")]
    assert [p.pid for p in to_kill(found[0], 0)] == [1]
    assert evaluate("GPU-aaa", 0, procs, slices, tolerance_bytes=0, check_unregistered=False) == []


def test_an_allocation_whose_shim_never_registered_is_reported_not_killed():
    [f] = evaluate("GPU-aaa", 0, [_proc(1, 100, "a")], {"a": _slice("a", 1024, registered=False)},
                   tolerance_bytes=0)
    assert f.reason == NO_SHIM and to_kill(f, 0) == []
    assert evaluate("GPU-aaa", 0, [_proc(1, 100, "a")], {"a": _slice("a", 1024, registered=False)},
                    tolerance_bytes=0, check_shim=False) == []


class _Actions:
    """Records what the backstop does."""

    def __init__(self) -> None:
        self.counted: list[str] = []
        self.killed_pids: list[int] = []
        self.events: list[tuple[str, str, str]] = []

    def count(self, f: Finding) -> None:
        self.counted.append(f.reason)

    def killed(self, f: Finding, p: Proc) -> None:
        self.killed_pids.append(p.pid)

    async def record(self, f: Finding, message: str) -> None:
        self.events.append((f.reason, f.pod, message))


def _over(pid: int = 11, used_mib: int = 2048) -> Finding:
    return evaluate("GPU-aaa", 3, [_proc(pid, used_mib, "a")], {"a": _slice("a", 1024)}, tolerance_bytes=0)[0]


def test_a_finding_is_acted_on_once_per_episode_after_it_is_confirmed():
    kills: list[int] = []
    b = Backstop(confirm_checks=2, action="report", kill=lambda pid: kills.append(pid) or "")
    acts = _Actions()
    run = asyncio.run
    assert run(b.act([_over()], acts)) == []  # seen once: not yet
    assert len(run(b.act([_over()], acts))) == 1
    assert run(b.act([_over()], acts)) == []  # the same episode
    assert acts.counted == [OVER_LIMIT] and kills == []
    reason, pod, message = acts.events[0]
    assert pod == "jhub/a" and "2 GiB" in message and "1 GiB" in message and "GPU 3" in message
    assert "Reported only (Backstop.action is 'report')." in message
    run(b.act([], acts))  # usage back under the slice: the episode ends
    run(b.act([_over()], acts))
    run(b.act([_over()], acts))
    assert acts.counted == [OVER_LIMIT, OVER_LIMIT]


def test_the_kill_policy_kills_and_says_so_and_leaves_killed_pids_alone():
    now = [0.0]
    kills: list[int] = []

    def kill(pid: int) -> str:
        kills.append(pid)
        return "permission denied (the agent needs CAP_KILL and hostPID)" if pid == 13 else ""

    b = Backstop(confirm_checks=1, action="kill", kill=kill, clock=lambda: now[0])
    acts = _Actions()
    two = evaluate("GPU-aaa", 0, [_proc(12, 900, "a"), _proc(13, 800, "a")], {"a": _slice("a", 512)},
                   tolerance_bytes=0)
    asyncio.run(b.act(two, acts))
    assert kills == [12, 13] and acts.killed_pids == [12]
    message = acts.events[0][2]
    assert "Killed process 12." in message and "Could not kill 13: permission denied" in message
    assert b.recently_killed(12) and not b.recently_killed(13)
    now[0] = 61.0
    assert not b.recently_killed(12)


def test_backstop_settings_are_validated_with_the_allowed_values():
    from traitlets import TraitError

    with pytest.raises(TraitError, match="report.*kill"):
        Backstop(action="explode")
    with pytest.raises(TraitError):
        Backstop(tolerance_mib=-1)


# ---- installing the shim ------------------------------------------------------------------------


def test_install_is_atomic_idempotent_and_names_the_library_inside_pods(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    files = []
    for name, data in (("libvgpu.so", b"v1"), ("libvgpu-cuda.so", b"c"), ("libvgpu-nvml.so", b"n")):
        (src / name).write_bytes(data)
        files.append(str(src / name))
    host = tmp_path / "host"
    first = install_shim(host, "/opt/egpu/", sources=files)
    assert set(first.changed) == {"libvgpu.so", "libvgpu-cuda.so", "libvgpu-nvml.so", "ld.so.preload"}
    assert (host / "ld.so.preload").read_text() == "/opt/egpu/libvgpu.so\n"
    assert (host / "regions").stat().st_mode & 0o7777 == 0o755  # the agent's: pods plant nothing there
    inode = (host / "lib" / "libvgpu.so").stat().st_ino
    assert install_shim(host, "/opt/egpu", sources=files).changed == ()
    (src / "libvgpu.so").write_bytes(b"v2")
    again = install_shim(host, "/opt/egpu", sources=files)
    assert again.changed == ("libvgpu.so",)
    new = host / "lib" / "libvgpu.so"
    assert new.read_bytes() == b"v2" and new.stat().st_ino != inode  # renamed into place, not rewritten
    assert not [p for p in (host / "lib").iterdir() if p.name.startswith(".")]


def test_install_replaces_the_empty_directory_a_kubelet_left_where_the_preload_file_goes(tmp_path):
    """GPU pods mount <host dir>/ld.so.preload as a subPath; a pod that lands before the agent
    wrote it makes the kubelet create a directory there. The agent then failed every install
    (IsADirectoryError), so no pod on that node ever got the shim preloaded."""
    src = tmp_path / "src"
    src.mkdir()
    files = []
    for name in ("libvgpu.so", "libvgpu-cuda.so", "libvgpu-nvml.so"):
        (src / name).write_bytes(b"x")
        files.append(str(src / name))
    host = tmp_path / "host"
    (host / "ld.so.preload").mkdir(parents=True)  # what the kubelet makes for a missing subPath
    installed = install_shim(host, "/opt/egpu", sources=files)
    assert "ld.so.preload" in installed.changed
    assert (host / "ld.so.preload").read_text() == "/opt/egpu/libvgpu.so\n"
    # a directory with something in it is not the kubelet's: left alone, with the reason
    (host / "ld.so.preload").unlink()
    (host / "ld.so.preload").mkdir()
    (host / "ld.so.preload" / "keep").write_text("")
    with pytest.raises(OSError, match="ld.so.preload is a directory"):
        install_shim(host, "/opt/egpu", sources=files)


# ---- configuration ---------------------------------------------------------------------------------


def _init(tmp_path: Path, config: str | None, *args: str) -> NodeAgent:
    argv = ["--node-name", "n1", *args]
    if config is not None:
        (tmp_path / "c.yaml").write_text(config)
        argv += ["--config", str(tmp_path / "c.yaml")]
    app = NodeAgent()
    app.initialize(argv)
    return app


def test_the_config_file_sets_traits_and_the_command_line_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_GPU_BACKEND", "whole")
    app = _init(tmp_path, "NodeAgent: {metrics_port: 9999, pod_namespace: jhub}\nBackstop: {action: kill}\n",
                "--metrics-port", "9400")
    assert (app.metrics_port, app.pod_namespace, app.backstop.action) == (9400, "jhub", "kill")
    assert (app.backend, app.default_mode) == ("whole", "whole")
    assert _init(tmp_path, "").node_name == "n1"  # an empty file (the chart's default `{}` too)
    assert _init(tmp_path, "{}").backstop.tolerance_mib == 256


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("Agent: {}\n", "unknown section 'Agent' (allowed: NodeAgent, Backstop)"),
        ("Backstop: {tolerance_mb: 10}\n", "Backstop.tolerance_mb is not a setting (allowed: action, check_shim"),
        ("NodeAgent: {gpu_overrides: {'0': {speed: 2}}}\n", "NodeAgent.gpu_overrides.0: unknown key(s) speed"),
        ("NodeAgent: {metrics_port: many}\n", "invalid setting: The 'metrics_port' trait"),
        ("- a\n- b\n", "must be a mapping of NodeAgent / Backstop sections"),
        ("NodeAgent: {a: [}\n", "not valid YAML"),
    ],
)
def test_config_mistakes_are_refused_naming_the_key(tmp_path, config, message):
    with pytest.raises(AgentError) as err:
        _init(tmp_path, config)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_the_node_name_is_required(tmp_path, monkeypatch):
    monkeypatch.delenv("NODE_NAME", raising=False)
    with pytest.raises(AgentError, match="--node-name is required"):
        NodeAgent().initialize([])


# ---- metrics ----------------------------------------------------------------------------------------


def _dashboard_metrics() -> set[str]:
    dash = json.loads((REPO / "helm" / "elastic-gpu" / "dashboards" / "grafana.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p.get("targets", []))
    return {m for m in re.findall(r"\belastic_gpu_[a-z_]+\b", exprs) if not m.startswith("elastic_gpu_culler_")}


def test_the_registry_serves_every_series_the_dashboard_queries_with_its_labels():
    m = AgentMetrics("n1", "native", "550.54")
    gpu = GPUS[0]
    m.declare_gpus([gpu], ("over-limit",))
    m.count_xid(gpu, gpu.uuid, 79)
    pods = [_pod("a", "alloc-a", 1024)]
    usage = allocation_usage(pods, _regions(_entry(0, "alloc-a", 1024, 100)), {}, {})
    m.update(Snapshot(gpus=[gpu], samples={gpu.uuid: GPUSample(gpu.uuid, 5 * MIB, 81559 * MIB, 0.25, 61.0)},
                      allocations=usage, xid_supported={gpu.uuid: True}))
    text = generate_latest(m.registry).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    names = {name for name, _ in samples}
    assert _dashboard_metrics() <= names, sorted(_dashboard_metrics() - names)
    g = (("gpu_index", "0"), ("gpu_uuid", "GPU-aaa"), ("model", "H100-80GB"), ("node", "n1"))
    assert samples[("elastic_gpu_utilization_ratio", g)] == 0.25
    assert samples[("elastic_gpu_temperature_celsius", g)] == 61.0
    a = (("allocation_id", "alloc-a"), ("gpu_uuid", "GPU-aaa"), ("kind", "kernel"), ("namespace", "ns"),
         ("node", "n1"), ("pod", "a"), ("user", "u-a"), ("workspace", "ws"))
    assert samples[("elastic_gpu_allocation_memory_used_bytes", a)] == 100 * MIB
    assert samples[("elastic_gpu_allocation_memory_limit_bytes", a)] == 1024 * MIB
    assert samples[("elastic_gpu_allocation_last_activity_timestamp_seconds", a)] == 1000.0
    assert samples[("elastic_gpu_enforcement_violations_total",
                    (("gpu_uuid", "GPU-aaa"), ("node", "n1"), ("reason", "over-limit")))] == 0
    assert samples[("elastic_gpu_xid_errors_total",
                    (("gpu_index", "0"), ("gpu_uuid", "GPU-aaa"), ("node", "n1"), ("xid", "79")))] == 1



# ---- republishing ---------------------------------------------------------------------------------


class _FakeNVML:
    def __init__(self, gpus: list[GPUInfo]) -> None:
        self.gpus = gpus

    def discover(self) -> list[GPUInfo]:
        return list(self.gpus)


class _FakeKube:
    def __init__(self) -> None:
        self.label: str | None = None
        self.annotation: str | None = None
        self.uninstall_requested = ""  # the chart's uninstall hook has not asked
        self.patches = 0

    async def node_inventory(self):
        return self.label, self.annotation

    async def publish_inventory(self, text: str, has_gpus: bool) -> None:
        self.patches += 1
        self.label, self.annotation = ("true" if has_gpus else None), text


def test_the_inventory_is_republished_only_when_the_gpus_or_the_node_changed(tmp_path):
    app = _init(tmp_path, None)
    app.nvml, app.kube = _FakeNVML(GPUS[:1]), _FakeKube()
    app.metrics = AgentMetrics("n1")
    app.gpus, app._published = [], None

    async def scenario() -> None:
        await app._rediscover()
        assert app.kube.patches == 1 and [g["uuid"] for g in json.loads(app.kube.annotation)] == ["GPU-aaa"]
        await app._rediscover()
        assert app.kube.patches == 1  # nothing changed: no patch
        app.nvml.gpus = GPUS  # a card appeared (or MIG was switched on)
        await app._rediscover()
        assert app.kube.patches == 2 and [g["mode"] for g in json.loads(app.kube.annotation)] == [
            "shared", "mig", "shared"]
        app.kube.annotation = "[]"  # someone else edited the node
        await app._rediscover()
        assert app.kube.patches == 3 and len(json.loads(app.kube.annotation)) == 3
        app.nvml.gpus = []  # the driver lost every card: no label, an empty list
        await app._rediscover()
        assert (app.kube.label, app.kube.annotation) == (None, "[]")

    asyncio.run(scenario())


# ---- the watch of the node's pods ------------------------------------------------------------------


class _PodWatchKube:
    """The node's pods as one watch shows them: each pod the test puts in ``changes``, as it comes;
    each watch opened is counted."""

    def __init__(self) -> None:
        self.changes: asyncio.Queue[dict] = asyncio.Queue()
        self.watches: list[str] = []

    async def watch_node_pods(self, namespace: str = ""):
        self.watches.append(namespace)
        while True:
            yield await self.changes.get()


def test_one_watch_of_the_nodes_pods_wakes_the_swap_loop_and_the_last_burst_of_a_deleted_elastic_pod(tmp_path):
    from dataclasses import replace

    from libvgpu import contract as L

    elastic = replace(_pod("e", "alloc-e", 1024).allocation, memory_limit_mib=4096)
    fixed = _pod("f", "alloc-f", 1024).allocation
    assert elastic.elastic and not fixed.elastic

    def raw(name: str, alloc: Allocation | None, deleting: bool, **annotations: str) -> dict:
        meta = {"name": name, "namespace": "jhub", "uid": f"uid-{name}", "labels": {}, "annotations": annotations}
        if alloc is not None:
            meta["labels"] = L.allocation_labels(alloc)
            meta["annotations"] = {**L.allocation_annotations(alloc), **annotations}
        if deleting:
            meta["deletionTimestamp"] = "2026-11-30T03:00:00Z"
        return {"metadata": meta, "status": {"phase": "Running"}}

    app = _init(tmp_path, None)

    async def scenario() -> None:
        app.kube = kube = _PodWatchKube()
        app._swap_wake, app._deletion_wake = asyncio.Event(), asyncio.Event()
        watch = asyncio.ensure_future(app._watch_pods("jhub"))
        try:
            kube.changes.put_nowait(raw("f", fixed, True))  # a fixed slice being deleted: no last burst
            kube.changes.put_nowait(raw("k", None, False, **{L.A_SWAP: json.dumps({"action": "suspend",
                                                                                   "generation": 1})}))
            await asyncio.wait_for(app._swap_wake.wait(), 10)
            assert not app._deletion_wake.is_set()  # the stream's order: "f" was seen before "k"
            kube.changes.put_nowait(raw("e", elastic, True))
            await asyncio.wait_for(app._deletion_wake.wait(), 10)
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
        assert kube.watches == ["jhub"]

    asyncio.run(scenario())
