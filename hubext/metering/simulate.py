"""``elastic-gpu simulate``'s inputs: scenarios written on the command line, and sessions from a
CSV file (pure). The replay itself is :mod:`.replay`.

A scenario is ``[name:] key=value ...`` with any of

- ``slice=1/4``: slices of that size (a session gets the smallest multiple that holds it);
- ``profiles=1/8,1/4,1/2,1``: the sizes offered (a profile mix);
- ``idle_timeout=600`` (seconds, or ``none``): the culler releases a slice idle that long;
- ``placement=spread`` or ``placement=binpack/spread`` (nodes/cards): binpack, spread or fgd;
- ``gpus=12`` (or ``auto``): a fixed pool size, whose waits are the answer, or the smallest pool;
- ``per_node=8``: GPUs per node.

A CSV of sessions has a header with ``start`` (ISO 8601 or unix seconds), ``end`` or
``duration_seconds``, ``size`` (a share of one card: ``1/4``, ``0.25``, ``25%``, or memory such
as ``20GiB``), and optionally ``count`` (GPUs, default 1), ``user``, ``id`` and ``bursts``
(``offset:length`` pairs in seconds from the start, separated by ``;``: when it used the GPU).
The raw records of ``elastic-gpu usage --records`` are read too (a header with ``granted_at``).
"""

from __future__ import annotations

import csv
import io
import math
import os
import stat
import typing
from dataclasses import fields, replace

from quotas import Placement
from quotas.messages import mib
from quotas.policy import STRATEGIES

from .capacity import parse_slice
from .record import UsageRecord
from .replay import Scenario, Session, parse_periods, slice_profiles
from .report import FORMULA_STARTS, ReportError, parse_time

SCENARIO_KEYS = ("slice", "profiles", "idle_timeout", "placement", "gpus", "per_node")
#: the most GPUs one session may ask for (a replay of more would take hours, not seconds)
MAX_SESSION_GPUS = 64
#: the largest CSV of sessions read (bytes): a year of a busy hub's sessions is far below
MAX_SESSIONS_BYTES = 256 << 20


def _placement(value: str, where: str) -> Placement:
    node, _, gpu = value.partition("/")
    gpu = gpu or node
    for part in (node, gpu):
        if part not in STRATEGIES:
            raise ReportError(
                f"{where}: placement {value!r} is not one of {', '.join(STRATEGIES)} "
                "(or node/gpu, e.g. binpack/spread)."
            )
    return Placement(node=node, gpu=gpu)  # type: ignore[arg-type]


def _positive_int(value: str, key: str, where: str, most: int | None = None) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1 or (most is not None and n > most):
        bound = f"from 1 to {most}" if most is not None else "of at least 1"
        raise ReportError(f"{where}: {key} must be a whole number {bound}; got {value[:40]!r}.")
    return n


