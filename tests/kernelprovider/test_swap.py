"""Swapping an idle GPU kernel out and back in, single-machine mode: a real hub with the broker,
users' real jupyter-servers, GPU kernels through the real provisioner, the shim preloaded, and the
CUDA/NVML doubles as the machine's driver (one 16 GiB card; the pool is read through NVML). The
kernels' cells use the driver (ctypes) as a CUDA program does, so the hub checkpoints real
CUDA processes of the double.

Two 16 GiB cards and a 10 GiB size: two such kernels do not fit on one card. The default priority
class is movable and the queue reserves after 1 s: the queue may swap out an idle kernel to make
room for a whole-card request (docs/admission.md, "The queue").
"""

from __future__ import annotations

import re
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from culler import service_role
from hubext.metering.record import swapped_periods
from hubext.metering.store import UsageStore
from quotas.messages import mib
from tests.culler.stack import CullerProcess, KernelTab, page_text, wait_until
from tests.hubrunner import HubRunner
from tests.kernelprovider.helpers import CUDA_CELL, doubles_stack, machine_mib

SIZES = [
    {"name": "gpu-10g", "display_name": "GPU 10 GiB", "memory_mib": 10240, "cores_percent": 50},
    {"name": "gpu-4g", "display_name": "GPU 4 GiB", "memory_mib": 4096, "cores_percent": 25},
    {"name": "gpu-whole", "display_name": "A whole GPU", "whole": True},
]
ADMISSION = {
    "priority_classes": {"default": {"value": 100, "preempt": False, "borrow": False, "movable": True}},
    "default_priority_class": "default",
    "placement": {"node": "binpack", "gpu": "binpack"},
    "queue": {"reserve_after_seconds": 1},
    "workspaces": {"default": {"namespaces": {"default": {}}}},
}
SPEC = "elastic-gpu-gpu-10g"
TOKEN = secrets.token_hex(16)  # the culler's
UUID_CELL = """
uuid = ctypes.create_string_buffer(16)
assert cuda.cuDeviceGetUuid(uuid, 0) == 0
h = uuid.raw.hex()
print(f"device0 GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")
"""
CAP_MIB = 1536  # swapped-out kernels may hold this much host memory: one 1 GiB kernel, not two


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    config = f"""
c.GPUBroker.max_queue_seconds = 60
c.Authenticator.admin_users = {{"admin"}}
c.GPUBroker.swap_host_memory_percent = {CAP_MIB * 100 / machine_mib()!r}
c.JupyterHub.services.append({{"name": "culler-under-test", "api_token": {TOKEN!r}}})
c.JupyterHub.load_roles.append({service_role("culler-under-test", ["custom:elastic-gpu:admin"])!r})
"""
    work = tmp_path_factory.mktemp("swap")
    with doubles_stack(work, devices=2, memory_mib=16384, admission=ADMISSION, sizes=SIZES,
                       extra_config=config) as (hub, servers):
        yield hub, servers, work


def broker_kernel(hub: HubRunner, kernel_id: str) -> dict:
    status, body = hub.api("GET", "/gpu/kernels")
    assert status == 200, body
    return next(k for k in body["kernels"] if k["kernel_id"] == kernel_id)


def pool(hub: HubRunner) -> dict:
    status, body = hub.api("GET", "/gpu/pool")
    assert status == 200, body
    return body


def slices(hub: HubRunner) -> list[dict]:
    return [dict(s, gpu=g["uuid"]) for n in pool(hub)["nodes"] for g in n["gpus"] for s in g["slices"]]


