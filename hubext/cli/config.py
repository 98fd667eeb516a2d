"""``elastic-gpu init``: the config dir a hub runs from, sized from this machine's GPUs.

It holds ``jupyterhub_config.py`` (rendered from ``templates/jupyterhub_config.py.in``), the
admission config ``elastic-gpu.yaml`` (quotas, priorities, placement) and ``data/`` (the hub's
state, the CLI's token). The login mode is chosen here, with the reason written into the config.
"""

from __future__ import annotations

import getpass
import os
import pprint
import pwd
import secrets
from datetime import datetime
from pathlib import Path
from string import Template
from typing import Any

from quotas.messages import mib

from .accounts import TEAM_ACCOUNT, harden_hub_state
from .base import ADMISSION_FILE, CONFIG_FILE, DEFAULT_SIMULATED, TOKEN_FILE, CLIError
from .proxy import service_ports

TEMPLATES = Path(__file__).resolve().parent / "templates"


def detect_inventory(simulate: str) -> tuple[str, list[dict[str, Any]]]:
    """(simulate spec or '' for real GPUs, GPUs as dicts) — NVML first, else the simulated default."""
    from quotas import ConfigError, parse_simulated

    from ..local.inventory import detect_nvml_gpus

    if not simulate:
        gpus = detect_nvml_gpus()
        if gpus:
            return "", [g.to_dict() for g in gpus]
        simulate = DEFAULT_SIMULATED
    try:
        pool = parse_simulated(simulate)
    except ConfigError as e:
        raise CLIError(f"--simulate-gpus: {e}") from None
    return simulate, [g.to_dict() for n in pool.nodes for g in n.gpus]


