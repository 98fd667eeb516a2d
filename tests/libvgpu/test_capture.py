"""Stream capture under the cores limiter. The CUDA double enforces the capture rules a real
driver does (waiting on an event recorded inside a capture is illegal in every mode; a thread
in the default global mode may not synchronise while any global-mode capture is under way; an
illegal call invalidates the capture). PyTorch captures CUDA graphs in global mode; the limiter
measures the first launches of a cold or idle container with a pair of events it waits on."""

from __future__ import annotations

import pytest

CAPTURE_UNSUPPORTED = 900
CAPTURE_INVALIDATED = 901


def test_the_double_enforces_the_capture_rules(node):
    """Without the shim: another thread may launch during a global capture, but not wait on the
    context; that wait is refused and breaks the capture, as on a real driver."""
    box = node.container("c", "", regions=False)
    r = box.run("init", "ctx", "capturewhile:100", "capturewhile:100:sync", shim=False)
    assert r.returncode == 0, r.stderr
    legal, illegal = r.all("capturewhile")
    assert (legal["other"], legal["end"]) == ("0", "0")
    assert (illegal["other"], illegal["end"]) == (str(CAPTURE_UNSUPPORTED), str(CAPTURE_INVALIDATED))


@pytest.mark.parametrize("mode", ["link", "getproc"])
def test_a_graph_captured_by_a_cold_container_is_not_broken_by_the_limiter(node, mode):
    box = node.container("c", "cores_percent=30")
    r = box.run("init", "ctx", "capture:8:1000", mode=mode)
    assert r.returncode == 0, r.stderr
    cap = r.one("capture")
    assert (cap["begin"], cap["launch"], cap["end"], cap["run"]) == ("0", "0", "0", "0"), cap


def test_a_first_launch_in_another_thread_does_not_break_a_global_capture(node):
    box = node.container("c", "cores_percent=30")
    r = box.run("init", "ctx", "capturewhile:1000")
    assert r.returncode == 0, r.stderr
    kv = r.one("capturewhile")
    assert kv["other"] == "0" and kv["end"] == "0", kv


def test_a_graph_captured_after_idle_is_not_broken_by_the_limiter(node):
    box = node.container("c", "cores_percent=30")
    r = box.run("init", "ctx", "util:0.3:0.3:500:kernel", "sleep:3500", "capture:8:1000")
    assert r.returncode == 0, r.stderr
    assert r.one("capture")["rc"] == "0", r.one("capture")
