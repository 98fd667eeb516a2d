"""Usage reports: GPU-hours, memory GiB-hours, busy and idle hours and cost, grouped (pure).

A record counts for the part of its life inside the period [start, end) (a record still held
counts until ``now``). For that part, of ``h`` hours, it adds:

- ``slice_hours``: ``h x count`` (slices held, whatever their size);
- ``gpu_hours``: ``h x count x share`` (card-equivalents: a 1/4 card for 4 h is 1 GPU-hour;
  the share is the larger of the memory and compute share, 1 for a whole card);
- ``memory_gib_hours``: ``h x count x memory GiB``;
- ``busy_gpu_hours`` / ``idle_gpu_hours``: ``gpu_hours`` split by the busy fraction measured by
  the activity samples (busy seconds / sampled seconds); records without activity add to
  ``unmetered_gpu_hours`` instead. ``idle_gpu_hours`` is the waste the culler could reclaim;
- ``burst_gpu_hours``: what an elastic slice used above its request (``gpu_hours`` count the
  request, what was guaranteed): its measured burst card-seconds (memory in use past the request
  over one card's memory, per activity sample), the part of them inside the period in proportion
  to its time there. Compute above the request is not measured per slice, so it is not counted;
- ``swapped_hours``: of a kernel swapped out to host memory (docs/culler.md), the hours from its
  release (cause ``swapped``) until it resumed or was stopped, inside the period: it kept its
  state and held no slice, so these hours cost nothing and are not in ``gpu_hours``; they fall
  in the groups of the record it was swapped out of;
- ``cost``: from the :class:`~.prices.PriceTable`; records whose model has no price add to
  ``unpriced_gpu_hours`` instead.

Groups: any of :data:`GROUP_KEYS`; ``day`` and ``month`` split a record at UTC day or month
boundaries; ``group`` is the user's JupyterHub groups when the slice was granted, as one key
(``a,b`` for a member of both, empty for none), so a record counts once and the sums hold.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from .prices import PriceTable
from .record import UsageRecord, swapped_periods

GROUP_KEYS = ("user", "namespace", "workspace", "group", "model", "kind", "node", "priority_class", "day", "month")
METRICS = (
    "sessions",
    "slice_hours",
    "gpu_hours",
    "memory_gib_hours",
    "busy_gpu_hours",
    "idle_gpu_hours",
    "unmetered_gpu_hours",
    "swapped_hours",
    "burst_gpu_hours",
    "cost",
    "unpriced_gpu_hours",
)
_RECORD_KEYS = {"model": "gpu_model", "group": "hub_groups"}


class ReportError(ValueError):
    """A report was asked for with bad parameters; ``message`` says what is allowed."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


#: the times a report may name: a calendar (datetime) holds them, and their month's end too
FIRST_TIME = datetime(1, 1, 2, tzinfo=timezone.utc).timestamp()
LAST_TIME = datetime(9999, 12, 1, tzinfo=timezone.utc).timestamp()


def parse_time(text: str | float | int, name: str = "time") -> float:
    """Unix seconds from an ISO 8601 date or date-time (UTC unless it names a zone) or a number,
    between the years 1 and 9999 (:data:`FIRST_TIME`, :data:`LAST_TIME`); else ReportError."""
    value = str(text).strip()
    refusal = ReportError(
        f"{name} {value!r} is not a date: use ISO 8601 such as 2026-11-01 or 2026-11-01T08:00:00Z, "
        "or unix seconds, between the years 1 and 9999."
    )
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = float(text)
    else:
        try:
            seconds = float(value)
        except ValueError:
            try:
                parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                raise refusal from None
            if parsed.tzinfo is None:
                parsed = parsed.replace(tzinfo=timezone.utc)
            seconds = parsed.timestamp()
    if not FIRST_TIME <= seconds <= LAST_TIME:  # also nan and infinities
        raise refusal
    return seconds


