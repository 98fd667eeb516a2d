"""The Grafana dashboard of a release shows that release only: two releases (two hubs, or one
release name in two namespaces) each ship a dashboard with its own uid and title (Grafana keeps
one dashboard per uid: the second overwrote the first), and every query reads only the series
of that release's node agents and culler (the ServiceMonitor's jobs), not both summed."""

from __future__ import annotations

import json
import re

from tests.helm import tools

MONITORING = tools.CHART / "examples" / "monitoring.yaml"


def _dashboard(release: str, namespace: str) -> dict:
    docs = tools.render([MONITORING], release=release, namespace=namespace)
    [cm] = [d for d in tools.find(docs, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")]
    return json.loads(cm["data"]["elastic-gpu.json"])


def _queries(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def _constants(dashboard: dict) -> dict[str, str]:
    return {v["name"]: v["query"] for v in dashboard["templating"]["list"] if v["type"] == "constant"}


def test_two_releases_ship_dashboards_with_their_own_uid_and_title():
    a, b, c = _dashboard("jhub", "jhub"), _dashboard("jhub", "research"), _dashboard("teach", "jhub")
    assert len({a["uid"], b["uid"], c["uid"]}) == 3
    assert all(len(d["uid"]) <= 40 for d in (a, b, c))  # Grafana's limit
    assert len({a["title"], b["title"], c["title"]}) == 3


def test_every_query_reads_only_this_releases_jobs():
    dashboard = _dashboard("teach", "teaching")
    constants = _constants(dashboard)
    assert constants.get("agent_job") == "teach-elastic-gpu-node-agent"
    assert constants.get("culler_job") == "teach-elastic-gpu-culler"
    assert constants.get("culler_namespace") == "teaching"
    for expr in _queries(dashboard):
        for metric, selector in re.findall(r"(elastic_gpu_\w+)(\{[^}]*\})?", expr):
            labels = selector or "{}"
            if metric.startswith("elastic_gpu_culler_"):
                assert 'job="$culler_job"' in labels and 'namespace="$culler_namespace"' in labels, expr
            else:
                assert 'job="$agent_job"' in labels, expr
