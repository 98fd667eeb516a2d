"""The chart on a platform team's cluster next to zero-to-jupyterhub (issue 14): every manifest
valid on Kubernetes 1.29 to 1.33, two releases that do not collide, the node agent in a namespace
of its own at Pod Security 'privileged', the kernels' egress sandbox (z2jh's singleuser rules),
and the kernel pod the launcher writes checked against the Pod Security profiles."""

from __future__ import annotations

import ipaddress

import pytest

from tests.helm import tools
from tests.kubeemu.podsecurity import violations

try:
    tools.helm_path()
except tools.HelmMissing as e:
    pytest.skip(str(e), allow_module_level=True)

VERSIONS = ["1.29.0", "1.30.0", "1.31.0", "1.32.0", "1.33.0"]
VALUES_SETS = {"default": [], **{f.stem: [f] for f in tools.EXAMPLES}}
METADATA_IP = ipaddress.ip_address("169.254.169.254")
CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "PriorityClass", "Namespace"}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: tools.render(files) for name, files in VALUES_SETS.items()}


@pytest.mark.parametrize("version", VERSIONS)
def test_every_values_set_validates_on_each_supported_kubernetes(version, rendered):
    for docs in rendered.values():
        for doc in docs:
            tools.validate(doc, version)


def test_chart_promises_the_versions_it_is_validated_against():
    import yaml

    spec = yaml.safe_load((tools.CHART / "Chart.yaml").read_text())["kubeVersion"]
    assert spec == ">=1.29.0-0"


# ---- two releases on one cluster --------------------------------------------------------------


def _keys(docs: list[dict]) -> set[tuple[str, str, str]]:
    return {
        (d["kind"], "" if d["kind"] in CLUSTER_SCOPED else d["metadata"].get("namespace", ""), d["metadata"]["name"])
        for d in docs
    }


