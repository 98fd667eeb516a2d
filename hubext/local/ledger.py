"""The single-machine ledger (SQLite through SQLAlchemy): allocations, GPU kernels, inventory, events.

One database for everything local mode must remember across a hub restart: which slice each
holder (server or kernel process) has, the broker's kernel records, the last inventory seen
(for ``elastic-gpu status`` while the hub is down) and recent preemptions. Usable without a hub.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from quotas import Allocation, Pool

LEDGER_FILE = "elastic-gpu-ledger.sqlite"

_metadata = sa.MetaData()
ALLOCATIONS = sa.Table(
    "allocations",
    _metadata,
    sa.Column("id", sa.String, primary_key=True),
    sa.Column("data", sa.Text, nullable=False),
    sa.Column("holder", sa.String, nullable=True),
    sa.Column("holder_started", sa.String, nullable=True),
    sa.Column("recorded_at", sa.Float, nullable=False),
    sa.Column("bound_at", sa.Float, nullable=True),
)
INVENTORY = sa.Table(
    "inventory",
    _metadata,
    sa.Column("key", sa.String, primary_key=True),
    sa.Column("data", sa.Text, nullable=False),
    sa.Column("simulated", sa.Boolean, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
)
KERNELS = sa.Table(
    "kernels",
    _metadata,
    sa.Column("id", sa.String, primary_key=True),
    sa.Column("data", sa.Text, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
)
EVENTS = sa.Table(
    "events",
    _metadata,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("at", sa.Float, nullable=False),
    sa.Column("allocation_id", sa.String, nullable=False),
    sa.Column("user", sa.String, nullable=False),
    sa.Column("kind", sa.String, nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
)


class Ledger:
    """The SQLite ledger, usable without a hub (``elastic-gpu status`` when the hub is down)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.exists():  # the hub's account only: it names every user's slices and kernels
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        self.engine = sa.create_engine(f"sqlite:///{self.path}", future=True)
        _metadata.create_all(self.engine)

    def rows(self) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            result = conn.execute(sa.select(ALLOCATIONS).order_by(ALLOCATIONS.c.recorded_at))
            return [dict(r._mapping) for r in result]

    def allocations(self) -> list[Allocation]:
        return [Allocation.from_dict(json.loads(r["data"])) for r in self.rows()]

    def holders(self) -> dict[str, str | None]:
        return {r["id"]: r["holder"] for r in self.rows()}

    def insert(self, allocation: Allocation) -> None:
        with self.engine.begin() as conn:
            conn.execute(sa.delete(ALLOCATIONS).where(ALLOCATIONS.c.id == allocation.id))
            conn.execute(
                sa.insert(ALLOCATIONS).values(
                    id=allocation.id,
                    data=json.dumps(allocation.to_dict()),
                    holder=None,
                    recorded_at=time.time(),
                )
            )

    def set_holder(self, allocation_id: str, holder: str, started: str | None) -> bool:
        with self.engine.begin() as conn:
            result = conn.execute(
                sa.update(ALLOCATIONS)
                .where(ALLOCATIONS.c.id == allocation_id)
                .values(holder=holder, holder_started=started, bound_at=time.time())
            )
            return result.rowcount > 0

    def delete(self, allocation_id: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(sa.delete(ALLOCATIONS).where(ALLOCATIONS.c.id == allocation_id))

    def save_inventory(self, pool: Pool, simulated: bool) -> None:
        with self.engine.begin() as conn:
            conn.execute(sa.delete(INVENTORY).where(INVENTORY.c.key == "pool"))
            conn.execute(
                sa.insert(INVENTORY).values(
                    key="pool", data=json.dumps(pool.to_dict()["nodes"]), simulated=simulated, updated_at=time.time()
                )
            )

    def inventory(self) -> tuple[list[dict[str, Any]], bool] | None:
        """The last inventory a hub saw (nodes as dicts, simulated), or None if never recorded."""
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(INVENTORY).where(INVENTORY.c.key == "pool")).first()
        if row is None:
            return None
        return json.loads(row.data), bool(row.simulated)

    def add_event(self, allocation: Allocation, kind: str, reason: str) -> None:
        self.add_event_for(allocation.id, allocation.owner.user, kind, reason)

    def add_event_for(self, allocation_id: str, user: str, kind: str, reason: str) -> None:
        """An event by id and user ('' allocation id: about a process of no slice, ``user`` its account)."""
        with self.engine.begin() as conn:
            row = {"at": time.time(), "allocation_id": allocation_id, "user": user, "kind": kind, "reason": reason}
            conn.execute(sa.insert(EVENTS).values(**row))

    def events(self, limit: int = 20) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            result = conn.execute(sa.select(EVENTS).order_by(EVENTS.c.seq.desc()).limit(limit))
            return [{k: v for k, v in dict(r._mapping).items() if k != "seq"} for r in result]

    # ---- GPU kernels (the broker's records; the allocations above hold their slices) ---------

    def save_kernels(self, records: list[dict[str, Any]]) -> None:
        """Replace the kernel records with ``records`` (one transaction)."""
        now = time.time()
        with self.engine.begin() as conn:
            conn.execute(sa.delete(KERNELS))
            if records:
                conn.execute(
                    sa.insert(KERNELS),
                    [{"id": r["id"], "data": json.dumps(r, sort_keys=True), "updated_at": now} for r in records],
                )

    def kernels(self) -> list[dict[str, Any]]:
        """The kernel records, oldest first; a damaged row is skipped."""
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(KERNELS).order_by(KERNELS.c.updated_at, KERNELS.c.id)).all()
        out = []
        for row in rows:
            try:
                data = json.loads(row.data)
            except ValueError:
                continue
            if isinstance(data, dict):
                out.append(data)
        return out

    def close(self) -> None:
        self.engine.dispose()
