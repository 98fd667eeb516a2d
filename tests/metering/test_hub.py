"""Through a real hub (single-machine mode, one simulated H100): GPU kernels' and a GPU notebook's
start, stop and preemption are recorded with the user's hub groups, a user reads only their own
usage (403 for another's), CSV, XLSX and SVG come out, the page works in a browser, and the
records survive a hub SIGKILL and an outage of the usage store's database (a real PostgreSQL
server stopped while the hub runs; on SQLite where PostgreSQL is missing, without that test)."""

from __future__ import annotations

import csv
import io
import json
import os
import time
import urllib.request

import openpyxl
import pytest

from hubext.metering.store import UsageStore
from tests.cli.browser import Browser, chromium_path
from tests.hubrunner import REPO, http
from tests.kernelprovider.helpers import ADMISSION, SIZES, Server, local_stack

SPEC = "elastic-gpu-gpu-10g"
BIG, BIG_HIGH = "elastic-gpu-gpu-70g", "elastic-gpu-gpu-70g-high"
# no per-user limit (ADMISSION allows a user 16 GiB): a user's 70 GiB kernels, and a high-priority one
# that preempts a default one on the one 80 GiB card
METERING_ADMISSION = {**ADMISSION, "workspaces": {"default": {"namespaces": {"default": {}}}}}
METERING_SIZES = [
    *SIZES,
    {"name": "gpu-70g", "display_name": "GPU 70 GiB", "memory_mib": 71680, "cores_percent": 50},
    {
        "name": "gpu-70g-high",
        "display_name": "GPU 70 GiB (high)",
        "memory_mib": 71680,
        "cores_percent": 50,
        "priority_class": "high",
    },
]
PROFILES = [
    {"display_name": "CPU only", "slug": "cpu", "default": True},
    {"display_name": "GPU quarter", "slug": "quarter", "gpu": {"memory_mib": 20480, "cores_percent": 25}},
]
EXTRA = f"""
c.UsageMeter.sample_interval_seconds = 0.5
c.UsageMeter.retry_interval_seconds = 0.5
c.UsageMeter.prices = {{"H100-80GB": {{"gpu_hour": 4.0}}}}
c.UsageMeter.currency = "EUR"
c.Authenticator.admin_users = {{"usage-admin"}}
c.HubUserGPUSpawner.profile_list = {PROFILES!r}
"""
ARTIFACTS = REPO / "artifacts" / "metering"


@pytest.fixture(scope="module")
def usage_db(request):
    """(URL, server control) of a PostgreSQL database for the usage store, or None (SQLite)."""
    try:
        url, server = request.getfixturevalue("postgres")
    except pytest.skip.Exception:
        return None
    import psycopg

    dsn = url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True) as db:
        db.execute("DROP DATABASE IF EXISTS metering_hub")
        db.execute("CREATE DATABASE metering_hub")
    return url.replace("/postgres?", "/metering_hub?"), server


@pytest.fixture(scope="module")
def stack(tmp_path_factory, usage_db):
    work = tmp_path_factory.mktemp("metering-hub")
    extra = EXTRA + f"c.UsageMeter.spool_file = {str(work / 'usage.spool')!r}\n"
    url = f"sqlite:///{work / 'jupyterhub.sqlite'}"  # the hub's own database
    if usage_db is not None:  # the usage store in PostgreSQL, as a hub with an external database has it
        url = usage_db[0]
        extra += f"c.UsageMeter.db_url = {url!r}\n"
    with local_stack(
        work, users=("alice", "bob", "carol"), admission=METERING_ADMISSION, sizes=METERING_SIZES, extra_config=extra
    ) as st:
        st["store"] = store = UsageStore(url)
        try:
            yield work, st
        finally:
            store.close()


def store_of(st) -> UsageStore:
    return st["store"]


