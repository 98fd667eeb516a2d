"""The test hub runner starts a real hub behind the real proxy and cleans up after itself."""

import os

from tests.hubrunner import HubRunner


def test_hub_runner_starts_real_hub_and_proxy_and_leaves_nothing(tmp_path):
    hub = HubRunner(tmp_path).start()
    try:
        status, info = hub.api("GET", "/info")
        assert status == 200 and "version" in info
        token = hub.user_token("ada")
        status, me = hub.api("GET", "/user", token=token)
        assert status == 200 and me["name"] == "ada"
        status, _ = hub.api("GET", "/users", token=token)
        assert status == 403, "a user's token must not list all users"
        pgid = hub.proc.pid
    finally:
        hub.stop()
    try:
        os.killpg(pgid, 0)
        alive = True
    except ProcessLookupError:
        alive = False
    assert not alive, "the hub's process group outlived stop()"