def test_idle_kernel_is_swapped_out_its_slice_serves_a_waiting_kernel_and_it_resumes_on_its_next_cell(stack):
    hub, servers, _ = stack
    status, session = servers["alice"].start_session(SPEC)
    assert status == 201, session
    alice_kernel = session["kernel"]["id"]
    alice = servers["alice"].connect(alice_kernel)
    out = alice.execute(CUDA_CELL + "notes = {'answer': 42}")
    assert out["status"] == "ok" and "alloc 0" in out["text"], out
    record = broker_kernel(hub, alice_kernel)
    first_card = record["allocation"]["gpu_uuids"][0]
    # bob's first kernel takes the other card; his second waits in the GPU queue
    status, bob_first = servers["bob"].start_session(SPEC)
    assert status == 201, bob_first
    other_card = broker_kernel(hub, bob_first["kernel"]["id"])["allocation"]["gpu_uuids"][0]
    assert other_card != first_card
    bob_started: dict = {}
    waiting = threading.Thread(
        target=lambda: bob_started.update(result=servers["bob"].start_session(SPEC)), daemon=True
    )
    waiting.start()
    hub.wait_for(lambda: any(q["user"] == "bob" for q in pool(hub)["queue"]), 30, what="bob to wait")

    decided = time.monotonic()
    status, model = hub.api("POST", f"/gpu/kernels/{record['id']}/suspend?reason=idle")
    assert status == 200, model
    assert model["gpu_swapped"] and model["swap"]["host_mib"] == 1024, model
    hub.wait_for(lambda: any(s["user"] == "bob" for s in slices(hub)), 10, interval=0.05, what="bob's slice")
    granted_after = time.monotonic() - decided
    assert granted_after < 2.0, f"the slice reached the waiting kernel {granted_after:.2f} s after the decision"
    assert not any(s["user"] == "alice" for s in slices(hub))
    waiting.join(90)
    status, bob_session = bob_started["result"]
    assert status == 201, bob_session
    assert broker_kernel(hub, alice_kernel)["state"] == "running"  # alive, only its GPU is gone

    # bob's kernel uses its GPU; swapping it out too would pass the host-memory cap
    bob = servers["bob"].connect(bob_session["kernel"]["id"])
    assert "alloc 0" in bob.execute(CUDA_CELL)["text"]
    bob_record = broker_kernel(hub, bob_session["kernel"]["id"])
    status, refusal = hub.api("POST", f"/gpu/kernels/{bob_record['id']}/suspend")
    assert status == 409 and "over the cap" in refusal["message"], refusal
    assert not broker_kernel(hub, bob_session["kernel"]["id"])["gpu_swapped"]

    # alice's next cell: her kernel asks for its GPU back, waits behind bob's slices, says where it stands;
    # when bob's first kernel stops, she resumes on the other card (the driver remaps her GPU state)
    msg_id = alice.execute_async(
        "print('answer', notes['answer'] + 1); print('again', cuda.cuMemAlloc_v2(ctypes.byref(ptr), 1 << 20))"
    )
    assert alice.wait_for_output(msg_id, "position 1 in the GPU queue", 30), hub.log_tail(30)
    status, _ = servers["bob"].api("DELETE", f"/sessions/{bob_first['id']}")
    assert status == 204
    out = alice.collect(msg_id, 60)
    assert out["status"] == "ok", out
    assert "answer 43" in out["text"] and "again 0" in out["text"], out
    assert "GPU resumed" in out["text"], out
    assert not broker_kernel(hub, alice_kernel)["gpu_swapped"]
    assert sorted((s["user"], s["gpu"]) for s in slices(hub)) == [("alice", other_card), ("bob", first_card)]
    assert f"(moved from {first_card})" in hub.log_tail(200)
    # the usage records (docs/metering.md): alice's first slice closed 'swapped', her resume's
    # record continues it; between the two she held no GPU
    store = UsageStore(f"sqlite:///{hub.workdir / 'jupyterhub.sqlite'}")
    try:

        def linked() -> list:
            mine = [r for r in store.records() if r.user == "alice"]
            return [(p, r) for p in swapped_periods(mine) if p[2] is not None for r in mine if r.resumes == p[0].id]

        (((swapped, swapped_at, ended), resume),) = hub.wait_for(
            linked, 30, what="alice's swapped record and its resume"
        )
    finally:
        store.close()
    assert (swapped.kind, swapped.release_cause, resume.resumes) == ("kernel", "swapped", swapped.id)
    assert swapped.granted_at < swapped_at <= resume.granted_at == ended and resume.released_at is None
    alice.close()
    bob.close()
    servers["alice"].api("DELETE", f"/sessions/{session['id']}")
    servers["bob"].api("DELETE", f"/sessions/{bob_session['id']}")


