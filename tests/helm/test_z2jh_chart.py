"""zero-to-jupyterhub's own chart with our documented values (helm/examples-z2jh/values.yaml).

z2jh's chart is not in a package registry this project installs from, so CI cannot fetch it:

- always: our z2jh values against a subset of z2jh 4.3.3's values schema that we keep
  (``z2jh-4.3.3-values.subset.schema.json``; its ``$comment`` names the source), with z2jh's
  ``additionalProperties: false`` — a misspelt or removed z2jh key fails here;
- with ``Z2JH_CHART=/path/to/jupyterhub`` (the chart folder of a zero-to-jupyterhub-k8s checkout,
  or a chart .tgz): ``helm lint --strict`` and ``helm template`` of z2jh's chart with our values,
  every manifest validated (strict) on Kubernetes 1.29 to 1.33, what our integration needs
  checked in the rendered objects, and our subset compared with that chart's full schema.
"""

from __future__ import annotations

import json
import os
import shutil
import tarfile
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.helm import tools

SUBSET = Path(__file__).with_name("z2jh-4.3.3-values.subset.schema.json")
Z2JH_VALUES = tools.Z2JH_EXAMPLES / "values.yaml"
VERSIONS = ["1.29.0", "1.30.0", "1.31.0", "1.32.0", "1.33.0"]
KERNEL_SELECTOR = {"podSelector": {"matchLabels": {"elastic-gpu.jupyter.org/kind": "kernel"}}}


def _values() -> dict:
    return yaml.safe_load(Z2JH_VALUES.read_text())


def test_our_z2jh_values_fit_z2jhs_schema():
    jsonschema.validate(_values(), json.loads(SUBSET.read_text()))


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("singleuser", "cloudMetadata", "blockWithIptable"), False),  # misspelt
        (("hub", "image", "name"), 5),  # wrong type
        (("prePuller", "extraImages", "elastic-gpu-kernel", "digest"), "sha256:x"),  # no such key
        (("cull", "timeoutSeconds"), 60),
    ],
)
def test_a_key_z2jh_does_not_know_is_refused(path, value):
    values = _values()
    node = values
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(values, json.loads(SUBSET.read_text()))


# ---- z2jh's chart itself (Z2JH_CHART) -------------------------------------------------------------


@pytest.fixture(scope="module")
def z2jh_chart(tmp_path_factory) -> Path:
    source = os.environ.get("Z2JH_CHART")
    if not source:
        pytest.skip("Z2JH_CHART is not set (a zero-to-jupyterhub chart folder or .tgz; not installable here)")
    try:
        tools.helm_path()
    except tools.HelmMissing as e:
        pytest.fail(str(e))
    out = tmp_path_factory.mktemp("z2jh")
    src = Path(source)
    if src.is_file():
        with tarfile.open(src) as tf:
            tf.extractall(out, filter="data")
        chart = next(p.parent for p in out.rglob("Chart.yaml"))
    else:
        chart = out / "jupyterhub"
        shutil.copytree(src, chart)
    schema_json = chart / "values.schema.json"
    if not schema_json.exists() and (chart / "values.schema.yaml").exists():
        # what z2jh's tools/generate-json-schema.py does when it packages the chart
        schema_json.write_text(json.dumps(yaml.safe_load((chart / "values.schema.yaml").read_text())))
    return chart


@pytest.fixture(scope="module")
def z2jh_rendered(z2jh_chart: Path) -> list[dict]:
    proc = tools.helm(
        "template", "jhub", str(z2jh_chart), "--namespace", "jhub", "--kube-version", tools.KUBE_VERSION,
        "--values", str(Z2JH_VALUES),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def test_z2jh_chart_lints_strictly_with_our_values(z2jh_chart):
    proc = tools.helm("lint", "--strict", str(z2jh_chart), "--values", str(Z2JH_VALUES))
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("version", VERSIONS)
def test_z2jh_chart_with_our_values_is_valid_kubernetes(z2jh_rendered, version):
    assert len(z2jh_rendered) > 10
    for doc in z2jh_rendered:
        tools.validate(doc, version)


def test_z2jh_hub_runs_our_image_and_reads_our_admission_config(z2jh_rendered):
    values = _values()
    hub = tools.one(z2jh_rendered, "Deployment", "hub")["spec"]["template"]["spec"]
    [container] = [c for c in hub["containers"] if c["name"] == "hub"]
    assert container["image"] == f"{values['hub']['image']['name']}:{values['hub']['image']['tag']}"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in hub["volumes"]}
    assert volumes[mounts["/etc/elastic-gpu"]]["configMap"]["name"] == "elastic-gpu-admission"
    # our culler service: z2jh generates its token into the hub Secret the culler reads
    secret = tools.one(z2jh_rendered, "Secret", "hub")
    assert "hub.services.elastic-gpu-culler.apiToken" in secret["data"]


def test_z2jh_servers_may_reach_their_kernels_and_the_kernel_image_is_pre_pulled(z2jh_rendered):
    policy = tools.one(z2jh_rendered, "NetworkPolicy", "singleuser")
    assert any(KERNEL_SELECTOR in rule.get("to", []) for rule in policy["spec"]["egress"])
    kernel = _values()["prePuller"]["extraImages"]["elastic-gpu-kernel"]
    image = f"{kernel['name']}:{kernel['tag']}"
    for name in ("hook-image-puller", "continuous-image-puller"):
        pod = tools.one(z2jh_rendered, "DaemonSet", name)["spec"]["template"]["spec"]
        assert image in [c["image"] for c in pod["initContainers"]], name


def _subset_matches(subset: dict, full: dict, path: str = "") -> list[str]:
    """Where our subset says something z2jh's full schema does not (descriptions and required aside)."""
    out = []
    for key, value in subset.items():
        if key in ("$comment", "description", "required"):
            continue
        if key == "properties":
            for name, sub in value.items():
                if name not in full.get("properties", {}):
                    out.append(f"{path}.{name}: not in z2jh's schema")
                else:
                    out += _subset_matches(sub, full["properties"][name], f"{path}.{name}")
        elif key == "patternProperties":
            out += [
                f"{path}: patternProperties {pattern!r} differ"
                for pattern, sub in value.items()
                if _subset_matches(sub, full.get("patternProperties", {}).get(pattern, {}))
            ]
        elif full.get(key) != value:
            out.append(f"{path}: {key} is {full.get(key)!r} in z2jh, {value!r} in our subset")
    return out


def test_our_schema_subset_is_z2jhs_schema(z2jh_chart):
    full = yaml.safe_load((z2jh_chart / "values.schema.yaml").read_text()) if (
        z2jh_chart / "values.schema.yaml"
    ).exists() else json.loads((z2jh_chart / "values.schema.json").read_text())
    assert _subset_matches(json.loads(SUBSET.read_text()), full) == []


def test_z2jhs_own_pods_pass_pod_security_baseline_so_the_namespace_can_enforce_it(z2jh_rendered):
    """docs/helm.md says: label the hub's/users' namespace enforce=baseline. z2jh's own workloads
    there (hub, proxy, user-scheduler, image pullers, placeholders) must pass it too."""
    from tests.kubeemu.podsecurity import violations

    checked = []
    for doc in z2jh_rendered:
        spec = (doc.get("spec") or {}).get("template", {}).get("spec")
        if spec is not None:
            assert violations({"spec": spec}, "baseline") == [], f"{doc['kind']}/{doc['metadata']['name']}"
            checked.append(doc["metadata"]["name"])
    assert {"hub", "proxy", "continuous-image-puller"} <= set(checked)
