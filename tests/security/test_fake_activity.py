"""Attack: keep a GPU slice forever by writing a far-future last launch into one's activity record.

The activity record lives in the slice's region directory, which the kernel's own processes
write (the shim does, from inside the user's process). Code in alice's kernel writes a record
whose last launch is a year ahead, once, then leaves the kernel idle. The culler must still
reclaim it: a record is believed no further than the moment the culler first saw it.
"""

from __future__ import annotations

import inspect
import time

import pytest

from tests.culler import shimrecord
from tests.culler.stack import CullerProcess
from tests.security.conftest import CULLER_TOKEN, SPEC
from tests.security.helpers import Session, broker_kernels, used_mib, wait_until

YEAR = 365 * 24 * 3600


def forge_code(last_launch: float) -> str:
    """Cell code that writes the shim's activity record of the kernel's own slice."""
    constants = "".join(
        f"{name} = {getattr(shimrecord, name)!r}\n" for name in ("MAGIC", "VERSION", "KIND_ACTIVITY", "SIZE")
    )
    return (
        "import os, struct, time\n"
        + constants
        + inspect.getsource(shimrecord.write_activity)
        + "\npath = os.path.join(os.path.dirname(os.environ['LIBVGPU_CONTAINER_REGION']), 'activity')\n"
        + f"write_activity(path, last_launch={last_launch!r}, used_mib=(512,), launches=1)\n"
        + "print(path)\n"
    )


@pytest.fixture
def culler(sec):
    procs: list[CullerProcess] = []
    yield lambda name, **traits: procs.append(CullerProcess(sec.hub, sec.work, CULLER_TOKEN, name, **traits).start())
    for proc in procs:
        proc.stop()


def test_a_far_future_last_launch_does_not_keep_an_idle_kernel(sec, culler):
    hub = sec.hub
    session = Session(sec.server("alice"), SPEC)
    try:
        path = session.run(forge_code(time.time() + YEAR)).strip()
        assert path == broker_kernels(hub)[session.kernel_id]["activity_file"], "wrote somewhere else"
        session.tab.close()
        session._tab = None
        culler("sec-activity", idle_timeout_seconds=3, warning_seconds=0, gpu_busy_window_seconds=2)
        wait_until(
            lambda: session.kernel_id not in broker_kernels(hub),
            30,
            "the culler to reclaim the idle kernel whose record claims a launch a year from now",
        )
        wait_until(lambda: used_mib(hub) == 0, 10, "the slice to be back in the pool")
    finally:
        session.close()