def test_culler_swaps_idle_kernels_out_culls_what_cannot_be_swapped_with_the_reason_and_culls_swapped_ones_later(
    stack,
):
    hub, servers, work = stack
    started, tabs, since = {}, {}, time.time()
    for user in ("alice", "bob"):
        status, session = servers[user].start_session(SPEC)
        assert status == 201, session
        tabs[user] = KernelTab(hub, user, session["kernel"]["id"])
        assert "alloc 0" in tabs[user].execute(CUDA_CELL)
        # the kernel's CUDA device 0 is the card it was granted (the pool hands it over by
        # CUDA_VISIBLE_DEVICES; bob's is the other card: alice's swapped-out kernel keeps room on hers)
        granted = broker_kernel(hub, session["kernel"]["id"])["allocation"]["gpu_uuids"]
        assert f"device0 {granted[0]}" in tabs[user].execute(UUID_CELL), granted
        if user == "bob":
            tabs[user].close()
        started[user] = session["kernel"]["id"]
        if user == "alice":  # swapped out first: then bob's kernel fits on the card
            culler = CullerProcess(
                hub,
                work,
                TOKEN,
                name="swapping-culler",
                swap_idle_kernels=True,
                idle_timeout_seconds=2,
                warning_seconds=1,
                cull_swapped_after_seconds=8,
            ).start()
            wait_until(lambda: broker_kernel(hub, started["alice"])["gpu_swapped"], 30, "alice's kernel swapped out")
            swapped_line = culler.wait_log(rf"Swapped out GPU kernel {started['alice']} .*").group(0)
            # swapped, not culled: the log never said it was culling it
            assert f"Culling GPU kernel {started['alice']}" not in culler.log_text(), culler.log_text()[-3000:]
            assert "instead of culling it" in swapped_line
            tabs["alice"].drain(0.5)  # her open tab was told what would happen, and that her variables stay
            (notice,) = tabs["alice"].streams("will be moved to host memory")
            assert "idle GPU kernels are swapped out after 2 s here" in notice and "Your variables stay" in notice
    try:
        # bob's kernel cannot be swapped out (the host-memory cap): culled as without swapping, saying why
        line = culler.wait_log(rf"GPU kernel {started['bob']} of bob cannot be swapped out \(.*\): culling it")
        assert "over the cap" in line.group(0), line.group(0)
        culler.wait_log(rf"Culled GPU kernel {started['bob']} of bob")
        log = culler.log_text()  # the refusal first, then the cull, which says the state is lost
        culling = re.search(rf"Culling GPU kernel {started['bob']} of bob .*", log)
        assert culling and log.index(line.group(0)) < culling.start(), log[-3000:]
        assert "it cannot be swapped out" in culling.group(0) and "over the cap" in culling.group(0)
        assert "Swapped out GPU kernel " + started["alice"] in culler.log_text()
        # alice's swapped-out kernel is culled once it has been swapped out for cull_swapped_after_seconds;
        # the culler's notice in her open tab is no cell of hers: it does not bring the GPU back first
        alice_id = broker_kernel(hub, started["alice"])["id"]
        culler.wait_log(rf"Culled GPU kernel {started['alice']} of alice", timeout=30)
        status, kernels = hub.api("GET", "/gpu/kernels")
        assert not [k for k in kernels["kernels"] if k["kernel_id"] in started.values()], kernels
        assert f"GPU kernel {alice_id} of alice resumed" not in hub.log_tail(400)
        # her usage: the swapped period ends when the culler shut the kernel down (docs/metering.md)
        store = UsageStore(f"sqlite:///{hub.workdir / 'jupyterhub.sqlite'}")
        try:

            def ended() -> list:
                mine = [r for r in store.records() if r.user == "alice"]
                return [p for p in swapped_periods(mine) if p[1] >= since and p[2] is not None]

            ((swapped, swapped_at, until),) = hub.wait_for(ended, 30, what="alice's swapped period ended")
        finally:
            store.close()
        assert swapped.release_cause == "swapped" and swapped_at <= until
    finally:
        culler.stop()
        tabs["alice"].close()


