"""`elastic-gpu up` and the ports a hub uses besides the public one (issue 29: a CI flake).

A hub listens on three ports: the public one (`--port`, the proxy), the hub's internal API
(`c.JupyterHub.hub_port`) and the proxy's API (`c.ConfigurableHTTPProxy.api_url`), the last two
written into jupyterhub_config.py by `elastic-gpu init`. Before: `up --port P` where P was one of
the other two started the proxy on P; JupyterHub could not bind and exited, the proxy stayed
running, and `up` printed the proxy's own log lines instead of the hub's error.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import psutil
import pytest

from tests.cli.uphub import cli, cli_command, reachable_dir, remove_dir
from tests.hubrunner import free_port

pytestmark = pytest.mark.timeout(180)


def configured_port(config_dir: Path, setting: str) -> int:
    text = (config_dir / "jupyterhub_config.py").read_text()
    pattern = {
        "hub_port": r"^c\.JupyterHub\.hub_port = (\d+)",
        "proxy_api": r"^c\.ConfigurableHTTPProxy\.api_url = \"http://127\.0\.0\.1:(\d+)\"",
    }[setting]
    match = re.search(pattern, text, re.M)
    assert match, f"jupyterhub_config.py sets no {setting}:\n{text}"
    return int(match.group(1))


def run_up(config_dir: Path, port: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        cli_command() + ["up", "--config-dir", str(config_dir), "--port", str(port), "--no-kernelspecs"],
        capture_output=True,
        text=True,
        timeout=120,
    )


def proxies_of(config_dir: Path) -> list[psutil.Process]:
    """configurable-http-proxy processes whose pid file is in this config dir (JupyterHub writes it there)."""
    pid_file = config_dir / "data" / "jupyterhub-proxy.pid"
    try:
        proc = psutil.Process(int(pid_file.read_text().strip()))
        if proc.status() != psutil.STATUS_ZOMBIE and "configurable-http-proxy" in " ".join(proc.cmdline()):
            return [proc]
    except (OSError, ValueError, psutil.NoSuchProcess):
        pass
    return []


@pytest.fixture
def config_dir():
    root = reachable_dir("egpu-ports-")
    config_dir = root / "elastic-gpu"
    init = cli("init", "--config-dir", str(config_dir), "--simulate-gpus", "1xT4", "--authenticator", "firstuse")
    assert init.returncode == 0, init.stderr
    try:
        yield config_dir
    finally:
        for proc in proxies_of(config_dir):  # only after a failed test: the tests check none is left
            proc.kill()
        remove_dir(root)


@pytest.mark.parametrize(
    "setting,line",
    [("hub_port", "c.JupyterHub.hub_port"), ("proxy_api", "c.ConfigurableHTTPProxy.api_url")],
)
def test_up_refuses_a_public_port_the_config_gives_the_hub_or_the_proxy_api(config_dir, setting, line):
    port = configured_port(config_dir, setting)
    up = run_up(config_dir, port)
    out = up.stdout + up.stderr
    assert up.returncode == 2, out
    assert f"--port {port} is the port jupyterhub_config.py gives" in up.stderr and line in up.stderr, out
    assert "Traceback" not in out and "hub is up" not in out, out
    assert not proxies_of(config_dir), f"a configurable-http-proxy was left running:\n{out}"
    assert not (config_dir / "data" / "jupyterhub.log").exists(), "JupyterHub was started"


def test_when_jupyterhub_exits_at_start_up_shows_the_hubs_error_and_stops_the_proxy(config_dir):
    config = config_dir / "jupyterhub_config.py"
    text = config.read_text()
    assert 'c.JupyterHub.hub_ip = "127.0.0.1"' in text
    # an admin's mistake: an address this machine does not have (TEST-NET-1); the proxy starts, the hub cannot bind
    config.write_text(text.replace('c.JupyterHub.hub_ip = "127.0.0.1"', 'c.JupyterHub.hub_ip = "192.0.2.1"'))
    (config_dir / "data" / "jupyterhub.log").write_text("[E 2000-01-01 00:00:00.000 JupyterHub] an earlier run\n")
    up = run_up(config_dir, free_port())
    out = up.stdout + up.stderr
    assert up.returncode == 1, out
    assert "JupyterHub exited with status 1" in up.stderr, out
    assert "Failed to bind hub to http://192.0.2.1:" in up.stderr, out
    assert "[ConfigProxy]" not in out, f"the proxy's lines hide the hub's:\n{out}"
    assert "an earlier run" not in out, f"lines of an earlier run were shown as this one's:\n{out}"
    assert not proxies_of(config_dir), f"a configurable-http-proxy was left running:\n{out}"


def test_init_gives_the_hub_and_the_proxy_api_ports_no_outgoing_connection_or_random_bind_can_take(config_dir):
    """The two internal ports live in the config for as long as the hub is used; a port of the
    kernel's ephemeral range (ip_local_port_range) is handed to any outgoing connection and any
    bind to port 0 on the machine in the meantime (a CI run saw the proxy's API port answered by
    another program, 404, and JupyterHub exit with a traceback). They are chosen below it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {setting: configured_port(config_dir, setting) for setting in ("hub_port", "proxy_api")}
    assert all(1024 <= port < low for port in ports.values()), (ports, low)
    assert ports["hub_port"] != ports["proxy_api"], ports
