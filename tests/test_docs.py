"""The docs a maintainer reads stay true to the code: the configuration reference is the one the
code generates, and docs/architecture.md names every module."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("hubext", "culler", "quotas", "libvgpu", "kernelprovider")


def _reference_module():
    spec = importlib.util.spec_from_file_location("make_reference", REPO / "docs" / "make_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_reference", module)
    spec.loader.exec_module(module)
    return module


def test_the_configuration_reference_is_the_one_the_code_generates():
    reference = _reference_module()
    committed = (REPO / "docs" / "configuration.md").read_text()
    assert committed == reference.render(), (
        "docs/configuration.md differs from the settings' help texts and the Helm schema; regenerate it with "
        "`.venv/bin/python docs/make_reference.py` and commit it"
    )


def test_every_setting_and_helm_value_is_on_the_reference_page():
    reference = _reference_module()
    page = (REPO / "docs" / "configuration.md").read_text()
    classes = reference.configurable_classes()
    missing = [
        f"c.{cls.__name__}.{name}"
        for cls in classes
        for name in cls.class_own_traits(config=True)
        if f"`c.{cls.__name__}.{name}`" not in page
    ]
    assert classes and not missing, missing
    for name in ("GPUAllocator", "GPUBroker", "LocalPool", "KubernetesPool", "GPUCuller", "UsageMeter", "NodeAgent"):
        assert f"### `{name}`" in page, name
    assert "**`nodeAgent.hostLibDir`**" in page and "**`admission.queue.moves.max_slices`**" in page


def _modules() -> list[str]:
    names = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if "/migrations/" in rel:
                rel = rel.split("/migrations/")[0] + "/migrations/"
            if rel not in names:
                names.append(rel)
    return names


def test_the_architecture_names_every_module():
    page = (REPO / "docs" / "architecture.md").read_text()
    missing = [m for m in _modules() if f"`{m}`" not in page]
    lines = "\n".join(f"| `{m}` | <what it holds, in one line> |" for m in missing)
    assert not missing, (
        f"docs/architecture.md does not name {', '.join(missing)}. Add one line each to the table of its "
        f"package under '## Module map' in docs/architecture.md:\n{lines}"
    )


def test_the_architecture_answers_the_four_questions_in_one_place():
    page = (REPO / "docs" / "architecture.md").read_text()
    for question in (
        "### Why was my kernel culled, or swapped out?",
        "### How does a slice reach the shim in a pod?",
        "### Where is a refusal written?",
        "### How is GPU use billed?",
    ):
        assert question in page, question