def test_restarting_a_swapped_out_kernel_gives_a_fresh_kernel_on_one_slice(stack):
    hub, servers, _ = stack
    status, session = servers["alice"].start_session(SPEC)
    assert status == 201, session
    kernel_id = session["kernel"]["id"]
    record = broker_kernel(hub, kernel_id)
    status, model = hub.api("POST", f"/gpu/kernels/{record['id']}/suspend")
    assert status == 200 and model["gpu_swapped"], model
    status, _ = servers["alice"].api("POST", f"/kernels/{kernel_id}/restart")
    assert status == 200
    kernel = servers["alice"].connect(kernel_id)
    out = kernel.execute(CUDA_CELL)
    kernel.close()
    assert out["status"] == "ok" and "alloc 0" in out["text"] and "GPU resumed" not in out["text"], out
    assert not broker_kernel(hub, kernel_id)["gpu_swapped"]
    assert [s["user"] for s in slices(hub)] == ["alice"]
    servers["alice"].api("DELETE", f"/sessions/{session['id']}")


def test_a_kernel_that_cannot_be_checkpointed_keeps_its_slice_and_is_culled_with_the_drivers_reason(stack):
    hub, servers, work = stack
    status, session = servers["bob"].start_session(SPEC)
    assert status == 201, session
    kernel_id = session["kernel"]["id"]
    kernel = servers["bob"].connect(kernel_id)
    # memory exported through CUDA IPC: the driver (before 610) cannot checkpoint the process
    out = kernel.execute(
        CUDA_CELL + "handle = ctypes.create_string_buffer(64)\nprint('ipc', cuda.cuIpcGetMemHandle(handle, ptr))"
    )
    assert "ipc 0" in out["text"], out
    status, refusal = hub.api("POST", f"/gpu/kernels/{broker_kernel(hub, kernel_id)['id']}/suspend")
    assert status == 409 and "CUDA_ERROR_NOT_SUPPORTED" in refusal["message"], refusal
    # never half-suspended: its CUDA calls run (a locked process's would block), on its slice
    out = kernel.execute("print('again', cuda.cuMemAlloc_v2(ctypes.byref(ptr), 1 << 20))", timeout=20)
    assert out["status"] == "ok" and "again 0" in out["text"] and "GPU resumed" not in out["text"], out
    assert not broker_kernel(hub, kernel_id)["gpu_swapped"]
    assert [s["user"] for s in slices(hub)] == ["bob"]
    kernel.close()
    culler = CullerProcess(
        hub, work, TOKEN, name="ipc-culler", swap_idle_kernels=True, idle_timeout_seconds=2, warning_seconds=0
    ).start()
    try:
        culler.wait_log(
            rf"GPU kernel {kernel_id} of bob cannot be swapped out \(.*CUDA_ERROR_NOT_SUPPORTED.*\): culling it"
        )
        culler.wait_log(rf"Culled GPU kernel {kernel_id} of bob")
    finally:
        culler.stop()


