"""The hub's pages as people see them, in headless Chromium: a user's slices and remaining quota on
/hub/home and the spawn page; the admin page /hub/gpu keeping itself current, naming the server of
each slice and queued request, cancelling a waiting request and stopping a GPU kernel or server.

One real hub in single-machine mode (one simulated H100-80GB, the real broker, users' real
jupyter-servers and GPU kernels). alice may hold 56 GiB, bob the whole card.
"""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from tests.cli.browser import Browser, chromium_path
from tests.kernelprovider.helpers import local_stack

pytestmark = pytest.mark.timeout(300)

ADMISSION = {
    "priority_classes": {"default": {"value": 100, "preempt": False, "borrow": False}},
    "default_priority_class": "default",
    "placement": {"node": "binpack", "gpu": "binpack"},
    "workspaces": {
        "default": {
            "limits": {"memory_mib": 81920},
            "namespaces": {
                "default": {
                    "user_limits": {"memory_mib": 57344, "gpus": 4},
                    "users": {"bob": {"memory_mib": 81920}},
                }
            },
        }
    },
}
SIZES = [
    {"name": "gpu-10g", "display_name": "GPU 10 GiB", "memory_mib": 10240, "cores_percent": 25},
    {"name": "gpu-40g", "display_name": "GPU 40 GiB", "memory_mib": 40960, "cores_percent": 50},
]
PROFILES = [
    {"display_name": "CPU only", "slug": "cpu", "default": True},
    {"display_name": "GPU 40 GiB", "slug": "g40", "gpu": {"memory_mib": 40960, "cores_percent": 50}},
]
EXTRA = f"""
c.JupyterHub.allow_named_servers = True
c.HubUserGPUSpawner.profile_list = {PROFILES!r}
c.GPUBroker.max_queue_seconds = 60
c.Authenticator.admin_users = {{"admin"}}
c.Authenticator.allow_all = True
"""
SMALL, BIG = "elastic-gpu-gpu-10g", "elastic-gpu-gpu-40g"


def need_chromium() -> None:
    if chromium_path() is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (.ci/run installs it: apt-get install chromium)")
        pytest.skip("chromium is not installed (apt-get install chromium)")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with local_stack(tmp_path_factory.mktemp("hub-pages"), admission=ADMISSION, sizes=SIZES, extra_config=EXTRA) as st:
        yield st


async def logged_in(hub, user: str) -> Browser:
    browser = await Browser(width=1280, height=1400).start()
    await browser.goto(hub.url + "/hub/login")
    await browser.submit_and_wait(  # the dummy authenticator takes any password
        f"document.getElementById('username_input').value = {user!r};"
        "document.getElementById('password_input').value = 'any';"
        "document.querySelector('form').submit();"
    )
    return browser


