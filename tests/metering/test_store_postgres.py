"""The usage store on a real PostgreSQL server (as a hub with an external database uses it):
migrations from empty and from the previous schema, the 'user' column (a reserved word there),
batched events and reconciliation. Skipped where PostgreSQL or the psycopg driver is missing."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile

import pytest
from sqlalchemy import text

from hubext.metering.record import UNRECORDED
from hubext.metering.store import UsageStore

from .test_store import record

psycopg = pytest.importorskip("psycopg", reason="the psycopg driver is not installed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def postgres_url():
    initdb, pg_ctl = shutil.which("initdb"), shutil.which("pg_ctl")
    if not initdb or not pg_ctl:
        pytest.skip("PostgreSQL (initdb, pg_ctl) is not installed")
    root = tempfile.mkdtemp(prefix="egpu-pg-")  # not under pytest's 0700 tree: the server's account must reach it
    as_server = []
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root
        shutil.chown(root, "postgres")
        as_server = ["runuser", "-u", "postgres", "--"]
    data, port = os.path.join(root, "data"), _free_port()
    subprocess.run([*as_server, initdb, "-D", data, "-A", "trust", "-U", "egpu"], check=True, capture_output=True)
    options = f"-p {port} -k {root} -c listen_addresses=''"
    subprocess.run([*as_server, pg_ctl, "-D", data, "-o", options, "-w", "-l", f"{root}/log", "start"], check=True)
    try:
        yield f"postgresql+psycopg://egpu@/postgres?host={root}&port={port}"
    finally:
        subprocess.run([*as_server, pg_ctl, "-D", data, "-m", "immediate", "stop"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def test_the_store_migrates_and_records_on_postgresql(postgres_url):
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
    assert store.revision() == "0002"
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
