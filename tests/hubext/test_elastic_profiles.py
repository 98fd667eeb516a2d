"""Elastic profiles and kernel sizes (issue 27): a request and a limit for memory and compute,
checked with a sentence wherever an admin writes them, and shown as 'X guaranteed, up to Y'."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from traitlets import TraitError

from hubext.broker.sizes import BrokerError, validate_sizes
from hubext.gpu_spawner import GPUSpawnError
from hubext.kubernetes.objects import apply_gpu_to_pod
from hubext.kubernetes.spawner import ElasticGPUSpawner
from hubext.local.spawner import LocalGPUSpawner, gpu_summary
from hubext.requests import profile_gpu_section, request_from_section
from quotas import Owner
from quotas.messages import compute_size, memory_size
from tests.kubeemu.fixtures import kube_emulator  # noqa: F401

from .test_elastic_allocation import ELASTIC

ELASTIC_PROFILE = {
    "display_name": "H100, grows",
    "slug": "h100-elastic",
    "gpu": {"memory_mib": 20480, "memory_limit_mib": 40960, "cores_percent": 25, "cores_limit_percent": 100},
}


USER = SimpleNamespace(name="alice", groups=[], url="/user/alice/", escaped_name="alice", id=1)


def local(profiles):
    return LocalGPUSpawner(user=USER, profile_list=profiles)


@pytest.fixture
def kubeconfig(kube_emulator):  # noqa: F811
    """KubeSpawner loads its client configuration when it is built, once per process
    (``kubespawner.clients.load_config`` is cached): it must load the process's one emulator. A
    kubeconfig of its own here (an unreachable https://127.0.0.1:1) became every later Kubernetes
    test's API server in the same pytest worker."""
    return kube_emulator.kubeconfig_path


def kube(profiles):
    """A spawner built as the hub builds one: profile_list from its config."""
    from traitlets.config import Config

    c = Config()
    c.ElasticGPUSpawner.profile_list = profiles
    return ElasticGPUSpawner(_mock=True, user=USER, config=c)


def test_an_elastic_section_asks_for_its_request_and_carries_its_limit():
    section = profile_gpu_section(ELASTIC_PROFILE, {})
    r = request_from_section(section, Owner("alice"), "r1", kind="notebook")
    assert (r.memory_mib, r.memory_limit_mib, r.cores_percent, r.cores_limit_percent) == (20480, 40960, 25, 100)


@pytest.mark.parametrize(
    "gpu,sentence",
    [
        ({"memory_mib": 20480, "memory_limit_mib": 10240, "cores_percent": 25},
         "LocalGPUSpawner.profile 'p'.gpu: memory_limit_mib (10240) is below memory_mib (20480); a limit is "
         "how far the slice may grow, so it must be at least what it asks for."),
        ({"memory_mib": 20480, "cores_percent": 50, "cores_limit_percent": 25},
         "LocalGPUSpawner.profile 'p'.gpu: cores_limit_percent (25) must be between cores_percent (50) and "
         "100; a limit is how far the slice may grow, at most the whole card."),
        ({"memory_mib": 20480, "cores_percent": 50, "cores_limit_percent": 150}, "cores_limit_percent (150)"),
        ({"whole": True, "memory_limit_mib": 40960},
         "a whole GPU or a MIG slice cannot grow, so it takes no memory_limit_mib"),
        ({"memory_mib": 20480, "cores_percent": 5, "memory_limit_mib": -1}, "memory_limit_mib must be 0 or more"),
        ({"memory_mib": 20480, "cores_percent": 5, "memory_limit_mib": "40 GiB"}, "memory_limit_mib must be int"),
    ],
)
def test_a_bad_limit_in_the_local_profile_list_is_refused_with_a_sentence(gpu, sentence):
    with pytest.raises(TraitError) as e:
        local([{"display_name": "P", "slug": "p", "gpu": gpu}])
    assert sentence in str(e.value)


def test_a_choice_that_asks_for_more_than_the_profile_lets_it_grow_to_is_refused_naming_the_choice():
    profile = {
        "display_name": "Sized", "slug": "sized",
        "gpu": {"cores_percent": 25, "memory_limit_mib": 40960},
        "profile_options": {"size": {"choices": {
            "small": {"display_name": "20 GiB", "gpu": {"memory_mib": 20480}},
            "huge": {"display_name": "60 GiB", "gpu": {"memory_mib": 61440}},
        }}},
    }
    with pytest.raises(TraitError) as e:
        local([profile])
    assert ("profile 'sized' with option 'size' choice 'huge': memory_limit_mib (40960) is below memory_mib "
            "(61440)") in str(e.value)
    with pytest.raises(TraitError, match="choice 'huge': memory_limit_mib"):
        kube([profile])


async def test_a_bad_limit_in_the_kubernetes_profile_list_is_refused_with_a_sentence(kubeconfig):
    bad = {**ELASTIC_PROFILE, "gpu": {**ELASTIC_PROFILE["gpu"], "memory_limit_mib": 1024}}
    with pytest.raises(TraitError) as e:
        kube([bad])
    assert str(e.value).startswith(
        "ElasticGPUSpawner.profile_list: profile 'h100-elastic'.gpu: memory_limit_mib (1024) is below memory_mib"
    )
    assert kube([ELASTIC_PROFILE]).profile_list == [ELASTIC_PROFILE]


def test_a_bad_limit_in_a_kernel_size_is_refused_with_a_sentence():
    with pytest.raises(BrokerError) as e:
        validate_sizes([{"name": "g", "memory_mib": 20480, "cores_percent": 25, "memory_limit_mib": 10240}])
    assert "GPUBroker.kernel_sizes[0] (g).gpu: memory_limit_mib (10240) is below memory_mib (20480)" in e.value.message
    sizes = validate_sizes([{"name": "g", "memory_mib": 20480, "cores_percent": 25, "memory_limit_mib": 40960,
                             "cores_limit_percent": 100}])
    assert sizes[0]["gpu"]["memory_limit_mib"] == 40960
    assert sizes[0]["display_name"] == "GPU 20 GiB guaranteed, up to 40 GiB"


async def test_a_profile_made_bad_at_spawn_time_is_refused_with_a_sentence_not_a_traceback():
    profile = {"display_name": "Bad", "slug": "bad", "gpu": {"memory_mib": 20480, "cores_percent": 25,
                                                             "memory_limit_mib": 1024}}
    sp = LocalGPUSpawner(user=USER, profile_list=lambda spawner: [profile])
    sp.__dict__["_gpu_profile"] = profile
    with pytest.raises(GPUSpawnError) as e:
        await sp.gpu_admit()
    assert e.value.message.startswith(
        "The server profiles are misconfigured (profile 'bad'.gpu: memory_limit_mib (1024)"
    )
    assert e.value.message.endswith("Ask an admin to fix them.")


async def test_a_backend_that_cannot_let_a_slice_grow_refuses_an_elastic_one():
    from kubespawner.objects import make_pod

    pod = make_pod(name="jupyter-alice", cmd=["jupyterhub-singleuser"], port=8888, image="x",
                   labels={}, annotations={})
    with pytest.raises(GPUSpawnError) as e:
        apply_gpu_to_pod(pod, ELASTIC, backend="hami", section=ELASTIC_PROFILE["gpu"], priority_value=100,
                         priority_class_name="p", runtime_class="nvidia", server="")
    assert "only the 'native' GPU backend enforces; with 'hami' it could not grow" in e.value.message
    fixed = dataclasses.replace(ELASTIC, memory_limit_mib=0, cores_limit_percent=0)
    apply_gpu_to_pod(pod, fixed, backend="hami", section={"memory_mib": 20480}, priority_value=100,
                     priority_class_name="p", runtime_class="nvidia", server="")


def test_a_slice_is_shown_as_guaranteed_up_to_its_limit():
    assert memory_size(20480, 40960) == "20 GiB guaranteed, up to 40 GiB"
    assert memory_size(20480, 0) == "20 GiB" and memory_size(20480, 20480) == "20 GiB"
    assert compute_size(25, 100) == "25% guaranteed, up to 100%"
    assert compute_size(25) == "25%"
    assert gpu_summary(ELASTIC_PROFILE["gpu"]) == (
        "20 GiB guaranteed, up to 40 GiB · compute 25% guaranteed, up to 100%"
    )
    assert gpu_summary({"memory_mib": 20480, "cores_percent": 25}) == "20 GiB, 25 % compute"