def test_a_whole_card_request_waiting_on_fragmentation_gets_in_once_the_queue_swaps_out_an_idle_kernel(stack):
    hub, servers, _ = stack
    hub.wait_for(lambda: not slices(hub), 30, what="an empty pool")
    sessions = {}
    users = {"whole": "bob"}
    try:
        for name, user, spec in (("p", "bob", SPEC), ("q", "bob", SPEC), ("r", "alice", "elastic-gpu-gpu-4g")):
            status, sessions[name] = servers[user].start_session(spec)
            assert status == 201, sessions[name]
            users[name] = user
        kernel = {name: broker_kernel(hub, s["kernel"]["id"]) for name, s in sessions.items()}
        card = {name: k["allocation"]["gpu_uuids"][0] for name, k in kernel.items()}
        assert card["p"] != card["q"]  # one 10 GiB kernel per card; alice's 4 GiB one beside one of them
        alice = servers["alice"].connect(sessions["r"]["kernel"]["id"])
        out = alice.execute(CUDA_CELL + "notes = {'answer': 41}")
        assert out["status"] == "ok" and "alloc 0" in out["text"], out
        # the 10 GiB kernel beside alice's stops: each card now holds one kernel, 22 GiB are free, no card is
        beside = "p" if card["p"] == card["r"] else "q"
        other = "q" if beside == "p" else "p"
        status, _ = servers["bob"].api("DELETE", f"/sessions/{sessions[beside]['id']}")
        assert status == 204
        hub.wait_for(lambda: len(slices(hub)) == 2, 30, what="bob's kernel to give its slice back")

        status, whole = servers["bob"].start_session("elastic-gpu-gpu-whole")  # waits, then gets alice's card
        sessions["whole"] = whole
        assert status == 201, (whole, hub.log_tail(40))
        moved = broker_kernel(hub, sessions["r"]["kernel"]["id"])
        assert moved["gpu_swapped"] and "moved to make room for" in moved["swap"]["reason"], moved
        assert moved["swap"]["moved"]  # its resume is not held behind another overdue request
        assert broker_kernel(hub, whole["kernel"]["id"])["allocation"]["gpu_uuids"] == [card["r"]]
        log = hub.log_tail(200)
        assert "GPU move: " in log and "whole GPU) waiting" in log, log

        # alice's next cell brings her GPU back, on the card that has room (bob's 10 GiB one), state intact
        out = alice.execute(
            "print('answer', notes['answer'] + 1); print('again', cuda.cuMemAlloc_v2(ctypes.byref(ptr), 1 << 20))"
        )
        assert out["status"] == "ok" and "answer 42" in out["text"] and "again 0" in out["text"], out
        after = broker_kernel(hub, sessions["r"]["kernel"]["id"])
        assert not after["gpu_swapped"] and after["allocation"]["gpu_uuids"] == [card[other]]
        assert f"(moved from {card['r']})" in hub.log_tail(200)  # the driver remapped its GPU state
        store = UsageStore(f"sqlite:///{hub.workdir / 'jupyterhub.sqlite'}")
        try:

            def released() -> list:
                return [
                    r
                    for r in store.records()
                    if r.user == "alice"
                    and r.release_cause == "swapped"
                    and "moved to make room for" in (r.release_why or "")
                ]

            hub.wait_for(released, 30, what="alice's usage record closed by the move, with the reason")
        finally:
            store.close()
        alice.close()
    finally:  # the kernels run as another account: they outlive the hub unless their sessions go
        for name, model in sessions.items():
            if isinstance(model, dict) and "id" in model:
                servers[users[name]].api("DELETE", f"/sessions/{model['id']}")


