"""The usage store: alembic migrations on SQLite (empty DB, previous schema, beside the hub's own
tables), idempotent events, reconciliation after a crash, records that survive a reopen."""

from __future__ import annotations

import sqlite3

import pytest
from sqlalchemy import inspect

from hubext.metering.record import UNRECORDED, UsageRecord, swapped_periods
from hubext.metering.schema import VERSION_TABLE
from hubext.metering.store import UsageStore, head_revision

#: columns revision 0006 added (an elastic slice's limits and burst)
NEWER_0006 = ("memory_limit_mib", "cores_limit_percent", "burst_gpu_seconds")


def record(rid: str, user: str = "alice", granted_at: float = 1000.0, **kw) -> dict:
    data = dict(
        id=rid,
        user=user,
        namespace="default",
        workspace="vision",
        kind="notebook",
        priority_class="normal",
        node="n1",
        gpu_uuids="GPU-0",
        gpu_model="H100-80GB",
        gpu_memory_mib=81920,
        count=1,
        memory_mib=20480,
        cores_percent=25,
        whole=False,
        borrowed=False,
        granted_at=granted_at,
        last_seen=granted_at,
    )
    data.update(kw)
    return UsageRecord(**data).to_dict()


def test_an_empty_database_is_migrated_to_head(tmp_path):
    store = UsageStore(f"sqlite:///{tmp_path / 'hub.sqlite'}")
    assert store.revision() is None
    store.upgrade()
    assert store.revision() == head_revision() == "0006"
    columns = {c["name"] for c in inspect(store.engine).get_columns("elastic_gpu_usage")}
    assert {
        "busy_seconds",
        "memory_used_peak_mib",
        "release_cause",
        "last_seen",
        "hub_groups",
        "busy_periods",
        "resumes",
    } <= columns


def test_records_of_the_previous_schema_survive_the_upgrade(tmp_path):
    path = tmp_path / "hub.sqlite"
    store = UsageStore(f"sqlite:///{path}")
    store.upgrade("0001")
    assert store.revision() == "0001"
    with sqlite3.connect(path) as db:  # a row written by the 0001 code, without activity columns
        db.execute(
            "INSERT INTO elastic_gpu_usage (id, user, namespace, workspace, kind, priority_class, node, gpu_uuids,"
            " gpu_model, gpu_memory_mib, count, memory_mib, cores_percent, whole, borrowed, granted_at, released_at,"
            " release_cause, release_why, last_seen) VALUES ('old', 'carol', 'default', 'nlp', 'kernel', '', 'n1',"
            " 'GPU-1', 'A100-40GB', 40960, 1, 10240, 50, 0, 0, 100.0, 3700.0, 'stopped', 'kernel shut down', 3700.0)"
        )
    store.upgrade()
    assert store.revision() == head_revision()
    (old,) = store.records()
    assert (old.user, old.gpu_model, old.granted_at, old.released_at) == ("carol", "A100-40GB", 100.0, 3700.0)
    assert old.busy_seconds is None and old.activity_samples == 0
    assert old.hub_groups == "" and old.busy_periods is None


def test_records_of_the_0002_schema_survive_the_upgrade_and_old_spooled_events_still_apply(tmp_path):
    """0002 -> head (0003: hub groups, busy periods; 0004: resumes): a row and a spool written by the 0002 code."""
    path = tmp_path / "hub.sqlite"
    store = UsageStore(f"sqlite:///{path}")
    store.upgrade("0002")
    with sqlite3.connect(path) as db:
        db.execute(
            "INSERT INTO elastic_gpu_usage (id, user, namespace, workspace, kind, priority_class, node, gpu_uuids,"
            " gpu_model, gpu_memory_mib, count, memory_mib, cores_percent, whole, borrowed, granted_at, released_at,"
            " release_cause, release_why, last_seen, busy_seconds, activity_seconds, memory_used_peak_mib,"
            " memory_used_mean_mib, activity_samples) VALUES ('old', 'carol', 'default', 'nlp', 'kernel', '', 'n1',"
            " 'GPU-1', 'A100-40GB', 40960, 1, 10240, 50, 0, 0, 100.0, 3700.0, 'stopped', 'done', 3700.0,"
            " 60.0, 3600.0, 900, 500.0, 120)"
        )
    store.upgrade()
    assert store.revision() == head_revision()
    old_grant = record("spooled")
    del old_grant["hub_groups"], old_grant["busy_periods"]  # an event the 0002 hub spooled
    old_activity = {"event": "activity", "id": "spooled", "busy_seconds": 5.0, "activity_seconds": 30.0}
    old_activity |= {"memory_used_peak_mib": 10, "memory_used_mean_mib": 10.0, "activity_samples": 1}
    store.apply([{"event": "granted", "record": old_grant}, old_activity])
    by_id = {r.id: r for r in store.records()}
    assert (by_id["old"].busy_seconds, by_id["old"].hub_groups, by_id["old"].busy_periods) == (60.0, "", None)
    assert (by_id["spooled"].busy_seconds, by_id["spooled"].hub_groups) == (5.0, "")


