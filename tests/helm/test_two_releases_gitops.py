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
# and a second release of the same name (in another namespace): the first one's PriorityClasses
SAME_NAME = ["priorityClasses.create=false"]


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
    for setting in SAME_NAME:
        key, value = setting.split("=")
        assert f"{key}: {value}" in section or f"{key}={value}" in section, setting


def test_the_same_release_name_in_two_namespaces_shares_no_cluster_scoped_object():
    """A platform team installs the chart as ``elastic-gpu`` in each hub's namespace (the docs'
    commands, unchanged but for ``-n``, and what the docs tell a second release of the same name).
    Cluster-scoped names carried only the release name, so the second install collided with the
    first on its ClusterRoles and ClusterRoleBindings (Helm refuses to adopt another release's
    object); the PriorityClasses, which the hubs' config names, are the first release's."""
    first = tools.render([EXAMPLE], release="elastic-gpu", namespace="jhub")
    second = tools.render([EXAMPLE], SECOND + SAME_NAME, release="elastic-gpu", namespace="research")
    shared = _cluster_scoped(first) & _cluster_scoped(second)
    assert not shared, f"both releases render {sorted(shared)}"
    # also when both run their own node agent (on different GPU nodes: nodeAgent.nodeSelector)
    both = tools.render([EXAMPLE], ["claims.createNamespace=false", *SAME_NAME], release="elastic-gpu",
                        namespace="research")
    shared = _cluster_scoped(first) & _cluster_scoped(both)
    assert not shared, f"both releases render {sorted(shared)}"
    # nor a namespaced object in a namespace both releases share ('default': the agent's Role for
    # Node events; the claims namespace: each hub's Role there)
    def in_shared_ns(docs: list[dict]) -> set[tuple[str, str, str]]:
        return {(d["kind"], d["metadata"]["namespace"], d["metadata"]["name"]) for d in docs
                if d["metadata"].get("namespace") not in (None, "jhub", "research")}
    shared = in_shared_ns(first) & in_shared_ns(both)
    assert not shared, f"both releases render {sorted(shared)}"
