"""Report math (a hand-computed example and a property: report sums equal record sums), prices
refused with a sentence naming the key, CSV round trip, capacity planning by hand."""

from __future__ import annotations

import csv
import dataclasses
import io
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hubext.metering import ReportError, load_prices, parse_slice, plan_capacity, report_csv, usage_report
from hubext.metering.plot import capacity_svg, usage_svg
from hubext.metering.prices import load_prices_file
from hubext.metering.record import UsageRecord
from hubext.metering.replay import (
    Scenario,
    plan_by_replay,
    replay,
    requests_of,
    sessions_from_records,
    slice_profiles,
)
from hubext.metering.report import METRICS, parse_time, records_csv, report_xlsx
from quotas import ConfigError

H = 3600.0


def rec(rid, user, model, card, memory, cores, t0, t1, count=1, whole=False, busy=None, sampled=None, **kw):
    return UsageRecord(
        id=rid,
        user=user,
        namespace=kw.get("namespace", "default"),
        workspace=kw.get("workspace", "default"),
        kind=kw.get("kind", "notebook"),
        priority_class="",
        node="n1",
        gpu_uuids=",".join(f"{rid}-gpu{i}" for i in range(count)),
        gpu_model=model,
        gpu_memory_mib=card,
        count=count,
        memory_mib=memory,
        cores_percent=cores,
        whole=whole,
        borrowed=False,
        granted_at=t0,
        released_at=t1,
        last_seen=t1 or t0,
        busy_seconds=busy,
        activity_seconds=sampled,
    )


PRICES = {"H100-80GB": {"gpu_hour": 4.0}, "A100-40GB": {"memory_gib_hour": 0.05, "compute_hour": 1.0}}
RECORDS = [
    # alice: a quarter H100 for 4 h, busy a quarter of the sampled time
    rec("r1", "alice", "H100-80GB", 81920, 20480, 25, 1 * H, 5 * H, busy=3600.0, sampled=14400.0),
    # alice: two whole H100s from 8 h, still held (counts until the period's end, 10 h)
    rec("r2", "alice", "H100-80GB", 81920, 81920, 100, 8 * H, None, count=2, whole=True),
    # bob: 10 GiB and 50 % of an A100-40GB (share 0.5) from -2 h to 3 h: 3 h inside; never launched
    rec("r3", "bob", "A100-40GB", 40960, 10240, 50, -2 * H, 3 * H, busy=0.0, sampled=18000.0),
    # carol: a T4 slice, no price for T4
    rec("r4", "carol", "T4", 16384, 4096, 10, 0.0, 1 * H),
]


def test_report_by_user_matches_the_hand_computed_example():
    report = usage_report(RECORDS, 0.0, 10 * H, ["user"], load_prices(PRICES, "EUR"), now=12 * H)
    rows = {r["user"]: r for r in report.rows}
    assert rows["alice"] == pytest.approx(
        {
            "user": "alice",
            "sessions": 2,
            "slice_hours": 4 + 2 * 2,
            "gpu_hours": 1.0 + 4.0,
            "memory_gib_hours": 20 * 4 + 80 * 2 * 2,
            "busy_gpu_hours": 0.25,
            "idle_gpu_hours": 0.75,
            "unmetered_gpu_hours": 4.0,
            "swapped_hours": 0.0,
            "burst_gpu_hours": 0.0,
            "cost": 1.0 * 4.0 + 2 * 2 * 4.0,
            "unpriced_gpu_hours": 0.0,
        }
    )
    assert rows["bob"]["gpu_hours"] == pytest.approx(1.5)
    assert rows["bob"]["idle_gpu_hours"] == pytest.approx(1.5)
    assert rows["bob"]["cost"] == pytest.approx(3 * (10 * 0.05 + 0.5 * 1.0))
    assert rows["carol"]["cost"] == 0 and rows["carol"]["unpriced_gpu_hours"] == pytest.approx(0.25)
    assert report.totals["sessions"] == 4
    assert report.totals["gpu_hours"] == pytest.approx(6.75)
    assert report.totals["cost"] == pytest.approx(23.0)
    assert report.currency == "EUR"


