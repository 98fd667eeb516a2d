"""LocalGPUSpawner without a hub: profile validation, choosing a profile from user options (forged
or hidden ones refused with a sentence), the form, overrides and the GPU environment."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from traitlets import TraitError

from hubext.allocator import GPUAllocator
from hubext.gpu_spawner import GPUSpawnError
from hubext.local.spawner import HubUserGPUSpawner, LocalGPUSpawner, gpu_summary, normalize_profile_list

PROFILES = [
    {"display_name": "CPU only", "default": True},
    {
        "display_name": "1/4 H100",
        "slug": "h100-quarter",
        "gpu": {"memory_mib": 20480, "cores_percent": 25, "model": "H100-80GB"},
        "spawner_override": {"default_url": "/lab/tree/gpu", "environment": {"PROFILE": "quarter"}},
    },
    {
        "display_name": "Sized H100",
        "slug": "h100-sized",
        "profile_options": {
            "size": {
                "display_name": "Size",
                "choices": {
                    "small": {"display_name": "10 GiB", "gpu": {"memory_mib": 10240, "cores_percent": 10}},
                    "large": {"display_name": "40 GiB", "default": True, "gpu": {"memory_mib": 40960}},
                },
            }
        },
        "gpu": {"cores_percent": 50},
    },
    {"display_name": "Vision team A100", "slug": "vision", "allowed_groups": ["vision"], "gpu": {"whole": True}},
]


class Group:
    def __init__(self, name: str) -> None:
        self.name = name


def spawner(groups: tuple[str, ...] = (), options: dict | None = None, **traits) -> LocalGPUSpawner:
    user = SimpleNamespace(name="alice", groups=[Group(g) for g in groups], url="/user/alice/", escaped_name="alice")
    sp = LocalGPUSpawner(user=user, profile_list=traits.pop("profile_list", PROFILES), **traits)
    sp.user_options = options or {}
    return sp


@pytest.fixture
def simulated_allocator(tmp_path):
    GPUAllocator.clear_instance()
    from traitlets.config import Config

    c = Config()
    c.GPUAllocator.pool_backend_class = "hubext.local.pool.LocalPool"
    c.LocalPool.simulate_gpus = "2xH100-80GB"
    c.LocalPool.data_dir = str(tmp_path)
    allocator = GPUAllocator.instance(config=c)
    yield allocator
    GPUAllocator.clear_instance()


# ---- the admin's profile_list ------------------------------------------------------------------


def test_profiles_get_slugs_from_display_names():
    assert [p["slug"] for p in normalize_profile_list(PROFILES)] == ["cpu-only", "h100-quarter", "h100-sized", "vision"]


@pytest.mark.parametrize(
    "profiles,message",
    [
        ([{"slug": "x"}], r"profile_list\[0\] needs a display_name"),
        ([{"display_name": "A", "image": "x"}], r"unknown key\(s\) image; allowed: .*spawner_override"),
        ([{"display_name": "A"}, {"display_name": "A"}], r"profile 'a': slug is used by two profiles"),
        ([{"display_name": "A", "gpu": {"memory_mib": "20G"}}], r"profile 'a'.gpu.memory_mib must be int"),
        ([{"display_name": "A", "allowed_groups": "vision"}], r"allowed_groups must be a list of group names"),
        (
            [{"display_name": "A", "profile_options": {"size": {"choices": {}, "unlisted_choice": {"enabled": True}}}}],
            r"profile_options.size needs a non-empty 'choices'",
        ),
        (
            [
                {
                    "display_name": "A",
                    "profile_options": {"size": {"choices": {"s": {}}, "unlisted_choice": {"enabled": True}}},
                }
            ],
            r"unlisted_choice is not supported",
        ),
    ],
)
def test_bad_profile_list_is_refused_naming_the_entry(profiles, message):
    with pytest.raises(ValueError, match=message):
        normalize_profile_list(profiles)


def test_bad_profile_list_in_config_names_the_trait():
    with pytest.raises(TraitError, match=r"LocalGPUSpawner.profile_list\[0\] needs a display_name"):
        spawner(profile_list=[{"slug": "nameless"}])


# ---- choosing a profile -------------------------------------------------------------------------


async def test_no_options_picks_the_default_profile():
    assert (await spawner()._select_profile())["slug"] == "cpu-only"


async def test_a_visible_profile_and_offered_choice_are_accepted():
    sp = spawner(options={"profile": "h100-sized", "size": "small"})
    assert (await sp._select_profile())["slug"] == "h100-sized"


async def test_unknown_profile_is_refused_listing_the_visible_ones():
    with pytest.raises(GPUSpawnError, match=r"No server profile 'h200' is available to you. Choose one of: cpu-only, "):
        await spawner(options={"profile": "h200"})._select_profile()


async def test_profile_of_another_group_is_refused_as_unknown():
    with pytest.raises(GPUSpawnError, match=r"No server profile 'vision' is available") as e:
        await spawner(options={"profile": "vision"})._select_profile()
    assert "vision" not in e.value.message.split("Choose one of:")[1]
    assert (await spawner(groups=("vision",), options={"profile": "vision"})._select_profile())["slug"] == "vision"


async def test_forged_gpu_option_is_refused_naming_what_is_allowed():
    sp = spawner(options={"profile": "h100-quarter", "gpu": {"memory_mib": 81920}})
    with pytest.raises(GPUSpawnError, match=r"Unknown server option\(s\) 'gpu' for profile 'h100-quarter'") as e:
        await sp._select_profile()
    assert e.value.status_code == 400


async def test_forged_choice_is_refused_naming_the_offered_ones():
    sp = spawner(options={"profile": "h100-sized", "size": "huge"})
    with pytest.raises(GPUSpawnError, match=r"no choice 'huge' for 'size'. Choose one of: small, large"):
        await sp._select_profile()


async def test_nobody_may_spawn_when_every_profile_is_restricted():
    sp = spawner(profile_list=[PROFILES[3]])
    with pytest.raises(GPUSpawnError, match="No server profile is available to you") as e:
        await sp._select_profile()
    assert e.value.status_code == 403


async def test_profile_overrides_set_traits_and_merge_dicts():
    sp = spawner(options={"profile": "h100-quarter"}, environment={"KEEP": "1"})
    profile = await sp._select_profile()
    sp._apply_profile_overrides(profile)
    assert sp.default_url == "/lab/tree/gpu"
    assert sp.environment == {"KEEP": "1", "PROFILE": "quarter"}


def test_form_data_becomes_user_options_of_the_chosen_profile_only():
    form = {
        "profile": ["h100-sized"],
        "profile-option-h100-sized--size": ["small"],
        "profile-option-other--size": ["large"],
    }
    assert spawner()._options_from_form(form) == {"profile": "h100-sized", "size": "small"}


def test_cpu_servers_see_no_gpu_and_gpu_servers_get_the_shim_env(tmp_path):
    hub = SimpleNamespace(public_host="", api_url="http://127.0.0.1:8081/hub/api", base_url="/hub/", url="")
    user = SimpleNamespace(name="alice", groups=[], url="/user/alice/", escaped_name="alice")
    sp = HubUserGPUSpawner(user=user, hub=hub, home_dir_template=str(tmp_path / "{username}"))
    assert sp.get_env()["CUDA_VISIBLE_DEVICES"] == ""
    sp.__dict__["_gpu_env"] = {"CUDA_VISIBLE_DEVICES": "GPU-1", "LIBVGPU_CONFIG": "/x/limits.conf"}
    env = sp.get_env()
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-1" and env["LIBVGPU_CONFIG"] == "/x/limits.conf"
    assert env["HOME"] == str(tmp_path / "alice")  # the hub-user spawner's per-user home


@pytest.mark.parametrize(
    "section,text",
    [
        ({"memory_mib": 20480, "cores_percent": 25, "model": "H100-80GB"}, "20 GiB, 25 % compute · H100-80GB"),
        ({"memory_mib": 1536, "cores_percent": 5}, "1.5 GiB, 5 % compute"),
        ({"whole": True, "count": 2, "model": "A100"}, "2 whole A100s"),
        (None, ""),
    ],
)
def test_gpu_sections_are_summarised_for_people(section, text):
    assert gpu_summary(section) == text


async def test_form_lists_visible_profiles_and_says_gpus_are_simulated(simulated_allocator):
    html = await spawner(groups=())._render_options_form()
    assert "Simulated GPUs" in html and "2 × H100-80GB" in html
    assert 'value="h100-quarter"' in html and 'value="vision"' not in html
    assert 'name="profile-option-h100-sized--size"' in html
    assert '<option value="large" selected>' in html  # the default choice
    assert 'id="egpu-profile-cpu-only" value="cpu-only" checked' in html


def test_gpu_owner_mapping_is_configurable_on_the_local_spawner():
    from traitlets.config import Config

    c = Config()
    c.LocalGPUSpawner.gpu_owner_mapping = {"alice": "vision/research", "group:ml": "ml"}
    user = SimpleNamespace(name="alice", groups=[], url="/user/alice/", escaped_name="alice")
    owner = LocalGPUSpawner(user=user, config=c).gpu_owner()
    assert (owner.user, owner.workspace, owner.namespace) == ("alice", "vision", "research")
    bob = SimpleNamespace(name="bob", groups=[Group("ml")], url="/user/bob/", escaped_name="bob")
    assert LocalGPUSpawner(user=bob, config=c).gpu_owner().workspace == "ml"


async def test_every_progress_reader_gets_each_event_and_ends_when_admission_finishes():
    """Two readers of one spawn's progress (two open spawn pages), one of them slow: each gets every
    event in order, and both end when admission finishes, with no event left behind."""
    import asyncio

    sp = spawner()
    sp.gpu_reset_progress()
    seen: dict[str, list[str]] = {"fast": [], "slow": []}

    async def read(name: str) -> None:
        async for event in sp.gpu_progress_events():
            seen[name].append(event["message"])
            if name == "slow":
                await asyncio.sleep(0.05)  # still busy with this event when the next is queued

    readers = [asyncio.create_task(read(name)) for name in seen]
    for message in ("Checking GPU quota", "Queued: no requests ahead.", "Placed on node-1 / GPU-1"):
        await asyncio.sleep(0.02)
        sp.gpu_progress(message)
    sp.gpu_admission_finished()
    await asyncio.wait_for(asyncio.gather(*readers), 10)  # the spawner's start_timeout is 60 s
    expected = ["Checking GPU quota", "Queued: no requests ahead.", "Placed on node-1 / GPU-1"]
    assert seen == {"fast": expected, "slow": expected}


async def test_the_account_a_running_server_runs_as_is_one_the_backstop_answers_for(simulated_allocator):
    """A CPU server too: its user could leave it (setsid, env -i) and open the GPU; the backstop
    then kills GPU processes of that account that belong to no slice (tests/libvgpu/test_backstop_local.py).
    The hub's first poll of a server that outlived it reports it the same way."""
    import os
    import pwd
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("runs a server process as another account")
    nobody = pwd.getpwnam("nobody")
    server = subprocess.Popen(["sleep", "60"], user=nobody.pw_uid, group=nobody.pw_gid, extra_groups=[])
    try:
        sp = spawner()
        sp.pid = server.pid
        assert nobody.pw_uid not in simulated_allocator.backend.server_accounts()
        assert await sp.poll() is None
        assert simulated_allocator.backend.server_accounts()[nobody.pw_uid] == "nobody"
    finally:
        server.kill()
        server.wait()
