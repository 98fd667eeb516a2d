"""Write docs/configuration.md from the code, as JupyterHub's docs list its configurables.

Every traitlets setting (``config=True``) of the classes in hubext, culler, kernelprovider and
libvgpu, with its type, default and the ``help`` text the trait already carries; then every
Helm value of helm/elastic-gpu/values.schema.json with its schema description and its default
from values.yaml. A page written by hand drifts; this one is regenerated:

    .venv/bin/python docs/make_reference.py           # rewrite docs/configuration.md
    .venv/bin/python docs/make_reference.py --check   # exit 1 when the committed page differs

tests/test_docs.py runs the check.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import pkgutil
import re
import sys
from pathlib import Path
from typing import Any

import yaml
from traitlets import TraitType
from traitlets.config import Configurable

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "configuration.md"
PACKAGES = ("hubext", "culler", "kernelprovider", "libvgpu")
CHART = REPO / "helm" / "elastic-gpu"
#: modules that are programs or data, not configuration (importing them would run them)
SKIP = ("__main__", ".migrations")

HEADER = """# Configuration reference

Generated from the code by `docs/make_reference.py`: do not edit by hand. Regenerate it with
`.venv/bin/python docs/make_reference.py` after changing a setting's `help`, default or a
Helm value's schema description (`tests/test_docs.py` fails while this page differs).

- [Hub, culler, kernel and node-agent settings](#traitlets-settings) (`c.<Class>.<setting>` in
  `jupyterhub_config.py`; the culler and the node agent also take them as `--<Class>.<setting>=`)
- [Helm values](#helm-values) (`helm/elastic-gpu/values.yaml`, checked by `values.schema.json`)
"""


def _modules() -> list[str]:
    names = []
    for package in PACKAGES:
        module = importlib.import_module(package)
        names.append(package)
        for info in pkgutil.walk_packages(module.__path__, package + "."):
            if any(part in info.name for part in SKIP):
                continue
            spec = importlib.util.find_spec(info.name)
            # only modules that use traitlets (the others may be programs: bootstrap.py runs on import)
            if spec and (spec.origin or "").endswith(".py") and "traitlets" in Path(spec.origin).read_text():
                names.append(info.name)
    return sorted(names)


def configurable_classes() -> list[type[Configurable]]:
    """Our Configurable classes that declare settings of their own, by module then name."""
    found: dict[str, type[Configurable]] = {}
    for name in _modules():
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if (
                issubclass(cls, Configurable)
                and cls.__module__ == name
                and cls.class_own_traits(config=True)
            ):
                found[f"{cls.__module__}.{cls.__name__}"] = cls
    return [found[key] for key in sorted(found)]


def _default(trait: TraitType) -> str:
    try:
        text = trait.default_value_repr()
    except Exception:  # a default computed at run time
        text = "(computed at start)"
    text = re.sub(r" at 0x[0-9a-f]+", "", text.replace(str(REPO), "<repo>").replace(str(Path.home()), "~"))
    return text if len(text) <= 300 else text[:297] + "..."


def _help(text: str) -> str:
    return " ".join((text or "").split()) or "(no help text)"


def traitlets_section() -> list[str]:
    lines = ["## Traitlets settings", ""]
    classes = configurable_classes()
    for cls in classes:
        bases = [b.__name__ for b in cls.__mro__[1:] if b in classes]
        subs = [c.__name__ for c in classes if c is not cls and issubclass(c, cls)]
        lines += [f"### `{cls.__name__}`", ""]
        doc = " ".join((inspect.getdoc(cls) or "").split("\n\n")[0].split())
        where = f"`{cls.__module__}`"
        if bases:
            where += f"; also takes the settings of {', '.join(f'`{b}`' for b in bases)}"
        if subs:
            where += f"; its settings are set on {', '.join(f'`{c}`' for c in subs)} too"
        lines += [f"{doc} ({where})" if doc else f"({where})", ""]
        for name, trait in sorted(cls.class_own_traits(config=True).items()):
            lines.append(f"- **`c.{cls.__name__}.{name}`** ({type(trait).__name__}, default `{_default(trait)}`):")
            lines.append(f"  {_help(trait.help)}")
        lines.append("")
    return lines


def _schema_rows(node: dict[str, Any], values: Any, path: str, definitions: dict[str, Any]) -> list[str]:
    rows = []
    for key, child in (node.get("properties") or {}).items():
        here = f"{path}.{key}" if path else key
        if "$ref" in child:
            child = {**definitions.get(child["$ref"].rsplit("/", 1)[-1], {}), **child}
        value = values.get(key) if isinstance(values, dict) else None
        kind = child.get("type") or ("/".join(sorted({str(o.get("type", "?")) for o in child.get("anyOf", child.get(
            "oneOf", []))})) or "any")
        if isinstance(kind, list):
            kind = " or ".join(kind)
        shown = json.dumps(value) if not isinstance(value, dict) else "(below)" if child.get("properties") else "{...}"
        if len(shown) > 120:
            shown = shown[:117] + "..."
        description = " ".join((child.get("description") or "(no description)").split())
        rows.append(f"- **`{here}`** ({kind}, default `{shown}`): {description}")
        if child.get("properties"):
            rows += _schema_rows(child, value or {}, here, definitions)
    return rows


def helm_section() -> list[str]:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text()) or {}
    return ["## Helm values", "", *_schema_rows(schema, values, "", schema.get("definitions", {})), ""]


def render() -> str:
    return "\n".join([HEADER, *traitlets_section(), *helm_section()]).rstrip() + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(
                f"{PAGE.relative_to(REPO)} differs from the code; regenerate it with "
                "`.venv/bin/python docs/make_reference.py` and commit it.",
                file=sys.stderr,
            )
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