def test_swapped_hours_count_the_time_a_kernel_held_no_slice_inside_the_period():
    """A kernel swapped out from 2 h to 5 h (then resumed) and one swapped out from 8 h and never
    resumed (counts until the period's end): its slice's GPU-hours stop, its swapped hours run."""
    swapped = dataclasses.replace(
        rec("s1", "dora", "H100-80GB", 81920, 20480, 25, 1 * H, 2 * H, kind="kernel"),
        release_cause="swapped",
        swap_ended_at=5 * H,
    )
    resumed = dataclasses.replace(rec("s2", "dora", "H100-80GB", 81920, 20480, 25, 5 * H, 6 * H), resumes="s1")
    still = dataclasses.replace(rec("s3", "dora", "H100-80GB", 81920, 20480, 25, 7 * H, 8 * H), release_cause="swapped")
    ended_before = dataclasses.replace(
        rec("s4", "erin", "H100-80GB", 81920, 20480, 25, -3 * H, -2 * H), release_cause="swapped", swap_ended_at=-H
    )
    report = usage_report([swapped, resumed, still, ended_before], 0.0, 10 * H, ["user"], now=12 * H)
    (dora,) = report.rows
    assert dora["swapped_hours"] == pytest.approx(3 + 2)
    assert dora["slice_hours"] == pytest.approx(1 + 1 + 1) and dora["sessions"] == 3
    assert report.totals["swapped_hours"] == pytest.approx(5)
    # by day: the swapped hours fall in the day they were swapped out in
    t0 = parse_time("2026-11-01T23:00:00Z")
    night = dataclasses.replace(
        rec("n", "dora", "H100-80GB", 81920, 20480, 25, t0 - H, t0), release_cause="swapped", swap_ended_at=t0 + 2 * H
    )
    by_day = usage_report([night], parse_time("2026-11-01"), parse_time("2026-11-03"), ["day"])
    assert [(r["day"], r["swapped_hours"]) for r in by_day.rows] == [("2026-11-01", 1.0), ("2026-11-02", 1.0)]
    assert "swapped_hours" in report_csv(report).splitlines()[0]


def test_by_day_splits_a_session_at_midnight_utc():
    t0 = parse_time("2026-11-01T22:00:00Z")
    r = rec("night", "alice", "H100-80GB", 81920, 81920, 100, t0, t0 + 4 * H, whole=True)
    report = usage_report([r], parse_time("2026-11-01"), parse_time("2026-11-03"), ["day"])
    assert [(row["day"], row["gpu_hours"]) for row in report.rows] == [("2026-11-01", 2.0), ("2026-11-02", 2.0)]


def expected_gpu_hours(records, start, end, now):
    return sum(max(0.0, min(end, r.end(now)) - max(start, r.granted_at)) / H * r.count * r.share for r in records)


record_strategy = st.builds(
    lambda i, user, model, memory, cores, t0, length, count, whole, still: rec(
        f"r{i}",
        user,
        model,
        {"H100-80GB": 81920, "A100-40GB": 40960, "T4": 16384}[model],
        memory,
        cores,
        t0,
        None if still else t0 + length,
        count=count,
        whole=whole,
    ),
    st.integers(0, 10**6),
    st.sampled_from(["alice", "bob", "carol"]),
    st.sampled_from(["H100-80GB", "A100-40GB", "T4"]),
    st.integers(256, 16384),
    st.integers(1, 100),
    st.floats(-5 * 86400, 40 * 86400),
    st.floats(0, 10 * 86400),
    st.integers(1, 4),
    st.booleans(),
    st.booleans(),
)


@settings(max_examples=60, deadline=None)
@given(
    records=st.lists(record_strategy, max_size=12, unique_by=lambda r: r.id),
    start=st.floats(0, 20 * 86400),
    length=st.floats(60, 20 * 86400),
    by=st.sampled_from([["user"], ["model", "user"], ["day"], ["month", "workspace"], []]),
)
def test_report_sums_equal_the_sums_of_the_records(records, start, length, by):
    end, now = start + length, start + length + 86400
    prices = load_prices({"*": {"gpu_hour": 3.0}})
    report = usage_report(records, start, end, by, prices, now=now)
    expected = expected_gpu_hours(records, start, end, now)
    assert math.isclose(sum(r["gpu_hours"] for r in report.rows), expected, rel_tol=1e-9, abs_tol=1e-9)
    assert math.isclose(report.totals["gpu_hours"], expected, rel_tol=1e-9, abs_tol=1e-9)
    assert math.isclose(report.totals["cost"], 3.0 * expected, rel_tol=1e-9, abs_tol=1e-9)
    inside = {r.id for r in records if min(end, r.end(now)) > max(start, r.granted_at)}
    assert report.totals["sessions"] == len(inside)


def test_report_csv_round_trips():
    report = usage_report(RECORDS, 0.0, 10 * H, ["user", "model"], load_prices(PRICES), now=12 * H)
    rows = list(csv.DictReader(io.StringIO(report_csv(report))))
    assert len(rows) == len(report.rows)
    for back, row in zip(rows, report.rows, strict=True):
        assert (back["user"], back["model"]) == (row["user"], row["model"])
        for metric in METRICS[:-2]:
            assert float(back[metric]) == pytest.approx(row[metric], abs=1e-6)
        assert float(back["cost_USD"]) == pytest.approx(row["cost"], abs=1e-6)