def parse_group(by: str | Sequence[str]) -> tuple[str, ...]:
    """``"user,model"`` or ``["user", "model"]`` -> ``("user", "model")``; unknown keys are refused."""
    keys = [k.strip() for k in (by.split(",") if isinstance(by, str) else by) if k.strip()]
    for key in keys:
        if key not in GROUP_KEYS:
            raise ReportError(f"cannot group usage by {key!r}; group by any of {', '.join(GROUP_KEYS)}.")
    if len(set(keys)) != len(keys):
        raise ReportError(f"group keys repeat in {','.join(keys)!r}; name each at most once.")
    return tuple(keys)


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _next_boundary(t: float, bucket: str) -> float:
    d = datetime.fromtimestamp(t, timezone.utc)
    if bucket == "day":
        start = d.replace(hour=0, minute=0, second=0, microsecond=0)
        return start.timestamp() + 86400
    year, month = (d.year + 1, 1) if d.month == 12 else (d.year, d.month + 1)
    return datetime(year, month, 1, tzinfo=timezone.utc).timestamp()


def _label(t: float, bucket: str) -> str:
    d = datetime.fromtimestamp(t, timezone.utc)
    return d.strftime("%Y-%m-%d") if bucket == "day" else d.strftime("%Y-%m")


def pieces(t0: float, t1: float, bucket: str | None) -> list[tuple[str, float, float]]:
    """[t0, t1) cut at UTC day or month boundaries: (label, start, end); one piece without a bucket."""
    if bucket is None:
        return [("", t0, t1)] if t1 > t0 else []
    out = []
    while t0 < t1:
        edge = min(t1, _next_boundary(t0, bucket))
        out.append((_label(t0, bucket), t0, edge))
        t0 = edge
    return out


@dataclass
class Report:
    """Rows (one per group, sorted by key) and totals over the period."""

    start: float
    end: float
    by: tuple[str, ...]
    currency: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    totals: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "from": iso(self.start),
            "to": iso(self.end),
            "by": list(self.by),
            "currency": self.currency,
            "rows": self.rows,
            "totals": self.totals,
        }


def _empty() -> dict[str, Any]:
    return {m: 0.0 for m in METRICS} | {"sessions": 0}


def usage_report(
    records: Iterable[UsageRecord],
    start: float,
    end: float,
    by: Sequence[str] = ("user",),
    prices: PriceTable | None = None,
    now: float | None = None,
) -> Report:
    """The report of ``records`` over [start, end) grouped ``by`` (see the module docstring)."""
    if not end > start:
        raise ReportError(f"the period must end after it starts; got from {iso(start)} to {iso(end)}.")
    by = parse_group(by)
    if "day" in by and "month" in by:
        raise ReportError("group by day or by month, not both.")
    prices = prices or PriceTable(models={})
    now = end if now is None else now
    bucket = "day" if "day" in by else "month" if "month" in by else None
    groups: dict[tuple[str, ...], dict[str, Any]] = {}
    sessions: dict[tuple[str, ...], set[str]] = {}

    def key_of(record: UsageRecord, label: str) -> tuple[str, ...]:
        return tuple(label if k in ("day", "month") else str(getattr(record, _RECORD_KEYS.get(k, k))) for k in by)

    records = list(records)
    for record in records:
        t0, t1 = max(start, record.granted_at), min(end, record.end(now))
        for label, a, b in pieces(t0, t1, bucket):
            key = key_of(record, label)
            row = groups.setdefault(key, _empty())
            sessions.setdefault(key, set()).add(record.id)
            _add(row, record, (b - a) / 3600.0, prices)
    for record, swapped_at, until in swapped_periods(records):
        t0, t1 = max(start, swapped_at), min(end, now if until is None else until)
        for label, a, b in pieces(t0, t1, bucket):
            row = groups.setdefault(key_of(record, label), _empty())
            sessions.setdefault(key_of(record, label), set())
            row["swapped_hours"] += (b - a) / 3600.0
    rows = []
    for key in sorted(groups):
        row = groups[key]
        row["sessions"] = len(sessions[key])
        rows.append({**dict(zip(by, key, strict=True)), **row})
    totals = _empty()
    for row in rows:
        for m in METRICS:
            if m != "sessions":
                totals[m] += row[m]
    totals["sessions"] = len(set().union(*sessions.values())) if sessions else 0
    return Report(start=start, end=end, by=by, currency=prices.currency, rows=rows, totals=totals)


