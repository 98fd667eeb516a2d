"""The hub hands its c.GPUCuller section to the hub-managed culler ($ELASTIC_GPU_CULLER_CONFIG)."""

from __future__ import annotations

import json

import pytest

from culler import HUB_SETTINGS_ENV, hub_settings, service_spec
from culler.app import GPUCuller


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "t" * 32)
    GPUCuller.clear_instance()
    yield monkeypatch
    GPUCuller.clear_instance()


def test_the_service_spec_carries_the_hub_settings_function():
    spec = service_spec(port=9401, proxy_url="http://127.0.0.1:8000")
    assert spec["environment"][HUB_SETTINGS_ENV] is hub_settings
    assert hub_settings(None) == "{}"  # outside a hub


def test_the_hubs_section_is_applied_and_the_command_line_wins(fresh):
    section = {"idle_timeout_seconds": 1800, "warning_seconds": 60, "proxy_url": "http://127.0.0.1:8000"}
    fresh.setenv(HUB_SETTINGS_ENV, json.dumps(section))
    culler = GPUCuller.instance()
    culler.initialize(["--GPUCuller.warning_seconds=30"])
    assert culler.idle_timeout_seconds == 1800 and culler.warning_seconds == 30


def test_a_bad_section_is_refused_with_a_sentence(fresh, capsys):
    fresh.setenv(HUB_SETTINGS_ENV, "[1, 2]")
    with pytest.raises(SystemExit) as exit_:
        GPUCuller.instance().initialize([])
    assert exit_.value.code == 2
    assert "must be a JSON object of GPUCuller settings, got '[1, 2]'" in capsys.readouterr().err