def test_the_store_lives_beside_jupyterhubs_tables_without_touching_its_revision(tmp_path):
    from jupyterhub import orm

    url = f"sqlite:///{tmp_path / 'jupyterhub.sqlite'}"
    orm.new_session_factory(url)  # the hub creates and stamps its own tables
    hub_revision = sqlite3.connect(tmp_path / "jupyterhub.sqlite").execute("SELECT * FROM alembic_version").fetchall()
    store = UsageStore(url)
    store.upgrade()
    names = set(inspect(store.engine).get_table_names())
    assert {"users", "alembic_version", VERSION_TABLE, "elastic_gpu_usage"} <= names
    with sqlite3.connect(tmp_path / "jupyterhub.sqlite") as db:
        assert db.execute("SELECT * FROM alembic_version").fetchall() == hub_revision
    orm.new_session_factory(url)  # the hub still starts on it (its revision check passes)


def test_events_are_idempotent_and_the_first_release_wins(tmp_path):
    store = UsageStore(f"sqlite:///{tmp_path / 'u.sqlite'}")
    store.upgrade()
    batch = [
        {"event": "granted", "record": record("a")},
        {"event": "released", "id": "a", "at": 4600.0, "cause": "culled", "why": "idle 1 h"},
    ]
    store.apply(batch)
    store.apply(batch)  # a replayed batch changes nothing
    store.apply([{"event": "released", "id": "a", "at": 9999.0, "cause": "stopped", "why": "late"}])
    (a,) = store.records()
    assert (a.released_at, a.release_cause, a.release_why) == (4600.0, "culled", "idle 1 h")


def test_reconcile_inserts_missing_slices_and_closes_vanished_ones_when_last_seen(tmp_path):
    url = f"sqlite:///{tmp_path / 'u.sqlite'}"
    store = UsageStore(url)
    store.upgrade()
    store.apply([{"event": "granted", "record": record("gone")}, {"event": "granted", "record": record("kept")}])
    store.apply([{"event": "reconcile", "at": 2000.0, "live": [record("gone"), record("kept")]}])
    store.close()
    # the hub was killed; after restart the ledger holds 'kept' and a slice the store never heard of
    store = UsageStore(url)
    store.apply([{"event": "reconcile", "at": 5000.0, "live": [record("kept"), record("new", granted_at=4000.0)]}])
    by_id = {r.id: r for r in store.records()}
    assert (by_id["gone"].released_at, by_id["gone"].release_cause) == (2000.0, UNRECORDED)
    assert by_id["kept"].released_at is None and by_id["kept"].last_seen == 5000.0
    assert by_id["new"].granted_at == 4000.0 and by_id["new"].released_at is None


def test_records_are_selected_by_overlap_with_the_period_and_by_user(tmp_path):
    store = UsageStore(f"sqlite:///{tmp_path / 'u.sqlite'}")
    store.upgrade()
    store.apply(
        [
            {"event": "granted", "record": record("early", granted_at=0.0)},
            {"event": "released", "id": "early", "at": 50.0, "cause": "stopped"},
            {"event": "granted", "record": record("inside", user="bob", granted_at=120.0)},
            {"event": "granted", "record": record("open", granted_at=10.0)},
        ]
    )
    assert [r.id for r in store.records(100.0, 200.0)] == ["open", "inside"]
    assert [r.id for r in store.records(100.0, 200.0, users=["bob"])] == ["inside"]
    assert [r.id for r in store.records(0.0, 5.0)] == ["early"]


