"""Watch semantics from "Efficient detection of changes" in the Kubernetes API concepts."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request

import kubernetes
import kubernetes_asyncio
import pytest


async def _collect(stream, until, timeout: float = 5.0) -> list[dict]:
    events = []

    async def run():
        async for ev in stream:
            events.append(ev)
            if until(events):
                return

    await asyncio.wait_for(run(), timeout)
    return events


@pytest.fixture
async def acore(kube_emulator):
    api_client = await kubernetes_asyncio.config.new_client_from_config(
        config_file=kube_emulator.kubeconfig_path)
    async with api_client:
        yield kubernetes_asyncio.client.CoreV1Api(api_client)


def _summary(events) -> list[tuple[str, str, str | None]]:
    return [(e["type"], e["raw_object"]["metadata"].get("name"),
             (e["raw_object"].get("data") or {}).get("v")) for e in events]


async def test_watch_sees_added_modified_deleted_in_order_and_resumes(kube_emulator, acore,
                                                                      kube_namespace):
    ns = kube_namespace
    start = (await acore.list_namespaced_config_map(ns)).metadata.resource_version
    w = kubernetes_asyncio.watch.Watch()
    stream = w.stream(acore.list_namespaced_config_map, ns, resource_version=start,
                      timeout_seconds=10)

    async def writer():
        await acore.create_namespaced_config_map(ns, {"metadata": {"name": "c"},
                                                      "data": {"v": "1"}})
        await acore.patch_namespaced_config_map("c", ns, {"data": {"v": "2"}})
        await acore.delete_namespaced_config_map("c", ns)

    task = asyncio.ensure_future(writer())
    events = await _collect(stream, lambda ev: len(ev) == 3)
    await task
    await w.close()
    assert _summary(events) == [("ADDED", "c", "1"), ("MODIFIED", "c", "2"),
                                ("DELETED", "c", "2")]
    rvs = [int(e["raw_object"]["metadata"]["resourceVersion"]) for e in events]
    assert rvs == sorted(rvs) and len(set(rvs)) == 3 and rvs[0] > int(start)
    # resume after the first event: the history is replayed from there
    w2 = kubernetes_asyncio.watch.Watch()
    stream = w2.stream(acore.list_namespaced_config_map, ns, resource_version=str(rvs[0]),
                       timeout_seconds=10)
    resumed = await _collect(stream, lambda ev: len(ev) == 2)
    await w2.close()
    assert _summary(resumed) == [("MODIFIED", "c", "2"), ("DELETED", "c", "2")]


async def test_watch_without_resource_version_starts_with_current_objects(acore, kube_namespace):
    ns = kube_namespace
    for name in ("a", "b"):
        await acore.create_namespaced_config_map(ns, {"metadata": {"name": name}})
    w = kubernetes_asyncio.watch.Watch()
    stream = w.stream(acore.list_namespaced_config_map, ns, timeout_seconds=10)
    events = await _collect(stream, lambda ev: len(ev) == 2)
    await w.close()
    assert [(e["type"], e["raw_object"]["metadata"]["name"]) for e in events] == [
        ("ADDED", "a"), ("ADDED", "b")]


async def test_object_leaving_a_label_selector_is_reported_deleted(acore, kube_namespace):
    ns = kube_namespace
    start = (await acore.list_namespaced_config_map(ns)).metadata.resource_version
    await acore.create_namespaced_config_map(ns, {"metadata": {"name": "c",
                                                               "labels": {"team": "a"}}})
    await acore.patch_namespaced_config_map("c", ns, {"metadata": {"labels": {"team": "b"}}})
    await acore.patch_namespaced_config_map("c", ns, {"metadata": {"labels": {"team": "a"}}})
    w = kubernetes_asyncio.watch.Watch()
    stream = w.stream(acore.list_namespaced_config_map, ns, label_selector="team=a",
                      resource_version=start, timeout_seconds=10)
    events = await _collect(stream, lambda ev: len(ev) == 3)
    await w.close()
    assert [e["type"] for e in events] == ["ADDED", "DELETED", "ADDED"]


def _raw_watch_lines(emu, path: str, timeout: float = 10) -> list[dict]:
    req = urllib.request.Request(emu.url + path,
                                 headers={"Authorization": "Bearer kubeemu-token"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return [json.loads(line) for line in resp.read().decode().splitlines() if line.strip()]


async def test_too_old_resource_version_is_410_gone(kube_emulator, acore, kube_namespace):
    ns = kube_namespace
    first = await acore.create_namespaced_config_map(ns, {"metadata": {"name": "c"}})
    old = int(first.metadata.resource_version)
    await acore.patch_namespaced_config_map("c", ns, {"data": {"v": "1"}})
    kube_emulator.compact()
    lines = await asyncio.to_thread(
        _raw_watch_lines, kube_emulator,
        f"/api/v1/namespaces/{ns}/configmaps?watch=true&resourceVersion={old}&timeoutSeconds=5")
    assert len(lines) == 1 and lines[0]["type"] == "ERROR"
    status = lines[0]["object"]
    assert status["kind"] == "Status" and status["code"] == 410
    assert status["reason"] == "Expired"
    assert status["message"].startswith(f"too old resource version: {old} (")
    # kubernetes_asyncio turns it into an ApiException when the caller set a timeout
    w = kubernetes_asyncio.watch.Watch()
    stream = w.stream(acore.list_namespaced_config_map, ns, resource_version=str(old),
                      timeout_seconds=5)
    with pytest.raises(kubernetes_asyncio.client.ApiException) as err:
        await _collect(stream, lambda ev: True)
    await w.close()
    assert err.value.status == 410


async def test_bookmarks_only_when_allowed_and_timeout_seconds_ends_the_watch(
        kube_emulator, acore, kube_namespace):
    ns = kube_namespace
    created = await acore.create_namespaced_config_map(ns, {"metadata": {"name": "c"}})
    rv = created.metadata.resource_version
    path = f"/api/v1/namespaces/{ns}/configmaps?watch=1&resourceVersion={rv}&timeoutSeconds=2"
    t0 = time.monotonic()
    with_bookmarks = await asyncio.to_thread(_raw_watch_lines, kube_emulator,
                                             path + "&allowWatchBookmarks=true")
    elapsed = time.monotonic() - t0
    assert 1.8 < elapsed < 5, elapsed
    bookmarks = [e for e in with_bookmarks if e["type"] == "BOOKMARK"]
    assert bookmarks and all(e["object"]["kind"] == "ConfigMap" for e in bookmarks)
    assert all(int(e["object"]["metadata"]["resourceVersion"]) >= int(rv) for e in bookmarks)
    without = await asyncio.to_thread(_raw_watch_lines, kube_emulator, path)
    assert without == []


def test_sync_client_watch_streams_events(kube_emulator, kube_namespace):
    ns = kube_namespace
    api_client = kubernetes.config.new_client_from_config(kube_emulator.kubeconfig_path)
    core = kubernetes.client.CoreV1Api(api_client)
    try:
        rv = core.list_namespaced_secret(ns).metadata.resource_version

        def write():
            time.sleep(0.2)
            core.create_namespaced_secret(ns, {"metadata": {"name": "s"},
                                               "stringData": {"k": "v"}})
            core.delete_namespaced_secret("s", ns)

        t = threading.Thread(target=write)
        t.start()
        seen = []
        w = kubernetes.watch.Watch()
        for ev in w.stream(core.list_namespaced_secret, ns, resource_version=rv,
                           timeout_seconds=5):
            if ev["raw_object"]["metadata"]["name"] == "s":
                seen.append(ev["type"])
            if len(seen) == 2:
                w.stop()
        t.join()
        assert seen == ["ADDED", "DELETED"]
    finally:
        api_client.close()


async def test_send_initial_events_ends_with_an_annotated_bookmark(kube_emulator, acore,
                                                                   kube_namespace):
    ns = kube_namespace
    await acore.create_namespaced_secret(ns, {"metadata": {"name": "c"}})
    lines = await asyncio.to_thread(
        _raw_watch_lines, kube_emulator,
        f"/api/v1/namespaces/{ns}/secrets?watch=1&sendInitialEvents=true"
        "&allowWatchBookmarks=true&resourceVersionMatch=NotOlderThan&timeoutSeconds=1")
    assert [e["type"] for e in lines[:2]] == ["ADDED", "BOOKMARK"]
    assert lines[1]["object"]["metadata"]["annotations"] == {
        "k8s.io/initial-events-end": "true"}
