"""Kubernetes quantities ("500m", "2", "64Gi") as numbers: what a pod asks of its node."""

from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

_SUFFIX = {
    "": 1,
    "m": Decimal("0.001"),
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")


def quantity(value: Any) -> Decimal | None:
    """A Kubernetes quantity ("500m", "2", "64Gi", "1e9") as a number; None if malformed."""
    match = _QUANTITY.match(str(value).strip())
    if not match:
        return None
    try:
        return Decimal(match.group(1)) * _SUFFIX[match.group(2) or ""]
    except InvalidOperation:
        return None


def cpu_and_memory(resources: Mapping[str, Any] | None) -> tuple[int, int]:
    """(CPU millicores, memory MiB) of a resources mapping (``{"cpu": "2", "memory": "4Gi"}``),
    rounded up; what is absent or malformed counts 0."""
    cpu = quantity((resources or {}).get("cpu", 0)) or Decimal(0)
    memory = quantity((resources or {}).get("memory", 0)) or Decimal(0)
    return int(-(-cpu * 1000 // 1)), int(-(-memory // 2**20))
