"""Kubernetes resource quantities ("100m", "1Gi", "2", "1e3") as exact fractions."""

from __future__ import annotations

import math
import re
from fractions import Fraction

_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$")
QUANTITY_ERROR = ("quantities must match the regular expression "
                  "'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'")

_SUFFIX = {
    "": Fraction(1), "n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000),
    "k": Fraction(10**3), "M": Fraction(10**6), "G": Fraction(10**9), "T": Fraction(10**12),
    "P": Fraction(10**15), "E": Fraction(10**18),
    "Ki": Fraction(2**10), "Mi": Fraction(2**20), "Gi": Fraction(2**30), "Ti": Fraction(2**40),
    "Pi": Fraction(2**50), "Ei": Fraction(2**60),
}


class QuantityError(ValueError):
    pass


def parse(value: str | int | float) -> Fraction:
    """Parse a quantity; raises QuantityError with the API server's message."""
    if isinstance(value, bool):
        raise QuantityError(QUANTITY_ERROR)
    if isinstance(value, int):
        return Fraction(value)
    if isinstance(value, float):
        return Fraction(value).limit_denominator(10**9)
    text = str(value).strip()
    m = _QUANTITY.match(text)
    if not m:
        raise QuantityError(QUANTITY_ERROR)
    number, suffix = m.groups()
    try:
        num = Fraction(number)
    except ValueError:
        raise QuantityError(QUANTITY_ERROR) from None
    if suffix in _SUFFIX:
        return num * _SUFFIX[suffix]
    em = re.fullmatch(r"[eE]([-+]?[0-9]+)", suffix)
    if em:
        return num * Fraction(10) ** int(em.group(1))
    raise QuantityError(QUANTITY_ERROR)


def fmt(value: Fraction) -> str:
    """A canonical-enough rendering: integers plain, otherwise milli-units rounded up."""
    if value.denominator == 1:
        return str(value.numerator)
    milli = math.ceil(value * 1000)
    if milli % 1000 == 0:
        return str(milli // 1000)
    return f"{milli}m"


def is_extended(resource: str) -> bool:
    """Extended resources are the ones with a domain outside kubernetes.io (nvidia.com/gpu)."""
    if "/" not in resource:
        return False
    domain = resource.split("/", 1)[0]
    return not (domain == "kubernetes.io" or domain.endswith(".kubernetes.io")
                or resource.startswith("requests."))