def test_an_unknown_event_is_refused_and_nothing_of_its_batch_is_written(tmp_path):
    store = UsageStore(f"sqlite:///{tmp_path / 'u.sqlite'}")
    store.upgrade()
    with pytest.raises(ValueError, match="unknown usage event 'bogus'"):
        store.apply([{"event": "granted", "record": record("a")}, {"event": "bogus"}])
    assert store.records() == []


def test_a_batch_gives_the_same_records_as_its_events_one_by_one(tmp_path):
    activity = {
        "event": "activity",
        "id": "a",
        "busy_seconds": 30.0,
        "activity_seconds": 60.0,
        "memory_used_peak_mib": 900,
        "memory_used_mean_mib": 500.0,
        "activity_samples": 2,
    }
    events = [
        {"event": "granted", "record": record("a", granted_at=100.0)},
        {"event": "granted", "record": record("b", granted_at=110.0)},
        {"event": "released", "id": "b", "at": 150.0, "cause": "stopped"},
        {"event": "reconcile", "at": 160.0, "live": [record("a", granted_at=100.0)]},
        activity,
        {"event": "granted", "record": record("c", granted_at=170.0)},  # after the reconciliation: stays open
        {"event": "released", "id": "a", "at": 200.0, "cause": "culled"},
        {"event": "released", "id": "a", "at": 300.0, "cause": "stopped"},
    ]
    one_by_one = UsageStore(f"sqlite:///{tmp_path / 'one.sqlite'}")
    batched = UsageStore(f"sqlite:///{tmp_path / 'batch.sqlite'}")
    for store in (one_by_one, batched):
        store.upgrade()
    for event in events:
        one_by_one.apply([event])
    batched.apply(events)
    assert batched.records() == one_by_one.records()
    by_id = {r.id: r for r in batched.records()}
    assert (by_id["a"].release_cause, by_id["a"].busy_seconds) == ("culled", 30.0)
    assert by_id["c"].released_at is None and by_id["b"].release_cause == "stopped"


def test_a_swapped_out_kernel_and_its_resume_express_the_swapped_period_from_the_0003_schema(tmp_path):
    """0003 -> 0004: a record of the 0003 code survives; a kernel released as 'swapped' and resumed
    in a new slice gives the period it held no GPU."""
    path = tmp_path / "hub.sqlite"
    store = UsageStore(f"sqlite:///{path}")
    store.upgrade("0003")
    old = {k: v for k, v in record("old").items() if k not in ("resumes", "swap_ended_at", *NEWER_0006)}  # 0003
    with sqlite3.connect(path) as db:
        db.execute(
            f"INSERT INTO elastic_gpu_usage ({', '.join(old)}) VALUES ({', '.join('?' * len(old))})", list(old.values())
        )
    store.upgrade()
    assert store.revision() == head_revision()
    store.apply(
        [
            {"event": "granted", "record": record("k-0", granted_at=1000.0, kind="kernel")},
            {"event": "released", "id": "k-0", "at": 1600.0, "cause": "swapped", "why": "idle 10 min"},
            {"event": "granted", "record": record("k-1", granted_at=4000.0, kind="kernel")},
            {"event": "resumed", "id": "k-1", "resumes": "k-0"},
            {"event": "granted", "record": record("j-0", granted_at=1000.0, kind="kernel")},
            {"event": "released", "id": "j-0", "at": 2000.0, "cause": "swapped"},
        ]
    )
    by_id = {r.id: r for r in store.records()}
    assert by_id["old"].resumes is None and by_id["k-1"].resumes == "k-0"
    periods = {r.id: (start, ended) for r, start, ended in swapped_periods(by_id.values())}
    assert periods == {"k-0": (1600.0, 4000.0), "j-0": (2000.0, None)}  # j-0: still swapped out


