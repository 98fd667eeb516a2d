"""The usage store on a real PostgreSQL server (as a hub with an external database uses it):
migrations from empty and from the previous schema, the 'user' column (a reserved word there),
batched events and reconciliation. Skipped where PostgreSQL or the psycopg driver is missing."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import text

from hubext.metering.record import UNRECORDED
from hubext.metering.recorder import UsageRecorder
from hubext.metering.store import UsageStore, head_revision

from .test_store import record

pytest.importorskip("psycopg", reason="the psycopg driver is not installed")


def test_the_store_migrates_and_records_on_postgresql(postgres):
    postgres_url, _ = postgres
    store = UsageStore(postgres_url)
    assert store.revision() is None
    store.upgrade("0001")
    with store.engine.begin() as db:  # a row of the previous schema
        db.execute(
            text(
                'INSERT INTO elastic_gpu_usage (id, "user", namespace, workspace, kind, priority_class, node, '
                "gpu_uuids, gpu_model, gpu_memory_mib, count, memory_mib, cores_percent, whole, borrowed, granted_at, "
                "released_at, release_cause, release_why, last_seen) VALUES ('old', 'carol', 'default', 'nlp', "
                "'kernel', '', 'n1', 'GPU-1', 'A100-40GB', 40960, 1, 10240, 50, false, false, 1795600000.125, "
                "1795603600.5, 'stopped', 'kernel shut down', 1795603600.5)"
            )
        )
    store.upgrade()
    assert store.revision() == head_revision()
    store.apply(
        [
            {"event": "granted", "record": record("a", granted_at=1795600000.25)},
            {"event": "granted", "record": record("b", granted_at=1795600001.0)},
            {"event": "reconcile", "at": 1795600100.0, "live": [record("a", granted_at=1795600000.25)]},
            {"event": "released", "id": "a", "at": 1795600200.75, "cause": "culled", "why": "idle"},
        ]
    )
    by_id = {r.id: r for r in store.records()}
    assert by_id["old"].granted_at == 1795600000.125  # double precision: unix times keep their fraction
    assert by_id["old"].busy_seconds is None
    assert (by_id["a"].released_at, by_id["a"].release_cause) == (1795600200.75, "culled")
    assert (by_id["b"].released_at, by_id["b"].release_cause) == (1795600001.0, UNRECORDED)
    assert [r.id for r in store.records(users=["carol"])] == ["old"]
    store.close()


def test_a_postgresql_outage_loses_no_event(postgres, tmp_path):
    postgres_url, server = postgres
    store = UsageStore(postgres_url)
    recorder = UsageRecorder(store, tmp_path / "usage.spool", retry_interval=0.2)
    recorder.start()
    try:
        server("stop")  # the database goes away
        recorder.submit({"event": "granted", "record": record("outage", granted_at=1795700000.0)})
        recorder.submit({"event": "released", "id": "outage", "at": 1795700600.0, "cause": "stopped"})
        assert recorder.flush()
        assert recorder.spool_pending and recorder.last_error
        server("start")  # back: the writer replays the spool on its next try
        assert recorder.flush()
        deadline = time.monotonic() + 30
        while recorder.spool_pending and time.monotonic() < deadline:
            time.sleep(0.05)
        (r,) = [r for r in store.records() if r.id == "outage"]
        assert (r.granted_at, r.released_at) == (1795700000.0, 1795700600.0)
        assert recorder.last_error is None
    finally:
        recorder.stop()
        store.close()