def default_profiles(gpus: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A CPU profile, then 1/4, 1/2 and a whole card of each GPU model."""
    profiles: list[dict[str, Any]] = [
        {
            "display_name": "CPU only",
            "slug": "cpu",
            "description": "No GPU. GPU kernels (Kernel > Change kernel) still get a slice when you need one.",
            "default": True,
        }
    ]
    seen: dict[str, int] = {}
    for gpu in gpus:
        seen.setdefault(gpu["model"], gpu["memory_mib"])
    for model, memory in seen.items():
        slug = "".join(ch if ch.isalnum() else "-" for ch in model.lower()).strip("-")
        for name, fraction, cores in (("quarter", 4, 25), ("half", 2, 50)):
            size = memory // fraction
            profiles.append(
                {
                    "display_name": f"1/{fraction} {model} — {mib(size)}, {cores} % compute",
                    "slug": f"{slug}-{name}",
                    "description": f"A {name} of one {model}: {mib(size)} of GPU memory.",
                    "gpu": {"memory_mib": size, "cores_percent": cores, "model": model},
                }
            )
        profiles.append(
            {
                "display_name": f"Whole {model} — {mib(memory)}",
                "slug": f"{slug}-whole",
                "description": f"One whole {model} for this server alone.",
                "gpu": {"whole": True, "model": model},
            }
        )
    return profiles


def default_kernel_sizes(gpus: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """GPU kernel sizes (one kernelspec each): 1/8, 1/4 and 1/2 of the smallest card."""
    smallest = min((g["memory_mib"] for g in gpus), default=0)
    if not smallest:
        return []
    sizes = []
    for fraction, cores in ((8, 12), (4, 25), (2, 50)):
        memory = smallest // fraction
        gib = format(memory / 1024, "g")  # the kernelspec's name: gpu-10g, gpu-17-625g
        sizes.append(
            {
                "name": f"gpu-{gib.replace('.', '-')}g",
                "display_name": f"GPU {mib(memory)}",
                "memory_mib": memory,
                "cores_percent": cores,
            }
        )
    return sizes


def admission_yaml(gpus: list[dict[str, Any]], admins: list[str], users: list[str], simulate: str) -> str:
    total = sum(g["memory_mib"] for g in gpus) or 1024
    biggest = max((g["memory_mib"] for g in gpus), default=1024)
    lines = [
        f"# Admission config of this hub: quotas, priorities, placement (written by `elastic-gpu init`"
        f" on {datetime.now():%Y-%m-%d}).",
        "# Edit and restart the hub (`elastic-gpu up`). Memory in MiB (per level, summed over GPUs),",
        "# compute in % of one card (a quarter card = 25), gpus = number of slices. A missing key = no limit.",
        f"# Pool: {len(gpus)} GPU(s){' (simulated: ' + simulate + ')' if simulate else ''},"
        f" {total} MiB in all (the unit of the limits below). Format: docs/single-machine.md.",
        "priority_classes:",
        "  high:    {value: 1000, preempt: true,  borrow: false}   # may stop lower-priority slices",
        "  default: {value: 100,  preempt: false, borrow: false, movable: true}   # kernels may be swapped out"
        " to make room for a request that waited (docs/admission.md)",
        "  low:     {value: 10,   preempt: false, borrow: true,  movable: true}   # may use idle GPUs above its quota",
        "default_priority_class: default",
        "placement: {node: binpack, gpu: binpack}   # binpack: fill a card before the next; spread: even out",
        "workspaces:",
        "  default:",
        f"    limits: {{memory_mib: {total}}}",
        "    namespaces:",
        "      default:",
        f"        user_limits: {{memory_mib: {biggest}, gpus: 4}}   # each user: one card's memory, 4 slices",
        "        users:",
    ]
    for name in admins:
        lines.append(f"          {name}: {{memory_mib: {total}, gpus: 8}}   # admin: the whole pool")
    for name in users:
        if name not in admins:
            lines.append(f"          {name}: {{}}   # the default user_limits")
    if not admins and not users:
        lines[-1] = "        users: {}"
    return "\n".join(lines) + "\n"


def choose_mode(requested: str, admins: list[str]) -> tuple[str, str]:
    """(authenticator, why): 'pam' when root serves real system users, else 'firstuse' (hub-only accounts)."""
    if requested != "auto":
        return requested, f"--authenticator {requested}"
    if os.geteuid() != 0:
        return "firstuse", "not run as root, so every server runs as your own account"
    strangers = [a for a in admins if not system_user(a)]
    if strangers:
        return "firstuse", (
            f"run as root, but the admin {strangers[0]!r} is not an account on this machine (PAM needs every admin "
            f"to be one); servers run as the unprivileged account {TEAM_ACCOUNT!r}"
        )
    return "pam", f"run as root and every admin ({', '.join(admins)}) is an account on this machine"


def choose_authenticator(requested: str, admins: list[str]) -> str:
    return choose_mode(requested, admins)[0]


def system_user(name: str) -> bool:
    try:
        return pwd.getpwnam(name).pw_uid >= 1000
    except KeyError:
        return False


def default_admin() -> str:
    name = os.environ.get("SUDO_USER") or getpass.getuser()
    return "admin" if not name or name == "root" else name


def hub_config_text(
    *,
    authenticator: str,
    mode_reason: str,
    admins: list[str],
    users: list[str],
    simulate: str,
    profiles: list[dict[str, Any]],
    kernel_sizes: list[dict[str, Any]],
    hub_port: int,
    proxy_api_port: int,
) -> str:
    """``jupyterhub_config.py`` from ``templates/jupyterhub_config.py.in`` (values as Python literals)."""
    auth = Template((TEMPLATES / f"auth-{authenticator}.py.in").read_text()).substitute(team_account=TEAM_ACCOUNT)
    mode = "PAM (this machine's accounts)" if authenticator == "pam" else "first-use passwords (hub-only accounts)"
    return Template((TEMPLATES / "jupyterhub_config.py.in").read_text()).substitute(
        date=f"{datetime.now():%Y-%m-%d}",
        mode=mode,
        mode_reason=mode_reason,
        simulate=repr(simulate),
        hub_port=hub_port,
        proxy_api_port=proxy_api_port,
        auth=auth.rstrip("\n"),
        admins=repr(set(admins)),
        allowed=repr(set(admins) | set(users)),
        profiles=pprint.pformat(profiles, sort_dicts=False, width=110),
        kernel_sizes=pprint.pformat(kernel_sizes, sort_dicts=False, width=110),
    )


def config_mode(config_dir: Path) -> tuple[str, str]:
    """(authenticator, the reason init wrote) of an existing config: 'pam', 'firstuse' or 'other'."""
    text = (config_dir / CONFIG_FILE).read_text()
    reason = next((line.split("—", 1)[1].strip() for line in text.splitlines() if line.startswith("# Login mode:")), "")
    if "FirstUseAuthenticator" in text and "HubUserGPUSpawner" in text:
        return "firstuse", reason or "set in jupyterhub_config.py"
    if '"pam"' in text and "LocalGPUSpawner" in text:
        return "pam", reason or "set in jupyterhub_config.py"
    return "other", "jupyterhub_config.py names another authenticator or spawner"


def check_user_names(names: list[str]) -> None:
    for name in names:
        if not name or any(ch in name for ch in " ,/:") or name != name.strip():
            raise CLIError(f"user name {name!r} is not allowed: no spaces, commas, slashes or colons")


def init_config(
    config_dir: Path,
    *,
    admins: list[str],
    users: list[str],
    simulate: str,
    authenticator: str,
    force: bool = False,
) -> list[str]:
    """Write the config dir; return the files written. Existing files are kept unless ``force``."""
    check_user_names(admins + users)
    config_dir.mkdir(parents=True, exist_ok=True)
    data = config_dir / "data"
    data.mkdir(exist_ok=True)
    simulate, gpus = detect_inventory(simulate)
    authenticator, reason = choose_mode(authenticator, admins)
    written = []
    token = data / TOKEN_FILE
    if not token.exists():
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    harden_hub_state(data)
    hub_config = config_dir / CONFIG_FILE
    if force or not hub_config.exists():
        hub_port, proxy_api_port = service_ports(2)
        hub_config.write_text(
            hub_config_text(
                authenticator=authenticator,
                mode_reason=reason,
                admins=admins,
                users=users,
                simulate=simulate,
                profiles=default_profiles(gpus),
                kernel_sizes=default_kernel_sizes(gpus),
                hub_port=hub_port,
                proxy_api_port=proxy_api_port,
            )
        )
        written.append(str(hub_config))
    admission = config_dir / ADMISSION_FILE
    if force or not admission.exists():
        admission.write_text(admission_yaml(gpus, admins, users, simulate))
        written.append(str(admission))
    return written
