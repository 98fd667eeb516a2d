"""`elastic-gpu` without a running hub: every option is described, `init` writes a config that
loads and is sized from the GPUs, and mistakes give one clear line, not a traceback."""

from __future__ import annotations

import argparse
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from traitlets.config import PyFileConfigLoader

from hubext import cli
from hubext.cli import base, config, proxy
from hubext.local.spawner import normalize_profile_list
from quotas import load_config

ELASTIC_GPU = Path(sys.executable).parent / "elastic-gpu"


def subcommand(name: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [str(ELASTIC_GPU)] if ELASTIC_GPU.exists() else [sys.executable, "-m", "hubext.cli"]
    return subprocess.run(
        cmd + list(args), capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})}
    )


@pytest.mark.parametrize("command", ["up", "status", "init", "quota"])
def test_help_describes_every_option(command):
    result = run_cli(command, "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    for action in subcommand(command)._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help and len(action.help) > 20, f"{command} {action.option_strings} has no real help"
        for option in action.option_strings:
            assert option in text, f"`elastic-gpu {command} --help` does not show {option}"
        first_words = " ".join(action.help.replace("%(default)s", "").split()[:4])
        assert first_words in text, f"`elastic-gpu {command} --help` does not describe {action.option_strings}"


def test_up_help_names_the_options_a_new_user_needs():
    text = run_cli("up", "--help").stdout
    for option in ("--config-dir", "--port", "--ip", "--simulate-gpus", "--admin", "--authenticator"):
        assert option in text


def load_hub_config(path: Path):
    return PyFileConfigLoader(path.name, path=str(path.parent)).load_config()


def test_init_writes_a_config_that_loads_sized_from_the_simulated_gpus(tmp_path):
    result = run_cli(
        "init", "--config-dir", str(tmp_path), "--simulate-gpus", "1xA100-40GB", "--admin", "ada", "--user", "bo"
    )
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stdout

    admission = load_config(yaml.safe_load((tmp_path / "elastic-gpu.yaml").read_text()))
    assert set(admission.priority_classes) == {"high", "default", "low"}
    # as without priority_classes: idle kernels of default and low may be swapped out for an overdue request
    assert [n for n, pc in admission.priority_classes.items() if pc.movable] == ["default", "low"]
    namespace = admission.workspaces["default"].namespaces["default"]
    assert namespace.limits_for("bo").memory_mib == 40960  # one card's memory per user
    assert namespace.limits_for("ada").memory_mib == 40960  # the admin: the whole (one-card) pool

    c = load_hub_config(tmp_path / "jupyterhub_config.py")
    profiles = normalize_profile_list(c.LocalGPUSpawner.profile_list)
    sizes = {p["slug"]: p.get("gpu") for p in profiles}
    assert sizes["a100-40gb-quarter"] == {"memory_mib": 10240, "cores_percent": 25, "model": "A100-40GB"}
    assert sizes["a100-40gb-half"]["memory_mib"] == 20480
    assert sizes["a100-40gb-whole"] == {"whole": True, "model": "A100-40GB"}
    assert sizes["cpu"] is None
    assert [s["memory_mib"] for s in c.GPUBroker.kernel_sizes] == [5120, 10240, 20480]
    assert c.LocalPool.simulate_gpus == "1xA100-40GB"
    assert c.JupyterHub.authenticator_class == "firstuseauthenticator.FirstUseAuthenticator"
    assert c.FirstUseAuthenticator.create_users is False
    assert c.Authenticator.admin_users == {"ada"} and c.Authenticator.allowed_users == {"ada", "bo"}
    assert c.JupyterHub.spawner_class == "hubext.local.spawner.HubUserGPUSpawner"
    assert c.GPUAllocator.admission_config_file == str(tmp_path / "elastic-gpu.yaml")
    token = tmp_path / "data" / "cli-token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert stat.S_IMODE(token.parent.stat().st_mode) == 0o711  # servers reach their home in it, nobody lists it
    assert c.JupyterHub.services[-1] == {"name": "elastic-gpu-cli", "api_token": token.read_text().strip()}


def test_init_names_sizes_as_the_refusals_and_pages_do(tmp_path):
    """An H200's 141 GiB split in 8 is 18048 MiB: the kernel size and the profile say so, as a
    refusal of that kernel does (quotas.messages.mib), not '17.625 GiB'."""
    assert run_cli("init", "--config-dir", str(tmp_path), "--simulate-gpus", "1xH200").returncode == 0
    c = load_hub_config(tmp_path / "jupyterhub_config.py")
    sizes = {s["memory_mib"]: s["display_name"] for s in c.GPUBroker.kernel_sizes}
    assert sizes == {18048: "GPU 18048 MiB", 36096: "GPU 36096 MiB", 72192: "GPU 70.5 GiB"}, sizes
    names = {p["slug"]: p["display_name"] for p in normalize_profile_list(c.LocalGPUSpawner.profile_list)}
    assert names["h200-quarter"] == "1/4 H200 — 36096 MiB, 25 % compute", names
    assert names["h200-whole"] == "Whole H200 — 141 GiB", names


def test_init_keeps_an_edited_config_unless_forced(tmp_path):
    assert run_cli("init", "--config-dir", str(tmp_path), "--simulate-gpus", "1xT4").returncode == 0
    edited = tmp_path / "elastic-gpu.yaml"
    edited.write_text(edited.read_text() + "# my edit\n")
    result = run_cli("init", "--config-dir", str(tmp_path), "--simulate-gpus", "1xT4")
    assert "already has a config" in result.stdout and "# my edit" in edited.read_text()
    assert run_cli("init", "--config-dir", str(tmp_path), "--simulate-gpus", "1xT4", "--force").returncode == 0
    assert "# my edit" not in edited.read_text()


@pytest.mark.parametrize(
    "args,message",
    [
        (["init", "--simulate-gpus", "lots"], "elastic-gpu init: error: --simulate-gpus: simulated GPUs: 'lots'"),
        (["init", "--admin", "a b"], "elastic-gpu init: error: user name 'a b' is not allowed"),
        (["status"], "elastic-gpu status: error: no hub has run with the config dir"),
        (["quota", "--offline"], "elastic-gpu quota: error: no hub has run with the config dir"),
    ],
)
def test_mistakes_get_one_clear_line_not_a_traceback(tmp_path, args, message):
    extra = ["--url", "http://127.0.0.1:9"] if args[0] in ("status", "quota") else []  # no hub there
    result = run_cli(*args, "--config-dir", str(tmp_path / "cfg"), *extra)
    assert result.returncode == 1
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_a_missing_proxy_is_reported_with_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setattr(base, "REPO", tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("ELASTIC_GPU_PROXY", raising=False)
    with pytest.raises(cli.CLIError, match=r"configurable-http-proxy is not installed. Install it with `npm install"):
        proxy.find_proxy()


def test_pam_is_chosen_only_for_root_serving_real_accounts_and_the_reason_is_given(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(config, "system_user", lambda name: name == "ada")
    assert config.choose_mode("auto", ["ada"]) == (
        "pam",
        "run as root and every admin (ada) is an account on this machine",
    )
    mode, why = config.choose_mode("auto", ["ada", "ghost"])
    assert mode == "firstuse" and "'ghost' is not an account on this machine" in why and "'elastic-gpu'" in why
    assert config.choose_mode("firstuse", ["ada"]) == ("firstuse", "--authenticator firstuse")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert config.choose_mode("auto", ["ada"])[0] == "firstuse"


def test_the_default_config_dir_as_root_is_one_other_accounts_can_reach(monkeypatch, tmp_path):
    monkeypatch.delenv("ELASTIC_GPU_CONFIG_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert base.default_config_dir() == Path("/var/lib/elastic-gpu")  # not root's home, which is 0700
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert base.default_config_dir() == tmp_path / ".elastic-gpu"
    monkeypatch.setenv("ELASTIC_GPU_CONFIG_DIR", "/srv/hub")
    assert base.default_config_dir() == Path("/srv/hub")


def test_the_config_names_its_login_mode_and_why(tmp_path):
    result = run_cli("init", "--config-dir", str(tmp_path), "--simulate-gpus", "1xT4", "--authenticator", "pam")
    assert result.returncode == 0, result.stderr
    assert config.config_mode(tmp_path) == ("pam", "--authenticator pam")
    c = load_hub_config(tmp_path / "jupyterhub_config.py")
    assert c.JupyterHub.authenticator_class == "pam"
    assert c.JupyterHub.spawner_class == "hubext.local.spawner.LocalGPUSpawner"


def test_usage_and_simulate_are_elastic_gpu_commands(tmp_path):
    """The metering reports are reached through the one CLI (not only as functions)."""
    import subprocess
    import sys

    for cmd in ("usage", "simulate"):
        result = subprocess.run(
            [sys.executable, "-m", "hubext.cli", cmd, "--config", str(tmp_path / "missing.py")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2, result
        assert "does not exist; pass --config" in result.stderr and "Traceback" not in result.stderr
        shown = subprocess.run(
            [sys.executable, "-m", "hubext.cli", cmd, "--help"], capture_output=True, text=True, timeout=60
        )
        assert shown.returncode == 0 and f"usage: elastic-gpu {cmd}" in shown.stdout, shown


def test_every_subcommand_takes_the_config_dir(tmp_path):
    """`--config-dir` names the hub's folder for every command; usage and simulate read its hub
    config (its database and prices) from there."""
    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in action.choices:
        args = parser.parse_args([name, "--config-dir", str(tmp_path)])
        assert Path(args.config_dir) == tmp_path, name
    from hubext.metering.store import UsageStore
    from tests.metering.test_store import record

    db = tmp_path / "data" / "jupyterhub.sqlite"
    db.parent.mkdir()
    store = UsageStore(f"sqlite:///{db}")
    store.upgrade()
    store.apply(
        [
            {"event": "granted", "record": record("a", "alice", granted_at=0.0)},
            {"event": "released", "id": "a", "at": 4 * 3600.0, "cause": "stopped"},
        ]
    )
    store.close()
    (tmp_path / "jupyterhub_config.py").write_text(
        f"c = get_config()  # noqa\nc.JupyterHub.db_url = 'sqlite:///{db}'\n"
        "c.UsageMeter.prices = {'H100-80GB': {'gpu_hour': 2.0}}\nc.UsageMeter.currency = 'EUR'\n"
    )
    period = ["--from", "0", "--to", "36000"]
    usage = run_cli("usage", "--config-dir", str(tmp_path), *period)
    assert usage.returncode == 0 and "alice" in usage.stdout and "cost (EUR)" in usage.stdout, usage
    simulate = run_cli("simulate", "--config-dir", str(tmp_path), *period)
    assert simulate.returncode == 0 and "GPUs keep the p95 wait" in simulate.stdout, simulate