def test_a_kernel_stopped_while_swapped_out_ends_its_swapped_period_and_later_periods_still_see_it(tmp_path):
    """A swapped-out kernel that is culled or shut down before it resumes has no resume to end its
    swapped period: the 'swap_ended' event does. A record released (swapped) before a report's
    period whose swapped time reaches into it is still returned for that period."""
    store = UsageStore(f"sqlite:///{tmp_path / 'hub.sqlite'}")
    store.upgrade()
    events = [
        {"event": "granted", "record": record("k-0", granted_at=1000.0, kind="kernel")},
        {"event": "released", "id": "k-0", "at": 1600.0, "cause": "swapped", "why": "idle"},
        {"event": "granted", "record": record("k-1", granted_at=4000.0, kind="kernel")},
        {"event": "resumed", "id": "k-1", "resumes": "k-0"},
        {"event": "granted", "record": record("j-0", granted_at=1000.0, kind="kernel")},
        {"event": "released", "id": "j-0", "at": 2000.0, "cause": "swapped"},
        {"event": "swap_ended", "id": "j-0", "at": 3000.0, "why": "culled: swapped out 1 h"},
        {"event": "swap_ended", "id": "j-0", "at": 3900.0, "why": "a repeat changes nothing"},
        {"event": "granted", "record": record("m-0", granted_at=1000.0, kind="kernel")},
        {"event": "released", "id": "m-0", "at": 2500.0, "cause": "swapped"},
        {"event": "granted", "record": record("old", granted_at=1000.0)},
        {"event": "released", "id": "old", "at": 2000.0, "cause": "stopped"},
    ]
    store.apply(events)
    periods = {r.id: (start, ended) for r, start, ended in swapped_periods(store.records())}
    assert periods == {"k-0": (1600.0, 4000.0), "j-0": (2000.0, 3000.0), "m-0": (2500.0, None)}
    # from 3500 on: k-0 was swapped out until 4000 and m-0 still is; j-0's period and 'old' ended before
    assert sorted(r.id for r in store.records(start=3500.0, end=9000.0)) == ["k-0", "k-1", "m-0"]
    assert sorted(r.id for r in store.records(start=4500.0, end=9000.0)) == ["k-1", "m-0"]


def test_the_0005_migration_ends_the_swapped_periods_of_resumed_kernels(tmp_path):
    path = tmp_path / "hub.sqlite"
    store = UsageStore(f"sqlite:///{path}")
    store.upgrade("0004")
    rows = [
        record("k-0", granted_at=1000.0, kind="kernel", released_at=1600.0, release_cause="swapped"),
        record("k-1", granted_at=4000.0, kind="kernel", resumes="k-0"),
        record("j-0", granted_at=1000.0, kind="kernel", released_at=2000.0, release_cause="swapped"),
    ]
    with sqlite3.connect(path) as db:
        for row in rows:
            for key in ("swap_ended_at", *NEWER_0006):  # a row the 0004 code wrote
                row.pop(key, None)
            db.execute(
                f"INSERT INTO elastic_gpu_usage ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                list(row.values()),
            )
    store.upgrade()
    by_id = {r.id: r for r in store.records()}
    assert (by_id["k-0"].swap_ended_at, by_id["j-0"].swap_ended_at, by_id["k-1"].swap_ended_at) == (4000.0, None, None)


def test_a_release_event_that_follows_a_reconcile_which_missed_the_slice_gives_the_real_cause(tmp_path):
    """The ledger drops a preempted slice a moment before the pool's release event is submitted
    (the pod is deleted in between): a usage sample in that moment reconciles without the slice
    and closes it 'unrecorded'. The release event that follows is the better knowledge (a CI run
    under two CPU hogs billed a preemption as 'unrecorded')."""
    store = UsageStore(f"sqlite:///{tmp_path / 'u.sqlite'}")
    store.upgrade()
    store.apply([{"event": "granted", "record": record("p", granted_at=1000.0)}])
    store.apply([{"event": "reconcile", "at": 1000.5, "live": []}])
    store.apply([{"event": "released", "id": "p", "at": 1000.6, "cause": "preempted", "why": "by a high one"}])
    (p,) = store.records()
    assert (p.released_at, p.release_cause, p.release_why) == (1000.6, "preempted", "by a high one")
    # a release event still never overrides a real one
    store.apply([{"event": "released", "id": "p", "at": 2000.0, "cause": "stopped", "why": "late"}])
    assert store.records()[0].release_cause == "preempted"
