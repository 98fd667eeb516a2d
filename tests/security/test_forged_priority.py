"""Attack: raise one's priority, or take a whole card, by forging the request.

Priority classes that preempt, whole cards and GPU counts come only from what an admin grants:
a size or profile the user may see. Forged through the broker's REST API (as a user's own
kernelspec or a curl with the server's token would) or through the spawn API, the request is
refused with a sentence saying what is allowed, and nothing is allocated.
"""

from __future__ import annotations

import secrets

import pytest

from tests.hubrunner import http
from tests.security.helpers import used_mib

FORGED = [
    {"memory_mib": 1024, "cores_percent": 10, "priority_class": "high"},
    {"whole": True},
    {"memory_mib": 1024, "cores_percent": 10, "count": 1, "priority_class": "high", "whole": True},
]


def create(sec, user: str, **body) -> tuple[int, dict]:
    body = {"server_name": "", "key": secrets.token_hex(16), **body}
    return http("POST", f"{sec.hub.hub_api}/gpu/kernels", sec.tokens[user], body)


@pytest.mark.parametrize("gpu", FORGED, ids=["priority", "whole", "all"])
def test_a_forged_gpu_section_is_refused_by_the_broker(sec, gpu):
    sec.server("alice")
    before = used_mib(sec.hub)
    status, body = create(sec, "alice", gpu=gpu)
    try:
        assert status in (400, 403), f"a forged gpu section {gpu} was accepted: {status} {body}"
        message = body["message"]
        assert "size" in message and "gpu-10g" in message, message
        assert "Traceback" not in message
        assert used_mib(sec.hub) == before
    finally:
        if status == 201:
            sec.hub.api("DELETE", f"/gpu/kernels/{body['id']}")


def test_a_size_granted_to_a_group_is_refused_to_others(sec):
    sec.server("alice")
    status, body = create(sec, "alice", size="gpu-whole-high")
    try:
        assert status == 403, (status, body)
        assert "not available to you" in body["message"]
        status, sizes = http("GET", f"{sec.hub.hub_api}/gpu/kernel-sizes", sec.tokens["alice"])
        assert status == 200 and [s["name"] for s in sizes["sizes"]] == ["gpu-10g"], sizes
        assert sizes["custom_allowed"] is False
    finally:
        if status == 201:
            sec.hub.api("DELETE", f"/gpu/kernels/{body['id']}")


@pytest.mark.parametrize(
    "options",
    [{"gpu": {"whole": True, "priority_class": "high"}}, {"profile": "vip-gpu"}, {"priority_class": "high"}],
    ids=["gpu-section", "vip-profile", "priority-option"],
)
def test_forged_spawn_options_are_refused(sec, options):
    hub = sec.hub
    before = used_mib(hub)
    status, body = hub.api("POST", "/users/carol/server", body=options)
    try:
        assert status == 400, f"a forged spawn {options} was not refused: {status} {body}"
        assert "Traceback" not in body["message"] and "profile" in body["message"], body
        assert used_mib(hub) == before
    finally:
        hub.api("DELETE", "/users/carol/server")
