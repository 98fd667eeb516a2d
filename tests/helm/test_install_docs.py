"""What a platform team follows word for word: the install steps of docs/helm.md, the image names
of helm/README.md, the values files and `./dev images`, and the NOTES `helm install` prints."""

from __future__ import annotations

import re
import shlex

import yaml
from traitlets.config import Config

from tests.helm import tools

REPO = tools.REPO
BUILD_SCRIPT = REPO / "helm" / "images" / "build.sh"
HELM_README = REPO / "helm" / "README.md"
HELM_DOC = REPO / "docs" / "helm.md"
Z2JH_REPO_URL = "https://hub.jupyter.org/helm-chart/"


def _basename(image: str) -> str:
    """registry/path/name:tag -> name"""
    return image.split("@", 1)[0].rsplit("/", 1)[-1].split(":", 1)[0]


def _dev_images_names() -> dict[str, str]:
    """{target: image name} as `./dev images` tags them."""
    text = BUILD_SCRIPT.read_text()
    found = dict(re.findall(r"^(HUB|AGENT|KERNEL|NOTEBOOK)_TAG=\$REGISTRY/([\w.-]+):", text, flags=re.M))
    return {k.lower(): v for k, v in found.items()}


def _readme_names() -> dict[str, str]:
    """{target: image name} of helm/README.md's `docker build --target T ... -t $REGISTRY/NAME:...`."""
    text = re.sub(r"\\\n\s*", " ", HELM_README.read_text())
    return dict(re.findall(r"docker build [^\n]*--target (\w+)[^\n]* -t \$REGISTRY/([\w.-]+):", text))


def test_every_image_has_one_name_in_the_docs_the_values_and_dev_images():
    """helm/README.md builds $REGISTRY/jupyterhub-elastic-gpu, the example values the docs say to
    edit named …/jupyterhub/elastic-gpu: an agent, culler and uninstall hook that never pull."""
    built = _dev_images_names()
    assert set(built) == {"hub", "agent", "kernel", "notebook"}
    assert _readme_names() == built
    values = yaml.safe_load((tools.CHART / "values.yaml").read_text())
    assert _basename(values["image"]["repository"]) == built["agent"]
    assert _basename(values["culler"]["image"]["repository"]) == built["hub"]  # the culler imports jupyterhub
    for example in tools.EXAMPLES:
        example_values = yaml.safe_load(example.read_text()) or {}
        image = example_values.get("image", {})
        if "repository" in image:
            assert _basename(image["repository"]) == built["agent"], f"{example.name}: {image['repository']}"
        image = (example_values.get("culler") or {}).get("image", {})
        if "repository" in image:
            assert _basename(image["repository"]) == built["hub"], f"{example.name}: {image['repository']}"
    z2jh = yaml.safe_load((tools.Z2JH_EXAMPLES / "values.yaml").read_text())
    assert _basename(z2jh["hub"]["image"]["name"]) == built["hub"]
    assert _basename(z2jh["singleuser"]["image"]["name"]) == built["notebook"]
    dockerfile = (REPO / "helm" / "images" / "Dockerfile").read_text()
    for target, name in built.items():
        assert re.search(rf"--target {target}\s+-t REGISTRY/{re.escape(name)}:", dockerfile), target


def _install_commands() -> list[list[str]]:
    """The commands of docs/helm.md's "## Install" code block, continuation lines joined."""
    section = HELM_DOC.read_text().split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    block = re.sub(r"\\\n\s*", " ", block)
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


def test_the_documented_install_adds_every_chart_repository_it_installs_from():
    """Step 3 (`helm upgrade --install jhub jupyterhub/jupyterhub`) failed with `repo jupyterhub
    not found`: no step said `helm repo add`."""
    added: dict[str, str] = {}
    used = []
    for cmd in _install_commands():
        if cmd[:3] == ["helm", "repo", "add"]:
            added[cmd[3]] = cmd[4]
        elif cmd[:3] == ["helm", "upgrade", "--install"]:
            chart = cmd[4]
            if not (REPO / chart).exists():
                repo = chart.split("/", 1)[0]
                assert repo in added, f"`{' '.join(cmd[:5])}` needs `helm repo add {repo} <url>` before it"
                used.append(repo)
    assert used == ["jupyterhub"] and added["jupyterhub"] == Z2JH_REPO_URL


def test_the_documented_install_of_our_chart_renders_as_written(tmp_path):
    """Each `helm upgrade --install` of a chart in this repository, run as `helm template` with
    the same arguments (no cluster here): every file it names exists and the chart renders."""
    ran = 0
    for cmd in _install_commands():
        if cmd[:3] == ["helm", "upgrade", "--install"] and (REPO / cmd[4]).exists():
            args = [str(REPO / a) if (REPO / a).exists() and "/" in a else a for a in cmd[3:]]
            proc = tools.helm("template", *args, "--kube-version", tools.KUBE_VERSION)
            assert proc.returncode == 0, proc.stderr
            ran += 1
    assert ran == 1


def _notes(*set_values: str) -> str:
    args = [a for s in set_values for a in ("--set", s)]
    proc = tools.helm("install", "--dry-run=client", "elastic-gpu", str(tools.CHART), "-n", "jhub", *args)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split("NOTES:\n", 1)[1]


def test_the_notes_hub_config_gives_the_culler_its_role():
    """The NOTES' z2jh snippet, run as z2jh runs hub.extraConfig: the culler service gets a role
    with the broker's scopes (without it, its token could do nothing)."""
    notes = _notes()
    block = "  hub:\n" + notes.split("\n  hub:\n", 1)[1]
    lines = []
    for line in block.splitlines():
        if line and not line.startswith("  "):
            break
        lines.append(line)
    hub = yaml.safe_load("\n".join(lines))["hub"]
    assert "elastic-gpu-culler" in hub["services"]
    c = Config()
    for key, snippet in hub["extraConfig"].items():
        exec(compile(snippet, f"NOTES hub.extraConfig.{key}", "exec"), {"c": c, "get_config": lambda: c})
    roles = [r for r in c.JupyterHub.load_roles if "elastic-gpu-culler" in r.get("services", [])]
    assert roles, "no role names the culler service"
    scopes = {s for r in roles for s in r.get("scopes", [])}
    assert any(s.startswith("custom:elastic-gpu") for s in scopes) and "list:users" in scopes, scopes


def test_the_docs_say_what_cluster_permissions_the_chart_needs():
    """The chart creates cluster-scoped objects (a PersistentVolume, Namespaces, ClusterRoles,
    PriorityClasses): the docs say an installer needs cluster-admin for them."""
    docs = tools.render([tools.CHART / "examples" / "z2jh-integration.yaml"], release="elastic-gpu")
    cluster_kinds = {d["kind"] for d in docs if "namespace" not in d["metadata"]}
    text = HELM_DOC.read_text()
    section = text.split("\n## What you need\n", 1)[1].split("\n## ", 1)[0]
    assert "cluster-admin" in section
    for kind in cluster_kinds:
        assert kind in section, f"the chart creates a {kind} and 'What you need' does not say so"
