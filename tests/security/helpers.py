"""What the security tests share: GPU kernel sessions on users' servers, the broker's view, processes."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.hubrunner import HubRunner
from tests.kernelprovider.helpers import KernelConnection, Server


def broker_kernels(hub: HubRunner) -> dict[str, dict]:
    """The broker's kernels by the server's (Jupyter) kernel id."""
    status, body = hub.api("GET", "/gpu/kernels")
    assert status == 200, body
    return {k["kernel_id"]: k for k in body["kernels"]}


def used_mib(hub: HubRunner) -> int:
    status, pool = hub.api("GET", "/gpu/pool")
    assert status == 200, pool
    return sum(s["memory_mib"] for n in pool["nodes"] for g in n["gpus"] for s in g["slices"])


class Session:
    """A notebook session with a GPU kernel on a user's server, and a tab connected to it."""

    def __init__(self, server: Server, spec: str) -> None:
        self.server = server
        status, body = server.start_session(spec)
        assert status == 201, body
        self.model = body
        self.kernel_id = body["kernel"]["id"]
        self._tab: KernelConnection | None = None

    @property
    def tab(self) -> KernelConnection:
        if self._tab is None:
            self._tab = self.server.connect(self.kernel_id)
        return self._tab

    def run(self, code: str, timeout: float = 60) -> str:
        out = self.tab.execute(code, timeout)
        assert out["status"] == "ok", out
        return out["text"]

    def close(self) -> None:
        if self._tab is not None:
            self._tab.close()
            self._tab = None
        self.server.api("DELETE", f"/sessions/{self.model['id']}")


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, log: Callable[[], str] | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{log() if log else ''}")


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def processes_with_env(name: str, value: str) -> list[int]:
    """Pids of live processes whose environment has ``name=value``."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle in env and pid_alive(int(entry.name)):
            found.append(int(entry.name))
    return found
