"""Through a real hub (single-machine mode, one simulated H100): a GPU kernel's start and stop
are recorded in the hub's own database, a user reads only their own usage (403 for another's),
CSV and SVG come out, and the records survive a hub SIGKILL."""

from __future__ import annotations

import csv
import io
import os

import pytest

from hubext.metering.store import UsageStore
from tests.cli.browser import Browser, chromium_path
from tests.hubrunner import REPO, http
from tests.kernelprovider.helpers import Server, local_stack

SPEC = "elastic-gpu-gpu-10g"
EXTRA = """
c.UsageMeter.sample_interval_seconds = 0.5
c.UsageMeter.prices = {"H100-80GB": {"gpu_hour": 4.0}}
c.UsageMeter.currency = "EUR"
c.Authenticator.admin_users = {"usage-admin"}
"""
ARTIFACTS = REPO / "artifacts" / "metering"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    work = tmp_path_factory.mktemp("metering-hub")
    with local_stack(work, extra_config=EXTRA) as st:
        yield work, st


def store_of(work) -> UsageStore:
    return UsageStore(f"sqlite:///{work / 'jupyterhub.sqlite'}")


def test_a_gpu_kernel_is_recorded_and_each_user_reads_only_their_own_usage(stack):
    work, st = stack
    hub, tokens = st["hub"], st["tokens"]
    alice: Server = st["alice"]
    status, session = alice.start_session(SPEC)
    assert status == 201, session
    status, body = alice.api("DELETE", f"/sessions/{session['id']}")
    assert status == 204, body

    def closed() -> list:
        return [r for r in store_of(work).records() if r.user == "alice" and r.release_cause == "stopped"]

    (record,) = hub.wait_for(closed, timeout=60, what="alice's kernel record, closed")
    assert (record.kind, record.gpu_model, record.memory_mib) == ("kernel", "H100-80GB", 10240)
    assert record.released_at > record.granted_at

    status, report = hub.api("GET", "/gpu/usage?by=user,kind")  # the admin service: everyone
    assert status == 200, report
    assert report["currency"] == "EUR"
    assert [(r["user"], r["kind"], r["sessions"]) for r in report["rows"]] == [("alice", "kernel", 1)]
    assert report["rows"][0]["cost"] == pytest.approx(report["rows"][0]["gpu_hours"] * 4.0)

    status, own = http("GET", f"{hub.hub_api}/gpu/usage", tokens["alice"])
    assert status == 200 and [r["user"] for r in own["rows"]] == ["alice"]
    status, bobs = http("GET", f"{hub.hub_api}/gpu/usage", tokens["bob"])
    assert status == 200 and bobs["rows"] == []
    for token, other in ((tokens["bob"], "alice"), (tokens["alice"], "bob")):
        status, refused = http("GET", f"{hub.hub_api}/gpu/usage/records?user={other}", token)
        assert status == 403, refused
        assert f"may not read the GPU usage of user '{other}'" in refused["message"]
    status, refused = http("GET", f"{hub.hub_api}/gpu/capacity?slice=1/4", tokens["alice"])
    assert status == 403 and "read:users" in refused["message"]

    status, text = hub.api("GET", "/gpu/usage?by=user&format=csv")
    assert status == 200
    (row,) = list(csv.DictReader(io.StringIO(text)))
    assert row["user"] == "alice" and float(row["gpu_hours"]) > 0 and "cost_EUR" in row
    status, svg = hub.api("GET", "/gpu/usage?format=svg")
    assert status == 200 and svg.startswith("<svg") and ">alice</text>" in svg
    status, plan = hub.api("GET", "/gpu/capacity?slice=1/4&model=H100-80GB")
    assert status == 200 and plan["sessions"] == 1 and plan["gpus_needed_peak"] == 1, plan
    assert plan["admission"]["gpus_needed"] == 1, plan  # replayed through the admission core
    status, bad = hub.api("GET", "/gpu/usage?by=team")
    assert status == 400 and "cannot group usage by 'team'" in bad["message"]


async def test_the_usage_page_in_a_browser_shows_everyone_to_an_admin_and_only_their_own_to_a_user(stack):
    if chromium_path() is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (.ci/run installs it: apt-get install chromium)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    work, st = stack
    hub = st["hub"]
    assert [r for r in store_of(work).records() if r.user == "alice"], "the first test recorded alice's kernel"
    for name in ("usage-admin", "bob"):
        browser = await Browser(width=1280, height=1500).start()
        try:
            await browser.goto(hub.url + "/hub/login")
            await browser.submit_and_wait(
                f"document.getElementById('username_input').value = {name!r};"
                "document.getElementById('password_input').value = 'any';"
                "document.querySelector('form').submit();"
            )
            await browser.goto(hub.url + "/hub/gpu/usage?by=user")
            assert (await browser.url()).endswith("/hub/gpu/usage?by=user")
            text = await browser.evaluate("document.body.innerText")
            assert "GPU usage" in text
            rows = await browser.evaluate(
                "Array.from(document.querySelectorAll('.egpu-cost-row td:first-child')).map(c => c.innerText.trim())"
            )
            if name == "usage-admin":
                assert "Everyone's GPU use" in text and "alice" in rows
                assert await browser.evaluate("document.querySelectorAll('.egpu-chart svg rect title').length") >= 2
                assert (
                    await browser.evaluate(
                        "document.querySelectorAll('svg.egpu-held-busy .egpu-busy, "
                        "svg.egpu-held-busy .egpu-idle, svg.egpu-held-busy .egpu-unmetered')"
                        ".length"
                    )
                    >= 1
                )
                shot = await browser.screenshot(ARTIFACTS / "gpu-usage.png")
                assert shot.stat().st_size > 10_000
            else:
                assert "Your GPU use (bob)" in text and rows == [] and "No GPU use in this period." in text
        finally:
            await browser.close()


def test_records_survive_a_hub_sigkill(stack):
    work, st = stack
    hub = st["hub"]
    alice: Server = st["alice"]
    status, session = alice.start_session(SPEC)
    assert status == 201, session
    kernel = session["kernel"]["id"]

    def held() -> list:
        return [r for r in store_of(work).records() if r.released_at is None]

    (open_record,) = hub.wait_for(held, timeout=60, what="the running kernel's record")
    hub.kill()  # SIGKILL: no shutdown, nothing flushed
    hub.start()
    records = {r.id: r for r in store_of(work).records()}
    assert open_record.id in records
    assert sum(1 for r in records.values() if r.release_cause == "stopped") >= 1  # the first test's record
    status, body = alice.api("DELETE", f"/kernels/{kernel}")
    assert status in (204, 404), body

    def closed() -> bool:
        r = {r.id: r for r in store_of(work).records()}[open_record.id]
        return r.released_at is not None

    hub.wait_for(closed, timeout=60, what="the kernel's record to close after the restart")
