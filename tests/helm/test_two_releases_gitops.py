"""Two releases rendered as GitOps tools render them (`helm template`: no cluster, so the chart's
`lookup` of the shared claims namespace finds nothing), each from the documented values: the
example values for the first, the same plus what docs/helm.md's "Two releases on one cluster"
says for the second. No cluster-scoped object shares a name, and the one shared object the
docs name (the claims namespace) is rendered by one release only."""

from __future__ import annotations

from tests.helm import tools

EXAMPLE = tools.CHART / "examples" / "z2jh-integration.yaml"
HELM_DOC = tools.REPO / "docs" / "helm.md"
# what the docs' "Two releases on one cluster" tells the second release to set
SECOND = ["nodeAgent.enabled=false", "claims.createNamespace=false"]


def _cluster_scoped(docs: list[dict]) -> set[tuple[str, str]]:
    return {(d["kind"], d["metadata"]["name"]) for d in docs if "namespace" not in d["metadata"]}


def test_two_releases_rendered_without_lookup_share_no_cluster_scoped_object():
    first = tools.render([EXAMPLE], release="elastic-gpu", namespace="jhub")
    second = tools.render([EXAMPLE], SECOND, release="research", namespace="research")
    shared = _cluster_scoped(first) & _cluster_scoped(second)
    assert not shared, f"both releases render {sorted(shared)}"
    claims = [d for d in first + second if d["kind"] == "Namespace" and d["metadata"]["name"] == "elastic-gpu-claims"]
    assert len(claims) == 1
    # both hubs still get their Role in the shared claims namespace
    for docs in (first, second):
        [role] = [d for d in tools.find(docs, "Role") if d["metadata"]["name"].endswith("-hub-claims")]
        assert role["metadata"]["namespace"] == "elastic-gpu-claims"


def test_the_docs_tell_the_second_release_what_the_render_above_sets():
    section = HELM_DOC.read_text().split("\n## Two releases on one cluster\n", 1)[1].split("\n### ", 1)[0]
    for setting in SECOND:
        key, value = setting.split("=")
        assert f"{key}: {value}" in section or f"{key}={value}" in section, setting
    assert "own release name" in section  # cluster-scoped names carry the release name, not the namespace
