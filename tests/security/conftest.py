"""One single-machine hub for every security test (starting a hub costs seconds on two cores).

The hub: local mode, one simulated H100-80GB, users' servers as the hub's account
(``HubUserGPUSpawner``, homes under the test's directory), the real broker and provisioner,
kernel sizes of which two are granted to the group ``vip`` only, server profiles of which one
(a whole card at high priority) is for ``vip`` only, and a service token for a culler run by
the tests themselves (as the Kubernetes Deployment runs it) with exactly the scopes
``culler.service_role`` grants.

Users: alice and bob (ordinary), carol (ordinary, no server unless a test starts one), dave
(in ``vip``). alice's home carries a hostile ``~/.jupyter/jupyter_server_config.py`` that
records every credential sent to her server (what any user may do: the server is their process
and reads their config).
"""

from __future__ import annotations

import secrets
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from culler import service_role
from tests.hubrunner import HubRunner
from tests.kernelprovider.helpers import Server, install_kernelspecs, start_server

CULLER_TOKEN = secrets.token_hex(16)
CULLER_NAME = "sec-culler"
#: a token with what the single-machine CLI needs for `up` (install the kernelspecs): read the sizes
SIZES_TOKEN = secrets.token_hex(16)
ADMISSION = {
    "priority_classes": {
        "high": {"value": 1000, "preempt": True, "borrow": False},
        "default": {"value": 100, "preempt": False, "borrow": False},
    },
    "default_priority_class": "default",
    "placement": {"node": "binpack", "gpu": "binpack"},
    "workspaces": {"default": {"namespaces": {"default": {}}}},
}
SIZES = [
    {"name": "gpu-10g", "display_name": "GPU 10 GiB", "memory_mib": 10240, "cores_percent": 25},
    {
        "name": "gpu-10g-vip",
        "display_name": "GPU 10 GiB (vip)",
        "memory_mib": 10240,
        "cores_percent": 25,
        "allowed_groups": ["vip"],
    },
    {
        "name": "gpu-whole-high",
        "display_name": "Whole GPU, high priority",
        "whole": True,
        "priority_class": "high",
        "allowed_groups": ["vip"],
    },
]
PROFILES = [
    {"display_name": "CPU only", "slug": "cpu", "default": True},
    {
        "display_name": "Whole H100, high priority (vip)",
        "slug": "vip-gpu",
        "allowed_groups": ["vip"],
        "gpu": {"whole": True, "priority_class": "high"},
    },
]
SPEC = "elastic-gpu-gpu-10g"
WHOLE_SPEC = "elastic-gpu-gpu-whole-high"

#: alice's own server config: records the Authorization header and ?token= of every request
CAPTURE_CONFIG = """
import os
from jupyter_server.base.handlers import JupyterHandler

_CAPTURED = os.path.join(os.path.expanduser("~"), "captured-credentials.txt")
_prepare = JupyterHandler.prepare


def _capturing_prepare(self, *args, **kwargs):
    seen = [self.request.headers.get("Authorization", ""), self.get_argument("token", "")]
    with open(_CAPTURED, "a") as f:
        for value in seen:
            if value:
                f.write(value.split()[-1] + "\\n")
    return _prepare(self, *args, **kwargs)


JupyterHandler.prepare = _capturing_prepare
"""


@dataclass
class SecurityHub:
    hub: HubRunner
    work: Path
    tokens: dict[str, str] = field(default_factory=dict)
    servers: dict[str, Server] = field(default_factory=dict)

    def home(self, user: str) -> Path:
        return self.work / "home" / user

    def server(self, user: str) -> Server:
        if user not in self.servers:
            start_server(self.hub, user, self.tokens[user])
            self.servers[user] = Server(self.hub, user, self.tokens[user])
        return self.servers[user]


@pytest.fixture(scope="session")
def sec(tmp_path_factory) -> SecurityHub:
    work = tmp_path_factory.mktemp("security")
    (work / "admission.yaml").write_text(yaml.safe_dump(ADMISSION))
    prefix = work / "jupyter-prefix"
    capture = work / "home" / "alice" / ".jupyter"
    capture.mkdir(parents=True)
    (capture / "jupyter_server_config.py").write_text(CAPTURE_CONFIG)
    role = service_role(CULLER_NAME, ["custom:elastic-gpu:admin"])
    config = textwrap.dedent(
        f"""
        from hubext.hubconfig import configure_hub
        configure_hub(c, mode="local", admission_config_file={str(work / "admission.yaml")!r},
                      simulate_gpus="1xH100-80GB", data_dir={str(work / "data")!r}, culler=False)
        c.JupyterHub.spawner_class = "hubext.local.spawner.HubUserGPUSpawner"
        c.HubUserGPUSpawner.home_dir_template = {str(work / "home" / "{username}")!r}
        c.HubUserGPUSpawner.profile_list = {PROFILES!r}
        c.Spawner.environment = {{"JUPYTER_PATH": {str(prefix / "share" / "jupyter")!r}}}
        c.JupyterHub.cleanup_servers = False
        c.Spawner.default_url = "/tree"
        c.GPUBroker.kernel_sizes = {SIZES!r}
        c.GPUBroker.reconcile_interval_seconds = 1
        c.LocalPool.check_interval_seconds = 0.5
        c.LocalPool.evict_grace_seconds = 2
        c.LocalKernelLauncher.stop_grace_seconds = 1
        c.JupyterHub.services.append({{"name": {CULLER_NAME!r}, "api_token": {CULLER_TOKEN!r}}})
        c.JupyterHub.load_roles.append({role!r})
        c.JupyterHub.services.append({{"name": "sec-cli", "api_token": {SIZES_TOKEN!r}}})
        c.JupyterHub.load_roles.append(
            {{"name": "sec-cli", "services": ["sec-cli"], "scopes": ["custom:elastic-gpu:sizes"]}}
        )
        """
    )
    hub = HubRunner(work, config)
    hub.start()
    try:
        s = SecurityHub(hub, work)
        s.tokens = {name: hub.user_token(name) for name in ("alice", "bob", "carol", "dave")}
        status, body = hub.api("POST", "/groups/vip", body={"users": ["dave"]})
        assert status == 201, body
        install_kernelspecs(hub, hub.admin_token, prefix)  # every size, as an admin's install would
        yield s
    finally:
        hub.stop()
