"""The words JupyterLab shows of a GPU kernel (kernelprovider/labstatus.py) and the launcher icon's
size label (kernelprovider/kernelspecs.py), for every state and shape a kernel can be in."""

from __future__ import annotations

from datetime import datetime, timezone

from kernelprovider.kernelspecs import logo_svg, size_label
from kernelprovider.labstatus import NOTICE_CHARS, slice_view
from kernelprovider.provisioner import stopped_reason
from quotas.messages import kernel_stopped

NOW = 1_000_000.0
RUNNING = {"state": "running", "memory_mib": 10240, "cores_percent": 50, "gpu_count": 1, "gpu": {}}
WAITING = {**RUNNING, "state": "pending", "queue": {"position": 1, "waiting_reason": "No GPU has 10 GiB free."}}


def iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="seconds")


def views() -> dict[str, dict]:
    long_reason = "kernel shut down by admin: " + "x" * 300
    return {
        "running": slice_view(RUNNING, NOW),
        "swapped": slice_view({**RUNNING, "swap": {"state": "swapped", "host_mib": 1024, "reason": "idle"}}, NOW),
        "swapped-culled-soon": slice_view(
            {**RUNNING, "swap": {"state": "swapped", "host_mib": 1024, "reason": "idle", "cull_at": NOW + 150}}, NOW
        ),
        "queued": slice_view({**RUNNING, "swap": {"state": "queued", "position": 2, "host_mib": 1024}}, NOW),
        "stopped-by-admin": slice_view({**RUNNING, "state": "stopped", "reason": f"the hub stopped it: {long_reason}"}),
        "failed": slice_view({**RUNNING, "state": "failed", "reason": "its GPU slice was taken back"}, NOW),
        "waiting-to-start": slice_view(WAITING, NOW),
        "idle": slice_view({**RUNNING, "idle_action": "swap", "idle_deadline": iso(NOW + 150)}, NOW),
    }


def test_every_notice_fits_what_jupyterlab_shows_and_ends_with_what_to_do():
    for name, view in views().items():
        assert len(view["notice"]) <= NOTICE_CHARS, (name, view["notice"])
        assert "profile" not in view["notice"] + view["detail"] + view["status"], name
    stopped = views()["stopped-by-admin"]["notice"]
    assert stopped.startswith("The hub stopped your GPU kernel (kernel shut down by admin: xxx") and "…)" in stopped
    assert stopped.endswith("Start a new kernel; its variables are lost."), stopped


def test_the_status_says_the_slice_the_queue_place_and_the_time_left():
    v = views()
    assert v["running"]["status"] == "GPU 10 GiB, 50% compute"
    assert v["swapped"]["status"] == "GPU swapped out (1 GiB in host memory)"
    assert v["swapped-culled-soon"]["status"].endswith("stopped in 3 min unless a cell runs")
    assert v["queued"]["status"] == "GPU queued: position 3 in the GPU queue (2 requests ahead)"
    assert v["failed"]["status"] == "GPU kernel stopped: its GPU slice was taken back"
    assert (
        v["waiting-to-start"]["status"] == "GPU kernel queued to start: position 2 in the GPU queue (1 request ahead)"
    )
    assert v["idle"]["status"] == "GPU 10 GiB, 50% compute · idle: swapped out in 3 min"
    assert {view["event"] for view in v.values()} == {"running", "swapped", "queued:2", "stopped", "waiting:1"}


def test_a_start_that_waits_is_told_as_a_start_not_as_a_resume():
    waiting = views()["waiting-to-start"]
    assert (
        waiting["notice"] == "Your GPU kernel waits for a GPU to start: position 2 in the GPU queue (1 request ahead)."
    )
    assert "No GPU has 10 GiB free." in waiting["detail"] and "variables" not in waiting["detail"]
    started = views()["running"]["started"]
    assert started == "Your GPU kernel has its GPU and started (GPU 10 GiB, 50% compute)."


def test_the_idle_countdown_reads_the_brokers_deadline_and_drops_a_stale_or_malformed_one():
    def status(**idle: str) -> str:
        return slice_view({**RUNNING, **idle}, NOW)["status"]

    assert status(idle_action="stop", idle_deadline=iso(NOW + 30)).endswith("· idle: stopped in 1 min")
    assert status(idle_action="stop", idle_deadline=iso(NOW - 120)) == "GPU 10 GiB, 50% compute"
    assert status(idle_action="stop", idle_deadline="at noon") == "GPU 10 GiB, 50% compute"
    assert status(idle_action="explode", idle_deadline=iso(NOW + 30)) == "GPU 10 GiB, 50% compute"


def test_the_page_tells_a_stopped_kernel_with_the_who_and_why_of_the_brokers_answer():
    # the broker's 404 to the kernel's owner, as its provisioner keeps it, as the status shows it
    reason = stopped_reason({"message": kernel_stopped("kernel shut down by admin: maintenance at 18:00")})
    view = slice_view({**RUNNING, "state": "stopped", "reason": reason}, NOW)
    assert view["status"] == "GPU kernel stopped by the hub: kernel shut down by admin: maintenance at 18:00"
    # an answer without the broker's sentence: still no guess at who or why
    bare = slice_view({**RUNNING, "state": "stopped", "reason": stopped_reason({"message": "No GPU kernel"})}, NOW)
    assert bare["status"] == "GPU kernel stopped: the hub stopped it"


