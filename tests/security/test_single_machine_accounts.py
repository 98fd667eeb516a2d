"""A single-machine hub started as root (`./dev up` on a fresh machine) never runs a user's code as root.

Issue 19, item 1: in first-use mode as root every user's server ran as root with
``--ServerApp.allow_root=True``, so a user could read /etc/shadow, the hub's cookie secret, the
CLI token and every other file of the hub. These tests are the attack as a user performs it:
log in, start a server, run code in a kernel of it (a plain one in the server and a GPU kernel
through the broker) that reads what it must not.

In this "trusted team" mode the servers run as one unprivileged system account; the hub (root)
keeps its state readable only by itself.
"""

from __future__ import annotations

import json
import os
import pwd
import stat
import subprocess
from pathlib import Path

import pytest

from tests.cli.uphub import UpHub, cli, cli_command, reachable_dir, remove_dir
from tests.hubrunner import free_port

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0, reason="the attack needs a hub started as root (run the suite as root)"),
]

ADMIN, ALICE, EVE = "boss", "alice", "eve"
PASSWORDS = {ADMIN: "boss-password-1", ALICE: "alice-password-1", EVE: "eve-password-1"}

#: what a user's code tries to read; each must be refused
HUB_SECRETS = (
    "jupyterhub_cookie_secret",
    "cli-token",
    "jupyterhub.sqlite",
    "elastic-gpu-ledger.sqlite",
    "jupyterhub.log",
    "passwords.dbm.dat",
    "passwords.dbm.dir",
)

PROBE = """
import json, os
data = {data!r}
out = {{"uid": os.getuid(), "euid": os.geteuid(), "read": {{}}, "listed": None}}
for path in ["/etc/shadow"] + [os.path.join(data, name) for name in {names!r}]:
    try:
        with open(path, "rb") as f:
            f.read(1)
        out["read"][path] = "READ"
    except FileNotFoundError:
        out["read"][path] = "missing"
    except PermissionError:
        out["read"][path] = "denied"
try:
    out["listed"] = sorted(os.listdir(data))
except PermissionError:
    out["listed"] = "denied"
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def hub():
    root = reachable_dir("egpu-sec-")
    config_dir = root / "elastic-gpu"
    init = cli(
        "init", "--config-dir", str(config_dir), "--simulate-gpus", "1xH100-80GB",
        "--admin", ADMIN, "--user", ALICE, "--user", EVE,
    )  # fmt: skip
    assert init.returncode == 0, init.stderr
    runner = UpHub(config_dir, ADMIN)
    try:
        runner.start()
        for user in (ADMIN, ALICE, EVE):
            runner.tokens[user] = runner.login(user, PASSWORDS[user])
        yield runner
    finally:
        runner.stop()
        runner.kill_leftovers()
        remove_dir(root)


def probe(hub: UpHub, user: str, kernel_id: str) -> dict:
    code = PROBE.format(data=str(hub.config_dir / "data"), names=list(HUB_SECRETS))
    return json.loads(hub.run_code(user, kernel_id, code).strip().splitlines()[-1])


def assert_refused(seen: dict) -> None:
    assert seen["uid"] != 0 and seen["euid"] != 0, f"the user's code runs as root: {seen}"
    read = {path: what for path, what in seen["read"].items() if what == "READ"}
    assert not read, f"the user's code read {sorted(read)}"
    assert seen["read"]["/etc/shadow"] == "denied"
    assert seen["listed"] == "denied", f"the user's code listed the hub's data dir: {seen['listed']}"


def test_up_says_it_runs_a_trusted_team_mode_and_what_users_see_of_each_other(hub):
    out = hub.output()
    assert "mode: first-use login" in out and "because" in out, out
    assert "trusted team" in out, out
    assert "NOT isolated from each other" in out, out
    account = pwd.getpwnam("elastic-gpu")
    assert account.pw_uid != 0 and f"system account 'elastic-gpu' (uid {account.pw_uid})" in out, out


def test_a_users_server_does_not_run_as_root(hub):
    status, body = hub.spawn(ALICE, {"profile": "cpu"})
    assert status in (201, 202), body
    server = hub.wait_ready(ALICE)
    pid = server["state"]["pid"]
    uids = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("Uid:"))
    assert set(uids.split()[1:]) == {str(pwd.getpwnam("elastic-gpu").pw_uid)}, uids
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
    assert "allow_root" not in cmdline


def test_code_in_a_users_kernel_cannot_read_the_shadow_file_or_the_hubs_secrets(hub):
    hub.wait_ready(ALICE)
    kernel = hub.start_kernel(ALICE, "python3")
    assert_refused(probe(hub, ALICE, kernel["id"]))


def test_code_in_a_gpu_kernel_cannot_read_them_either(hub):
    hub.wait_ready(ALICE)
    kernel = hub.start_kernel(ALICE, "elastic-gpu-gpu-10g")
    assert_refused(probe(hub, ALICE, kernel["id"]))


def test_the_hubs_state_is_readable_by_the_hub_alone(hub):
    data = hub.config_dir / "data"
    assert stat.S_IMODE(data.stat().st_mode) & 0o044 == 0, oct(data.stat().st_mode)
    for name in HUB_SECRETS:
        path = data / name
        if not path.exists():
            continue
        info = path.stat()
        assert info.st_uid == 0 and stat.S_IMODE(info.st_mode) & 0o077 == 0, f"{name}: {oct(info.st_mode)}"


def test_up_as_root_refuses_a_config_that_would_run_servers_as_root():
    root = reachable_dir("egpu-sec-old-")
    config_dir = root / "elastic-gpu"
    try:
        init = cli("init", "--config-dir", str(config_dir), "--simulate-gpus", "1xT4", "--authenticator", "firstuse")
        assert init.returncode == 0, init.stderr
        hub_config = config_dir / "jupyterhub_config.py"
        lines = hub_config.read_text().splitlines()
        hub_config.write_text("\n".join(line for line in lines if "run_as_account" not in line) + "\n")  # an old config
        up = subprocess.Popen(
            cli_command() + ["up", "--config-dir", str(config_dir), "--port", str(free_port())],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            out, _ = up.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            up.terminate()
            out, _ = up.communicate(timeout=60)
            raise AssertionError(f"`elastic-gpu up` started a hub that runs servers as root:\n{out}") from None
        assert up.returncode == 1, out
        assert "runs every user's server as the hub's own account, which would be root" in out, out
        assert "c.HubUserGPUSpawner.run_as_account = 'elastic-gpu'" in out, out
    finally:
        remove_dir(root)
