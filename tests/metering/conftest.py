"""A real PostgreSQL server for the usage store's tests (one per session: the store's own tests
use its ``postgres`` database, the hub tests a database of their own). Skipped where
PostgreSQL (initdb, pg_ctl) or the psycopg driver is missing."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_program(name: str) -> str | None:
    """``name`` on PATH, else from Debian's versioned directory (where apt puts it, off PATH)."""
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=lambda p: int(p.split("/")[4]))
    return candidates[-1] if candidates else None


@pytest.fixture(scope="session")
def postgres():
    """(URL of the server's ``postgres`` database, server(action): "stop" or "start" it)."""
    pytest.importorskip("psycopg", reason="the psycopg driver is not installed")
    initdb, pg_ctl = _server_program("initdb"), _server_program("pg_ctl")
    if not initdb or not pg_ctl:
        if os.environ.get("ELASTIC_GPU_CI"):  # .ci/run installs it: a skip there would hide the outage test
            pytest.fail("PostgreSQL (initdb, pg_ctl) is not installed, but .ci/run should have installed it")
        pytest.skip("PostgreSQL (initdb, pg_ctl) is not installed")
    root = tempfile.mkdtemp(prefix="egpu-pg-")  # not under pytest's 0700 tree: the server's account must reach it
    as_server = []
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root
        shutil.chown(root, "postgres")
        as_server = ["runuser", "-u", "postgres", "--"]
    data, port = os.path.join(root, "data"), _free_port()
    subprocess.run([*as_server, initdb, "-D", data, "-A", "trust", "-U", "egpu"], check=True, capture_output=True)
    options = f"-p {port} -k {root} -c listen_addresses=''"
    subprocess.run([*as_server, pg_ctl, "-D", data, "-o", options, "-w", "-l", f"{root}/log", "start"], check=True)

    def server(action: str) -> None:
        args = ["-o", options, "-w", "-l", f"{root}/log"] if action == "start" else ["-m", "fast", "-w"]
        subprocess.run([*as_server, pg_ctl, "-D", data, *args, action], check=True, capture_output=True)

    try:
        yield f"postgresql+psycopg://egpu@/postgres?host={root}&port={port}", server
    finally:
        subprocess.run([*as_server, pg_ctl, "-D", data, "-m", "immediate", "stop"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