def test_two_releases_share_no_object_name_but_the_claims_namespace():
    """Cluster-scoped objects (ClusterRoles, bindings, PriorityClasses, the agent's Namespace) and
    namespaced ones in shared namespaces ('default' for Node events, the claims namespace) carry
    the release's name. The one object both render is the claims Namespace, which a release
    creates only where no other release has (test_claims_namespace_is_created_once) and no
    uninstall deletes (helm.sh/resource-policy: keep)."""
    a = tools.render(release="hub-a", namespace="team-a")
    b = tools.render(release="hub-b", namespace="team-b")
    assert _keys(a) & _keys(b) == {("Namespace", "", "elastic-gpu-claims")}
    [shared] = [d for d in a if d["kind"] == "Namespace" and d["metadata"]["name"] == "elastic-gpu-claims"]
    assert shared["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert "app.kubernetes.io/instance" not in shared["metadata"]["labels"]  # it belongs to no release
    assert {d["kind"] for d in a} >= {"ClusterRole", "ClusterRoleBinding", "PriorityClass"}


def test_priority_classes_are_named_after_the_release_by_default():
    docs = tools.render(release="elastic-gpu")
    assert {d["metadata"]["name"] for d in tools.find(docs, "PriorityClass")} == {
        "elastic-gpu-high",
        "elastic-gpu-default",
        "elastic-gpu-low",
    }
    docs = tools.render(release="hub-a")
    assert all(d["metadata"]["name"].startswith("hub-a-elastic-gpu-") for d in tools.find(docs, "PriorityClass"))


# ---- the node agent's own namespace -----------------------------------------------------------


def _agent_namespaces(docs: list[dict]) -> list[dict]:
    return [d for d in tools.find(docs, "Namespace") if d["metadata"]["name"].endswith("-node-agent")]


def test_node_agent_runs_in_its_own_privileged_namespace(rendered):
    docs = rendered["default"]
    [ns] = _agent_namespaces(docs)
    name = ns["metadata"]["name"]
    assert name != tools.NAMESPACE
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    ds = tools.one(docs, "DaemonSet")
    assert ds["metadata"]["namespace"] == name
    for kind in ("ServiceAccount", "ConfigMap", "Service"):
        agent = [d for d in tools.find(docs, kind) if d["metadata"]["name"].endswith("-node-agent")]
        assert [d["metadata"]["namespace"] for d in agent] == [name], kind
    subjects = [
        s for d in docs if d["kind"].endswith("Binding") for s in d["subjects"] if s["name"].endswith("-node-agent")
    ]
    assert subjects and all(s["namespace"] == name for s in subjects)
    # nothing else of ours lands there (but the uninstall hook's Job, which runs before the agent
    # is deleted): users' and the hub's pods stay at a stricter level
    hooks = [d for d in docs if "helm.sh/hook" in (d["metadata"].get("annotations") or {})]
    assert {d["kind"] for d in hooks if d["metadata"].get("namespace") == name} == {"Job", "ServiceAccount"}
    assert {d["kind"] for d in docs if d["metadata"].get("namespace") == name and d not in hooks} == {
        "DaemonSet",
        "ServiceAccount",
        "ConfigMap",
        "Service",
    }


def test_node_agent_namespace_can_be_an_existing_one():
    docs = tools.render(set_values=["nodeAgent.namespace.create=false", "nodeAgent.namespace.name=gpu-system"])
    assert [d["metadata"]["name"] for d in tools.find(docs, "Namespace")] == ["elastic-gpu-claims"]
    assert tools.one(docs, "DaemonSet")["metadata"]["namespace"] == "gpu-system"


def test_service_monitor_scrapes_the_agent_namespace_too():
    docs = tools.render(set_values=["monitoring.serviceMonitor.enabled=true"])
    sm = tools.one(docs, "ServiceMonitor")
    agent_ns = tools.one(docs, "DaemonSet")["metadata"]["namespace"]
    assert set(sm["spec"]["namespaceSelector"]["matchNames"]) == {tools.NAMESPACE, agent_ns}


# ---- the kernels' egress sandbox --------------------------------------------------------------


def _kernel_policy(docs: list[dict]) -> dict:
    return tools.one(docs, "NetworkPolicy", f"{tools.RELEASE}-elastic-gpu-kernels")


def _allowed_cidrs(policy: dict) -> list[tuple[ipaddress.IPv4Network, list, list]]:
    """(cidr, except, ports) of every ipBlock egress peer."""
    out = []
    for rule in policy["spec"]["egress"]:
        for peer in rule.get("to", []):
            block = peer.get("ipBlock")
            if block:
                out.append(
                    (
                        ipaddress.ip_network(block["cidr"]),
                        [ipaddress.ip_network(c) for c in block.get("except", [])],
                        rule.get("ports"),
                    )
                )
    return out


def _reachable(policy: dict, ip: str, port: int) -> bool:
    addr = ipaddress.ip_address(ip)
    for cidr, excepts, ports in _allowed_cidrs(policy):
        if addr in cidr and not any(addr in e for e in excepts):
            if not ports or any(p.get("port") == port for p in ports):
                return True
    return False


def test_kernel_pods_egress_is_z2jhs_singleuser_sandbox(rendered):
    policy = _kernel_policy(rendered["default"])
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    # DNS through kube-system
    dns = [r for r in policy["spec"]["egress"] if {"port": 53, "protocol": "UDP"} in (r.get("ports") or [])]
    assert dns and any(
        p.get("namespaceSelector") == {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}}
        for r in dns
        for p in r["to"]
    )
    # the internet, but not the cloud metadata service, nor nodes' kubelet/metrics ports
    assert _reachable(policy, "1.1.1.1", 443)
    assert not _reachable(policy, "169.254.169.254", 80)
    for node_ip in ("10.0.0.5", "172.16.3.4", "192.168.1.10"):
        for port in (10250, 10255, 9100, 9400):
            assert not _reachable(policy, node_ip, port), (node_ip, port)


def test_kernel_egress_rules_are_z2jhs_keys():
    docs = tools.render(
        set_values=[
            "networkPolicy.egressAllowRules.privateIPs=true",
            "networkPolicy.egressAllowRules.nonPrivateIPs=false",
        ]
    )
    policy = _kernel_policy(docs)
    assert _reachable(policy, "10.0.0.5", 5432)
    assert not _reachable(policy, "1.1.1.1", 443)
    assert not _reachable(policy, "169.254.169.254", 80)


