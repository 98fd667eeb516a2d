"""The usage store: usage records in a SQL database through SQLAlchemy, schema by alembic.

It lives in the hub's own database (``JupyterHub.db_url``: SQLite by default, PostgreSQL or
MySQL where the hub uses them), in its own table and its own alembic version table, so it
survives hub restarts and pod deletion as the hub's users do. Every method is synchronous
and blocking: the hub calls it from the recorder's writer thread (:mod:`.recorder`), never
from the event loop.

Writes are *events* (JSON-ready dicts, so the recorder can spool them to a file while the
database is down and replay them later), applied in order, in one transaction per batch, and
idempotent (a replayed batch changes nothing):

- ``{"event": "granted", "record": {...}}``: insert the record unless it exists;
- ``{"event": "released", "id", "at", "cause", "why"}``: close it (first close wins);
- ``{"event": "activity", "id", "busy_seconds", ...}``: absolute activity totals of an open record;
- ``{"event": "resumed", "id", "resumes"}``: this record continues ``resumes`` (a kernel swapped
  out, released with cause ``swapped``, and resumed in this slice): that one's swapped period
  ends at this one's grant;
- ``{"event": "swap_ended", "id", "at", "why"}``: the kernel swapped out of record ``id`` was
  stopped before it resumed: its swapped period ends at ``at`` (the first end wins);
- ``{"event": "reconcile", "at", "live": [record, ...]}``: the allocator's ledger at ``at``:
  insert live allocations the store misses, mark them seen, and close open records that are
  no longer live at the last time they were seen (cause ``unrecorded``).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import alembic.command
from alembic.config import Config as AlembicConfig
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, and_, bindparam, create_engine, insert, or_, select, update
from sqlalchemy.engine import Connection

from .record import SWAPPED, UNRECORDED, UsageRecord
from .schema import VERSION_TABLE, usage

MIGRATIONS = Path(__file__).parent / "migrations"


ACTIVITY_COLUMNS = (
    "busy_seconds",
    "activity_seconds",
    "memory_used_peak_mib",
    "memory_used_mean_mib",
    "activity_samples",
    "busy_periods",
    "burst_gpu_seconds",
)


def _chunks(items: list[Any], size: int) -> Iterable[list[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


_KIND_ORDER = {"granted": 0, "activity": 1, "resumed": 1, "released": 2, "swap_ended": 3}


def _by_kind(events: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Events regrouped by kind between reconciliations (see :meth:`UsageStore.apply`)."""
    out: list[Mapping[str, Any]] = []
    segment: list[Mapping[str, Any]] = []
    for event in events:
        if event["event"] == "reconcile":
            out += sorted(segment, key=lambda e: _KIND_ORDER.get(e["event"], 3))
            out.append(event)
            segment = []
        else:
            segment.append(event)
    return out + sorted(segment, key=lambda e: _KIND_ORDER.get(e["event"], 3))


