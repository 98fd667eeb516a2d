"""Kubernetes quantities ("500m", "2", "64Gi") as numbers: what a pod asks of its node.

Every suffix the API server accepts (k8s.io/apimachinery's resource.Quantity): decimal
n u m k M G T P E, binary Ki Mi Gi Ti Pi Ei, and decimal exponents ("1e3")."""

from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import ROUND_CEILING, Decimal, InvalidOperation
from typing import Any

_SUFFIX = {
    "": 1,
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
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
_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(n|u|m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")


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
    # Decimal's // truncates toward zero, so -(-x // 1) is no ceiling for a fraction ("100n")
    return (int((cpu * 1000).to_integral_value(rounding=ROUND_CEILING)),
            int((memory / 2**20).to_integral_value(rounding=ROUND_CEILING)))
