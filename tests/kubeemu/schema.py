"""Server-side field validation: unknown fields are dropped, warned about, or refused.

As kube-apiserver (``fieldValidation`` query parameter, KEP-2885): ``Warn`` (the default) drops
each field the type's schema does not know and answers with a ``Warning: 299 - "unknown field
\\"spec.foo\\""`` header per field; ``Ignore`` drops them silently; ``Strict`` refuses the
request with 400 ``strict decoding error: unknown field "spec.foo"``. The schemas are the
official Python client's models (``openapi_types``/``attribute_map``), generated from the same
OpenAPI document the API server publishes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import kubernetes.client as models

from . import errors as E
from .resources import ResourceType

MODES = ("Ignore", "Warn", "Strict")
_LIST = re.compile(r"^(?:list|List)\[(.+)\]$")
_DICT = re.compile(r"^(?:dict|Dict)\[?\(?str, (.+?)\)?\]?$")
# model class names that differ from "V1" + kind
_MODEL_NAMES = {("", "Event"): "CoreV1Event", ("events.k8s.io", "Event"): "EventsV1Event"}


@cache
def _fields(type_name: str) -> dict[str, str] | None:
    """JSON field name -> type name of a model, or None when the type is not a model."""
    cls = getattr(models, type_name, None)
    if cls is None or not hasattr(cls, "openapi_types"):
        return None
    return {cls.attribute_map[a]: t for a, t in cls.openapi_types.items()}


def model_for(rt: ResourceType) -> str | None:
    name = _MODEL_NAMES.get((rt.group, rt.kind), f"{rt.version.capitalize()}{rt.kind}")
    return name if _fields(name) is not None else None


def unknown_fields(obj: Any, type_name: str, path: str = "") -> list[str]:
    """Drop the fields of ``obj`` its type does not declare (in place); their paths."""
    found: list[str] = []
    m = _LIST.match(type_name)
    if m:
        if isinstance(obj, list):
            for i, item in enumerate(obj):
                found += unknown_fields(item, m.group(1), f"{path}[{i}]")
        return found
    m = _DICT.match(type_name)
    if m:
        if isinstance(obj, dict):
            for k, v in obj.items():
                found += unknown_fields(v, m.group(1), f"{path}.{k}" if path else k)
        return found
    known = _fields(type_name)
    if known is None or not isinstance(obj, dict):
        return found
    for key in list(obj):
        where = f"{path}.{key}" if path else key
        if key not in known:
            del obj[key]
            found.append(where)
        else:
            found += unknown_fields(obj[key], known[key], where)
    return found


@dataclass
class FieldValidation:
    """One request's field validation: its mode, and the warnings its response carries (the
    unknown fields it dropped, and admission's, e.g. Pod Security's ``warn`` mode)."""

    mode: str = "Warn"
    warnings: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, value: str | None) -> FieldValidation:
        mode = value or "Warn"
        if mode not in MODES:
            raise E.bad_request(f'fieldValidation: Unsupported value: "{mode}": supported '
                                'values: "Ignore", "Strict", "Warn"')
        return cls(mode)

    def check(self, rt: ResourceType, body: dict) -> None:
        """Prune ``body`` (a decoded request object) of unknown fields, per the mode."""
        type_name = model_for(rt)
        if type_name is None:
            return
        found = unknown_fields(body, type_name)
        if not found:
            return
        if self.mode == "Strict":
            detail = ", ".join(f'unknown field "{f}"' for f in found)
            raise E.bad_request(f'{rt.kind} in version "{rt.version}" cannot be handled as a '
                                f"{rt.kind}: strict decoding error: {detail}")
        if self.mode == "Warn":
            self.warnings += [f'unknown field "{f}"' for f in found]