def test_a_gpu_kernel_is_recorded_and_each_user_reads_only_their_own_usage(stack):
    work, st = stack
    hub, tokens = st["hub"], st["tokens"]
    alice: Server = st["alice"]
    status, session = alice.start_session(SPEC)
    assert status == 201, session
    status, body = alice.api("DELETE", f"/sessions/{session['id']}")
    assert status == 204, body

    def closed() -> list:
        return [r for r in store_of(st).records() if r.user == "alice" and r.release_cause == "stopped"]

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
    period = f"from={int(record.granted_at) - 10}&to={int(record.released_at) + 10}"  # fixed: both agree
    status, same = hub.api("GET", f"/gpu/usage?by=user&{period}")
    assert status == 200, same
    req = urllib.request.Request(f"{hub.hub_api}/gpu/usage?by=user&format=xlsx&{period}")
    req.add_header("Authorization", f"token {hub.admin_token}")
    with urllib.request.urlopen(req, timeout=30) as resp:
        workbook = openpyxl.load_workbook(io.BytesIO(resp.read()))
    sheet = workbook.worksheets[0]
    header = [c.value for c in next(sheet.iter_rows(max_row=1))]
    cells = dict(zip(header, [c.value for c in next(sheet.iter_rows(min_row=2, max_row=2))], strict=True))
    assert cells["user"] == "alice" and cells["gpu_hours"] == pytest.approx(same["rows"][0]["gpu_hours"], rel=1e-9)
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
    assert [r for r in store_of(st).records() if r.user == "alice"], "the first test recorded alice's kernel"
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
                assert "kernel-hours swapped out" in text and "swapped out (h)" in text
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


def _wait_server(hub, user: str, ready: bool) -> None:
    def state() -> bool:
        _, model = hub.api("GET", f"/users/{user}")
        server = (model.get("servers") or {}).get("")
        return (bool(server) and bool(server.get("ready"))) if ready else not server

    hub.wait_for(state, timeout=120, what=f"{user}'s server {'ready' if ready else 'stopped'}")


def test_a_notebook_and_a_preempted_kernel_are_recorded_with_their_causes_and_hub_groups(stack):
    work, st = stack
    hub, store = st["hub"], store_of(st)
    alice: Server = st["alice"]
    assert hub.api("POST", "/groups/vision")[0] in (201, 409)
    status, body = hub.api("POST", "/groups/vision/users", body={"users": ["bob"]})
    assert status == 200, body
    # bob's notebook server with a quarter of the card (a profile), started and stopped through the hub
    status, body = hub.api("POST", "/users/bob/server", body={"profile": "quarter"})
    assert status in (201, 202), body
    _wait_server(hub, "bob", ready=True)
    (notebook,) = hub.wait_for(
        lambda: [r for r in store.records() if r.user == "bob" and r.released_at is None],
        what="bob's notebook record",
    )
    assert (notebook.kind, notebook.memory_mib, notebook.hub_groups) == ("notebook", 20480, "vision")
    status, body = hub.api("DELETE", "/users/bob/server")
    assert status in (202, 204), body
    _wait_server(hub, "bob", ready=False)
    hub.wait_for(
        lambda: [r for r in store.records() if r.id == notebook.id and r.release_cause == "stopped"],
        what="bob's notebook record closed 'stopped'",
    )
    # a high-priority kernel takes the card from a default one of 70 GiB: preempted
    status, low = alice.start_session(BIG)
    assert status == 201, low
    status, high = alice.start_session(BIG_HIGH)
    assert status == 201, high
    (preempted,) = hub.wait_for(
        lambda: [r for r in store.records() if r.memory_mib == 71680 and r.release_cause == "preempted"],
        what="the default 70 GiB kernel's record closed 'preempted'",
    )
    assert preempted.user == "alice" and preempted.priority_class == "default"
    # only the culler (a GPU admin) may end a kernel as culled: a user cannot skew the records
    status, body = hub.api("GET", "/gpu/kernels?user=alice")
    (running,) = [k for k in body["kernels"] if k["state"] == "running"]
    status, refused = http("DELETE", f"{hub.hub_api}/gpu/kernels/{running['id']}?cause=culled", st["tokens"]["alice"])
    assert status == 403 and "may cull a kernel" in refused["message"], refused
    status, refused = http("POST", f"{hub.hub_api}/gpu/kernels/{running['id']}/cull", st["tokens"]["alice"], {})
    assert status == 403, refused
    assert "preempted" in (preempted.release_why or "")
    for session in (low, high):
        assert alice.api("DELETE", f"/sessions/{session['id']}")[0] in (204, 404)
    hub.wait_for(
        lambda: [r for r in store.records() if r.priority_class == "high" and r.release_cause == "stopped"],
        what="the high-priority kernel's record closed 'stopped'",
    )
    status, report = hub.api("GET", "/gpu/usage?by=group,kind")
    assert status == 200, report
    rows = {(r["group"], r["kind"]): r["sessions"] for r in report["rows"]}
    assert rows[("vision", "notebook")] == 1 and rows[("", "kernel")] >= 3