def test_kernel_egress_can_be_left_open():
    policy = _kernel_policy(tools.render(set_values=["networkPolicy.egressEnabled=false"]))
    assert policy["spec"]["policyTypes"] == ["Ingress"]


def test_hub_may_read_the_claims_kernel_pods_mount(rendered):
    """The launcher reads a home claim's access modes to refuse a ReadWriteOnce mount on another node."""
    role = tools.one(rendered["default"], "Role", f"{tools.RELEASE}-elastic-gpu-hub")
    rules = [r for r in role["rules"] if "persistentvolumeclaims" in r["resources"]]
    assert rules == [{"apiGroups": [""], "resources": ["persistentvolumeclaims"], "verbs": ["get"]}]


# ---- the kernel pod against Pod Security --------------------------------------------------------


def _kernel_pod(backend: str) -> dict:
    from kubernetes_asyncio.client import models as k8s

    from hubext.allocator import GPUAllocator
    from hubext.backends import ServerRef
    from hubext.kernels import KernelRecord
    from hubext.kubernetes.launcher import KubernetesKernelLauncher
    from quotas import Allocation, Owner

    launcher = KubernetesKernelLauncher(namespace="jhub", gpu_backend=backend)
    record = KernelRecord(
        id="0" * 32,
        user="alice",
        server_name="",
        size="gpu-10g",
        allocation_id="a",
        section={"memory_mib": 10240},
        namespace="jhub",
        ports={"shell_port": 1, "iopub_port": 2, "stdin_port": 3, "control_port": 4, "hb_port": 5},
    )
    allocation = Allocation(
        id="a",
        owner=Owner(user="alice"),
        node="gpu-1",
        gpu_uuids=("GPU-1",),
        memory_mib=10240,
        cores_percent=25,
        priority_class="default",
        kind="kernel",
    )
    server = ServerRef(user="alice", pod_name="jupyter-alice", pod_uid="u", namespace="jhub", pod=k8s.V1Pod())
    try:
        pod = launcher._pod(record, allocation, server)
    finally:
        GPUAllocator.clear_instance()
    return _prune(pod.to_dict(serialize=True))


