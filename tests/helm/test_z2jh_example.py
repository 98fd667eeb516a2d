"""The z2jh side of the integration (helm/examples-z2jh/values.yaml and docs/helm.md) agrees with
what our chart renders, and its hub config and profiles are what the hub accepts."""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

import pytest
import yaml

from libvgpu import contract as L
from tests.helm import tools

try:
    tools.helm_path()
except tools.HelmMissing as e:
    pytest.skip(str(e), allow_module_level=True)

Z2JH_VALUES = tools.Z2JH_EXAMPLES / "values.yaml"
DOC = tools.REPO / "docs" / "helm.md"


@pytest.fixture(scope="module")
def z2jh() -> dict:
    return yaml.safe_load(Z2JH_VALUES.read_text())


@pytest.fixture(scope="module")
def ours() -> list[dict]:
    """Our chart as the z2jh example expects it: release 'elastic-gpu' in the hub's namespace."""
    return tools.render([tools.CHART / "examples" / "z2jh-integration.yaml"], release="elastic-gpu")


def _extra_config(z2jh: dict) -> str:
    return "\n".join(z2jh["hub"]["extraConfig"].values())


def test_z2jh_values_are_not_picked_up_as_our_examples():
    assert Z2JH_VALUES.is_file()
    assert tools.CHART not in Z2JH_VALUES.parents


def test_hub_mounts_our_admission_configmap_where_the_allocator_reads_it(z2jh, ours):
    volumes = {v["name"]: v for v in z2jh["hub"]["extraVolumes"]}
    mounts = {m["name"]: m for m in z2jh["hub"]["extraVolumeMounts"]}
    (name,) = [n for n, v in volumes.items() if "configMap" in v]
    cm = tools.one(ours, "ConfigMap", volumes[name]["configMap"]["name"])
    path = PurePosixPath(mounts[name]["mountPath"]) / "config.yaml"
    assert "config.yaml" in cm["data"]
    assert f'admission_config_file = "{path}"' in _extra_config(z2jh)


def test_hub_reads_the_prices_of_our_chart_from_the_mounted_configmap(z2jh, ours, tmp_path):
    """metering.json of our ConfigMap, where the hub config points c.UsageMeter.prices_file,
    gives the UsageMeter the currency and prices of our values."""
    from hubext.metering.meter import UsageMeter

    volumes = {v["name"]: v for v in z2jh["hub"]["extraVolumes"]}
    mounts = {m["name"]: m for m in z2jh["hub"]["extraVolumeMounts"]}
    (name,) = [n for n, v in volumes.items() if "configMap" in v]
    cm = tools.one(ours, "ConfigMap", volumes[name]["configMap"]["name"])
    path = PurePosixPath(mounts[name]["mountPath"]) / "metering.json"
    assert f'UsageMeter.prices_file = "{path}"' in _extra_config(z2jh)
    local = tmp_path / "metering.json"
    local.write_text(cm["data"]["metering.json"])
    table = UsageMeter(prices_file=str(local)).price_table()
    values = yaml.safe_load((tools.CHART / "examples" / "z2jh-integration.yaml").read_text())["metering"]
    assert table.currency == values["currency"] == "EUR"
    assert table.models["H100-80GB"].gpu_hour == 3.2
    assert (table.models["A100-40GB"].memory_gib_hour, table.models["A100-40GB"].compute_hour) == (0.02, 0.9)
    assert table.price_of("T4").gpu_hour == 1.0  # "*"