def test_a_database_outage_while_the_hub_runs_loses_no_record(stack, usage_db):
    """The usage store's PostgreSQL server stops while the hub runs: kernels still start and stop
    (admission never waits for it), their events go to the spool, and when the server is back
    the spool is replayed: the record is there, granted and closed at the right times."""
    if usage_db is None:
        pytest.skip("PostgreSQL is not installed: the usage store is the hub's SQLite file")
    work, st = stack
    hub, store, (_, server) = st["hub"], store_of(st), usage_db
    alice: Server = st["alice"]
    spool = work / "usage.spool"

    def spooled(event: str) -> list:
        lines = spool.read_text().splitlines() if spool.exists() else []
        events = [json.loads(line) for line in lines if line.strip()]
        return [e for e in events if e["event"] == event and (e.get("record") or {}).get("user", "alice") == "alice"]

    server("stop")
    try:
        with pytest.raises(Exception, match="(?i)connect"):
            store.records()  # a real outage: nothing answers
        started = time.time()
        status, session = alice.start_session(SPEC)
        assert status == 201, session
        (grant,) = hub.wait_for(
            lambda: [e for e in spooled("granted") if e["record"]["granted_at"] >= started - 1],
            what="the kernel's grant in the spool",
        )
        assert alice.api("DELETE", f"/sessions/{session['id']}")[0] == 204
        stopped = time.time()
        hub.wait_for(
            lambda: [e for e in spooled("released") if e["id"] == grant["record"]["id"]],
            what="the kernel's release in the spool",
        )
    finally:
        server("start")
    (record,) = hub.wait_for(
        lambda: [r for r in store.records() if r.id == grant["record"]["id"] and r.released_at is not None],
        timeout=60,
        what="the spooled record replayed into PostgreSQL",
    )
    assert record.release_cause == "stopped" and record.kind == "kernel"
    assert started - 1 <= record.granted_at <= record.released_at <= stopped + 1
    hub.wait_for(lambda: spool.stat().st_size == 0, what="the spool emptied")


def test_records_survive_a_hub_sigkill(stack):
    work, st = stack
    hub = st["hub"]
    alice: Server = st["alice"]
    status, session = alice.start_session(SPEC)
    assert status == 201, session
    kernel = session["kernel"]["id"]

    def held() -> list:
        return [r for r in store_of(st).records() if r.released_at is None]

    (open_record,) = hub.wait_for(held, timeout=60, what="the running kernel's record")
    hub.kill()  # SIGKILL: no shutdown, nothing flushed
    hub.start()
    records = {r.id: r for r in store_of(st).records()}
    assert open_record.id in records
    assert sum(1 for r in records.values() if r.release_cause == "stopped") >= 1  # the first test's record
    status, body = alice.api("DELETE", f"/kernels/{kernel}")
    assert status in (204, 404), body

    def closed() -> bool:
        r = {r.id: r for r in store_of(st).records()}[open_record.id]
        return r.released_at is not None

    hub.wait_for(closed, timeout=60, what="the kernel's record to close after the restart")
