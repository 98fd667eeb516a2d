"""What a user reads when a GPU kernel is refused or waits, through the real stack: JupyterLab's
REST calls (POST /api/sessions) on the user's real jupyter-server, the real provisioner, the hub's
broker and allocator (single-machine mode, one simulated H100-80GB).

The admission config is the one `elastic-gpu init` writes: the workspace's memory quota is the
whole pool, so a full pool is also a "full" workspace. Each user may hold 64 GiB and 40% of compute;
bob may hold the whole card. Kernels that do not fit wait up to 15 s in the GPU queue.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.kernelprovider.helpers import Server, local_stack, start_server

ADMISSION = {
    "priority_classes": {"default": {"value": 100, "preempt": False, "borrow": False}},
    "default_priority_class": "default",
    "placement": {"node": "binpack", "gpu": "binpack"},
    "workspaces": {
        "default": {
            "limits": {"memory_mib": 81920},
            "namespaces": {
                "default": {
                    "user_limits": {"memory_mib": 65536, "cores_percent": 40},
                    "users": {"bob": {"memory_mib": 81920, "cores_percent": 100}},
                }
            },
        }
    },
}
SIZES = [
    {"name": "gpu-30g", "display_name": "GPU 30 GiB", "memory_mib": 30720, "cores_percent": 30},
    {"name": "gpu-40g", "display_name": "GPU 40 GiB", "memory_mib": 40960, "cores_percent": 50},
]
SMALL, BIG = "elastic-gpu-gpu-30g", "elastic-gpu-gpu-40g"
QUEUE_SECONDS = 15


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with local_stack(
        tmp_path_factory.mktemp("gpu-refusals"),
        admission=ADMISSION,
        sizes=SIZES,
        extra_config=f"c.GPUBroker.max_queue_seconds = {QUEUE_SECONDS}\n",
    ) as st:
        start_server(st["hub"], "bob", st["tokens"]["bob"])
        st["bob"] = Server(st["hub"], "bob", st["tokens"]["bob"])
        yield st


def stop(server: Server, session: dict) -> None:
    status, body = server.api("DELETE", f"/sessions/{session['id']}")
    assert status == 204, body


def test_a_refusal_reaches_jupyterlab_as_the_whole_sentence_with_single_percent_signs(stack):
    alice: Server = stack["alice"]
    status, first = alice.start_session(SMALL)
    assert status == 201, first
    try:
        t0 = time.monotonic()
        status, body = alice.start_session(SMALL)
        waited = time.monotonic() - t0
        assert status >= 400, body  # jupyter_server answers a failed session start with 500
        message = body["message"]
        assert "%%" not in message, message
        # one line: API clients get no hard line breaks (JupyterLab's dialog wraps it: tests/lab)
        assert "\n" not in message, message
        sentence = message
        assert sentence.startswith("User 'alice' has 40% of GPU compute; 30% are in use, so a kernel asking 30%"), (
            sentence
        )
        assert "Stop one of your kernels" in sentence, sentence
        # only alice's own kernel stands in the way: waiting in the queue cannot help her
        assert "Waited" not in sentence and waited < QUEUE_SECONDS / 2, (waited, sentence)
    finally:
        stop(alice, first)


def test_a_full_pool_is_explained_as_a_full_pool_and_an_admin_can_cancel_the_wait(stack):
    hub, alice, bob = stack["hub"], stack["alice"], stack["bob"]
    held = []
    for _ in range(2):  # bob fills the card: 80 GiB, 100% of compute
        status, session = bob.start_session(BIG)
        assert status == 201, session
        held.append(session)
    answer: dict = {}

    def alice_starts() -> None:
        answer["status"], answer["body"] = alice.start_session(SMALL)

    thread = threading.Thread(target=alice_starts)
    thread.start()
    try:
        rows = hub.wait_for(
            lambda: hub.api("GET", "/gpu/pool")[1]["queue"], timeout=QUEUE_SECONDS / 2, what="alice's request to queue"
        )
        [row] = rows
        assert row["user"] == "alice" and row["server_name"] == "" and row["kind"] == "kernel", row
        why = row["reason"]
        assert why.startswith("No GPU has 30 GiB of memory and 30% of compute free right now"), why
        assert "quota" not in why and "Workspace" not in why, "a full pool is not a quota"
        assert "Stop" not in why, "alice holds nothing she could stop"
        status, body = hub.api("DELETE", f"/gpu/queue/{row['request_id']}")
        assert status == 204, body
        thread.join(QUEUE_SECONDS / 2)
        assert not thread.is_alive(), "the cancelled request still waits"
        assert answer["status"] >= 400, answer
        message = " ".join(answer["body"]["message"].splitlines())
        assert "cancelled by an admin" in message and "free right now" in message, message
        assert hub.api("GET", "/gpu/pool")[1]["queue"] == []
        status, body = hub.api("DELETE", f"/gpu/queue/{row['request_id']}")
        assert status == 404 and "no longer waiting" in body["message"], body
    finally:
        thread.join(QUEUE_SECONDS + 5)
        for session in held:
            stop(bob, session)
