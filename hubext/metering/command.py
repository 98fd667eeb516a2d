"""``elastic-gpu usage`` and ``elastic-gpu simulate``: reports and capacity planning from the usage
store, hub up or down (``hubext.cli.commands`` wires them as sub-commands).

They read the database directly (``--db-url``, else the ``JupyterHub.db_url`` and
``UsageMeter`` settings of the hub config, ``<config dir>/jupyterhub_config.py`` by default),
so the prices are the hub's; ``simulate --sessions FILE`` reads a CSV of sessions instead.
They return the exit status and print one sentence on bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from sqlalchemy.engine import make_url

from quotas import ConfigError

from .meter import UsageMeter
from .plot import scenarios_svg, usage_svg
from .prices import PriceTable
from .replay import Scenario, ScenarioResult, model_of, run_scenario, sessions_from_records, size_label
from .report import GROUP_KEYS, ReportError, parse_time, records_csv, report_csv, report_xlsx, usage_report
from .simulate import apply_setting, parse_scenario, read_sessions_file, sessions_from_csv
from .store import UsageStore

USAGE_HELP = "GPU usage and cost per user, workspace, namespace, model, day or month (CSV, JSON or a table)"
SIMULATE_HELP = (
    "replay the recorded usage (or a CSV of sessions) with another pool size, profile mix, idle timeout or "
    "placement: p95 wait and GPUs needed per scenario"
)


def _common(parser: argparse.ArgumentParser, default_config: Path | None) -> None:
    # the caller (the `elastic-gpu` CLI) knows where its hub config lives; nothing here imports it
    parser.set_defaults(default_config=default_config)
    parser.add_argument("--from", dest="start", default="", help="start (ISO date/time, UTC; default: 30 days ago)")
    parser.add_argument("--to", dest="end", default="", help="end (ISO date/time, UTC; default: now)")
    parser.add_argument("--db-url", default="", help="the usage store's database (default: the hub config's)")
    parser.add_argument(
        "--config", default="", help="the hub's jupyterhub_config.py (default: <config dir>/jupyterhub_config.py)"
    )


def add_usage_arguments(parser: argparse.ArgumentParser, default_config: Path | None = None) -> None:
    """``elastic-gpu usage``'s arguments; ``default_config``: the hub config read without --config."""
    _common(parser, default_config)
    parser.add_argument("--by", default="user", help=f"comma-separated groups: {', '.join(GROUP_KEYS)}")
    parser.add_argument("--user", default="", help="only this user's records")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--csv", action="store_true", help="print the report as CSV")
    out.add_argument("--records", action="store_true", help="print the raw records as CSV")
    out.add_argument("--xlsx", metavar="FILE", default="", help="write the report as an Excel workbook to FILE")
    out.add_argument("--svg", metavar="FILE", default="", help="write a stacked GPU-hours chart to FILE")


def add_simulate_arguments(parser: argparse.ArgumentParser, default_config: Path | None = None) -> None:
    """``elastic-gpu simulate``'s arguments; ``default_config``: the hub config read without --config."""
    _common(parser, default_config)
    parser.add_argument(
        "--sessions",
        metavar="CSV",
        default="",
        help="replay this CSV of sessions (start, end or duration_seconds, size[, count, user, id, bursts]; "
        "or `elastic-gpu usage --records` output) instead of the recorded usage",
    )
    parser.add_argument("--model", default="", help="only sessions on this GPU model (the pool's model to plan)")
    parser.add_argument("--card-memory", default="80GiB", help="--sessions: the planned card's memory (default 80GiB)")
    base = parser.add_argument_group("the first scenario (each --scenario starts from it)")
    base.add_argument("--slice", default="", help="slice size: 1/4, 0.25, 25%%, or memory such as 20GiB")
    base.add_argument("--profiles", default="", help="the sizes offered, e.g. 1/8,1/4,1/2,1 (default: as asked)")
    base.add_argument("--idle-timeout", default="", help="seconds an idle slice is held before it is culled")
    base.add_argument("--placement", default="", help="binpack, spread or fgd, or node/gpu such as binpack/spread")
    base.add_argument("--gpus", default="", help="a fixed pool size: answer its waits (default: the smallest pool)")
    base.add_argument("--per-node", default="8", help="GPUs per node of the planned pool (default 8)")
    parser.add_argument(
        "--scenario",
        action="append",
        default=[],
        metavar="'NAME: KEY=VALUE ...'",
        help="another scenario; keys: slice, profiles, idle_timeout, placement, gpus, per_node (repeat for more)",
    )
    parser.add_argument("--percentile", type=float, default=95.0, help="the wait percentile (default 95)")
    parser.add_argument("--max-wait", type=float, default=30.0, help="the longest wait allowed (s, default 30)")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the answers as JSON")
    out.add_argument("--svg", metavar="FILE", default="", help="also write a chart of GPUs and waits per scenario")


def _load(args: argparse.Namespace) -> tuple[UsageStore, PriceTable]:
    config: Any = None
    path = Path(args.config) if args.config else getattr(args, "default_config", None)
    if args.config and not path.is_file():
        raise ReportError(f"hub config {path} does not exist; pass --config with the hub's jupyterhub_config.py.")
    hub_db_url = ""
    if path is not None and path.is_file():
        from traitlets.config.loader import PyFileConfigLoader

        config = PyFileConfigLoader(path.name, str(path.parent)).load_config()
        hub_db_url = config.JupyterHub.get("db_url", "") if "JupyterHub" in config else ""
    meter = UsageMeter(config=config) if config is not None else UsageMeter()
    db_url = args.db_url or meter.resolve_db_url(hub_db_url)
    url = make_url(db_url)
    if url.get_backend_name() == "sqlite" and url.database and not Path(url.database).is_file():
        raise ReportError(
            f"there is no hub database at {url.database}; pass --db-url, or --config with the hub's "
            "jupyterhub_config.py."
        )
    return UsageStore(db_url), meter.price_table()


