"""Attack: capture the culler's credential from inside one's own server, then act as the culler.

alice's server is alice's process and loads alice's ``~/.jupyter`` config: it records every
credential sent to it (the fixture's CAPTURE_CONFIG). The culler then does its whole job on
alice's idle GPU kernel: reads the server's kernels, warns through the kernel's websocket,
shuts it down through the server. Every credential alice captured must be alice's own: it
reaches neither bob's server nor bob's GPU kernels, and names no one but alice.
"""

from __future__ import annotations

import pytest

from tests.culler.stack import CullerProcess
from tests.hubrunner import http
from tests.security.conftest import CULLER_TOKEN, SPEC
from tests.security.helpers import Session, broker_kernels, wait_until


@pytest.fixture
def culler(sec):
    made: list[CullerProcess] = []

    def make(name: str, **traits) -> CullerProcess:
        proc = CullerProcess(sec.hub, sec.work, CULLER_TOKEN, name=name, **traits)
        made.append(proc)
        return proc.start()

    yield make
    for proc in made:
        proc.stop()


def test_no_credential_but_alices_own_reaches_alices_server(sec, culler):
    hub = sec.hub
    alice, bob = sec.server("alice"), sec.server("bob")
    captured = sec.home("alice") / "captured-credentials.txt"
    session = Session(alice, SPEC)
    try:
        tab = alice.connect(session.kernel_id)  # a tab left open: the culler warns it, then shuts it down
        proc = culler("sec-token", idle_timeout_seconds=2, warning_seconds=1, gpu_busy_window_seconds=1)
        wait_until(
            lambda: session.kernel_id not in broker_kernels(hub),
            40,
            "the culler to reclaim alice's idle GPU kernel",
            log=lambda: proc.log_text()[-3000:],
        )
        tab.close()
        proc.stop()
    finally:
        session.close()
    tokens = set(captured.read_text().split()) - {sec.tokens["alice"]}
    assert tokens, "the culler never talked to alice's server (nothing to judge)"
    for token in tokens:
        status, who = http("GET", f"{hub.hub_api}/user", token)
        assert status == 200 and who.get("kind") == "user" and who.get("name") == "alice", (
            f"alice's server received a credential of {who!r}"
        )
        status, _ = http("GET", f"{hub.url}/user/bob/api/kernels", token)
        assert status in (401, 403, 404), f"a credential alice captured opens bob's server (HTTP {status})"
        status, _ = http("GET", f"{hub.hub_api}/gpu/kernels?user=bob", token)
        assert status in (401, 403), f"a credential alice captured lists bob's GPU kernels (HTTP {status})"
        status, _ = http("GET", f"{hub.hub_api}/gpu/kernels", token)
        assert status in (400, 401, 403), f"a credential alice captured lists every GPU kernel (HTTP {status})"
    assert bob  # bob's server ran throughout: the replays above had something to reach