class StoreError(Exception):
    """The usage store cannot be used as configured; ``message`` says why and what to change."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def make_engine(db_url: str) -> Engine:
    """An engine for ``db_url`` (SQLite: usable from the writer thread, waits 30 s for a lock)."""
    kwargs: dict[str, Any] = {"pool_pre_ping": True, "future": True}
    if db_url.startswith("sqlite"):
        kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
    try:
        return create_engine(db_url, **kwargs)
    except Exception as e:  # bad URL or a missing driver: say which
        raise StoreError(f"UsageMeter.db_url {db_url!r} cannot be used: {e}") from None


def alembic_config(connection: Connection | None = None) -> AlembicConfig:
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    return ScriptDirectory.from_config(alembic_config()).get_current_head() or ""


class UsageStore:
    """Usage records in ``db_url`` (see the module docstring)."""

    def __init__(self, db_url: str) -> None:
        self.db_url = db_url
        self.engine = make_engine(db_url)
        self._lock = threading.Lock()
        self._at_head = False

    def upgrade(self, revision: str = "head") -> None:
        """Create or migrate the store's tables to ``revision`` (alembic, in its own version table)."""
        with self._lock, self.engine.begin() as connection:
            alembic.command.upgrade(alembic_config(connection), revision)

    def ensure_schema(self) -> None:
        """Upgrade to head once per process (the writer and the readers call it before use)."""
        if not self._at_head:
            self.upgrade()
            self._at_head = True

    def revision(self) -> str | None:
        """The store's schema revision in the database (None: never created)."""
        with self.engine.connect() as connection:
            return MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE}).get_current_revision()

    def close(self) -> None:
        self.engine.dispose()

    # ---- writes -------------------------------------------------------------------------------

    def apply(self, events: Iterable[Mapping[str, Any]]) -> None:
        """Apply events in one transaction (all or nothing), written together by kind: between two
        reconciliations, grants, then activity, then releases, each kind in its order (one query
        for the grants, executemany for the rest). That is the order the hub produces them in for
        any one allocation (grant, activity, release), so the result is that of applying them one
        by one; a reconciliation sees everything before it and nothing after."""
        with self.engine.begin() as db:
            for kind, run in itertools.groupby(_by_kind(events), key=lambda e: e["event"]):
                run = list(run)
                if kind == "granted":
                    self._insert(db, [e["record"] for e in run])
                elif kind == "released":
                    # a reconcile that missed the slice closed it 'unrecorded' (a guess: the
                    # ledger drops a slice a moment before its release event is submitted); the
                    # event is the better knowledge. A real release still wins over a later one.
                    db.execute(
                        update(usage)
                        .where(usage.c.id == bindparam("b_id"),
                               or_(usage.c.released_at.is_(None), usage.c.release_cause == UNRECORDED))
                        .values(
                            released_at=bindparam("b_at"),
                            release_cause=bindparam("b_cause"),
                            release_why=bindparam("b_why"),
                            last_seen=bindparam("b_at"),
                        ),
                        [
                            {"b_id": e["id"], "b_at": e["at"], "b_cause": e["cause"], "b_why": e.get("why", "")}
                            for e in run
                        ],
                    )
                elif kind == "activity":
                    db.execute(
                        update(usage)
                        .where(usage.c.id == bindparam("b_id"))
                        .values({c: bindparam(f"b_{c}") for c in ACTIVITY_COLUMNS}),
                        # an event spooled by an older hub lacks the newer columns
                        [{"b_id": e["id"], **{f"b_{c}": e.get(c) for c in ACTIVITY_COLUMNS}} for e in run],
                    )
                elif kind == "resumed":
                    db.execute(
                        update(usage).where(usage.c.id == bindparam("b_id")).values(resumes=bindparam("b_resumes")),
                        [{"b_id": e["id"], "b_resumes": e["resumes"]} for e in run],
                    )
                    resume = usage.alias("resume")
                    granted = select(resume.c.granted_at).where(resume.c.id == bindparam("b_id")).scalar_subquery()
                    db.execute(
                        update(usage)
                        .where(usage.c.id == bindparam("b_resumes"), usage.c.swap_ended_at.is_(None))
                        .values(swap_ended_at=granted),
                        [{"b_id": e["id"], "b_resumes": e["resumes"]} for e in run],
                    )
                elif kind == "swap_ended":
                    db.execute(
                        update(usage)
                        .where(usage.c.id == bindparam("b_id"), usage.c.swap_ended_at.is_(None))
                        .values(swap_ended_at=bindparam("b_at")),
                        [{"b_id": e["id"], "b_at": e["at"]} for e in run],
                    )
                elif kind == "reconcile":
                    for event in run:
                        self._reconcile(db, event["at"], event["live"])
                else:
                    raise ValueError(f"unknown usage event {kind!r}")

    @staticmethod
    def _insert(db: Connection, records: list[Mapping[str, Any]]) -> None:
        """Insert the records whose id is not stored yet (the first of a repeated id wins)."""
        new: dict[str, Mapping[str, Any]] = {}
        for record in records:  # through the dataclass: a record spooled by an older hub gets the new columns' defaults
            if record["id"] not in new:
                new[record["id"]] = UsageRecord.from_dict(record).to_dict()
        for chunk in _chunks(list(new), 500):
            for row in db.execute(select(usage.c.id).where(usage.c.id.in_(chunk))):
                new.pop(row.id, None)
        if new:
            db.execute(insert(usage), list(new.values()))

    def _reconcile(self, db: Connection, at: float, live: list[Mapping[str, Any]]) -> None:
        live_ids = {r["id"] for r in live}
        self._insert(db, list(live))
        open_ids = {row.id for row in db.execute(select(usage.c.id).where(usage.c.released_at.is_(None)))}
        for chunk in _chunks(sorted(live_ids & open_ids), 500):
            db.execute(update(usage).where(usage.c.id.in_(chunk)).values(last_seen=at))
        for chunk in _chunks(sorted(open_ids - live_ids), 500):
            db.execute(
                update(usage)
                .where(usage.c.id.in_(chunk), usage.c.released_at.is_(None))
                .values(
                    released_at=usage.c.last_seen,
                    release_cause=UNRECORDED,
                    release_why="released while the hub was not recording (closed at the last time it was seen held)",
                )
            )

    # ---- reads --------------------------------------------------------------------------------

    def records(
        self, start: float | None = None, end: float | None = None, users: Iterable[str] | None = None
    ) -> list[UsageRecord]:
        """Records that overlap [start, end) (open records overlap everything after their grant),
        and records whose swapped period does (released as swapped before ``start``)."""
        self.ensure_schema()
        query = select(usage)
        conditions = []
        if end is not None:
            conditions.append(usage.c.granted_at < end)
        if start is not None:
            swapped_into = and_(
                usage.c.release_cause == SWAPPED, or_(usage.c.swap_ended_at.is_(None), usage.c.swap_ended_at > start)
            )
            conditions.append(or_(usage.c.released_at.is_(None), usage.c.released_at > start, swapped_into))
        if users is not None:
            conditions.append(usage.c.user.in_(list(users)))
        if conditions:
            query = query.where(and_(*conditions))
        with self.engine.connect() as db:
            rows = db.execute(query.order_by(usage.c.granted_at, usage.c.id)).mappings().all()
        return [UsageRecord.from_dict(dict(row)) for row in rows]

    def open_records(self) -> list[UsageRecord]:
        self.ensure_schema()
        with self.engine.connect() as db:
            rows = db.execute(select(usage).where(usage.c.released_at.is_(None))).mappings().all()
        return [UsageRecord.from_dict(dict(row)) for row in rows]
