"""The functions behind `elastic-gpu usage` / `elastic-gpu simulate`: they read the hub's
database and prices from its config, print CSV or a table, and answer bad input with a sentence."""

from __future__ import annotations

import argparse
import csv
import io
import json

import pytest

from hubext.metering.command import add_simulate_arguments, add_usage_arguments, run_simulate, run_usage
from hubext.metering.store import UsageStore

from .test_store import record

H = 3600.0


@pytest.fixture()
def hub_config(tmp_path):
    db = tmp_path / "jupyterhub.sqlite"
    store = UsageStore(f"sqlite:///{db}")
    store.upgrade()
    store.apply(
        [
            {"event": "granted", "record": record("a", "alice", granted_at=0.0, workspace="vision")},
            {"event": "released", "id": "a", "at": 4 * H, "cause": "stopped"},
            {"event": "granted", "record": record("b", "bob", granted_at=2 * H, workspace="nlp")},
            {"event": "released", "id": "b", "at": 6 * H, "cause": "culled"},
        ]
    )
    config = tmp_path / "jupyterhub_config.py"
    config.write_text(
        "c = get_config()  # noqa\n"
        f"c.JupyterHub.db_url = 'sqlite:///{db}'\n"
        "c.UsageMeter.prices = {'H100-80GB': {'gpu_hour': 2.0}}\n"
        "c.UsageMeter.currency = 'EUR'\n"
    )
    return config


def parse(add, argv):
    parser = argparse.ArgumentParser()
    add(parser)
    return parser.parse_args(argv)


def test_usage_csv_by_workspace_reads_the_hubs_database_and_prices(hub_config):
    out = io.StringIO()
    args = parse(
        add_usage_arguments, ["--config", str(hub_config), "--from", "0", "--to", "36000", "--by", "workspace"]
    )
    args.csv = True
    assert run_usage(args, out) == 0
    rows = {r["workspace"]: r for r in csv.DictReader(io.StringIO(out.getvalue()))}
    # 20 GiB of an 80 GiB card (share 0.25) for 4 h each: 1 GPU-hour, 2 EUR
    assert float(rows["vision"]["gpu_hours"]) == pytest.approx(1.0)
    assert float(rows["nlp"]["cost_EUR"]) == pytest.approx(2.0)


def test_usage_table_has_a_total_line(hub_config):
    out = io.StringIO()
    args = parse(add_usage_arguments, ["--config", str(hub_config), "--from", "0", "--to", "36000"])
    assert run_usage(args, out) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].split()[:2] == ["user", "sessions"] and "cost (EUR)" in lines[0]
    assert lines[-1].split()[:3] == ["total", "2", "2.00"]


def test_simulate_answers_gpus_and_the_p95_wait_per_scenario(hub_config, tmp_path):
    out = io.StringIO()
    argv = ["--config", str(hub_config), "--from", "0", "--to", "36000", "--slice", "1/4"]
    argv += ["--scenario", "whole cards: slice=1", "--scenario", "one card: slice=1 gpus=1 placement=spread"]
    args = parse(add_simulate_arguments, [*argv, "--svg", str(tmp_path / "plan.svg")])
    assert run_simulate(args, out) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].split()[:2] == ["scenario", "sizes"] and "p95 wait (s)" in lines[0]
    # alice 0-4 h and bob 2-6 h, a quarter card each: one card holds both; whole cards need two,
    # and on one whole card bob waits from 2 h until alice leaves at 4 h
    assert "baseline (sizes 1/4, 1/2, 3/4, whole, no idle timeout" in out.getvalue()
    assert "1 GPUs keep the p95 wait within 30 s for every size class (1/4: 0 s)" in out.getvalue()
    assert "whole cards (sizes whole," in out.getvalue() and "2 GPUs keep the p95 wait" in out.getvalue()
    assert "with 1 GPUs the p95 wait is 7200 s (whole: 7200 s), over 30 s" in out.getvalue()
    svg = (tmp_path / "plan.svg").read_text()
    assert svg.startswith("<svg") and svg.count('class="egpu-scenario"') == 3 and "p95 wait 7200 s" in svg
    out = io.StringIO()
    assert run_simulate(parse(add_simulate_arguments, [*argv[:6], "--json"]), out) == 0
    (result,) = json.loads(out.getvalue())["results"]
    assert (result["gpus"], result["class_wait_seconds"], result["sessions"]) == (1, {"1/4": 0.0}, 2)