def test_users_service_account_and_culler_token_match_our_chart(z2jh, ours):
    sa = tools.one(ours, "ServiceAccount", z2jh["singleuser"]["serviceAccountName"])
    assert sa["automountServiceAccountToken"] is False
    # GPU kernel pods run as the same ServiceAccount
    assert f'KubernetesKernelLauncher.service_account = "{sa["metadata"]["name"]}"' in _extra_config(z2jh)
    dep = tools.one(ours, "Deployment", "elastic-gpu-culler")
    env = {e["name"]: e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    ref = env["JUPYTERHUB_API_TOKEN"]["valueFrom"]["secretKeyRef"]
    (service,) = z2jh["hub"]["services"]
    assert ref == {"name": "hub", "key": f"hub.services.{service}.apiToken"}
    assert env["JUPYTERHUB_SERVICE_NAME"]["value"] == service
    assert f'culler.service_role("{service}"' in _extra_config(z2jh)


def test_backend_and_prefix_in_hub_config_match_our_chart(z2jh, ours):
    config = _extra_config(z2jh)
    values = yaml.safe_load((tools.CHART / "examples" / "z2jh-integration.yaml").read_text())
    assert f'gpu_backend = "{values["gpuBackend"]}"' in config
    prefix = re.search(r'gpu_priority_class_prefix = "([^"]*)"', config).group(1)
    pcs = {d["metadata"]["name"] for d in tools.find(ours, "PriorityClass")}
    assert pcs == {prefix + c for c in values["admission"]["priority_classes"]}
    claim = re.search(r'gpu_host_claim = "([^"]*)"', config).group(1)
    pvc = tools.one(ours, "PersistentVolumeClaim", claim)
    pv = tools.one(ours, "PersistentVolume", pvc["spec"]["volumeName"])
    assert pv["spec"]["hostPath"]["path"] == values["nodeAgent"]["hostLibDir"]
    # the hub writes its claims where our chart made the namespace and gave it a Role
    claims_ns = re.search(r'claims_namespace = "([^"]*)"', config).group(1)
    [role] = [r for r in tools.find(ours, "Role") if r["metadata"]["name"].endswith("-hub-claims")]
    assert role["metadata"]["namespace"] == claims_ns


def test_singleuser_egress_reaches_the_pods_our_kernel_policy_guards(z2jh, ours):
    np = tools.one(ours, "NetworkPolicy", "elastic-gpu-kernels")
    peers = [p for rule in z2jh["singleuser"]["networkPolicy"]["egress"] for p in rule["to"]]
    assert {"podSelector": np["spec"]["podSelector"]} in peers


def test_hub_extra_config_is_valid_python(z2jh):
    for name, code in z2jh["hub"]["extraConfig"].items():
        compile(code, f"hub.extraConfig.{name}", "exec")


def test_hub_extra_config_configures_the_hub(z2jh):
    """Run the snippet on a traitlets Config as z2jh's jupyterhub_config.py does."""
    pytest.importorskip("hubext.hubconfig", exc_type=ImportError)
    pytest.importorskip("hubext.broker", exc_type=ImportError)
    from traitlets.config import Config

    c = Config()
    exec(compile(_extra_config(z2jh), "hub.extraConfig", "exec"), {"c": c, "get_config": lambda: c})
    assert c.JupyterHub.spawner_class == "hubext.ElasticGPUSpawner"
    assert c.GPUAllocator.admission_config_file == "/etc/elastic-gpu/config.yaml"
    assert c.ElasticGPUSpawner.gpu_backend == "native"
    assert c.KubeSpawner.automount_service_account_token is False
    assert c.KubernetesKernelLauncher.service_account == "elastic-gpu-user"
    roles = c.JupyterHub.load_roles
    roles = roles.get_value([]) if hasattr(roles, "get_value") else roles
    (culler_role,) = [r for r in roles if r.get("services") == ["elastic-gpu-culler"]]
    # the culler's token never opens users' servers (it asks the broker for the user's own token)
    assert not {"access:servers", "admin:servers"} & set(culler_role["scopes"])
    assert not any(s.get("name") == "gpu-culler" for s in c.JupyterHub.get("services", []))


def _gpu_sections(z2jh: dict) -> list[tuple[str, dict, dict]]:
    """(where, profile, user_options) for every profile and every option choice."""
    out = []
    for p in z2jh["singleuser"]["profileList"]:
        opts = p.get("profile_options") or {}
        if not opts:
            out.append((p["slug"], p, {}))
        for opt_name, opt in opts.items():
            for choice in opt["choices"]:
                out.append((f"{p['slug']}/{opt_name}={choice}", p, {opt_name: choice}))
    return out


def test_profiles_have_the_documented_gpu_sections(z2jh):
    slugs = [p["slug"] for p in z2jh["singleuser"]["profileList"]]
    assert len(slugs) == len(set(slugs))
    quarter = next(p for p in z2jh["singleuser"]["profileList"] if p["slug"] == "h100-quarter")
    assert quarter["display_name"] == "1/4 H100 — 20 GiB, 25 %"
    assert quarter["gpu"] == {
        "memory_mib": 20480,
        "cores_percent": 25,
        "count": 1,
        "model": "H100-80GB",
        "priority_class": "default",
    }
    assert "kubespawner_override" in quarter
    assert any(p.get("profile_options") for p in z2jh["singleuser"]["profileList"])


def test_profiles_are_accepted_by_the_spawner_and_admission(z2jh, ours):
    """Every profile/choice's gpu section passes the spawner's validation, names a priority class
    of the admission config, and (for GPU ones) is a valid request against an H100 pool."""
    requests = pytest.importorskip("hubext.requests", exc_type=ImportError)
    quotas = pytest.importorskip("quotas", exc_type=ImportError)
    for name in ("load_config", "parse_simulated", "AdmissionState", "GPURequest", "Owner"):
        if not hasattr(quotas, name):
            pytest.skip(f"quotas.{name} is not written yet")
    cm = tools.one(ours, "ConfigMap", "elastic-gpu-admission")
    admission = yaml.safe_load(cm["data"]["config.yaml"])
    config = quotas.load_config(admission)
    state = quotas.AdmissionState(config, quotas.parse_simulated("4xH100-80GB"))
    gpu_count = 0
    for where, profile, options in _gpu_sections(z2jh):
        section = requests.profile_gpu_section(profile, options)
        if section is None:
            continue
        gpu_count += 1
        assert section.get("priority_class", admission["default_priority_class"]) in admission["priority_classes"]
        request = quotas.GPURequest(
            owner=quotas.Owner(user="ada"),
            memory_mib=section.get("memory_mib", 0),
            cores_percent=section.get("cores_percent", 100),
            count=section.get("count", 1),
            model=section.get("model"),
            priority_class=section.get("priority_class"),
            whole=section.get("whole", False),
        )
        state.validate(request)  # raises InvalidRequest with the reason
        assert state.decide(request).kind in ("grant", "wait", "reject", "preempt"), where
    assert gpu_count >= 5


def test_per_kernel_network_policy_in_the_docs_is_valid_kubernetes():
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), flags=re.S)
    policies = [d for b in blocks for d in yaml.safe_load_all(b) if isinstance(d, dict) and d.get("kind")]
    assert [d["kind"] for d in policies] == ["NetworkPolicy"]
    (np,) = policies
    assert tools.validate(np) is None
    assert np["spec"]["policyTypes"] == ["Ingress"]
    # the kernel, by its id, admits its owner's server (and nothing else) on its ports
    kernel_id = np["metadata"]["labels"]["elastic-gpu.jupyter.org/kernel-id"]
    assert np["spec"]["podSelector"] == {"matchLabels": {"elastic-gpu.jupyter.org/kernel-id": kernel_id}}
    (rule,) = np["spec"]["ingress"]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}
    user = np["metadata"]["labels"]["elastic-gpu.jupyter.org/user"]
    assert peer["podSelector"]["matchLabels"]["hub.jupyter.org/username"] == user
    assert rule["ports"] and all(p["protocol"] == "TCP" for p in rule["ports"])
    assert np["metadata"]["ownerReferences"][0]["kind"] == "Pod"