def read_sessions_file(path: str) -> str:
    """The text of a CSV of sessions: a regular file of at most :data:`MAX_SESSIONS_BYTES`, UTF-8."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise ReportError(f"the sessions CSV {path} is not a regular file; give the path of a CSV file.")
        if info.st_size > MAX_SESSIONS_BYTES:
            raise ReportError(
                f"the sessions CSV {path} has {mib(info.st_size >> 20)}; at most {mib(MAX_SESSIONS_BYTES >> 20)} "
                "are read: replay a shorter period."
            )
        with open(path, "rb") as f:  # (a regular file opens without blocking; it may grow meanwhile)
            data = f.read(MAX_SESSIONS_BYTES + 1)
    except OSError as e:
        raise ReportError(f"cannot read the sessions CSV {path}: {e.strerror}.") from None
    if len(data) > MAX_SESSIONS_BYTES:
        raise ReportError(f"the sessions CSV {path} grew past {mib(MAX_SESSIONS_BYTES >> 20)} while it was read.")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ReportError(f"the sessions CSV {path} is not UTF-8 text (line {line}, byte {e.start}).") from None


def _csv_rows(text: str) -> list[dict[str, str]]:
    reader = csv.DictReader(io.StringIO(text))
    try:
        return list(reader)
    except csv.Error as e:  # e.g. a cell over the csv module's field limit (128 KiB)
        raise ReportError(f"sessions CSV line {reader.line_num + 1}: {e}.") from None  # (the line being read)


def _finite(value: str, where: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise ReportError(f"{where}: {value[:40]!r} is not a finite number.")
    return number


def _size(value: str, where: str, card_memory_mib: int) -> float:
    try:
        return parse_slice(value, card_memory_mib)
    except ReportError as e:
        raise ReportError(f"{where}: {e.message}") from None


def apply_setting(scenario: Scenario, key: str, value: str, where: str, card_memory_mib: int = 0) -> Scenario:
    """``scenario`` with one ``key=value`` of the module docstring (ReportError naming it otherwise);
    ``card_memory_mib`` reads sizes given as memory (20GiB)."""
    value = value.strip()
    if key == "slice":
        return replace(scenario, profiles=slice_profiles(_size(value, where, card_memory_mib)))
    if key == "profiles":
        sizes = tuple(sorted({_size(v, where, card_memory_mib) for v in value.split(",") if v.strip()}))
        if not sizes:
            raise ReportError(f"{where}: profiles needs at least one size, e.g. profiles=1/4,1/2,1.")
        return replace(scenario, profiles=sizes)
    if key == "idle_timeout":
        if value.lower() in ("none", "off", ""):
            return replace(scenario, idle_timeout_seconds=None)
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ReportError(f"{where}: idle_timeout must be seconds (0 or more) or none; got {value!r}.")
        return replace(scenario, idle_timeout_seconds=seconds)
    if key == "placement":
        return replace(scenario, placement=_placement(value, where))
    if key == "gpus":
        return replace(scenario, gpus=None if value.lower() == "auto" else _positive_int(value, key, where))
    if key == "per_node":
        return replace(scenario, gpus_per_node=_positive_int(value, key, where))
    raise ReportError(f"{where}: unknown setting {key!r}; the settings are {', '.join(SCENARIO_KEYS)}.")


def parse_scenario(text: str, base: Scenario, number: int, card_memory_mib: int = 0) -> Scenario:
    """``[name:] key=value ...`` on top of ``base``."""
    name, sep, settings = text.partition(":")
    if not sep or "=" in name:
        name, settings = f"scenario {number}", text
    name = name.strip() or f"scenario {number}"
    scenario = replace(base, name=name)
    where = f"scenario {name!r}"
    for item in settings.split():
        key, eq, value = item.partition("=")
        if not eq:
            raise ReportError(f"{where}: {item!r} is not key=value; the settings are {', '.join(SCENARIO_KEYS)}.")
        scenario = apply_setting(scenario, key.strip(), value, where, card_memory_mib)
    return scenario


# ---- CSV of sessions ----------------------------------------------------------------------------


def _bursts(text: str, where: str) -> tuple[tuple[float, float], ...]:
    out = []
    for part in text.split(";"):
        if not part.strip():
            continue
        offset, sep, length = part.partition(":")
        try:
            pair = (float(offset), float(length))
        except ValueError:
            pair = (-1.0, -1.0)
        if not sep or not (0 <= pair[0] < math.inf and 0 < pair[1] < math.inf):
            raise ReportError(f"{where}: bursts must be offset:length pairs in seconds separated by ';'; got {part!r}.")
        out.append(pair)
    return tuple(out)


def sessions_from_csv(text: str, card_memory_mib: int) -> list[Session]:
    """The sessions of a CSV (module docstring); ReportError naming the row and column."""
    rows = _csv_rows(text)
    header = set(rows[0]) if rows else set()
    if "granted_at" in header:
        from .replay import sessions_from_records

        records = records_from_csv(rows)
        start = min(r.granted_at for r in records)
        end = max(r.end(r.last_seen) for r in records)
        return sessions_from_records(records, start, end + 1e-6, now=end)
    missing = [c for c in ("start", "size") if c not in header] + (
        [] if header & {"end", "duration_seconds"} else ["end or duration_seconds"]
    )
    if not rows or missing:
        raise ReportError(
            "the sessions CSV needs a header with start, end or duration_seconds, and size "
            f"(optional: count, user, id, bursts){'; missing: ' + ', '.join(missing) if rows else ''}."
        )
    sessions = []
    for n, row in enumerate(rows, 2):
        where = f"sessions CSV line {n}"
        start = parse_time(row["start"], f"{where}, start")
        if row.get("duration_seconds"):
            duration = _finite(row["duration_seconds"], f"{where}, duration_seconds")
        else:
            duration = parse_time(row.get("end") or "", f"{where}, end") - start
        if not duration > 0:
            raise ReportError(f"{where}: the session must end after it starts (a duration above 0 seconds).")
        parse_time(start + duration, f"{where}, its end")
        try:
            share = parse_slice(row["size"], card_memory_mib)
        except ReportError as e:
            raise ReportError(f"{where}, size: {e.message}") from None
        count = _positive_int(row.get("count") or "1", "count", where, MAX_SESSION_GPUS)
        bursts = _bursts(row["bursts"], where) if row.get("bursts") else None  # empty: not known
        sessions.append(
            Session(row.get("id") or f"line-{n}", start, duration, share, count, bursts, row.get("user", ""))
        )
    return sessions


def records_from_csv(rows: list[dict[str, str]]) -> list[UsageRecord]:
    """Records from the rows of ``elastic-gpu usage --records`` (their columns are the record's fields)."""
    hints = typing.get_type_hints(UsageRecord)
    records = []
    for n, row in enumerate(rows, 2):
        data: dict[str, typing.Any] = {}
        for f in fields(UsageRecord):
            raw = row.get(f.name)
            if raw is None or raw == "":
                continue  # the field's default (None for the optional ones)
            kind = hints[f.name]
            where = f"records CSV line {n}, {f.name}"
            if kind is bool:
                data[f.name] = raw in ("True", "true", "1")
            elif kind is int or kind == int | None:
                data[f.name] = int(_finite(raw, where))
            elif kind is float or kind == float | None:
                data[f.name] = _finite(raw, where)
            else:  # a name exported with a leading ' (report._text) reads back as it was
                data[f.name] = raw[1:] if raw[:1] == "'" and raw[1:2] in FORMULA_STARTS else raw
        where = f"records CSV line {n}"
        if "count" in data and not 1 <= data["count"] <= MAX_SESSION_GPUS:
            raise ReportError(f"{where}, count: a record holds 1 to {MAX_SESSION_GPUS} GPUs; got {row['count']!r}.")
        for name in ("granted_at", "released_at", "last_seen"):
            if data.get(name) is not None:
                parse_time(data[name], f"{where}, {name}")
        if data.get("busy_periods"):
            try:
                parse_periods(data["busy_periods"])
            except ValueError:
                raise ReportError(f"{where}, busy_periods: {row['busy_periods'][:40]!r} is not start-end,...") from None
        try:
            records.append(UsageRecord(**data))
        except TypeError:
            raise ReportError(
                f"records CSV line {n}: a record needs every column of `elastic-gpu usage --records`."
            ) from None
    if not records:
        raise ReportError("the records CSV has no records.")
    return records
