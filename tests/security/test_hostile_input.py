"""Input a hostile (or careless) user sends the broker's and the usage API: every answer is a
sentence with a 4xx status, never a 500, and nothing is left allocated; exports never carry a
live spreadsheet formula. The fuzz tests (hypothesis) throw arbitrary JSON bodies and query
strings at each endpoint family of a real hub."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime
from typing import Any

import openpyxl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hubext.metering.store import UsageStore
from tests.hubrunner import http
from tests.security.helpers import broker_kernels, used_mib

#: dates that are no time: not finite, or outside what a calendar (datetime) can hold
NO_TIMES = ("nan", "NaN", "inf", "-inf", "1e309", "1e20", "-1e20", "99999999999999")


@pytest.fixture(scope="module")
def admin_page(sec) -> urllib.request.OpenerDirector:
    """A hub admin's browser session (the usage page takes the login cookie, not tokens)."""
    sec.hub.user_token("usage-admin", admin=True)
    return sec.hub.login("usage-admin")


def reader(sec, admin_page, path: str) -> str | urllib.request.OpenerDirector:
    return admin_page if path.startswith("/gpu/") else sec.hub.admin_token


def raw_get(url: str, token: str | urllib.request.OpenerDirector, timeout: float = 30) -> tuple[int, str, str]:
    """GET ``url`` with an API token, or (a page) in a logged-in session: (status, content type, body text)."""
    opener = token if isinstance(token, urllib.request.OpenerDirector) else urllib.request.build_opener()
    headers = {} if isinstance(token, urllib.request.OpenerDirector) else {"Authorization": f"token {token}"}
    try:
        with opener.open(urllib.request.Request(url, headers=headers), timeout=timeout) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode(errors="replace")


def test_a_connection_key_with_lone_surrogates_is_refused_with_a_sentence(sec):
    sec.server("bob")
    before = used_mib(sec.hub)
    for key in ("\ud800" * 16, "a" * 15 + "\udfff", "\udc80abcdefghijklmnop"):
        body = {"server_name": "", "key": key, "size": "gpu-10g"}
        status, answer = http("POST", f"{sec.hub.hub_api}/gpu/kernels", sec.tokens["bob"], body)
        assert status == 400, (key.encode("unicode_escape"), status, answer)
        assert "'key'" in answer["message"] and "\n" not in answer["message"], answer
    assert used_mib(sec.hub) == before  # nothing allocated for them
    assert not any(k["user"] == "bob" for k in broker_kernels(sec.hub).values())


@pytest.mark.parametrize("path", ["/api/gpu/usage", "/api/gpu/usage/records", "/gpu/usage"])
def test_usage_dates_that_are_no_time_are_refused_with_a_sentence(sec, admin_page, path):
    base = sec.hub.url.rstrip("/") + "/hub" + path
    for name in ("from", "to"):
        for value in NO_TIMES:
            url = f"{base}?{urllib.parse.urlencode({name: value})}"
            status, _, text = raw_get(url, reader(sec, admin_page, path))
            assert status == 400, (path, name, value, status, text[-400:])
            assert f"{name} {value!r}" in text.replace("&#39;", "'"), (path, name, value, text[-400:])
            assert "Traceback" not in text


# ---- exports: no live formula --------------------------------------------------------------------

#: names a spreadsheet would read as a formula (OWASP "CSV injection")
FORMULAS = ("=2+3", "+4+5", "-6+7", "@SUM(1,2)")