async def until(browser: Browser, expression: str, timeout: float = 20) -> object:
    """Poll a page expression until it is truthy (the page changes by itself, without a reload)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = await browser.evaluate(expression)
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            text = await browser.evaluate("document.body.innerText")
            raise AssertionError(f"the page never showed {expression!r}; it shows:\n{text}")
        await asyncio.sleep(0.3)


async def test_home_and_spawn_pages_show_the_users_slices_and_what_is_left(stack):
    need_chromium()
    hub, alice = stack["hub"], stack["alice"]
    status, session = await asyncio.to_thread(alice.start_session, SMALL)
    assert status == 201, session
    browser = await logged_in(hub, "alice")
    try:
        await browser.goto(hub.url + "/hub/home")
        text = await browser.evaluate("document.getElementById('elastic-gpu-user')?.innerText || ''")
        assert "Your GPUs" in text, await browser.evaluate("document.body.innerText")
        rows = await browser.evaluate(
            "Array.from(document.querySelectorAll('.egpu-my-slices tbody tr')).map(r => r.innerText)"
        )
        assert len(rows) == 1 and "a GPU kernel on server default" in rows[0] and "10 GiB" in rows[0], rows
        # 56 GiB for alice, 10 GiB in use
        assert await browser.evaluate("document.querySelector('.egpu-left-memory').innerText") == "46 GiB"
        assert await browser.evaluate("document.querySelector('.egpu-left-slices').innerText") == "3"
        # the spawn page of a new named server: the profiles, and the same picture beside them
        await browser.goto(hub.url + "/hub/spawn/alice/second")
        assert await browser.evaluate("!!document.querySelector('form#spawn_form, #spawn_form')"), "no spawn form"
        assert await browser.evaluate("document.querySelector('.egpu-left-memory').innerText") == "46 GiB"
        assert "a GPU kernel on server default" in await browser.evaluate(
            "document.querySelector('.egpu-my-slices').innerText"
        )
    finally:
        await browser.close()
        status, body = await asyncio.to_thread(alice.api, "DELETE", f"/sessions/{session['id']}")
        assert status == 204, body


async def test_admin_page_keeps_itself_current_and_cancels_and_stops(stack):
    need_chromium()
    hub, alice = stack["hub"], stack["alice"]
    browser = await logged_in(hub, "admin")
    started_thread = None
    answer: dict = {}
    try:
        await browser.goto(hub.url + "/hub/gpu?refresh=1")
        await browser.evaluate(
            "window.egpuNotReloaded = true; window.confirm = () => true;"
            "window.egpuAsked = [];"
            "window.prompt = (q) => { window.egpuAsked.push(q); return 'maintenance at 18:00'; }; true"
        )
        # alice's GPU kernel appears without a reload, with its server
        status, session = await asyncio.to_thread(alice.start_session, BIG)
        assert status == 201, session
        await until(browser, "document.querySelectorAll('.egpu-slices tbody tr').length == 1")
        row = await browser.evaluate("document.querySelector('.egpu-slices tbody tr').innerText")
        assert "alice" in row and "kernel" in row and "default" in row, row
        assert await browser.evaluate("window.egpuNotReloaded === true"), "the page reloaded instead of updating"

        # bob's GPU notebook (a named server) fills the card
        status, body = await asyncio.to_thread(hub.api, "POST", "/users/bob/servers/big", None, {"profile": "g40"})
        assert status in (201, 202), body
        await asyncio.to_thread(
            hub.wait_for,
            lambda: ((hub.api("GET", "/users/bob")[1].get("servers") or {}).get("big") or {}).get("ready"),
            60,
            0.5,
            "bob's GPU server",
        )
        await until(browser, "document.querySelectorAll('.egpu-slices tbody tr').length == 2")

        # alice's next kernel waits: the queue row names her server, and the admin cancels it
        def alice_starts() -> None:
            answer["status"], answer["body"] = alice.start_session(SMALL)

        started_thread = threading.Thread(target=alice_starts)
        started_thread.start()
        await until(browser, "document.querySelectorAll('.egpu-queue tbody tr').length == 1")
        queue_row = await browser.evaluate("document.querySelector('.egpu-queue tbody tr').innerText")
        assert "alice" in queue_row and "default (GPU kernel)" in queue_row, queue_row
        await browser.evaluate("document.querySelector('.egpu-queue .egpu-cancel').click(); true")
        await asyncio.to_thread(started_thread.join, 30)
        assert not started_thread.is_alive(), "the cancelled request still waits"
        message = " ".join(answer["body"]["message"].split())
        assert answer["status"] >= 400 and "cancelled by an admin (admin)" in message, answer
        await until(browser, "!document.querySelector('.egpu-queue tbody tr')")

        # stop bob's server and alice's kernel from the page: their slices go back
        await browser.evaluate("document.querySelector('.egpu-stop-server').click(); true")
        await until(browser, "document.querySelectorAll('.egpu-slices tbody tr').length == 1", timeout=40)
        # the slice goes back inside the spawner's stop; the hub drops the server from its model
        # once stop returns, so the server leaves the model a moment after its slice row
        await asyncio.to_thread(
            hub.wait_for,
            lambda: "big" not in (hub.api("GET", "/users/bob")[1].get("servers") or {}),
            30,
            0.2,
            "bob's stopped server to leave the hub's model",
        )
        status, kernels = await asyncio.to_thread(hub.api, "GET", "/gpu/kernels")
        (kernel,) = kernels["kernels"]
        await browser.evaluate("document.querySelector('.egpu-stop-kernel').click(); true")
        await until(browser, "!document.querySelector('.egpu-slices')", timeout=40)
        # the admin was asked why, and alice's server reads it (JupyterLab shows it to her: tests/lab)
        asked = await browser.evaluate("window.egpuAsked.join(' | ')")
        assert "Stop alice's GPU kernel" in asked and "why" in asked, asked
        status, gone = await asyncio.to_thread(hub.api, "GET", f"/gpu/kernels/{kernel['id']}", stack["tokens"]["alice"])
        assert status == 404 and gone["message"] == (
            "The hub stopped this GPU kernel: kernel shut down by admin: maintenance at 18:00."
        ), gone
        status, pool = await asyncio.to_thread(hub.api, "GET", "/gpu/pool")
        assert pool["totals"]["slices"] == 0, pool["totals"]
        status, kernels = await asyncio.to_thread(hub.api, "GET", "/gpu/kernels")
        assert kernels["kernels"] == []
        assert await browser.evaluate("window.egpuNotReloaded === true")
        await asyncio.to_thread(alice.api, "DELETE", f"/sessions/{session['id']}")
    finally:
        if started_thread is not None:
            started_thread.join(70)
        await browser.close()
        await asyncio.to_thread(hub.api, "DELETE", "/users/bob/servers/big")
