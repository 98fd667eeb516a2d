"""Kubernetes quantities as the API server reads them (k8s.io/apimachinery resource.Quantity):
every suffix it accepts, decimal (n u m "" k M G T P E), binary (Ki .. Ei) and exponents."""

from __future__ import annotations

from decimal import Decimal

import pytest

from hubext.kubernetes.quantities import cpu_and_memory, quantity


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("100n", Decimal("1E-7")),
        ("250u", Decimal("0.00025")),
        ("500m", Decimal("0.5")),
        ("2", Decimal(2)),
        ("1.5", Decimal("1.5")),
        ("3k", Decimal(3000)),
        ("1M", Decimal(10**6)),
        ("1G", Decimal(10**9)),
        ("1T", Decimal(10**12)),
        ("1P", Decimal(10**15)),
        ("1E", Decimal(10**18)),
        ("1Ki", Decimal(1024)),
        ("64Gi", Decimal(64 * 2**30)),
        ("1Ei", Decimal(2**60)),
        ("1e3", Decimal(1000)),
        ("1E3", Decimal(1000)),
        ("+2", Decimal(2)),
    ],
)
def test_every_suffix_the_api_server_accepts_is_read(text, value):
    assert quantity(text) == value


@pytest.mark.parametrize("text", ["", "abc", "1x", "1 Gi", "Gi", "1.2.3", "1KI"])
def test_what_the_api_server_refuses_is_none(text):
    assert quantity(text) is None


def test_nano_and_micro_cpus_round_up_to_a_millicore():
    # the metrics API and some controllers write CPU in n/u: a request is never read as nothing
    assert cpu_and_memory({"cpu": "100n", "memory": "1Mi"}) == (1, 1)
    assert cpu_and_memory({"cpu": "1500000u", "memory": "1Gi"}) == (1500, 1024)