def test_a_kernel_in_a_cell_is_moved_live_its_cell_pauses_on_the_locked_gpu_then_ends_well_on_the_other_card(stack):
    """A cell running when its kernel is swapped out does not pass the resume hook again: its next
    GPU call waits on the locked driver. So a kernel the queue moves in a cell (a live move) is
    resumed by the hub at once, elsewhere: its cell pauses, then goes on on the new card, and says
    so in one line. Both kernels that could make room for the whole-card request run cells here;
    alice's, the smaller, moves: her cell waits until the driver locks her kernel, then uses the GPU.
    (Before live moves, a kernel in a cell was never moved: the whole-card request waited for a
    cell to end.)"""
    hub, servers, _ = stack
    hub.wait_for(lambda: not slices(hub), 30, what="an empty pool")
    sessions, users = {}, {}
    try:
        for name, user, spec in (("p", "bob", SPEC), ("q", "bob", SPEC), ("r", "alice", "elastic-gpu-gpu-4g")):
            status, sessions[name] = servers[user].start_session(spec)
            assert status == 201, sessions[name]
            users[name] = user
        card = {
            name: broker_kernel(hub, s["kernel"]["id"])["allocation"]["gpu_uuids"][0] for name, s in sessions.items()
        }
        alice = servers["alice"].connect(sessions["r"]["kernel"]["id"])
        out = alice.execute(CUDA_CELL + "notes = {'answer': 41}")
        assert out["status"] == "ok" and "alloc 0" in out["text"], out
        beside = "p" if card["p"] == card["r"] else "q"
        other = "q" if beside == "p" else "p"
        status, _ = servers["bob"].api("DELETE", f"/sessions/{sessions[beside]['id']}")
        assert status == 204
        hub.wait_for(lambda: len(slices(hub)) == 2, 30, what="bob's kernel to give its slice back")
        # bob's kernel on the other card runs a long cell: no kernel is between cells
        bob = servers["bob"].connect(sessions[other]["kernel"]["id"])
        long_cell = bob.execute_async("import time\nprint('started', flush=True)\ntime.sleep(30)")
        assert "started" in bob.collect(long_cell, timeout=30, until="started")["text"]
        # alice's cell waits until the driver has locked her kernel (the move has begun), then uses the GPU
        cell = alice.execute_async(
            "import os, time\nprint('started', flush=True)\nnote = os.environ['ELASTIC_GPU_SWAP_FILE'] + '.moved'\n"
            "me, st, deadline = os.getpid(), ctypes.c_int(), time.time() + 40\n"
            "while (cuda.cuCheckpointProcessGetState(me, ctypes.byref(st)), st.value) == (0, 0) and "
            "not os.path.exists(note) and time.time() < deadline:\n    time.sleep(0.001)\n"
            "print('state', st.value, flush=True)\n"
            "print('again', cuda.cuMemAlloc_v2(ctypes.byref(ptr), 1 << 20), 'answer', notes['answer'] + 1)\n"
        )
        assert "started" in alice.collect(cell, timeout=30, until="started")["text"]
        status, whole = servers["bob"].start_session("elastic-gpu-gpu-whole")  # alice's kernel moves for it
        sessions["whole"], users["whole"] = whole, "bob"
        assert status == 201, (whole, hub.log_tail(40))
        out = alice.collect(cell, timeout=60)
        assert out["status"] == "ok" and "again 0 answer 42" in out["text"], (out, hub.log_tail(60))
        line = r"This cell paused \d+\.\d s while its kernel was moved to another GPU to make room for a waiting "
        assert re.search(line + r"request \(moved to make room for \S+ of bob \([^)]*whole GPU\)", out["text"]), out
        assert broker_kernel(hub, whole["kernel"]["id"])["allocation"]["gpu_uuids"] == [card["r"]]
        after = broker_kernel(hub, sessions["r"]["kernel"]["id"])
        assert not after["gpu_swapped"] and after["allocation"]["gpu_uuids"] == [card[other]], after
        log = hub.log_tail(200)
        assert "live move" in log and f"(moved from {card['r']})" in log, log
        out = alice.execute("print('next', cuda.cuMemAlloc_v2(ctypes.byref(ptr), 1 << 20))")
        assert out["status"] == "ok" and "next 0" in out["text"] and "paused" not in out["text"], out
        alice.close()
        bob.close()
    finally:
        for name, model in sessions.items():
            if isinstance(model, dict) and "id" in model:
                servers[users[name]].api("DELETE", f"/sessions/{model['id']}")


