"""The recorder: submit never waits (a locked database, a full queue), a database outage loses no
event (spooled, replayed in order, also by the next process)."""

from __future__ import annotations

import json
import sqlite3
import time

from hubext.metering.recorder import UsageRecorder
from hubext.metering.store import UsageStore

from .test_store import record


def granted(rid: str, at: float = 1000.0) -> dict:
    return {"event": "granted", "record": record(rid, granted_at=at)}


def released(rid: str, at: float) -> dict:
    return {"event": "released", "id": rid, "at": at, "cause": "stopped", "why": "server stopped"}


def poll(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return bool(predicate())


def test_submit_never_waits_while_the_writer_is_stuck_on_a_locked_database(tmp_path):
    path = tmp_path / "hub.sqlite"
    store = UsageStore(f"sqlite:///{path}")
    store.upgrade()
    recorder = UsageRecorder(store, tmp_path / "spool", queue_size=5, batch_size=1)
    recorder.start()
    lock = sqlite3.connect(path, isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")  # another writer holds the database (the writer waits up to 30 s)
    try:
        assert recorder.submit(granted("stuck"))
        assert poll(lambda: recorder.queue.qsize() == 0), "the writer took the first event"
        started = time.monotonic()
        accepted = [recorder.submit(granted(f"g{i}")) for i in range(8)]
        waited = time.monotonic() - started
        # every call returned while the writer is still stuck on the lock (nothing written yet),
        # far sooner than the 30 s a call waiting for the lock (or for room) would take:
        # the queue holds 5, the rest are refused at once and counted
        assert recorder.written == 0
        assert waited < 10, f"submit waited {waited:.1f} s"
        assert accepted == [True] * 5 + [False] * 3
        assert recorder.dropped == 3
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    assert recorder.flush()
    assert sorted(r.id for r in store.records()) == sorted(["stuck", "g0", "g1", "g2", "g3", "g4"])
    recorder.stop()


def test_events_written_during_an_outage_are_spooled_then_replayed_in_order(tmp_path):
    db_dir = tmp_path / "db"  # does not exist yet: SQLite cannot open the database (an outage)
    store = UsageStore(f"sqlite:///{db_dir / 'hub.sqlite'}")
    spool = tmp_path / "usage.spool"
    recorder = UsageRecorder(store, spool, retry_interval=0.05)
    recorder.start()
    recorder.submit(granted("a", 1000.0))
    recorder.submit(released("a", 2000.0))
    assert recorder.flush()
    assert recorder.last_error and "unable to open database" in recorder.last_error
    lines = [json.loads(line) for line in spool.read_text().splitlines()]
    assert [e["event"] for e in lines] == ["granted", "released"]
    recorder.submit(granted("b", 3000.0))  # still down: after the spooled ones
    assert recorder.flush()
    db_dir.mkdir()  # the database is back
    assert poll(lambda: not recorder.spool_pending)
    recorder.submit(released("b", 4000.0))
    assert recorder.flush()
    by_id = {r.id: r for r in store.records()}
    assert (by_id["a"].released_at, by_id["b"].released_at) == (2000.0, 4000.0)
    assert recorder.last_error is None and recorder.spooled == 3
    recorder.stop()


def test_a_spool_left_by_a_killed_hub_is_replayed_by_the_next_one(tmp_path):
    db_dir = tmp_path / "db"
    store = UsageStore(f"sqlite:///{db_dir / 'hub.sqlite'}")
    spool = tmp_path / "usage.spool"
    first = UsageRecorder(store, spool, retry_interval=3600)
    first.start()
    first.submit(granted("a"))
    first.submit(released("a", 1500.0))
    assert first.flush()
    assert first.spool_pending
    with open(spool, "a") as f:
        f.write('{"event": "granted", "rec')  # the process died in the middle of a line
    db_dir.mkdir()
    second = UsageRecorder(UsageStore(store.db_url), spool)
    second.start()
    assert second.flush()
    assert not second.spool_pending
    (a,) = second.store.records()
    assert a.released_at == 1500.0
    second.stop()


def test_an_event_after_an_outage_is_written_after_the_spooled_ones(tmp_path):
    db_dir = tmp_path / "db"
    store = UsageStore(f"sqlite:///{db_dir / 'hub.sqlite'}")
    recorder = UsageRecorder(store, tmp_path / "usage.spool", retry_interval=3600)  # no timed retry here
    recorder.start()
    recorder.submit(granted("c", 1000.0))
    assert recorder.flush() and recorder.spool_pending
    db_dir.mkdir()
    recorder.submit(released("c", 2000.0))  # the database is back: the release must follow its grant
    assert recorder.flush()
    (c,) = store.records()
    assert c.released_at == 2000.0 and not recorder.spool_pending
    recorder.stop()
