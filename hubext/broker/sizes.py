"""GPU kernel sizes: the admin's ``GPUBroker.kernel_sizes``, checked, and the broker's refusals."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from quotas.messages import memory_size

from ..gpu_spawner import GPUSpawnError
from ..requests import validate_gpu_section

SIZE_KEYS = {
    "name",
    "display_name",
    "memory_mib",
    "cores_percent",
    "count",
    "priority_class",
    "model",
    "whole",
    "allowed_groups",
    "mig_profile",
    "memory_limit_mib",
    "cores_limit_percent",
}
SIGNATURE_SCHEMES = tuple(f"hmac-{name}" for name in ("sha256", "sha512", "sha384", "sha224", "sha1", "md5"))
_NAME_OK = re.compile(r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$")
#: what a user's own gpu section may set; the rest (GRANTED_KEYS) comes only from a size they may see
CUSTOM_KEYS = frozenset({"memory_mib", "cores_percent", "model", "memory_limit_mib", "cores_limit_percent"})
GRANTED_KEYS = frozenset({"priority_class", "whole", "count", "mig_profile"})


class BrokerError(GPUSpawnError):
    """A broker refusal the caller can act on: JupyterHub renders it as ``{"status", "message"}``
    (the same user-facing error as a spawn refusal: a sentence, a 4xx status, ``%`` kept as written)."""


def is_unicode(text: str) -> bool:
    """Whether ``text`` is valid Unicode (JSON's ``\\ud800`` escapes decode to lone surrogates, which
    no file, digest or database takes)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def bad_text_in(value: Any, where: str = "the body") -> str | None:
    """Where in a decoded JSON ``value`` a string (a key or a value) is not valid Unicode, or None."""
    if isinstance(value, str):
        return None if is_unicode(value) else where
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not is_unicode(key):
                return f"the key {key!r} of {where}"
            found = bad_text_in(item, repr(key) if where == "the body" else f"{where}[{key!r}]")
            if found:
                return found
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = bad_text_in(item, f"{where}[{i}]")
            if found:
                return found
    return None


def validate_sizes(sizes: Any) -> list[dict[str, Any]]:
    """Check ``GPUBroker.kernel_sizes``; raise BrokerError(500) naming the bad entry and key."""
    if not isinstance(sizes, list):
        raise BrokerError(f"GPUBroker.kernel_sizes must be a list of sizes, got {sizes!r}", 500)
    out, seen = [], set()
    for i, size in enumerate(sizes):
        where = f"GPUBroker.kernel_sizes[{i}]"
        if not isinstance(size, Mapping):
            raise BrokerError(f"{where} must be a mapping with keys {sorted(SIZE_KEYS)}, got {size!r}", 500)
        unknown = sorted(set(size) - SIZE_KEYS)
        if unknown:
            raise BrokerError(
                f"{where} has unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(SIZE_KEYS))}", 500
            )
        name = size.get("name")
        if not isinstance(name, str) or not _NAME_OK.match(name):
            raise BrokerError(f"{where}.name must be lowercase letters, digits and '-' (at most 40), got {name!r}", 500)
        if name in seen:
            raise BrokerError(f"{where}.name {name!r} is used twice", 500)
        seen.add(name)
        section = {k: v for k, v in size.items() if k not in ("name", "display_name", "allowed_groups")}
        try:
            validate_gpu_section(section, f"{where} ({name})")
        except ValueError as e:
            raise BrokerError(str(e), 500) from None
        if not section.get("whole") and not section.get("mig_profile"):
            mem, cores = section.get("memory_mib", 0), section.get("cores_percent", 0)
            if mem <= 0 or not 1 <= cores <= 100:
                raise BrokerError(
                    f"{where} ({name}) needs memory_mib > 0 and cores_percent in 1..100, got {mem} and {cores}", 500
                )
        groups = size.get("allowed_groups", [])
        if not isinstance(groups, list) or not all(isinstance(g, str) for g in groups):
            raise BrokerError(f"{where}.allowed_groups must be a list of group names, got {groups!r}", 500)
        display = size.get("display_name") or _default_display(section)
        out.append({**size, "display_name": display, "gpu": section})
    return out


def _default_display(section: Mapping[str, Any]) -> str:
    if section.get("whole"):
        n = section.get("count", 1)
        return f"{n} whole GPU{'s' if n != 1 else ''}"
    text = f"GPU {memory_size(section.get('memory_mib', 0), section.get('memory_limit_mib', 0))}"
    if section.get("count", 1) > 1:
        text = f"{section['count']}x {text}"
    return text


class SizesMixin:
    """Which sizes a user sees, and the gpu section a create request resolves to (the broker's
    ``kernel_sizes``, ``allow_custom_gpu`` and ``custom_gpu_allowed_groups``)."""

    sizes: Any
    allow_custom_gpu: bool
    custom_gpu_allowed_groups: Any

    def sizes_for(self, groups: set[str] | None) -> list[dict[str, Any]]:
        """Sizes visible to a user in ``groups`` (None: all, for admins)."""
        out = []
        for size in self.sizes():
            allowed = size.get("allowed_groups") or []
            if groups is None or not allowed or groups & set(allowed):
                out.append(size)
        return out

    def resolve_section(self, body: Mapping[str, Any], groups: set[str] | None) -> tuple[str, dict[str, Any]]:
        """(size name, gpu section) of a create request; BrokerError naming what is allowed."""
        size_name, gpu = body.get("size"), body.get("gpu")
        if size_name is not None and gpu is not None:
            raise BrokerError("Give either 'size' or 'gpu', not both.")
        if gpu is not None:
            try:
                section = validate_gpu_section(gpu, "request")
            except ValueError as e:
                raise BrokerError(str(e)) from None
            names = ", ".join(s["name"] for s in self.sizes_for(groups)) or "none"
            allowed_groups = set(self.custom_gpu_allowed_groups)
            may = groups is None or (self.allow_custom_gpu and (not allowed_groups or groups & allowed_groups))
            if not may:
                raise BrokerError(f"This hub offers GPU kernels in fixed sizes only; pick a 'size': {names}.", 403)
            granted = sorted(set(section) & GRANTED_KEYS)
            if granted and groups is not None:
                raise BrokerError(
                    f"A custom 'gpu' section may set only {', '.join(sorted(CUSTOM_KEYS))}; "
                    f"{', '.join(granted)} come only from a size an admin grants you: pick a 'size' ({names}).",
                    403,
                )
            return "custom", section
        visible = self.sizes_for(groups)
        if not isinstance(size_name, str) or not size_name:
            names = ", ".join(s["name"] for s in visible) or "none"
            raise BrokerError(f"Name a GPU kernel 'size' (one of: {names}) or give a 'gpu' section.")
        for size in visible:
            if size["name"] == size_name:
                return size_name, dict(size["gpu"])
        if any(s["name"] == size_name for s in self.sizes()):
            raise BrokerError(f"GPU kernel size {size_name!r} is not available to you.", 403)
        names = ", ".join(s["name"] for s in visible) or "none"
        raise BrokerError(f"No GPU kernel size {size_name!r}; this hub offers: {names}.", 400)