@pytest.fixture(scope="module")
def formula_records(sec):
    """Records (in 2001, far from every other test's) whose names are formulas, in the hub's usage store."""
    store = UsageStore(f"sqlite:///{sec.hub.workdir / 'jupyterhub.sqlite'}")
    granted = 978393600.0  # 2001-01-02
    events = []
    for i, name in enumerate(FORMULAS):
        record = {
            "id": f"formula-{i}",
            "user": name,
            "namespace": "default",
            "workspace": "default",
            "kind": "kernel",
            "priority_class": name,
            "node": name,
            "gpu_uuids": "GPU-0",
            "gpu_model": name,
            "gpu_memory_mib": 81920,
            "count": 1,
            "memory_mib": 10240,
            "cores_percent": 25,
            "whole": False,
            "borrowed": False,
            "granted_at": granted,
            "hub_groups": name,
        }
        events.append({"event": "granted", "record": record})
        events.append({"event": "released", "id": record["id"], "at": granted + 3600, "cause": "stopped", "why": name})
    store.ensure_schema()  # (the hub creates the tables on its first write, maybe not yet)
    store.apply(events)
    store.close()
    return "from=2001-01-01&to=2001-01-05"


def _csv_cells(text: str) -> list[str]:
    return [cell for row in csv.reader(io.StringIO(text)) for cell in row]


def test_csv_and_xlsx_exports_carry_no_live_formula(sec, admin_page, formula_records):
    hub_url = sec.hub.url.rstrip("/") + "/hub"
    period = formula_records
    exports = {
        "report": f"{hub_url}/api/gpu/usage?{period}&by=user,group,node,model,priority_class&format=csv",
        "records": f"{hub_url}/api/gpu/usage/records?{period}&format=csv",
        "page": f"{hub_url}/gpu/usage?{period}&by=user&format=csv",
    }
    for what, url in exports.items():
        status, kind, text = raw_get(url, admin_page if what == "page" else sec.hub.admin_token)
        assert status == 200 and kind.startswith("text/csv"), (what, status, text[-300:])
        cells = _csv_cells(text)
        for name in FORMULAS:
            assert name not in cells, (what, name)  # as it was, a spreadsheet runs it
            assert "'" + name in cells, (what, name, cells[:40])  # kept readable, as text
        live = [c for c in cells if c[:1] in ("=", "+", "@") or (c[:1] == "-" and not _is_number(c))]
        assert not live, (what, live)
    for url in (
        f"{hub_url}/api/gpu/usage?{period}&by=user,group,node&format=xlsx",
        f"{hub_url}/gpu/usage?{period}&by=user&format=xlsx",
    ):
        if "/api/" in url:
            req = urllib.request.Request(url, headers={"Authorization": f"token {sec.hub.admin_token}"})
            opener = urllib.request.build_opener()
        else:
            req, opener = urllib.request.Request(url), admin_page
        with opener.open(req, timeout=30) as resp:
            book = openpyxl.load_workbook(io.BytesIO(resp.read()))
        cells = [c for sheet in book.worksheets for row in sheet.iter_rows() for c in row]
        formulas = [c.value for c in cells if c.data_type == "f"]
        assert not formulas, (url, formulas)
        texts = {c.value for c in cells if c.data_type == "s"}
        assert set(FORMULAS) <= texts, (url, texts)  # the names themselves, as text cells


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


# ---- the broker called directly --------------------------------------------------------------


async def test_broker_status_refuses_a_wait_that_is_no_number_of_seconds():
    """Called from Python (not through ?wait=, which the handler checks): a nan wait looped forever."""
    from hubext.allocator import GPUAllocator
    from hubext.broker import GPUBroker
    from hubext.kernels import KernelRecord

    broker = GPUBroker()
    try:
        record = KernelRecord(id="e" * 32, user="u", server_name="", size="s", allocation_id="", section={})
        broker.kernels[record.id] = record
        for wait in (math.nan, math.inf, -math.inf):
            with pytest.raises(ValueError, match="wait_seconds"):
                await asyncio.wait_for(broker.status(record, wait), 10)
        assert (await asyncio.wait_for(broker.status(record, 0.0), 10)) is record
    finally:
        GPUBroker.clear_instance()
        GPUAllocator.clear_instance()


# ---- fuzz: every endpoint family answers a sentence, never a 500 ---------------------------------