def test_per_kernel_policy_in_the_docs_matches_the_broker():
    launcher = pytest.importorskip("hubext.kubernetes.launcher", exc_type=ImportError)
    cls = launcher.KubernetesKernelLauncher
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), flags=re.S)
    (np,) = [d for b in blocks for d in yaml.safe_load_all(b) if isinstance(d, dict) and d.get("kind")]
    peer = np["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert set(peer) == set(cls.server_selector_labels.default())
    assert set(np["spec"]["podSelector"]["matchLabels"]) == {L.KERNEL_ID}
    assert cls.network_policy.default() is True


def test_docs_name_every_example_file():
    text = DOC.read_text()
    for f in [*tools.EXAMPLES, Z2JH_VALUES]:
        assert str(Path(f).relative_to(tools.REPO)) in text, f"docs/helm.md does not mention {f.name}"


def test_kernel_image_is_pre_pulled_and_kernels_run_as_the_singleuser_uid(z2jh):
    """z2jh's image puller pulls prePuller.extraImages on every node, like the singleuser image."""
    from traitlets.config import Config

    pytest.importorskip("hubext.hubconfig", exc_type=ImportError)
    c = Config()
    exec(compile(_extra_config(z2jh), "hub.extraConfig", "exec"), {"c": c, "get_config": lambda: c})
    image = z2jh["prePuller"]["extraImages"]["elastic-gpu-kernel"]
    assert c.KubernetesKernelLauncher.image == f"{image['name']}:{image['tag']}"
    assert c.KubernetesKernelLauncher.uid == z2jh["singleuser"].get("uid", 1000)
    assert c.KubernetesKernelLauncher.fs_gid == z2jh["singleuser"].get("fsGid", 100)


def test_z2jhs_server_culler_outlives_our_kernel_timeouts(z2jh):
    values = yaml.safe_load((tools.CHART / "examples" / "z2jh-integration.yaml").read_text())
    config = (values.get("culler") or {}).get("config", {}).get("GPUCuller", {})
    timeouts = [config.get("idle_timeout_seconds", 3600)] + [
        p.get("idle_timeout_seconds", 0) for p in config.get("priority_class_policies", {}).values()
    ]
    assert not z2jh["cull"]["enabled"] or z2jh["cull"]["timeout"] > max(timeouts)