def test_simulate_replays_a_csv_of_sessions_with_an_idle_timeout(tmp_path, capsys):
    """Four whole-card sessions of 4 h, 1000 s apart, each busy only in its first minute: held
    throughout they need 4 GPUs; culled after 600 s idle, one card serves them in turn."""
    path = tmp_path / "sessions.csv"
    rows = [f"s{i},user{i},{i * 1000},14400,1,0:60" for i in range(4)]
    path.write_text("id,user,start,duration_seconds,size,bursts\n" + "\n".join(rows) + "\n")
    out = io.StringIO()
    argv = ["--sessions", str(path), "--scenario", "culled: idle_timeout=600"]
    assert run_simulate(parse(add_simulate_arguments, argv), out) == 0
    text = out.getvalue()
    assert "as recorded (sizes as asked, no idle timeout" in text and "4 GPUs keep the p95 wait" in text
    assert "culled (sizes as asked, idle timeout 600 s" in text and ": 1 GPUs keep the p95 wait" in text
    path.write_text("start,size\n0,1/4\n")
    assert run_simulate(parse(add_simulate_arguments, ["--sessions", str(path)]), io.StringIO()) == 2
    assert "needs a header with start, end or duration_seconds, and size" in capsys.readouterr().err
    path.write_text("start,duration_seconds,size,bursts\n0,60,1/4,5-10\n")
    assert run_simulate(parse(add_simulate_arguments, ["--sessions", str(path)]), io.StringIO()) == 2
    assert "sessions CSV line 2: bursts must be offset:length pairs" in capsys.readouterr().err
    path.write_text("start,duration_seconds,size\n0,60,1/4\n")
    bad = ["--sessions", str(path), "--scenario", "x: placement=roundrobin"]
    assert run_simulate(parse(add_simulate_arguments, bad), io.StringIO()) == 2
    assert "scenario 'x': placement 'roundrobin' is not one of binpack, spread, fgd" in capsys.readouterr().err


def test_simulate_asks_for_one_model_when_the_records_used_several(tmp_path, capsys):
    db = tmp_path / "jupyterhub.sqlite"
    store = UsageStore(f"sqlite:///{db}")
    store.upgrade()
    store.apply(
        [
            {"event": "granted", "record": record("h", granted_at=0.0)},
            {"event": "granted", "record": record("a", granted_at=0.0, gpu_model="A100-40GB", gpu_memory_mib=40960)},
        ]
    )
    args = parse(add_simulate_arguments, ["--db-url", f"sqlite:///{db}", "--from", "0", "--to", "3600"])
    assert run_simulate(args, io.StringIO()) == 2
    err = capsys.readouterr().err
    assert "the sessions used 2 GPU models (A100-40GB, H100-80GB); choose one (--model" in err, err
    out = io.StringIO()
    args = parse(
        add_simulate_arguments, ["--db-url", f"sqlite:///{db}", "--from", "0", "--to", "3600", "--model", "A100-40GB"]
    )
    assert run_simulate(args, out) == 0 and "1 GPUs keep the p95 wait" in out.getvalue()


def test_simulate_replays_the_records_csv_of_elastic_gpu_usage(hub_config, tmp_path):
    records = io.StringIO()
    run_usage(
        parse(add_usage_arguments, ["--config", str(hub_config), "--from", "0", "--to", "36000", "--records"]), records
    )
    path = tmp_path / "records.csv"
    path.write_text(records.getvalue())
    out = io.StringIO()
    assert run_simulate(parse(add_simulate_arguments, ["--sessions", str(path), "--slice", "1", "--json"]), out) == 0
    (result,) = json.loads(out.getvalue())["results"]
    assert (result["gpus"], result["sessions"]) == (2, 2)


def test_bad_input_is_one_sentence_and_exit_status_2(hub_config, capsys):
    args = parse(add_usage_arguments, ["--config", str(hub_config), "--by", "team"])
    assert run_usage(args, io.StringIO()) == 2
    assert "cannot group usage by 'team'" in capsys.readouterr().err
    args = parse(add_usage_arguments, ["--config", str(hub_config.parent / "missing.py")])
    assert run_usage(args, io.StringIO()) == 2
    assert "does not exist; pass --config" in capsys.readouterr().err
    args = parse(add_usage_arguments, ["--db-url", f"sqlite:///{hub_config.parent / 'nowhere.sqlite'}"])
    assert run_usage(args, io.StringIO()) == 2
    assert "there is no hub database at" in capsys.readouterr().err
    assert not (hub_config.parent / "nowhere.sqlite").exists()  # reading creates nothing
    args = parse(add_simulate_arguments, ["--config", str(hub_config), "--from", "0", "--slice", "3/2"])
    assert run_simulate(args, io.StringIO()) == 2
    assert "elastic-gpu simulate: --slice: slice size '3/2' is not a share of one card" in capsys.readouterr().err


def test_help_of_both_commands_renders():
    for add, words in (
        (add_usage_arguments, ("--by", "--csv", "--xlsx")),
        (add_simulate_arguments, ("--slice", "--profiles", "--idle-timeout", "--placement", "--gpus", "--scenario")),
    ):
        parser = argparse.ArgumentParser(prog="elastic-gpu")
        add(parser)
        text = parser.format_help()
        assert all(w in text for w in words), text
    assert "25%" in text and "--sessions CSV" in text


def test_usage_table_says_which_gpu_hours_were_not_measured(hub_config):
    """Records without activity samples (a simulated pool) are neither busy nor idle: the table shows
    them as unmetered, so busy + idle + unmetered add up to the GPU-hours."""
    out = io.StringIO()
    args = parse(add_usage_arguments, ["--config", str(hub_config), "--from", "0", "--to", "36000"])
    assert run_usage(args, out) == 0
    lines = out.getvalue().splitlines()
    header = lines[0].split()
    assert "unmetered_gpu_hours" in header, header
    total = dict(zip(header[1:], lines[-1].split()[1:], strict=False))
    assert total["gpu_hours"] == total["unmetered_gpu_hours"] == "2.00", total
    assert total["busy_gpu_hours"] == total["idle_gpu_hours"] == "0.00", total
