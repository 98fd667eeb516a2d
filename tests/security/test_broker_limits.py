"""Smaller abuses of the broker's API: a `wait` that never ends; ports another process takes; the CLI's token."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from tests.hubrunner import http
from tests.security.conftest import SIZES, SIZES_TOKEN, SPEC
from tests.security.helpers import Session, broker_kernels


def test_a_wait_that_is_not_a_finite_number_of_seconds_is_refused(sec):
    session = Session(sec.server("alice"), SPEC)
    try:
        kernel = broker_kernels(sec.hub)[session.kernel_id]
        for wait in ("nan", "NaN", "inf", "-inf", "-1", "1e309"):
            url = f"{sec.hub.hub_api}/gpu/kernels/{kernel['id']}?wait={wait}"
            status, body = http("GET", url, sec.tokens["alice"], timeout=20)
            assert status == 400, (wait, status, body)
            assert "'wait'" in body["message"] and "seconds" in body["message"] and wait in body["message"], body
        status, body = http("GET", f"{sec.hub.hub_api}/gpu/kernels/{kernel['id']}?wait=0.5", sec.tokens["alice"])
        assert status == 200 and body["state"] == "running", body
    finally:
        session.close()


def listening_ports(pid: int) -> set[int]:
    """TCP ports in LISTEN state on sockets that process ``pid`` holds (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_the_broker_answers_with_ports_the_kernel_already_holds(sec):
    """Ports picked by bind-then-close race with any process binding ports meanwhile: the kernel
    then dies with 'Address already in use' after the broker answered 201. The answer must name
    ports the kernel holds at that moment."""
    sec.server("alice")
    body = {"server_name": "", "key": secrets.token_hex(16), "size": "gpu-10g"}
    status, kernel = http("POST", f"{sec.hub.hub_api}/gpu/kernels", sec.tokens["alice"], body)
    try:
        assert status == 201, kernel
        held = listening_ports(int(kernel["holder"]))
        wanted = {kernel[name] for name in ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")}
        assert wanted <= held, f"the broker answered ports {sorted(wanted)}; the kernel holds {sorted(held)}"
    finally:
        if status == 201:
            sec.hub.api("DELETE", f"/gpu/kernels/{kernel['id']}")


def test_the_sizes_scope_reads_every_size_and_nothing_else(sec):
    """What the single-machine CLI's token needs for `up` (the kernelspecs): every size, no kernel rights."""
    status, body = http("GET", f"{sec.hub.hub_api}/gpu/kernel-sizes", SIZES_TOKEN)
    assert status == 200 and {s["name"] for s in body["sizes"]} == {s["name"] for s in SIZES}, body
    for method, path in (("GET", "/gpu/kernels"), ("GET", "/gpu/kernels?user=alice"), ("POST", "/gpu/server-token")):
        status, body = http(method, sec.hub.hub_api + path, SIZES_TOKEN, {} if method == "POST" else None)
        assert status == 403, (method, path, status, body)