FUZZ = settings(
    max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None
)
texts = st.text(max_size=40)  # lone surrogates included
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=8,
)
KERNEL_FIELDS = ("user", "server_name", "key", "size", "gpu", "signature_scheme", "cwd", "kernel_name", "kernel_id")
kernel_bodies = st.fixed_dictionaries(
    {},
    optional={
        "key": st.one_of(texts, st.text(min_size=16, max_size=64), json_values),
        "size": st.one_of(st.sampled_from(["gpu-10g", "gpu-10g-vip", "nope", ""]), json_values),
        **{f: json_values for f in KERNEL_FIELDS if f not in ("key", "size")},
    },
) | json_values
query_values = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",)), max_size=30
) | st.sampled_from(["nan", "inf", "-1", "1e309", "0", "2026-13-45", "user,day", "user,user", "json", "xlsx"])


def _check_refusal(status: int, body: Any, what: Any) -> None:
    assert status < 500, (what, status, body)
    if status >= 400:
        message = body.get("message") if isinstance(body, dict) else None
        assert isinstance(message, str) and message, (what, status, body)
        assert "Traceback" not in message and "\n" not in message.strip(), (what, message)


def _bob_holds_nothing(sec) -> None:
    """A body hypothesis makes valid starts a kernel: stop it so the next examples start from the same place."""
    for kernel in broker_kernels(sec.hub).values():
        if kernel["user"] == "bob":
            sec.hub.api("DELETE", f"/gpu/kernels/{kernel['id']}")


def test_fuzz_the_broker_kernel_requests(sec):
    sec.server("bob")
    url = f"{sec.hub.hub_api}/gpu/kernels"

    @FUZZ
    @given(body=kernel_bodies)
    def one(body: Any) -> None:
        status, answer = http("POST", url, sec.tokens["bob"], body, timeout=60)
        _check_refusal(status, answer, body)
        if status == 201:
            _bob_holds_nothing(sec)

    try:
        one()
    finally:
        _bob_holds_nothing(sec)


def test_fuzz_the_broker_kernel_queries_and_actions(sec):
    sec.server("bob")
    status, kernel = http(
        "POST", f"{sec.hub.hub_api}/gpu/kernels", sec.tokens["bob"], {"key": "k" * 32, "size": "gpu-10g"}
    )
    assert status == 201, kernel
    base = f"{sec.hub.hub_api}/gpu/kernels"
    paths = st.sampled_from(
        [
            "",
            "/" + kernel["id"],
            "/" + "0" * 32,
            "/" + kernel["id"] + "/interrupt",
            "/" + kernel["id"] + "/cull",
            "/" + kernel["id"] + "/idle",
        ]
    )
    params = st.dictionaries(st.sampled_from(["wait", "user", "reason", "cause"]), query_values, max_size=3)

    @FUZZ
    @given(path=paths, query=params, method=st.sampled_from(["GET", "POST"]), body=json_values)
    def one(path: str, query: dict[str, str], method: str, body: Any) -> None:
        if method == "GET" and path.endswith(("interrupt", "cull", "idle")):
            method = "POST"
        url = base + path + ("?" + urllib.parse.urlencode(query) if query else "")
        status, answer = http(method, url, sec.tokens["bob"], body if method == "POST" else None, timeout=60)
        _check_refusal(status, answer, (method, path, query, body))

    try:
        one()
        status, after = http("GET", f"{base}/{kernel['id']}", sec.tokens["bob"])
        assert status == 200 and after["state"] == "running", after  # nothing a fuzzed call did stopped it
    finally:
        sec.hub.api("DELETE", f"/gpu/kernels/{kernel['id']}")