def _prune(value):
    """A client model's dict as the JSON the API server receives (no nulls)."""
    if isinstance(value, dict):
        return {k: _prune(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_prune(v) for v in value]
    return value


def test_scheduler_backend_kernel_pods_pass_the_restricted_profile():
    assert violations(_kernel_pod("hami"), "restricted") == []
    assert violations(_kernel_pod("whole"), "restricted") == []


def test_native_kernel_pods_pass_the_restricted_profile_too():
    """The shim's files come through the chart's claim (a persistentVolumeClaim volume, allowed
    even by 'restricted'), the limits file through the downward API: no hostPath."""
    pod = _kernel_pod("native")
    assert violations(pod, "baseline") == []
    assert violations(pod, "restricted") == []


# ---- the node agent's directory reaches GPU pods through a claim (Pod Security "baseline") --------


def test_gpu_pods_get_the_agent_directory_through_a_claim_bound_to_one_host_path(rendered):
    docs = rendered["default"]
    pv = tools.one(docs, "PersistentVolume")
    pvc = tools.one(docs, "PersistentVolumeClaim")
    assert pv["spec"]["hostPath"] == {"path": "/var/lib/elastic-gpu", "type": "DirectoryOrCreate"}
    assert pv["spec"]["persistentVolumeReclaimPolicy"] == "Retain"  # uninstall never deletes host files
    # reserved for our claim, statically bound: no StorageClass provisions another volume for it
    assert pv["spec"]["claimRef"] == {"namespace": tools.NAMESPACE, "name": pvc["metadata"]["name"]}
    assert pvc["spec"]["volumeName"] == pv["metadata"]["name"]
    assert pv["spec"]["storageClassName"] == pvc["spec"]["storageClassName"] == ""
    assert pv["spec"]["accessModes"] == pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["metadata"]["namespace"] == tools.NAMESPACE
    # nothing else of the chart mounts a host path outside the agent's own namespace
    agent_ns = tools.one(docs, "DaemonSet")["metadata"]["namespace"]
    for d in docs:
        spec = (d.get("spec") or {}).get("template", {}).get("spec", {})
        if any("hostPath" in v for v in spec.get("volumes") or []):
            assert d["metadata"]["namespace"] == agent_ns, d["metadata"]["name"]


def test_host_claim_is_the_one_the_spawner_mounts_by_default():
    from hubext.kubernetes.launcher import KubernetesKernelLauncher
    from hubext.kubernetes.spawner import ElasticGPUSpawner

    pvc = tools.one(tools.render(release="elastic-gpu"), "PersistentVolumeClaim")
    assert pvc["metadata"]["name"] == ElasticGPUSpawner.gpu_host_claim.default_value
    assert pvc["metadata"]["name"] == KubernetesKernelLauncher.gpu_host_claim.default_value


def test_host_claim_follows_the_user_namespace_and_the_host_dir(rendered):
    docs = rendered["separate-user-namespace"]
    assert tools.one(docs, "PersistentVolumeClaim")["metadata"]["namespace"] == "jupyter-users"
    docs = tools.render(set_values=["nodeAgent.hostLibDir=/opt/egpu"])
    assert tools.one(docs, "PersistentVolume")["spec"]["hostPath"]["path"] == "/opt/egpu"
    c = tools.one(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][c["args"].index("--host-lib-dir") + 1] == "/opt/egpu"


@pytest.mark.parametrize("values", [["gpuBackend=hami"], ["nodeAgent.hostClaim.create=false"]])
def test_no_host_claim_without_the_native_backend_or_when_the_admin_makes_it(values):
    docs = tools.render(set_values=values)
    assert not tools.find(docs, "PersistentVolume") and not tools.find(docs, "PersistentVolumeClaim")


# ---- users' servers in a namespace of their own ---------------------------------------------------


def _pod(name: str, ns: str, labels: dict, ip: str, ports: dict[str, int] | None = None) -> dict:
    container = {"name": "c", "ports": [{"name": n, "containerPort": p} for n, p in (ports or {}).items()]}
    return {
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {"containers": [container]},
        "status": {"podIP": ip},
    }


def test_users_servers_in_their_own_namespace_get_z2jhs_singleuser_policy_there(rendered):
    """z2jh renders its singleuser policy only in the hub's namespace: with userNamespace elsewhere
    the chart renders it there, evaluated here with the emulator's NetworkPolicy semantics."""
    from tests.kubeemu.netpol import allowed

    assert not [d for d in rendered["default"] if d["metadata"]["name"].endswith("-servers")]
    docs = rendered["separate-user-namespace"]
    policies = tools.find(docs, "NetworkPolicy")
    server = _pod("ada", "jupyter-users", {"component": "singleuser-server"}, "10.1.0.5", {"notebook-port": 8888})
    access = {"component": "proxy", "hub.jupyter.org/network-access-singleuser": "true"}
    proxy = _pod("proxy", "jhub", access, "10.1.0.2")
    hub = _pod("hub", "jhub", {"app": "jupyterhub", "component": "hub"}, "10.1.0.3", {"http": 8081})
    other = _pod("other", "jhub", {"component": "something"}, "10.1.0.4")
    kernel = _pod("kernel-ada", "jupyter-users", {"elastic-gpu.jupyter.org/kind": "kernel"}, "10.1.0.6")
    metadata = _pod("metadata", "x", {}, "169.254.169.254")
    internet = _pod("internet", "x", {}, "8.8.8.8")
    assert allowed(policies, proxy, server, 8888)
    assert not allowed(policies, other, server, 8888)
    assert not allowed(policies, proxy, server, 22)
    assert allowed(policies, server, hub, 8081)
    assert allowed(policies, server, proxy, 8000)
    # egress to the kernels: their own policies (the chart's and the broker's per kernel) decide
    ingress_only = [p for p in policies if p["metadata"]["name"].endswith("-servers")]
    assert allowed(ingress_only, server, kernel, 50001)
    assert allowed(policies, server, internet, 443)
    assert not allowed(policies, server, metadata, 80)
    assert not allowed(policies, server, other, 8888)  # private addresses: no
