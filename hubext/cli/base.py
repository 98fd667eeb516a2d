"""What every ``elastic-gpu`` command shares: the config dir's layout, the defaults, the error type."""

from __future__ import annotations

import os
from pathlib import Path

CONFIG_FILE = "jupyterhub_config.py"
ADMISSION_FILE = "elastic-gpu.yaml"
HUB_STATE_FILE = "hub.json"  # where `up` records the hub's URL, port and pids (kept after it stops)
TOKEN_FILE = "cli-token"
DEFAULT_SIMULATED = "2xH100-80GB"
DEFAULT_PORT = 8000
DEFAULT_IP = "127.0.0.1"
ROOT_CONFIG_DIR = Path("/var/lib/elastic-gpu")
REPO = Path(__file__).resolve().parent.parent.parent


class CLIError(Exception):
    """A problem the user can fix; printed as one message, no traceback (exit status 1)."""

    status = 1


class UsageError(CLIError):
    """An option that cannot work as given (exit status 2, as argparse's own refusals)."""

    status = 2


def say(message: str) -> None:
    print(f"==> {message}", flush=True)


def default_config_dir() -> Path:
    """$ELASTIC_GPU_CONFIG_DIR, else /var/lib/elastic-gpu as root, else ~/.elastic-gpu.

    Not root's home as root: it is mode 0700, and in PAM mode each user's server (running as that
    user) must read its limits file under the config dir."""
    if os.environ.get("ELASTIC_GPU_CONFIG_DIR"):
        return Path(os.environ["ELASTIC_GPU_CONFIG_DIR"])
    if os.geteuid() == 0:
        return ROOT_CONFIG_DIR
    return Path.home() / ".elastic-gpu"


def data_dir(config_dir: Path) -> Path:
    return config_dir / "data"
