"""A hub killed just before it answers a kernel start: the server was told the start failed, so
nothing will ever use or stop that kernel. It must not keep its process and slice beyond the
reconciliation that follows the claim timeout (the server's provisioner asks about every kernel it
has at once and then every few seconds; one never asked about is an orphan).

Its own hub (the test kills it); the crash is the test's config wrapping the broker's create.
"""

from __future__ import annotations

import os
import signal
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.hubrunner import HubRunner
from tests.kernelprovider.helpers import Server, install_kernelspecs, start_server
from tests.security.conftest import ADMISSION, SIZES, SPEC
from tests.security.helpers import pid_alive, used_mib, wait_until

CLAIM_SECONDS = 4


def alice_kernel_processes(data_dir: Path) -> list[int]:
    """alice's GPU kernel processes of the hub whose data is in ``data_dir`` (other tests' hubs may
    run kernels of an 'alice' too: those are not this test's)."""
    found = []
    marker = f"LIBVGPU_CONFIG={data_dir}/".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ours = any(v.startswith(marker) for v in env)
        if (
            ours
            and any(v.startswith(b"ELASTIC_GPU_ALLOCATION_ID=kernel-alice-") for v in env)
            and pid_alive(int(entry.name))
        ):
            found.append(int(entry.name))
    return found


@pytest.fixture
def crashing_hub(tmp_path):
    (tmp_path / "admission.yaml").write_text(yaml.safe_dump(ADMISSION))
    prefix = tmp_path / "jupyter-prefix"
    flag = tmp_path / "crash-on-next-kernel"
    config = textwrap.dedent(
        f"""
        import os, signal
        from hubext.hubconfig import configure_hub
        from hubext.broker import GPUBroker
        configure_hub(c, mode="local", admission_config_file={str(tmp_path / "admission.yaml")!r},
                      simulate_gpus="1xH100-80GB", data_dir={str(tmp_path / "data")!r}, culler=False)
        c.JupyterHub.spawner_class = "hubext.local.spawner.HubUserGPUSpawner"
        c.HubUserGPUSpawner.home_dir_template = {str(tmp_path / "home" / "{username}")!r}
        c.Spawner.environment = {{"JUPYTER_PATH": {str(prefix / "share" / "jupyter")!r}}}
        c.JupyterHub.cleanup_servers = False
        c.GPUBroker.kernel_sizes = {SIZES!r}
        c.GPUBroker.reconcile_interval_seconds = 1
        c.GPUBroker.claim_timeout_seconds = {CLAIM_SECONDS}

        _create = GPUBroker.create

        async def create_then_crash(self, *args, **kwargs):
            record = await _create(self, *args, **kwargs)
            if os.path.exists({str(flag)!r}):  # the kernel runs, the answer is not sent yet
                os.unlink({str(flag)!r})
                os.kill(os.getpid(), signal.SIGKILL)
            return record

        GPUBroker.create = create_then_crash
        """
    )
    hub = HubRunner(tmp_path, config)
    hub.start()
    try:
        yield hub, flag, prefix
    finally:
        hub.stop()
        for pid in alice_kernel_processes(tmp_path / "data"):  # whatever the test left behind
            os.kill(pid, signal.SIGKILL)


def test_a_kernel_whose_start_answer_was_lost_is_not_left_running(crashing_hub):
    hub, flag, prefix = crashing_hub
    data_dir = prefix.parent / "data"
    token = hub.user_token("alice")
    install_kernelspecs(hub, hub.admin_token, prefix)
    start_server(hub, "alice", token)
    alice = Server(hub, "alice", token)
    flag.write_text("")
    status, body = alice.start_session(SPEC)
    assert status >= 500, f"the kernel start succeeded although the hub died answering it: {status} {body}"
    hub.proc.wait(30)
    assert alice_kernel_processes(data_dir), "the crash came too early: no kernel was started"
    hub.start()
    wait_until(
        lambda: not alice_kernel_processes(data_dir) and used_mib(hub) == 0,
        CLAIM_SECONDS + 30,
        "the orphaned kernel's process and slice to be gone",
        log=hub.log_tail,
    )
    status, body = hub.api("GET", "/gpu/kernels?user=alice")
    assert status == 200 and body["kernels"] == [], body
