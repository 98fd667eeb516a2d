"""The usage page through a real hub (single-machine mode): it answers every grouping the API
answers, a refused query shows the page with its form and the sentence once, and users find it
(their home page links it)."""

from __future__ import annotations

import html
import itertools
import re
import urllib.error
import urllib.parse
import urllib.request

import pytest

from hubext.metering.report import GROUP_KEYS
from tests.hubrunner import HubRunner
from tests.kernelprovider.helpers import local_stack

PERIOD = "from=2026-01-01&to=2026-03-01"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    work = tmp_path_factory.mktemp("usage-page")
    with local_stack(work, users=("alice",), extra_config='c.Authenticator.admin_users = {"page-admin"}\n') as st:
        hub: HubRunner = st["hub"]
        hub.user_token("page-admin", admin=True)
        yield hub


def _get(opener, url: str) -> tuple[int, str]:
    try:
        with opener.open(url, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def groupings() -> list[str]:
    """Every grouping the API accepts: each key, and each pair (day and month never together)."""
    pairs = [",".join(p) for p in itertools.combinations(GROUP_KEYS, 2) if set(p) != {"day", "month"}]
    return [*GROUP_KEYS, *pairs]


def test_the_page_answers_every_grouping_the_api_answers(hub):
    page = hub.login("page-admin")
    for by in groupings():
        query = f"{PERIOD}&by={urllib.parse.quote(by)}"
        status, body = hub.api("GET", f"/gpu/usage?{query}")
        assert status == 200, (by, status, body)
        status, text = _get(page, f"{hub.url}/hub/gpu/usage?{query}")
        assert status == 200, (by, status, text[-600:])
        head = re.search(r'<table class="table table-sm egpu-cost">.*?</thead>', text, re.S)
        assert head, (by, text[-600:])
        assert [html.unescape(h) for h in re.findall(r"<th>(.*?)</th>", head.group(0))][: len(by.split(","))] == (
            by.split(",")
        ), (by, head.group(0))
        assert re.search(rf'<option value="{re.escape(by)}"\s+selected>', text), by  # the form shows it


def test_a_refused_query_shows_the_page_its_form_and_the_sentence_once(hub):
    page = hub.login("page-admin")
    for query, sentence in (
        ("by=team", "cannot group usage by &#39;team&#39;"),
        ("by=day,month", "group by day or by month, not both."),
        ("from=nan", "from &#39;nan&#39; is not a date"),
    ):
        status, text = _get(page, f"{hub.url}/hub/gpu/usage?{query}")
        assert status == 400, (query, status, text[-600:])
        assert text.count(sentence) == 1, (query, text.count(sentence), text[-1500:])
        assert 'class="alert alert-danger egpu-error"' in text and 'id="egpu-by"' in text, query


def test_the_home_page_links_the_usage_page_and_says_what_is_left_in_words(hub):
    status, text = _get(hub.login("alice"), f"{hub.url}/hub/home")
    assert status == 200, text[-600:]
    assert re.search(r'href="/hub/gpu/usage"[^>]*>', text), text[-3000:]
    left = " ".join(re.search(r'<p class="egpu-remaining">(.*?)</p>', text, re.S).group(1).split())
    left = re.sub(r"<[^>]+>", "", left)
    assert "no limit on compute" in left and "no limit on slices" in left, left  # (ADMISSION limits neither)
    assert "unlimited of" not in text


def test_the_admin_and_home_pages_link_the_usage_page_and_each_link_opens_it(hub):
    """Issue 26: "the page is linked from nowhere". The links, followed as a browser does: the
    admin's from /hub/gpu opens everyone's usage; alice's from her home page opens her own."""

    def follow(opener, page: str, link: str) -> str:
        status, text = _get(opener, f"{hub.url}{page}")
        assert status == 200, (page, status, text[-600:])
        found = re.search(link, text, re.S)
        assert found, (page, text[-3000:])
        status, text = _get(opener, urllib.parse.urljoin(f"{hub.url}{page}", html.unescape(found.group(1))))
        assert status == 200, (page, found.group(1), status, text[-600:])
        return " ".join(re.sub(r"<[^>]+>", " ", text).split())

    admin = hub.login("page-admin")
    words = follow(admin, "/hub/gpu", r'<a class="egpu-usage-link" href="([^"]+)"')
    assert "Everyone's GPU use" in words, words[:1500]
    alice = hub.login("alice")
    words = follow(alice, "/hub/home", r'<p class="egpu-usage-link"><a href="([^"]+)"')
    assert "Your GPU use (alice)" in words and "Everyone" not in words, words[:1500]
    status, _ = _get(alice, f"{hub.url}/hub/gpu/usage?user=page-admin")  # her own only
    assert status == 403


def test_the_usage_chart_stays_in_gpu_hours_however_small_the_use():
    """The page's summary and table are in GPU-hours; the chart beside them switched to GPU-seconds
    when the bars were small (a few minutes of a quarter card)."""
    from hubext.metering.plot import usage_svg
    from hubext.metering.record import UsageRecord

    record = UsageRecord(
        id="r", user="alice", namespace="default", workspace="default", kind="kernel", priority_class="default",
        node="n", gpu_uuids="GPU-0", gpu_model="H100-80GB", gpu_memory_mib=81920, count=1, memory_mib=20480,
        cores_percent=25, whole=False, borrowed=False, granted_at=1000.0, released_at=1000.0 + 120,
    )  # fmt: skip
    svg = usage_svg([record], 0.0, 86400.0, "user")
    assert "GPU-seconds" not in svg and "GPU-hours by user" in svg, svg[:400]
    assert "alice: 0.0083 GPU-hours" in svg, svg  # 2 min of a quarter card


def test_the_login_page_says_the_gpus_are_simulated_and_who_the_admin_is(hub):
    with urllib.request.urlopen(f"{hub.url}/hub/login", timeout=60) as resp:
        text = resp.read().decode()
    about = re.search(r'<div class="[^"]*egpu-login-about[^"]*".*?</div>', text, re.S)
    assert about, text[-3000:]
    words = " ".join(re.sub(r"<[^>]+>", " ", about.group(0)).split())
    assert "simulated" in words and "page-admin" in words, words
