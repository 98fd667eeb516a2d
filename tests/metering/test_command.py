"""The functions behind `elastic-gpu usage` / `elastic-gpu capacity`: they read the hub's
database and prices from its config, print CSV or a table, and answer bad input with a sentence."""

from __future__ import annotations

import argparse
import csv
import io

import pytest

from hubext.metering.command import add_capacity_arguments, add_usage_arguments, run_capacity, run_usage
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


def test_capacity_answers_in_a_sentence(hub_config):
    out = io.StringIO()
    args = parse(
        add_capacity_arguments, ["--config", str(hub_config), "--from", "0", "--to", "36000", "--slice", "1/4"]
    )
    assert run_capacity(args, out) == 0
    assert "need 1 GPUs at their peak" in out.getvalue()
    assert "Replayed through admission (8 GPUs per node), 1 H100-80GB GPUs keep the p95 wait within 30 s" in (
        out.getvalue()
    )


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
    args = parse(add_capacity_arguments, ["--config", str(hub_config), "--slice", "20GiB"])
    assert run_capacity(args, io.StringIO()) == 2
    assert "the card's memory is unknown" in capsys.readouterr().err


def test_help_of_both_commands_renders():
    for add, words in ((add_usage_arguments, ("--by", "--csv", "--xlsx")), (add_capacity_arguments, ("--slice",))):
        parser = argparse.ArgumentParser(prog="elastic-gpu")
        add(parser)
        text = parser.format_help()
        assert all(w in text for w in words), text
    assert "25%" in text and "served without waiting this % of the time" in text
