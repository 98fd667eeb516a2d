"""Smaller abuses of the broker's API: a `wait` that never ends."""

from __future__ import annotations

import pytest

from tests.hubrunner import http
from tests.security.conftest import SPEC
from tests.security.helpers import Session, broker_kernels


@pytest.mark.parametrize("wait", ["nan", "inf", "-inf", "-1", "1e309", "NaN"])
def test_a_wait_that_is_not_a_finite_number_of_seconds_is_refused(sec, wait):
    session = Session(sec.server("alice"), SPEC)
    try:
        kernel = broker_kernels(sec.hub)[session.kernel_id]
        url = f"{sec.hub.hub_api}/gpu/kernels/{kernel['id']}?wait={wait}"
        status, body = http("GET", url, sec.tokens["alice"], timeout=20)
        assert status == 400, (status, body)
        assert "'wait'" in body["message"] and "seconds" in body["message"] and wait in body["message"], body
    finally:
        session.close()