def _period(args: argparse.Namespace) -> tuple[float, float]:
    end = parse_time(args.end, "--to") if args.end else time.time()
    start = parse_time(args.start, "--from") if args.start else end - 30 * 86400
    return start, end


def run_usage(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Print the report (table, --csv, --records) or write --svg; 2 on bad input."""
    try:
        start, end = _period(args)
        store, prices = _load(args)
        records = store.records(start, end, [args.user] if args.user else None)
        if args.records:
            out.write(records_csv(records))
            return 0
        if args.svg:
            Path(args.svg).write_text(usage_svg(records, start, end, args.by))
            out.write(f"wrote {args.svg}\n")
            return 0
        report = usage_report(records, start, end, args.by.split(","), prices)
    except (ReportError, ConfigError) as e:
        print(f"elastic-gpu usage: {e.message}", file=sys.stderr)
        return 2
    if args.csv:
        out.write(report_csv(report))
        return 0
    if args.xlsx:
        Path(args.xlsx).write_bytes(report_xlsx(report))
        out.write(f"wrote {args.xlsx}\n")
        return 0
    out.write(_table(report))
    return 0


def _scenarios(args: argparse.Namespace, card_memory_mib: int) -> list[Scenario]:
    changed = any((args.slice, args.profiles, args.idle_timeout, args.placement, args.gpus))
    base = Scenario(name="baseline" if changed else "as recorded")
    for key, value in (
        ("slice", args.slice),
        ("profiles", args.profiles),
        ("idle_timeout", args.idle_timeout),
        ("placement", args.placement),
        ("gpus", args.gpus),
        ("per_node", args.per_node),
    ):
        if value:
            base = apply_setting(base, key, value, f"--{key.replace('_', '-')}", card_memory_mib)
    return [base] + [parse_scenario(text, base, n, card_memory_mib) for n, text in enumerate(args.scenario, 2)]


def run_simulate(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Replay the recorded usage (or --sessions) under each scenario; print GPUs and waits (2 on bad input)."""
    try:
        if not (math.isfinite(args.percentile) and 0 < args.percentile <= 100):
            raise ReportError(f"--percentile must be a number in (0, 100], such as 95; got {args.percentile:g}.")
        if not (math.isfinite(args.max_wait) and args.max_wait >= 0):
            raise ReportError(f"--max-wait must be seconds (0 or more), such as 30; got {args.max_wait:g}.")
        if args.sessions:
            memory = _card_memory(args.card_memory)
            sessions, model = sessions_from_csv(read_sessions_file(args.sessions), memory), args.model or "GPU"
        else:
            start, end = _period(args)
            store, _ = _load(args)
            records = store.records(start, end)
            model, memory = model_of(records, args.model)
            sessions = sessions_from_records(records, start, end, model=model)
        scenarios = _scenarios(args, memory)
        results = [
            run_scenario(
                sessions,
                scenario,
                model=model,
                memory_mib=memory,
                max_wait_seconds=args.max_wait,
                percentile=args.percentile,
            )
            for scenario in scenarios
        ]
    except (ReportError, ConfigError) as e:
        print(f"elastic-gpu simulate: {e.message}", file=sys.stderr)
        return 2
    if args.json:
        out.write(json.dumps({"model": model, "results": [r.to_dict() for r in results]}, indent=2) + "\n")
        return 0
    out.write(_scenario_table(results, args.percentile))
    for r in results:
        out.write(r.sentence() + "\n")
    if args.svg:
        Path(args.svg).write_text(scenarios_svg(results, model))
        out.write(f"wrote {args.svg}\n")
    return 0


def _card_memory(text: str) -> int:
    m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*(GiB|MiB)\s*$", text, re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise ReportError(f"--card-memory must be a memory size such as 80GiB or 40960MiB; got {text!r}.")
    return round(float(m.group(1)) * (1024 if m.group(2).lower() == "gib" else 1))


def _scenario_table(results: list[ScenarioResult], percentile: float) -> str:
    header = ["scenario", "sizes", "idle timeout", "placement", "GPUs", f"p{percentile:g} wait (s)", "requests"]
    rows = []
    for r in results:
        s = r.scenario
        rows.append(
            [
                s.name,
                ",".join(size_label(p) for p in sorted(s.profiles)) or "as asked",
                "none" if s.idle_timeout_seconds is None else f"{s.idle_timeout_seconds:g} s",
                f"{s.placement.node}/{s.placement.gpu}",
                "-" if r.gpus is None else str(r.gpus) + ("" if s.gpus is None else " (fixed)"),
                "-" if r.gpus is None else (f"{r.wait:.0f}" if r.wait != float("inf") else "never"),
                str(r.requests),
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [header, *rows]]
    return "\n".join(lines) + "\n"


def _table(report: Any) -> str:
    columns = [
        *report.by,
        "sessions",
        "gpu_hours",
        "busy_gpu_hours",
        "idle_gpu_hours",
        "unmetered_gpu_hours",  # no activity samples (e.g. simulated GPUs): neither busy nor idle
        "memory_gib_hours",
        "cost",
    ]
    rows = [[str(r[k]) if k in report.by else _num(r[k]) for k in columns] for r in report.rows]
    rows.append(["total"] + [""] * (len(report.by) - 1) + [_num(report.totals[k]) for k in columns[len(report.by) :]])
    if not report.by:
        rows[-1] = rows[-1][1:]
    header = columns[:-1] + [f"cost ({report.currency})"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines) + "\n"


def _num(value: Any) -> str:
    return str(value) if isinstance(value, int) else f"{value:.2f}"