def test_a_burst_limit_and_several_cards_are_spelled_out():
    view = slice_view({**RUNNING, "gpu_count": 2, "gpu": {"memory_limit_mib": 20480}}, NOW)
    assert view["status"] == "GPU 2 × 10 GiB (up to 20 GiB), 50% compute"


def test_the_launcher_icon_says_the_size_of_slices_whole_cards_and_several_cards():
    assert size_label({"memory_mib": 10240, "cores_percent": 25}) == ("10 GiB", "25%")
    assert size_label({"whole": True, "count": 2}) == ("whole", "2 GPUs")
    assert size_label({"memory_mib": 40960, "cores_percent": 100, "count": 2}) == ("2 × 40 GiB", "100%")
    svg = logo_svg({"memory_mib": 1536, "cores_percent": 10, "name": "<x>"})
    assert ">1.5 GiB<" in svg and ">10%<" in svg and "<x>" not in svg


#: requests ahead -> the place a user reads (issue 26: the home page read "(2. in line)")
PLACES = {0: "position 1", 1: "position 2", 2: "position 3", 10: "position 11", 20: "position 21"}


def test_a_place_in_the_gpu_queue_reads_as_a_position_wherever_a_user_sees_it():
    from jinja2 import Environment, FileSystemLoader

    from hubext.admin import TEMPLATES
    from quotas.messages import mib, queue_place

    user_page = Environment(loader=FileSystemLoader(str(TEMPLATES)), autoescape=True).get_template(
        "elastic_gpu_user.html"
    )
    for ahead, place in PLACES.items():
        sentence = queue_place(ahead)  # the catalogue's sentence
        requests = "1 request" if ahead == 1 else f"{ahead} requests"
        assert sentence == f"{place} in the GPU queue ({requests} ahead)", sentence
        # JupyterLab's status item and notice
        view = slice_view({**RUNNING, "swap": {"state": "queued", "position": ahead, "host_mib": 1024}}, NOW)
        assert view["status"] == f"GPU queued: {sentence}", view["status"]
        # the home page: a waiting request and a swapped-out kernel waiting to resume
        waiting = {"count": 1, "memory_mib": 10240, "whole": False, "kind": "kernel", "server_name": "",
                   "position": ahead, "reason": "No GPU has 10 GiB free."}  # fmt: skip
        swapped = {"server_name": "", "kernel_id": "k1", "state": "queued", "position": ahead,
                   "memory_mib": 10240, "gpu_count": 1, "host_mib": 1024, "since_utc": "2026-11-29 08:00 UTC",
                   "cull_at_utc": ""}  # fmt: skip
        g = {"slices": [], "waiting": [waiting], "swapped": [swapped], "events": [], "levels": [],
             "remaining": {"memory_mib": None, "cores_percent": None, "gpus": None}, "usage_page": False,
             "simulated": False, "queue_place": queue_place,
             "owner": {"workspace": "default", "namespace": "default"}}  # fmt: skip
        page = " ".join(user_page.render(elastic_gpu=g, base_url="/hub/", gpu_size=mib).split())
        assert page.count(sentence) == 2, page
        assert ". in " not in page, page


def test_a_whole_gpu_kernel_reads_as_whole_gpus_not_as_a_slice_with_all_the_compute():
    whole = {**RUNNING, "memory_mib": 16384, "cores_percent": 100, "gpu": {"whole": True}}
    view = slice_view(whole, NOW)
    assert view["status"] == "1 whole GPU, 16 GiB", view["status"]
    assert view["started"] == "Your GPU kernel has its GPU and started (1 whole GPU, 16 GiB).", view["started"]
    two = slice_view({**whole, "gpu_count": 2, "activity": {"memory_used_mib": 1024}}, NOW)
    assert two["status"] == "2 whole GPUs, 1 GiB / 16 GiB each", two["status"]


def test_a_kernel_the_hub_stopped_and_jupyter_server_restarted_tells_why_its_variables_are_gone():
    """jupyter-server's restarter starts a kernel the hub stopped afresh within seconds (a burster
    whose card cannot swap it out, a preempted kernel); the page polls every 2 s and may never see
    it stopped. The broker keeps the stop (``last_stop``) and the page tells it once restarted."""
    sentence = "stopped: it held 7 GiB of GPU memory above its 1 GiB guarantee on GPU 0, which another kernel needed"
    restarted = {**RUNNING, "last_stop": {"at": NOW - 5, "reason": sentence}}
    view = slice_view(restarted, NOW)
    assert view["event"] == f"restarted:{NOW - 5}" and view["level"] == "warning", view
    assert view["notice"].startswith("Your GPU kernel was stopped and started afresh (it held 7 GiB"), view
    assert (
        view["notice"].endswith("Its variables were lost; run your cells again.")
        and len(view["notice"]) <= NOTICE_CHARS
    )
    assert sentence[len("stopped: ") :] in view["detail"] and view["status"] == "GPU 10 GiB, 50% compute"
    # swapped out later: the swap is what the page says, not the old stop
    assert (
        slice_view({**restarted, "swap": {"state": "swapped", "host_mib": 1, "reason": "idle"}}, NOW)["event"]
        == "swapped"
    )
