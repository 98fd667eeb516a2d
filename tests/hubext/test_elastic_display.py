"""An elastic slice is shown as 'X guaranteed, up to Y' with its memory in use wherever a slice is
shown: the pool view (API and admin page), the user's home, the CLI, the kernels API (issue 27)."""

from __future__ import annotations

import asyncio

import pytest

from hubext.admin import pool_view
from hubext.cli.render import render_pool
from tests.kernelprovider.helpers import ADMISSION, local_stack

from .test_elastic_allocation import ELASTIC

NODES = [{"name": "gpu-node-1", "gpus": [{"uuid": "GPU-aaaa", "model": "H100-80GB", "memory_mib": 81920, "index": 0}]}]


def test_the_pool_view_shows_request_limit_and_memory_in_use_and_counts_the_request():
    view = pool_view(NODES, [ELASTIC.to_dict()], simulated=False, now=ELASTIC.created_at + 60,
                     slice_use={ELASTIC.id: {"memory_used_mib": 30720, "last_launch": None}})
    gpu = view["nodes"][0]["gpus"][0]
    [s] = gpu["slices"]
    assert s["memory_text"] == "20 GiB guaranteed, up to 40 GiB"
    assert s["cores_text"] == "25% guaranteed, up to 100%"
    assert (s["memory_mib"], s["memory_limit_mib"], s["memory_in_use_mib"]) == (20480, 40960, 30720)
    assert s["in_use_text"] == "30 GiB in use"
    assert (gpu["used_memory_mib"], gpu["used_cores_percent"]) == (20480, 25)  # the request, as admission counts
    unmeasured = pool_view(NODES, [ELASTIC.to_dict()], simulated=False)["nodes"][0]["gpus"][0]["slices"][0]
    assert unmeasured["memory_in_use_mib"] is None and unmeasured["in_use_text"] == ""


def test_the_cli_prints_an_elastic_slices_limit_and_use_under_it():
    view = pool_view(NODES, [ELASTIC.to_dict()], simulated=False, now=ELASTIC.created_at + 60,
                     slice_use={ELASTIC.id: {"memory_used_mib": 30720}})
    text = render_pool(view, "hub")
    line = next(i for i, t in enumerate(text.splitlines()) if ELASTIC.id in t)
    assert text.splitlines()[line + 1].split() == (
        "memory 20 GiB guaranteed, up to 40 GiB; compute 25% guaranteed, up to 100%; 30 GiB in use".split()
    )


SIZES = [{"name": "gpu-el", "display_name": "GPU elastic", "memory_mib": 10240, "memory_limit_mib": 40960,
          "cores_percent": 25, "cores_limit_percent": 100}]
PROFILES = [
    {"display_name": "CPU only", "slug": "cpu", "default": True},
    {"display_name": "GPU grows", "slug": "grows",
     "gpu": {"memory_mib": 20480, "memory_limit_mib": 40960, "cores_percent": 25, "cores_limit_percent": 50}},
]
EXTRA = f"""
c.HubUserGPUSpawner.profile_list = {PROFILES!r}
c.Authenticator.admin_users = {{"admin"}}
c.JupyterHub.allow_named_servers = True
c.Authenticator.allow_all = True
"""


@pytest.mark.timeout(300)
async def test_a_real_hub_shows_elastic_slices_on_every_page_and_api(tmp_path):
    admission = {**ADMISSION, "workspaces": {"default": {"namespaces": {"default": {}}}}}  # no user limit
    with local_stack(tmp_path, admission=admission, sizes=SIZES, extra_config=EXTRA) as st:
        hub, alice = st["hub"], st["alice"]
        status, body = hub.api("POST", "/users/alice/servers/big", None, {"profile": "grows"})
        assert status in (201, 202), body
        hub.wait_for(lambda: ((hub.api("GET", "/users/alice")[1].get("servers") or {}).get("big") or {}).get("ready"),
                     90, 0.5, "alice's elastic GPU server")
        status, session = await asyncio.to_thread(alice.start_session, "elastic-gpu-gpu-el")
        assert status == 201, session

        status, pool = hub.api("GET", "/gpu/pool")
        assert status == 200, pool
        shown = sorted((s["kind"], s["memory_text"], s["cores_text"]) for s in pool["nodes"][0]["gpus"][0]["slices"])
        assert shown == [("kernel", "10 GiB guaranteed, up to 40 GiB", "25% guaranteed, up to 100%"),
                         ("notebook", "20 GiB guaranteed, up to 40 GiB", "25% guaranteed, up to 50%")]
        assert pool["nodes"][0]["gpus"][0]["used_memory_mib"] == 30720  # requests only

        status, kernels = hub.api("GET", "/gpu/kernels")
        [k] = kernels["kernels"]
        assert (k["memory_mib"], k["memory_limit_mib"], k["cores_limit_percent"]) == (10240, 40960, 100)

        home = hub.login("alice").open(hub.url + "/hub/home", timeout=60).read().decode()
        assert "20 GiB guaranteed, up to 40 GiB" in home and "10 GiB guaranteed, up to 40 GiB" in home
        assert "25% guaranteed, up to 50%" in home
        admin = hub.login("admin").open(hub.url + "/hub/gpu", timeout=60).read().decode()
        assert "20 GiB guaranteed, up to 40 GiB" in admin and "25% guaranteed, up to 100%" in admin

        await asyncio.to_thread(alice.api, "DELETE", f"/sessions/{session['id']}")
        hub.api("DELETE", "/users/alice/servers/big")
