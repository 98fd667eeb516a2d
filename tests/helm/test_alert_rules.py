"""The chart's Prometheus alert rules (a prometheus-operator PrometheusRule), checked and
unit-tested by promtool itself (Debian's `prometheus` package): they are valid, and each alert
fires on the series it is about (the node agent down, the culler no longer cycling, Xid errors,
backstop kills, a card out of service after a fatal Xid), scoped to this release's jobs and namespaces."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import textwrap
import urllib.error
import urllib.request

import pytest
import yaml

from tests.helm import tools
from tests.hubrunner import HubRunner, free_port

MONITORING = tools.CHART / "examples" / "monitoring.yaml"
AGENT_JOB = f"{tools.RELEASE}-elastic-gpu-node-agent"
AGENT_NS = tools.AGENT_NAMESPACE
CULLER_JOB = f"{tools.RELEASE}-elastic-gpu-culler"


def _promtool() -> str:
    found = shutil.which("promtool")
    if not found:
        if os.environ.get("ELASTIC_GPU_CI"):
            pytest.fail("promtool is missing, but CI installs it (Debian's prometheus package)")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    return found


@pytest.fixture(scope="module")
def rules_file(tmp_path_factory) -> str:
    docs = tools.render([MONITORING])
    rule = tools.one(docs, "PrometheusRule")
    assert rule["metadata"]["labels"].get("release") == "kube-prometheus-stack"  # what the stack selects on
    path = tmp_path_factory.mktemp("rules") / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    return str(path)


def test_the_alert_rules_pass_promtool_check(rules_file):
    proc = subprocess.run([_promtool(), "check", "rules", rules_file], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_each_alert_fires_on_its_series_and_only_for_this_release(rules_file, tmp_path):
    other = 'namespace="other-hub"'
    tests = {
        "rule_files": [rules_file],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    # one agent down for good, another release's agent down too (not ours to page)
                    {"series": f'up{{job="{AGENT_JOB}",namespace="{AGENT_NS}",node="gpu-1"}}', "values": "0x30"},
                    {"series": f'up{{job="{AGENT_JOB}",{other},node="gpu-9"}}', "values": "0x30"},
                    # the culler's last cycle stays at t=0
                    {"series": f'elastic_gpu_culler_last_cycle_timestamp_seconds{{job="{CULLER_JOB}",'
                               f'namespace="{tools.NAMESPACE}"}}', "values": "0x30"},
                    # a fatal Xid (79: fallen off the bus) at minute 3
                    {"series": f'elastic_gpu_xid_errors_total{{job="{AGENT_JOB}",namespace="{AGENT_NS}",'
                               'node="gpu-1",gpu_uuid="GPU-1",gpu_index="0",xid="79"}', "values": "0 0 0 1x27"},
                    # ... which took the card out of service from minute 3 (the agent's gauge), and
                    # another release's card too (not ours to page)
                    {"series": f'elastic_gpu_out_of_service{{job="{AGENT_JOB}",namespace="{AGENT_NS}",'
                               'node="gpu-1",gpu_uuid="GPU-1",gpu_index="0",xid="79"}', "values": "_ _ _ 1x27"},
                    {"series": f'elastic_gpu_out_of_service{{job="{AGENT_JOB}",{other},'
                               'node="gpu-9",gpu_uuid="GPU-9",gpu_index="0",xid="79"}', "values": "1x30"},
                    # the backstop killed a process at minute 4
                    {"series": f'elastic_gpu_enforcement_kills_total{{job="{AGENT_JOB}",namespace="{AGENT_NS}",'
                               'node="gpu-1",gpu_uuid="GPU-1",reason="over-limit"}', "values": "0 0 0 0 1x26"},
                ],  # fmt: skip
                "alert_rule_test": [
                    {"eval_time": "15m", "alertname": "ElasticGPUNodeAgentDown", "exp_alerts": [
                        {"exp_labels": {"severity": "critical", "job": AGENT_JOB, "namespace": AGENT_NS,
                                        "node": "gpu-1"}}]},
                    {"eval_time": "20m", "alertname": "ElasticGPUCullerNotCycling", "exp_alerts": [
                        {"exp_labels": {"severity": "warning", "job": CULLER_JOB, "namespace": tools.NAMESPACE}}]},
                    {"eval_time": "6m", "alertname": "ElasticGPUXidError", "exp_alerts": [
                        {"exp_labels": {"severity": "critical", "job": AGENT_JOB, "namespace": AGENT_NS,
                                        "node": "gpu-1", "gpu_uuid": "GPU-1", "gpu_index": "0", "xid": "79"}}]},
                    {"eval_time": "6m", "alertname": "ElasticGPUBackstopKilled", "exp_alerts": [
                        {"exp_labels": {"severity": "warning", "job": AGENT_JOB, "namespace": AGENT_NS,
                                        "node": "gpu-1", "gpu_uuid": "GPU-1", "reason": "over-limit"}}]},
                    {"eval_time": "6m", "alertname": "ElasticGPUCardOutOfService", "exp_alerts": [
                        {"exp_labels": {"severity": "critical", "node": "gpu-1", "gpu_uuid": "GPU-1",
                                        "gpu_index": "0", "xid": "79"}}]},
                    # nothing fires before its series says so
                    {"eval_time": "2m", "alertname": "ElasticGPUCardOutOfService", "exp_alerts": []},
                    {"eval_time": "2m", "alertname": "ElasticGPUXidError", "exp_alerts": []},
                    {"eval_time": "2m", "alertname": "ElasticGPUCullerNotCycling", "exp_alerts": []},
                ],  # fmt: skip
            }
        ],
    }
    # the annotations each alert carries: its rule's templates with the alert's labels
    annotations = {r["alert"]: r.get("annotations", {}) for g in yaml.safe_load(open(rules_file))["groups"]
                   for r in g["rules"]}  # fmt: skip
    for case in tests["tests"][0]["alert_rule_test"]:
        for alert in case["exp_alerts"]:
            labels = alert["exp_labels"]
            alert["exp_annotations"] = {
                k: re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m, lb=labels: lb[m[1]], v)
                for k, v in annotations[case["alertname"]].items()
            }
    path = tmp_path / "tests.yaml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    proc = subprocess.run([_promtool(), "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_culler_run_by_the_hub_is_scraped_through_a_service_on_the_hub_pod():
    """With the culler inside the hub pod (culler.enabled: false), nothing scraped it: its metrics
    sat behind the hub's token auth, so its dashboard row was empty and no alert watched it.
    culler.scrapeInHub renders a Service on the hub pod's culler port (the ServiceMonitor's
    target), a NetworkPolicy admitting scrapes to that port only, and the culler alert."""
    hub_service = tools.CHART / "examples" / "culler-as-hub-service.yaml"
    docs = tools.render([MONITORING, hub_service], ["culler.scrapeInHub=true"])
    assert not tools.find(docs, "Deployment", CULLER_JOB)
    service = tools.one(docs, "Service", CULLER_JOB)
    values = yaml.safe_load((tools.CHART / "values.yaml").read_text())
    assert service["spec"]["selector"] == values["hub"]["podSelector"]
    (port,) = service["spec"]["ports"]
    assert port["name"] == "metrics" and port["targetPort"] == values["culler"]["metricsPort"]
    monitor = tools.one(docs, "ServiceMonitor")
    selected = {e["key"]: e["values"] for e in monitor["spec"]["selector"]["matchExpressions"]}
    labels = service["metadata"]["labels"]
    assert all(labels.get(k) in v for k, v in selected.items()), (labels, selected)
    policy = tools.one(docs, "NetworkPolicy", f"{CULLER_JOB}-metrics")
    assert policy["spec"]["podSelector"]["matchLabels"] == values["hub"]["podSelector"]
    assert policy["spec"]["ingress"] == [{"ports": [{"port": values["culler"]["metricsPort"], "protocol": "TCP"}]}]
    rule = tools.one(docs, "PrometheusRule")
    assert "ElasticGPUCullerNotCycling" in {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
    # and the culler the hub starts serves there without a hub token, as the docs configure it
    from culler.app import GPUCuller

    culler = GPUCuller()
    culler.parse_command_line(["--GPUCuller.metrics_ip=0.0.0.0", "--GPUCuller.authenticate_metrics=False"])
    assert culler.metrics_ip == "0.0.0.0" and culler.authenticate_metrics is False
    # without scrapeInHub: nothing of the culler's is rendered
    docs = tools.render([MONITORING, hub_service])
    assert not tools.find(docs, "Service", CULLER_JOB)
    assert not tools.find(docs, "NetworkPolicy", f"{CULLER_JOB}-metrics")


def _pod_address() -> str:
    """This machine's address on its network (as a pod's IP is, for Prometheus), else loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 9))  # no packet is sent: only the route is chosen
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def test_the_culler_a_hub_runs_answers_the_scrape_the_chart_renders_and_nothing_else(tmp_path):
    """culler.scrapeInHub, run for real: a hub configured as docs/helm.md says (the culler inside it,
    with the arguments the docs give) serves the culler's metrics to a scrape without a token on the
    port and path the rendered Service and ServiceMonitor name; that port answers nothing of the hub."""
    port = free_port()
    hub_service = tools.CHART / "examples" / "culler-as-hub-service.yaml"
    docs = tools.render([MONITORING, hub_service], ["culler.scrapeInHub=true", f"culler.metricsPort={port}"])
    (service_port,) = tools.one(docs, "Service", CULLER_JOB)["spec"]["ports"]
    (endpoint,) = tools.one(docs, "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["port"] == service_port["name"] and not {"bearerTokenSecret", "authorization"} & endpoint.keys()
    assert service_port["targetPort"] == port
    guide = " ".join((tools.CHART.parent.parent / "docs" / "helm.md").read_text().split())
    args = json.loads("[" + re.search(r"culler_port=\d+, culler_args=\[([^\]]*)\]", guide)[1] + "]")
    config = textwrap.dedent(
        f"""
        from hubext.hubconfig import configure_hub
        configure_hub(c, mode="local", simulate_gpus="1xH100-80GB", data_dir={str(tmp_path / "data")!r},
                      culler=True, culler_port={port}, culler_args={args!r}, metering=False)
        """
    )
    target = f"http://{_pod_address()}:{port}"
    with HubRunner(tmp_path / "hub", config) as hub:

        def scrape() -> str | None:  # as Prometheus does: no token, the Service's port, the monitor's path
            try:
                with urllib.request.urlopen(target + endpoint["path"], timeout=10) as r:
                    text = r.read().decode()
            except OSError:
                return None
            return text if re.search(r"^elastic_gpu_culler_last_cycle_timestamp_seconds [1-9]", text, re.M) else None

        text = hub.wait_for(scrape, 60, what=f"the culler's metrics at {target}{endpoint['path']} after a cycle")
        assert "# TYPE elastic_gpu_culler_last_cycle_timestamp_seconds gauge" in text, text
        for path in ("/", "/hub/api", "/hub/api/users", "/hub/login", "/hub/gpu", "/user/x/api", "/services/"):
            with pytest.raises(urllib.error.HTTPError) as answer:
                urllib.request.urlopen(target + path, timeout=10)
            assert answer.value.code == 404, (path, answer.value.code)
