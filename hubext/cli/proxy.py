"""configurable-http-proxy for ``elastic-gpu up``: finding it, the ports the hub and it listen on, and
stopping one that JupyterHub left behind.

A hub listens on three ports: the public one (``up --port``, served by the proxy), the hub's internal
API (``c.JupyterHub.hub_port``) and the proxy's API (``c.ConfigurableHTTPProxy.api_url``), the last two
written into ``jupyterhub_config.py`` by ``elastic-gpu init``. ``up`` checks them before it starts
anything: the public port must be neither of the other two (else the proxy takes the hub's port, the hub
cannot start, and the proxy sends its error pages to itself).
"""

from __future__ import annotations

import errno
import os
import random
import re
import shutil
import signal
import socket
import time
from pathlib import Path

from ..local.processes import process_alive, process_cmdline
from . import base
from .base import CONFIG_FILE, CLIError, UsageError

PROXY_PID_FILE = "jupyterhub-proxy.pid"  # JupyterHub's default, in its working directory (data/)
PROXY_LOG_LINE = re.compile(r"^\S+ \[ConfigProxy\] ")  # configurable-http-proxy's


def find_proxy() -> str:
    """configurable-http-proxy from $ELASTIC_GPU_PROXY, the project's node_modules, the current directory's, or PATH."""
    candidates = [
        os.environ.get("ELASTIC_GPU_PROXY", ""),
        str(base.REPO / "node_modules" / ".bin" / "configurable-http-proxy"),
        str(Path.cwd() / "node_modules" / ".bin" / "configurable-http-proxy"),
        shutil.which("configurable-http-proxy") or "",
    ]
    for path in candidates:
        if path and os.access(path, os.X_OK):
            if not shutil.which("node"):
                raise CLIError(
                    f"found {path} but not `node` (Node.js) to run it; install Node.js 18 or newer "
                    "(e.g. apt-get install nodejs) and run again"
                )
            return path
    raise CLIError(
        "configurable-http-proxy is not installed. Install it with `npm install configurable-http-proxy` "
        "in the project folder (./dev up does this), or put it on PATH, or set ELASTIC_GPU_PROXY to its path"
    )


def port_in_use(ip: str, port: int) -> bool:
    """Whether another socket listens on ``ip:port`` (an address this machine lacks is not "in use")."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


#: where the internal ports are chosen: below the kernel's ephemeral range, from this port up
SERVICE_PORTS_FROM = 20000


def ephemeral_start() -> int:
    """The first port the kernel hands to outgoing connections and binds to port 0 (Linux's
    ``ip_local_port_range``; 32768, its default, where that cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def service_ports(count: int, ip: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports free now on ``ip`` for the hub's internal API and the proxy's API,
    which ``init`` writes into the config for as long as the hub is used: below the ephemeral
    range, so that no outgoing connection and no bind to port 0 on the machine takes one of
    them in the meantime (a port of that range can be anyone's between two ``up``)."""
    end = ephemeral_start()
    start = SERVICE_PORTS_FROM if end - SERVICE_PORTS_FROM >= 1000 else 1024
    rng = random.SystemRandom()
    ports: list[int] = []
    for _ in range(200):
        port = rng.randrange(start, max(start + 1, end))
        if port not in ports and not port_in_use(ip, port):
            ports.append(port)
            if len(ports) == count:
                return ports
    raise CLIError(
        f"found no {count} free ports between {start} and {end} on {ip}; "
        "free some, or set the ports in the config by hand"
    )


def internal_ports(config_dir: Path) -> dict[str, tuple[str, int]]:
    """The config line and (ip, port) of the hub's internal API and of the proxy's API.

    Read from the literal lines ``elastic-gpu init`` writes; JupyterHub's defaults where a line is gone.
    A value the config computes (not a literal) is not checked."""
    text = (config_dir / CONFIG_FILE).read_text()
    ports: dict[str, tuple[str, int]] = {}
    hub_ip = re.search(r"^c\.JupyterHub\.hub_ip\s*=\s*[\"']([^\"']*)[\"']", text, re.M)
    hub_port = re.search(r"^c\.JupyterHub\.hub_port\s*=\s*(.*)$", text, re.M)
    if hub_port is None or hub_port.group(1).split("#")[0].strip().isdigit():
        port = int(hub_port.group(1).split("#")[0]) if hub_port else 8081
        ports["c.JupyterHub.hub_port"] = ((hub_ip.group(1) if hub_ip else "") or "127.0.0.1", port)
    api_url = re.search(r"^c\.ConfigurableHTTPProxy\.api_url\s*=\s*(.*)$", text, re.M)
    literal = re.match(r"[\"']https?://([^:/\"']+):(\d+)/?[\"']", api_url.group(1).strip()) if api_url else None
    if api_url is None or literal:
        ip, port = (literal.group(1), int(literal.group(2))) if literal else ("127.0.0.1", 8001)
        ports["c.ConfigurableHTTPProxy.api_url"] = (ip, port)
    return ports


def check_ports(config_dir: Path, ip: str, port: int, stale_proxy: int | None) -> None:
    """Refuse, with the line to change, a public port the hub or the proxy API also needs, or one they find taken."""
    config = config_dir / CONFIG_FILE
    for line, (inner_ip, inner_port) in internal_ports(config_dir).items():
        if inner_port == port:
            raise UsageError(
                f"--port {port} is the port {CONFIG_FILE} gives {_role(line)} ({line} in {config}); "
                "pick another --port, or give that line another port"
            )
        if stale_proxy is None and port_in_use(inner_ip, inner_port):
            raise CLIError(
                f"port {inner_port}, which {config} gives {_role(line)} ({line}), is in use by another program; "
                "stop that program, or give that line a free port"
            )
    if stale_proxy is None and port_in_use(ip, port):
        raise CLIError(f"port {port} on {ip} is in use (another hub?); pick another with --port")


def _role(line: str) -> str:
    return "the hub's internal API" if "hub_port" in line else "the proxy's API"


def left_behind(data: Path) -> int | None:
    """The pid of a configurable-http-proxy that this config dir's JupyterHub started and left running."""
    try:
        pid = int((data / PROXY_PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if process_alive(pid) and "configurable-http-proxy" in " ".join(process_cmdline(pid)) else None


def stop_left_behind(data: Path, timeout: float = 10) -> int | None:
    """Stop the proxy JupyterHub left running (it exits without stopping it when it fails to start)."""
    pid = left_behind(data)
    if pid is None:
        return None
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while process_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not process_alive(pid):
            break
    try:
        (data / PROXY_PID_FILE).unlink()
    except FileNotFoundError:
        pass
    return pid


def hub_lines(log_path: Path, offset: int, lines: int = 40) -> tuple[str, int]:
    """The last ``lines`` lines JupyterHub wrote to its log since ``offset``, and how many proxy lines were left out.

    The proxy writes to the same log (JupyterHub starts it with its own output); its lines (a record and
    the indented lines after it) would hide the hub's own error."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError:
        return "", 0
    kept: list[str] = []
    dropped = 0
    in_proxy_record = False
    for line in text.splitlines():
        if PROXY_LOG_LINE.match(line):
            in_proxy_record = True
        elif line and not line[0].isspace() and line[0] != "}":  # not the rest of a proxy's error object
            in_proxy_record = False
        if in_proxy_record:
            dropped += 1
        else:
            kept.append(line)
    return "\n".join(kept[-lines:]), dropped