def test_a_swapped_out_kernel_is_listed_with_its_host_memory_and_cull_time_on_the_api_cli_and_pages(stack):
    hub, servers, work = stack
    status, session = servers["alice"].start_session(SPEC)
    assert status == 201, session
    kernel_id = session["kernel"]["id"]
    kernel = servers["alice"].connect(kernel_id)
    assert "alloc 0" in kernel.execute(CUDA_CELL)["text"]
    kernel.close()
    status, model = hub.api("POST", f"/gpu/kernels/{broker_kernel(hub, kernel_id)['id']}/suspend")
    assert status == 200 and model["gpu_swapped"], model
    # the culler's policy says when it is culled; it tells the broker (the user swapped it out herself)
    culler = CullerProcess(
        hub,
        work,
        TOKEN,
        name="cull-time",
        swap_idle_kernels=True,
        idle_timeout_seconds=3600,
        cull_swapped_after_seconds=7200,
    ).start()
    try:
        (entry,) = wait_until(
            lambda: [k for k in pool(hub).get("swapped", []) if k["kernel_id"] == kernel_id and k["cull_at"]],
            30,
            "the pool API to list the swapped-out kernel with its cull time",
        )
    finally:
        culler.stop()
    assert entry["user"] == "alice" and entry["host_mib"] > 0 and entry["memory_mib"] == 10240, entry
    assert abs(entry["cull_at"] - entry["since"] - 7200) < 1, entry
    assert not [s for s in slices(hub) if s["user"] == "alice"], "a swapped-out kernel holds no slice"
    host = mib(entry["host_mib"])  # the one size formatter the pages and the CLI use
    cli = subprocess.run(
        [
            str(Path(sys.executable).parent / "elastic-gpu"),
            "status",
            "--url",
            hub.url,
            "--token",
            hub.admin_token,
            "--config-dir",
            str(work / "cli"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 0, cli.stderr
    held = f"{mib(entry['host_mib'])} in host memory since {entry['since_utc']}"
    assert "Swapped out" in cli.stdout and held in cli.stdout, cli.stdout
    assert f"culled at {entry['cull_at_utc']}" in cli.stdout, cli.stdout
    home = page_text(hub, "alice", "/hub/home")
    assert "swapped out: GPU kernel on server" in home and kernel_id in home, home
    assert f"{host} {entry['since_utc']} {entry['cull_at_utc']}" in home, home
    admin = page_text(hub, "admin", "/hub/gpu")
    assert f"alice default {kernel_id}" in admin and f"{host} {entry['since_utc']} {entry['cull_at_utc']}" in admin, (
        admin
    )
    servers["alice"].api("DELETE", f"/sessions/{session['id']}")


def test_a_resume_into_a_full_pool_prints_its_place_in_the_queue_at_once_in_sentences_written_for_a_resume(stack):
    hub, servers, _ = stack
    status, session = servers["alice"].start_session(SPEC)
    assert status == 201, session
    alice = session["kernel"]["id"]
    tab = KernelTab(hub, "alice", alice)
    bob_sessions = []
    try:
        assert "alloc 0" in tab.execute(CUDA_CELL + "kept = 'still here'")
        status, model = hub.api("POST", f"/gpu/kernels/{broker_kernel(hub, alice)['id']}/suspend")
        assert status == 200 and model["gpu_swapped"], model
        for _ in range(2):  # bob fills both cards: no 10 GiB slice is free
            status, bob = servers["bob"].start_session(SPEC)
            assert status == 201, bob
            bob_sessions.append(bob)
        asked = time.monotonic()
        msg_id = tab.send_execute("print(kept)")
        line = tab.wait_stream(msg_id, "in the GPU queue", timeout=30)
        seconds = time.monotonic() - asked
        print(f"queue position printed {seconds:.2f} s after the cell: {line.strip()}")
        # driven by the queue's own news, not by the end of the hook's 10 s long-poll
        assert seconds < 5, f"the queue position came {seconds:.1f} s after the cell"
        assert "position 1 in the GPU queue (0 requests ahead)." in line, line
        assert "10 GiB of GPU memory on a card of model H100-80GB must be free" in line, line
        for wrong in ("smaller profile", "profile.).", ".)."):
            assert wrong not in line, f"{wrong!r} in a resume's sentence: {line}"
        # a card frees: the cell runs on the restored state
        servers["bob"].api("DELETE", f"/sessions/{bob_sessions.pop()['id']}")
        assert "still here" in tab.wait_stream(msg_id, "still here", timeout=60)
    finally:
        tab.close()
        for bob in bob_sessions:
            servers["bob"].api("DELETE", f"/sessions/{bob['id']}")
        servers["alice"].api("DELETE", f"/sessions/{session['id']}")


def test_one_user_suspending_repeatedly_cannot_make_another_users_idle_kernel_lose_its_state(stack):
    # swapped-out kernels may hold 1.5 GiB of host memory here; each kernel below holds 640 MiB
    hub, servers, _ = stack
    cell = CUDA_CELL.replace("1 << 30", "640 << 20")
    sessions: dict[str, list[dict]] = {"alice": [], "bob": []}

    def kernel(user: str) -> dict:
        status, session = servers[user].start_session(SPEC)
        assert status == 201, session
        sessions[user].append(session)
        client = servers[user].connect(session["kernel"]["id"])
        assert "alloc 0" in client.execute(cell + "kept = 'mine'")["text"]
        client.close()
        return broker_kernel(hub, session["kernel"]["id"])

    try:
        # bob swaps out his own kernels (his suspends need no culler), and would go on: two fit the cap
        bob_first, bob_second = kernel("bob"), kernel("bob")
        for k in (bob_first, bob_second):
            status, model = hub.api("POST", f"/gpu/kernels/{k['id']}/suspend", token=hub.user_token("bob"))
            assert status == 200 and model["gpu_swapped"], model
        # alice's idle kernel is swapped out by the culler (a GPU admin): the cap is full, but bob holds
        # 1.25 GiB, over his half of it: his newest swapped-out kernel makes room, with a sentence to him
        alice = kernel("alice")
        status, model = hub.api("POST", f"/gpu/kernels/{alice['id']}/suspend?reason=idle")
        assert status == 200 and model["gpu_swapped"], model
        status, gone = hub.api("GET", f"/gpu/kernels/{bob_second['id']}")
        assert status == 404 or gone["state"] in ("stopped", "failed", "culled"), gone
        line = hub.wait_for(
            lambda: next(
                (x for x in hub.log_tail(400).splitlines() if f"GPU kernel {bob_second['id']} of bob stopped" in x),
                None,
            ),
            30,
            what="the hub's line about bob's stopped kernel",
        )
        assert "over your share of 768 MiB" in line and "its variables lost" in line, line
        assert broker_kernel(hub, bob_first["kernel_id"])["gpu_swapped"], "bob keeps one swapped-out kernel"
        # bob suspending again cannot take alice's place: refused, his kernel keeps its slice and state
        bob_third = kernel("bob")
        status, refusal = hub.api("POST", f"/gpu/kernels/{bob_third['id']}/suspend", token=hub.user_token("bob"))
        assert status == 409 and "over their share of 768 MiB" in refusal["message"], refusal
        assert broker_kernel(hub, alice["kernel_id"])["gpu_swapped"], "alice's kernel must keep its state"
        # alice's state is there when she comes back
        client = servers["alice"].connect(alice["kernel_id"])
        out = client.execute("print(kept)", timeout=60)
        client.close()
        assert out["status"] == "ok" and "mine" in out["text"], out
    finally:
        for user, started in sessions.items():
            for session in started:
                servers[user].api("DELETE", f"/sessions/{session['id']}")


def test_with_the_default_warning_an_open_tab_is_swapped_out_at_its_short_timeout_not_300_s_later(stack):
    hub, servers, work = stack
    status, session = servers["alice"].start_session(SPEC)
    assert status == 201, session
    kernel_id = session["kernel"]["id"]
    tab = KernelTab(hub, "alice", kernel_id)
    culler = None
    try:
        assert "alloc 0" in tab.execute(CUDA_CELL)
        culler = CullerProcess(
            hub, work, TOKEN, name="short-swap", swap_idle_kernels=True, idle_timeout_seconds=3, warning_seconds=300
        ).start()
        # the default warning lead (300 s) is longer than the timeout: warned at once, swapped at the timeout
        wait_until(lambda: broker_kernel(hub, kernel_id)["gpu_swapped"], 30, "the kernel swapped out at its timeout")
        tab.drain(0.5)
        (notice,) = tab.streams("will be moved to host memory")
        assert "Your variables stay" in notice, notice
    finally:
        if culler is not None:
            culler.stop()
        tab.close()
        servers["alice"].api("DELETE", f"/sessions/{session['id']}")
