"""``elastic-gpu usage`` and ``elastic-gpu capacity``: reports from the usage store, hub up or down.

The CLI wires these in two lines each (it is being split into a package; see
/tmp/notes/metering.md)::

    p = sub.add_parser("usage", help=USAGE_HELP); add_usage_arguments(p); p.set_defaults(func=run_usage)
    p = sub.add_parser("capacity", help=CAPACITY_HELP); add_capacity_arguments(p); p.set_defaults(func=run_capacity)

They read the database directly (``--db-url``, else the ``JupyterHub.db_url`` and
``UsageMeter`` settings of the hub config, ``<config dir>/jupyterhub_config.py`` by default),
so the prices are the hub's. They return the exit status and print one sentence on bad input.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from sqlalchemy.engine import make_url

from quotas import ConfigError

from .capacity import parse_slice, plan_capacity
from .meter import UsageMeter
from .plot import capacity_svg, usage_svg
from .prices import PriceTable
from .replay import plan_by_replay
from .report import GROUP_KEYS, ReportError, parse_time, records_csv, report_csv, report_xlsx, usage_report
from .store import UsageStore

USAGE_HELP = "GPU usage and cost per user, workspace, namespace, model, day or month (CSV, JSON or a table)"
CAPACITY_HELP = "how many GPUs the recorded demand needs at a slice size (e.g. --slice 1/4)"


def _default_config() -> Path:
    from hubext.cli.base import default_config_dir  # the CLI's one rule (root: /var/lib/elastic-gpu)

    return default_config_dir() / "jupyterhub_config.py"


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from", dest="start", default="", help="start (ISO date/time, UTC; default: 30 days ago)")
    parser.add_argument("--to", dest="end", default="", help="end (ISO date/time, UTC; default: now)")
    parser.add_argument("--db-url", default="", help="the usage store's database (default: the hub config's)")
    parser.add_argument(
        "--config", default="", help="the hub's jupyterhub_config.py (default: <config dir>/jupyterhub_config.py)"
    )


def add_usage_arguments(parser: argparse.ArgumentParser) -> None:
    _common(parser)
    parser.add_argument("--by", default="user", help=f"comma-separated groups: {', '.join(GROUP_KEYS)}")
    parser.add_argument("--user", default="", help="only this user's records")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--csv", action="store_true", help="print the report as CSV")
    out.add_argument("--records", action="store_true", help="print the raw records as CSV")
    out.add_argument("--xlsx", metavar="FILE", default="", help="write the report as an Excel workbook to FILE")
    out.add_argument("--svg", metavar="FILE", default="", help="write a stacked GPU-hours chart to FILE")


def add_capacity_arguments(parser: argparse.ArgumentParser) -> None:
    _common(parser)
    parser.add_argument("--slice", default="1", help="slice size: 1/4, 0.25, 25%%, or memory such as 20GiB")
    parser.add_argument("--model", default="", help="only sessions on this GPU model (needed for a memory size)")
    parser.add_argument("--percentile", type=float, default=95.0, help="served without waiting this %% of the time")
    parser.add_argument("--max-wait", type=float, default=30.0, help="replay: the longest wait allowed (s)")
    parser.add_argument("--per-node", type=int, default=8, help="replay: GPUs per node of the planned pool")
    parser.add_argument("--no-replay", action="store_true", help="only the concurrency bound, no admission replay")
    parser.add_argument("--svg", metavar="FILE", default="", help="write the GPUs-needed chart to FILE")


def _load(args: argparse.Namespace) -> tuple[UsageStore, PriceTable]:
    config: Any = None
    path = Path(args.config) if args.config else _default_config()
    if args.config and not path.is_file():
        raise ReportError(f"hub config {path} does not exist; pass --config with the hub's jupyterhub_config.py.")
    hub_db_url = ""
    if path.is_file():
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


def run_capacity(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Print the capacity answer (and write --svg); 2 on bad input."""
    try:
        start, end = _period(args)
        store, _ = _load(args)
        records = store.records(start, end)
        card = next((r.gpu_memory_mib for r in records if r.gpu_model == args.model and r.gpu_memory_mib), 0)
        fraction = parse_slice(args.slice, card)
        plan = plan_capacity(records, start, end, fraction, percentile=args.percentile, model=args.model)
        replayed = None
        if not args.no_replay:
            replayed = plan_by_replay(
                records,
                start,
                end,
                fraction,
                model=args.model,
                max_wait_seconds=args.max_wait,
                percentile=args.percentile,
                gpus_per_node=args.per_node,
            )
    except (ReportError, ConfigError) as e:
        print(f"elastic-gpu capacity: {e.message}", file=sys.stderr)
        return 2
    out.write(plan.sentence() + "\n")
    if replayed is not None:
        out.write(replayed.sentence() + "\n")
    if args.svg:
        Path(args.svg).write_text(capacity_svg(plan))
        out.write(f"wrote {args.svg}\n")
    return 0


def _table(report: Any) -> str:
    columns = [*report.by, "sessions", "gpu_hours", "busy_gpu_hours", "idle_gpu_hours", "memory_gib_hours", "cost"]
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
