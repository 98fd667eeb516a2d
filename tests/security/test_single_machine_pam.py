"""PAM mode on one machine (issue 19, item 6): each server runs as its user, who reaches their own GPU
limits file but none of the hub's state, and a config dir users cannot reach is refused with the reason.

Before: as root the default config dir was root's home (mode 0700), so no PAM user could read their
limits file and the shim refused CUDA for everyone; the hub's database, ledger and log were
world-readable; the hub's Python under root's home made every spawn fail with a bare 500.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
from pathlib import Path

import psutil
import pytest

from tests.cli.uphub import UpHub, cli, cli_command, reachable_dir, remove_dir
from tests.hubrunner import free_port
from tests.security.test_single_machine_accounts import HUB_SECRETS, PROBE

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0, reason="PAM mode runs servers as their users, which needs root"),
]

USER, PASSWORD = f"egpu-pam-{os.getpid()}", "ann-password-1"  # one account per test run
QUARTER = "h100-80gb-quarter"


def drop_user(name: str) -> None:
    try:
        uid = pwd.getpwnam(name).pw_uid
    except KeyError:
        return
    for p in psutil.process_iter(["uids"]):
        if p.info["uids"] and p.info["uids"].real == uid:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
    subprocess.run(["userdel", "--force", name], capture_output=True)


@pytest.fixture(scope="module")
def hub():
    from hubext.cli.accounts import check_servers_can_reach, revoke_passage

    root = reachable_dir("egpu-pam-")
    config_dir = root / "elastic-gpu"
    home = root / "home"
    home.mkdir()
    os.chmod(home, 0o755)
    drop_user(USER)
    subprocess.run(["useradd", "--create-home", "--home-dir", str(home / USER), USER], check=True)
    subprocess.run(["chpasswd"], input=f"{USER}:{PASSWORD}\n", text=True, check=True)
    opened: list[Path] = []
    runner = UpHub(config_dir, USER)
    try:
        init = cli(
            "init", "--config-dir", str(config_dir), "--simulate-gpus", "1xH100-80GB",
            "--authenticator", "pam", "--admin", USER,
        )  # fmt: skip
        assert init.returncode == 0, init.stderr
        # what an admin does where the hub's Python lives under root's home: let the user pass through
        opened = check_servers_can_reach(config_dir, USER, grant=True)
        runner.start()
        runner.tokens[USER] = runner.login(USER, PASSWORD)
        yield runner
    finally:
        runner.stop()
        runner.kill_leftovers()
        uid = pwd.getpwnam(USER).pw_uid
        for directory in opened:
            revoke_passage(directory, uid)
        drop_user(USER)
        remove_dir(root)


def test_up_says_it_runs_pam_mode_and_why(hub):
    assert "mode: PAM login (this machine's accounts), because --authenticator pam" in hub.output(), hub.output()


def test_a_pam_users_gpu_server_runs_as_them_and_reads_its_limits_but_not_the_hubs_state(hub):
    status, body = hub.spawn(USER, {"profile": QUARTER})
    assert status in (201, 202), body
    server = hub.wait_ready(USER)
    status_lines = Path(f"/proc/{server['state']['pid']}/status").read_text().splitlines()
    uids = next(line for line in status_lines if line.startswith("Uid:"))
    assert set(uids.split()[1:]) == {str(pwd.getpwnam(USER).pw_uid)}, uids
    kernel = hub.start_kernel(USER, "python3")
    code = PROBE.format(data=str(hub.config_dir / "data"), names=list(HUB_SECRETS))
    code += "print(open(os.environ['LIBVGPU_CONFIG']).read().count('memory_mib.0=20480'))\n"
    lines = hub.run_code(USER, kernel["id"], code).strip().splitlines()
    assert lines[-1] == "1", "the user could not read their own GPU limits file"
    seen = json.loads(lines[-2])
    read = sorted(path for path, what in seen["read"].items() if what == "READ")
    assert not read, f"a PAM user's code read {read}"
    assert seen["listed"] == "denied"


def test_up_in_pam_mode_refuses_a_config_dir_users_cannot_reach_and_says_why():
    locked = reachable_dir("egpu-pam-locked-")
    os.chmod(locked, 0o700)  # like root's home
    config_dir = locked / "elastic-gpu"
    try:
        init = cli("init", "--config-dir", str(config_dir), "--simulate-gpus", "1xT4", "--authenticator", "pam")
        assert init.returncode == 0, init.stderr
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
            raise AssertionError(f"`elastic-gpu up` started a PAM hub users cannot reach:\n{out}") from None
        assert up.returncode == 1, out
        assert f"cannot reach the config dir {config_dir}" in out and f"cannot enter {locked}" in out, out
        assert "Traceback" not in out
    finally:
        remove_dir(locked)
