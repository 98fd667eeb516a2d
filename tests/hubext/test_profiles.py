"""Profile gpu sections: merged from profile and choices, validated with messages naming the key,
forged choices refused."""

import pytest

from hubext.gpu_spawner import GPUSpawnError, check_forged_options
from hubext.requests import profile_gpu_section, validate_gpu_section

PROFILE = {
    "slug": "h100",
    "display_name": "H100 slice",
    "gpu": {"memory_mib": 20480, "cores_percent": 25, "model": "H100-80GB"},
    "profile_options": {
        "size": {
            "display_name": "Size",
            "choices": {
                "quarter": {"display_name": "1/4", "gpu": {"memory_mib": 20480, "cores_percent": 25}},
                "half": {"display_name": "1/2", "default": True, "gpu": {"memory_mib": 40960, "cores_percent": 50}},
            },
        }
    },
}


def test_choice_gpu_section_overrides_the_profile_section():
    assert profile_gpu_section(PROFILE, {"size": "quarter"}) == {
        "memory_mib": 20480,
        "cores_percent": 25,
        "model": "H100-80GB",
    }


def test_default_choice_applies_when_the_user_chose_nothing():
    assert profile_gpu_section(PROFILE, {})["memory_mib"] == 40960


def test_profile_without_gpu_section_is_a_cpu_notebook():
    assert profile_gpu_section({"slug": "cpu", "display_name": "CPU"}, {}) is None


def test_forged_choice_is_refused_naming_the_allowed_choices():
    with pytest.raises(GPUSpawnError, match="no choice 'eight-gpus'.*quarter, half"):
        check_forged_options(PROFILE, {"size": "eight-gpus"})
    check_forged_options(PROFILE, {"size": "half"})  # offered: accepted


@pytest.mark.parametrize(
    "section,message",
    [
        ({"memory_mib": "lots"}, r"profile 'p'.gpu.memory_mib must be int, got 'lots'"),
        ({"memory": 10}, r"unknown key\(s\) memory; allowed: "),
        ({"whole": "yes"}, r"gpu.whole must be bool"),
        ({"count": True}, r"gpu.count must be int"),
        ("20GiB", r"must be a mapping"),
    ],
)
def test_bad_admin_gpu_section_names_the_key(section, message):
    with pytest.raises(ValueError, match=message):
        validate_gpu_section(section, "profile 'p'")