def test_report_xlsx_round_trips_through_openpyxl():
    from openpyxl import load_workbook

    report = usage_report(RECORDS, 0.0, 10 * H, ["user"], load_prices(PRICES, "EUR"), now=12 * H)
    book = load_workbook(io.BytesIO(report_xlsx(report)))
    rows = list(book["usage"].iter_rows(values_only=True))
    assert rows[0][0] == "user" and rows[0][-2] == "cost_EUR"
    back = {r[0]: dict(zip(rows[0], r, strict=True)) for r in rows[1:]}
    for row in report.rows:
        assert back[row["user"]]["gpu_hours"] == pytest.approx(row["gpu_hours"])
        assert back[row["user"]]["cost_EUR"] == pytest.approx(row["cost"])
    assert back["total"]["cost_EUR"] == pytest.approx(23.0) and back["total"]["sessions"] == 4
    assert dict(book["period"].iter_rows(values_only=True))["currency"] == "EUR"


def test_records_csv_has_one_row_per_record_with_iso_times():
    rows = list(csv.DictReader(io.StringIO(records_csv(RECORDS))))
    assert [r["id"] for r in rows] == ["r1", "r2", "r3", "r4"]
    assert rows[0]["granted"] == "1970-01-01T01:00:00Z" and rows[1]["released"] == ""
    assert float(rows[0]["busy_seconds"]) == 3600.0 and rows[1]["busy_seconds"] == ""


@pytest.mark.parametrize(
    "prices, currency, message",
    [
        ({"H100-80GB": {"gpu_hour": -1}}, "USD", r"UsageMeter.prices\['H100-80GB'\].gpu_hour must be a number"),
        ({"H100-80GB": {"gpu_hour": "cheap"}}, "USD", r"\.gpu_hour must be a number of USD per hour"),
        ({"H100-80GB": {"gpu_hour": True}}, "USD", r"\.gpu_hour must be a number"),
        ({"H100-80GB": {"per_hour": 2}}, "USD", r"unknown key 'per_hour'; the keys are gpu_hour, memory_gib_hour"),
        ({"H100-80GB": 2.5}, "USD", r"UsageMeter.prices\['H100-80GB'\] must be a mapping"),
        ({"H100-80GB": {}}, "USD", r"is empty; give at least gpu_hour"),
        ([2.5], "USD", r"UsageMeter.prices must be a mapping"),
        ({}, " ", r"UsageMeter.currency must be a currency name"),
    ],
)
def test_a_bad_price_is_refused_with_a_sentence_naming_the_key(prices, currency, message):
    with pytest.raises(ConfigError, match=message):
        load_prices(prices, currency)


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"prices": {"H100-80GB": {"gpu_hour": -1}}}', r"metering.prices\['H100-80GB'\].gpu_hour must be a number"),
        ('{"currency": "EUR", "price": {}}', r"metering: unknown key 'price'; the keys are currency and prices"),
        ('{"prices": {"H100-80GB": {"gpu_hour": 2}', r"is not valid JSON"),
    ],
)
def test_a_bad_prices_file_is_refused_naming_the_file_and_the_helm_key(tmp_path, content, message):
    """The Helm chart's metering values reach the hub as a JSON file (c.UsageMeter.prices_file)."""
    path = tmp_path / "metering.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message) as e:
        load_prices_file(str(path))
    assert str(path) in e.value.message
    with pytest.raises(ConfigError, match="cannot read the GPU prices file"):
        load_prices_file(str(tmp_path / "missing.json"))


def test_bad_report_parameters_are_refused_with_what_is_allowed():
    with pytest.raises(ReportError, match="cannot group usage by 'team'; group by any of user, namespace"):
        usage_report(RECORDS, 0, H, ["team"])
    with pytest.raises(ReportError, match="the period must end after it starts"):
        usage_report(RECORDS, H, 0, ["user"])
    with pytest.raises(ReportError, match="is not a date: use ISO 8601"):
        parse_time("last tuesday", "--from")
    with pytest.raises(ReportError, match="not a share of one card"):
        parse_slice("3/2")
    with pytest.raises(ReportError, match="the card's memory is unknown"):
        parse_slice("20GiB")


def test_slice_sizes_are_read_as_fractions_of_a_card():
    assert parse_slice("1/4") == parse_slice("0.25") == parse_slice("25%") == parse_slice("20GiB", 81920) == 0.25