def _add(row: dict[str, Any], record: UsageRecord, hours: float, prices: PriceTable) -> None:
    gpu_hours = hours * record.count * record.share
    row["slice_hours"] += hours * record.count
    row["gpu_hours"] += gpu_hours
    row["memory_gib_hours"] += hours * record.count * record.memory_mib / 1024
    if record.busy_seconds is not None and record.activity_seconds:
        busy = min(1.0, record.busy_seconds / record.activity_seconds)
        row["busy_gpu_hours"] += gpu_hours * busy
        row["idle_gpu_hours"] += gpu_hours * (1 - busy)
    else:
        row["unmetered_gpu_hours"] += gpu_hours
    if record.burst_gpu_seconds:
        lived = max(record.end(record.last_seen) - record.granted_at, 1e-9) / 3600.0
        row["burst_gpu_hours"] += record.burst_gpu_seconds / 3600.0 * min(1.0, hours / lived)
    cost = prices.cost(record, hours)
    if cost is None:
        row["unpriced_gpu_hours"] += gpu_hours
    else:
        row["cost"] += cost


#: a text cell starting with one of these is a formula to a spreadsheet (OWASP: CSV injection)
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def _text(value: str) -> str:
    """A name as a CSV cell no spreadsheet runs: one that starts like a formula gets a leading ``'``."""
    return "'" + value if value.startswith(FORMULA_STARTS) else value


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return f"{value:.6f}".rstrip("0").rstrip(".") if math.isfinite(value) else ""
    if isinstance(value, str):
        return _text(value)
    return value


def _append_text_cells(sheet: Any, values: Sequence[Any]) -> None:
    """Append a row to an openpyxl sheet; strings stay text cells (openpyxl makes '=...' a formula)."""
    sheet.append(values)
    for cell, value in zip(sheet[sheet.max_row], values, strict=False):
        if isinstance(value, str):
            cell.value = value
            cell.data_type = "s"


def report_csv(report: Report) -> str:
    """The report's rows as CSV (group columns, then :data:`METRICS`; cost in the report's currency)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([*report.by, *METRICS[:-2], f"cost_{report.currency}", METRICS[-1]])
    for row in report.rows:
        writer.writerow([_cell(row[k]) for k in (*report.by, *METRICS)])
    return out.getvalue()


def report_xlsx(report: Report) -> bytes:
    """The report as an Excel workbook (openpyxl): a 'usage' sheet (the CSV's columns, numbers as
    numbers, a total row) and a 'period' sheet (from, to, groups, currency)."""
    from openpyxl import Workbook

    book = Workbook()
    sheet = book.active
    sheet.title = "usage"
    _append_text_cells(sheet, [*report.by, *METRICS[:-2], f"cost_{report.currency}", METRICS[-1]])
    for row in report.rows:
        _append_text_cells(sheet, [row[k] for k in (*report.by, *METRICS)])
    if report.by:  # (without groups the one row is the total)
        sheet.append(["total", *[""] * (len(report.by) - 1), *(report.totals[m] for m in METRICS)])
    info = book.create_sheet("period")
    for key, value in (
        ("from", iso(report.start)),
        ("to", iso(report.end)),
        ("by", ",".join(report.by)),
        ("currency", report.currency),
    ):
        _append_text_cells(info, [key, value])
    out = io.BytesIO()
    book.save(out)
    return out.getvalue()


RECORD_COLUMNS = tuple(UsageRecord.__dataclass_fields__)


def records_csv(records: Iterable[UsageRecord]) -> str:
    """Raw records as CSV (one row per record, times as unix seconds and ISO UTC)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([*RECORD_COLUMNS, "granted", "released"])
    for r in records:
        d = r.to_dict()
        writer.writerow(
            [("" if d[k] is None else _text(d[k]) if isinstance(d[k], str) else d[k]) for k in RECORD_COLUMNS]
            + [iso(r.granted_at), iso(r.released_at) if r.released_at is not None else ""]
        )
    return out.getvalue()