def test_an_idle_warning_that_is_no_action_or_no_time_is_refused_with_a_sentence(sec):
    """The culler's word on an idle kernel (what JupyterLab counts down from): only a GPU admin may say
    it, and only as an action and a moment; the kernel's model carries it as said."""
    sec.server("bob")
    status, kernel = http(
        "POST", f"{sec.hub.hub_api}/gpu/kernels", sec.tokens["bob"], {"key": "k" * 32, "size": "gpu-10g"}
    )
    assert status == 201, kernel
    url = f"{sec.hub.hub_api}/gpu/kernels/{kernel['id']}/idle"
    now = time.time()
    try:
        status, answer = http("POST", url, sec.tokens["bob"], {"action": "stop", "deadline": now + 60})
        assert status == 403 and "GPU admin" in answer["message"], answer  # the owner cannot fake a countdown
        for body in (
            {"action": "explode", "deadline": now + 60},
            {"action": "stop"},
            {"action": "stop", "deadline": "soon"},
            {"action": "stop", "deadline": True},
            {"action": "swap", "deadline": 1e300},
            {"action": "swap", "deadline": now + 10 * 366 * 86400},
            [1, 2],
        ):
            status, answer = http("POST", url, sec.hub.admin_token, body)
            _check_refusal(status, answer, body)
            assert status == 400, (body, status, answer)
        status, _ = http("POST", url, sec.hub.admin_token, {"action": "swap", "deadline": now + 60})
        assert status == 204
        status, model = http("GET", f"{sec.hub.hub_api}/gpu/kernels/{kernel['id']}", sec.tokens["bob"])
        assert model["idle_action"] == "swap", model
        assert abs(datetime.fromisoformat(model["idle_deadline"]).timestamp() - (now + 60)) < 1, model
        status, _ = http("POST", url, sec.hub.admin_token, {"action": None})
        assert status == 204
        status, model = http("GET", f"{sec.hub.hub_api}/gpu/kernels/{kernel['id']}", sec.tokens["bob"])
        assert "idle_action" not in model and "idle_deadline" not in model, model
    finally:
        sec.hub.api("DELETE", f"/gpu/kernels/{kernel['id']}")


def test_fuzz_the_usage_queries(sec, admin_page):
    hub_url = sec.hub.url.rstrip("/") + "/hub"
    params = st.dictionaries(
        st.sampled_from(["from", "to", "by", "user", "format", "slice", "model", "percentile", "max_wait", "per_node"]),
        query_values,
        max_size=4,
    )
    alice_page = sec.hub.login("alice")
    paths = st.sampled_from(["/api/gpu/usage", "/api/gpu/usage/records", "/api/gpu/capacity", "/gpu/usage"])

    @FUZZ
    @given(path=paths, query=params, who=st.sampled_from(["admin", "alice"]))
    def one(path: str, query: dict[str, str], who: str) -> None:
        token = sec.hub.admin_token if who == "admin" else sec.tokens["alice"]
        if path.startswith("/gpu/"):
            token = admin_page if who == "admin" else alice_page
        query = {**query, "replay": "0"} if path.endswith("capacity") else query
        status, kind, text = raw_get(f"{hub_url}{path}?{urllib.parse.urlencode(query)}", token, timeout=60)
        assert status < 500, (path, query, status, text[-500:])
        assert "Traceback" not in text, (path, query)
        if status >= 400 and kind.startswith("application/json"):
            _check_refusal(status, json.loads(text), (path, query))

    one()


def test_a_spawn_with_a_profile_is_no_unhandled_user_options_warning(sec):
    """The spawner applies (and checks) the profile itself when the server starts; JupyterHub
    5.3+ warned 'Received unhandled user_options ... profile' on every such spawn. (Unknown and
    forged options are still refused: tests/security/test_forged_priority.py, tests/local/test_local_spawner.py.)"""
    before = len(sec.hub.log_text())
    status, body = sec.hub.api("POST", "/users/carol/server", body={"profile": "cpu"})
    assert status in (201, 202), body
    try:
        sec.hub.wait_for(
            lambda: (sec.hub.api("GET", "/users/carol")[1].get("servers", {}).get("", {}) or {}).get("ready"),
            timeout=90,
            what="carol's server",
        )
        spawned = sec.hub.log_text()[before:]
        assert "carol" in spawned
        assert "unhandled user_options" not in spawned, [
            line for line in spawned.splitlines() if "user_options" in line
        ]
    finally:
        sec.hub.api("DELETE", "/users/carol/server")
        sec.hub.wait_for(lambda: not sec.hub.api("GET", "/users/carol")[1].get("servers"), timeout=60, what="stop")