CAPACITY = [
    rec("a", "alice", "H100-80GB", 81920, 20480, 25, 0.0, 4 * H),  # 1/4 card
    rec("b", "bob", "H100-80GB", 81920, 40960, 50, 2 * H, 6 * H),  # 1/2 card
    rec("c", "carol", "H100-80GB", 81920, 81920, 100, 3 * H, 5 * H, whole=True),
]


def test_capacity_at_quarter_slices_matches_the_hand_computed_example():
    plan = plan_capacity(CAPACITY, 0.0, 10 * H, 0.25)
    # slices: a 1, b 2, c 4; 4 per GPU -> GPUs 1 (0-3 h), 2 (3-5 h), 1 (5-6 h), 0 (6-10 h)
    assert plan.slices_per_gpu == 4 and plan.slices_peak == 7
    assert (plan.gpus_needed_peak, plan.gpus_needed_percentile) == (2, 2)
    assert plan.gpus_needed_mean == pytest.approx(0.8)
    assert plan.gpus_held_peak == pytest.approx(1.75)
    assert plan.timeline == [(0.0, 1), (3 * H, 2), (5 * H, 1), (6 * H, 0)]
    assert plan_capacity(CAPACITY, 0.0, 10 * H, 0.25, percentile=50).gpus_needed_percentile == 1
    assert plan_capacity(CAPACITY, 0.0, 10 * H, 0.25, percentile=40).gpus_needed_percentile == 0
    assert "need 2 GPUs at their peak" in plan.sentence()


def test_capacity_at_whole_cards_gives_every_session_a_card():
    plan = plan_capacity(CAPACITY, 0.0, 10 * H, 1.0)
    assert plan.gpus_needed_peak == 3 and plan.gpus_used == 3


def test_charts_are_svg_with_a_bar_per_group_and_the_plan_lines():
    svg = usage_svg(RECORDS, 0.0, 10 * H, "user", now=12 * H)
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    for user in ("alice", "bob", "carol"):
        assert f">{user}</text>" in svg
    # 1 h bars: r1 is a quarter card (1-5 h), r2 two whole cards (8-10 h)
    assert svg.count("alice: 0.25 GPU-hours") == 4 and svg.count("alice: 2.00 GPU-hours") == 2
    plan_svg = capacity_svg(plan_capacity(CAPACITY, 0.0, 10 * H, 0.25))
    assert ">peak 2</text>" in plan_svg and ">p95 2</text>" in plan_svg


def replay_records(records, start, end, gpus, slice_fraction):
    scenario = Scenario(profiles=slice_profiles(slice_fraction))
    requests = requests_of(sessions_from_records(records, start, end), scenario)
    return replay(requests, scenario, gpus=gpus, model="H100-80GB", memory_mib=81920)


def test_replay_through_the_admission_core_counts_what_fragmentation_costs():
    # five sessions of 0.6 of a card at once; at 1/5 slices each needs 3 slices ON ONE card, so a
    # card holds one of them: the concurrency bound says 3 GPUs, placement needs 5
    sessions = [rec(f"s{i}", f"u{i}", "H100-80GB", 81920, 49152, 60, 0.0, H) for i in range(5)]
    assert plan_capacity(sessions, 0.0, 2 * H, 0.2).gpus_needed_peak == 3
    plan = plan_by_replay(sessions, 0.0, 2 * H, 0.2, max_wait_seconds=30)
    assert plan.gpus_needed == 5
    # below 5 the replay stops as soon as one session is late (p95 of 5 allows none): too small
    assert plan.tried[3] == plan.tried[4] == math.inf and plan.tried[5] == 0.0
    result = replay_records(sessions, 0.0, 2 * H, gpus=3, slice_fraction=0.2)
    assert sorted(result.waits["3/5"]) == [0.0, 0.0, 0.0, H, H] and result.unserved == {}
    assert result.wait_percentile(95) == H


def test_replay_of_the_hand_example_waits_for_a_whole_card_on_one_gpu():
    result = replay_records(CAPACITY, 0.0, 10 * H, gpus=1, slice_fraction=0.25)
    # a (1/4) and b (1/2) share the card; c (whole) waits from 3 h until b leaves at 6 h
    assert result.waits == {"1/4": [0.0], "1/2": [0.0], "whole": [3 * H]}
    assert result.class_percentiles(95) == {"1/2": 0.0, "1/4": 0.0, "whole": 3 * H}
    assert plan_by_replay(CAPACITY, 0.0, 10 * H, 0.25).gpus_needed == 2
    with pytest.raises(ReportError, match="no recorded sessions"):
        plan_by_replay(CAPACITY, 20 * H, 30 * H, 0.25)
