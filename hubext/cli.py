"""The ``elastic-gpu`` command line: init, up, status, quota (single-machine mode).

``elastic-gpu up`` is what a new user runs (``./dev up``): it writes an editable config on the
first run (``elastic-gpu init``), then starts JupyterHub with the real configurable-http-proxy,
the local GPU spawner, the broker and the culler, and prints the URL. ``status`` and ``quota``
show the pool and the use per workspace, from the hub's JSON API or, when the hub is down, from
the SQLite ledger it left.
"""

from __future__ import annotations

import argparse
import getpass
import importlib.util
import json
import os
import pprint
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

CONFIG_FILE = "jupyterhub_config.py"
ADMISSION_FILE = "elastic-gpu.yaml"
DEFAULT_SIMULATED = "2xH100-80GB"
DEFAULT_PORT = 8000
DEFAULT_IP = "127.0.0.1"
REPO = Path(__file__).resolve().parent.parent


class CLIError(Exception):
    """A problem the user can fix; printed as one message, no traceback."""


def say(message: str) -> None:
    print(f"==> {message}", flush=True)


def default_config_dir() -> Path:
    return Path(os.environ.get("ELASTIC_GPU_CONFIG_DIR") or Path.home() / ".elastic-gpu")


# ---- init ------------------------------------------------------------------------------------------


def detect_inventory(simulate: str) -> tuple[str, list[dict[str, Any]]]:
    """(simulate spec or '' for real GPUs, GPUs as dicts) — NVML first, else the simulated default."""
    from quotas import ConfigError, parse_simulated

    from .contract import gpu_to_dict
    from .local.inventory import detect_nvml_gpus

    if not simulate:
        gpus = detect_nvml_gpus()
        if gpus:
            return "", [gpu_to_dict(g) for g in gpus]
        simulate = DEFAULT_SIMULATED
    try:
        pool = parse_simulated(simulate)
    except ConfigError as e:
        raise CLIError(f"--simulate-gpus: {e}") from None
    return simulate, [gpu_to_dict(g) for n in pool.nodes for g in n.gpus]


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
                    "display_name": f"1/{fraction} {model} — {size / 1024:g} GiB, {cores} % compute",
                    "slug": f"{slug}-{name}",
                    "description": f"A {name} of one {model}: {size / 1024:g} GiB of GPU memory.",
                    "gpu": {"memory_mib": size, "cores_percent": cores, "model": model},
                }
            )
        profiles.append(
            {
                "display_name": f"Whole {model} — {memory / 1024:g} GiB",
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
        gib = f"{memory / 1024:g}"
        sizes.append(
            {
                "name": f"gpu-{gib.replace('.', '-')}g",
                "display_name": f"GPU {gib} GiB",
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
        f" {total} MiB in all. Format: docs/single-machine.md.",
        "priority_classes:",
        "  high:    {value: 1000, preempt: true,  borrow: false}   # may stop lower-priority slices",
        "  default: {value: 100,  preempt: false, borrow: false}",
        "  low:     {value: 10,   preempt: false, borrow: true}    # may use idle GPUs above its quota",
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


def choose_authenticator(requested: str, admins: list[str]) -> str:
    """'pam' when root serves real system users, else 'firstuse' (hub-only accounts)."""
    if requested != "auto":
        return requested
    if os.geteuid() == 0 and admins and all(_system_user(a) for a in admins):
        return "pam"
    return "firstuse"


def _system_user(name: str) -> bool:
    try:
        return pwd.getpwnam(name).pw_uid >= 1000
    except KeyError:
        return False


def default_admin() -> str:
    name = os.environ.get("SUDO_USER") or getpass.getuser()
    return "admin" if not name or name == "root" else name


def free_port(ip: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def hub_config_text(
    *,
    authenticator: str,
    admins: list[str],
    users: list[str],
    simulate: str,
    profiles: list[dict[str, Any]],
    kernel_sizes: list[dict[str, Any]],
    hub_port: int,
    proxy_api_port: int,
) -> str:
    profile_text = pprint.pformat(profiles, sort_dicts=False, width=110)
    sizes_text = pprint.pformat(kernel_sizes, sort_dicts=False, width=110)
    if authenticator == "pam":
        auth = """# Log in with this machine's accounts (PAM); each server runs as its user.
c.JupyterHub.authenticator_class = "pam"
c.JupyterHub.spawner_class = "hubext.local.spawner.LocalGPUSpawner"
"""
    else:
        auth = """# First-use passwords: the first password typed for an allowed name becomes its password
# (log in as the admin right away). Accounts live in the hub only; every server runs as the
# hub's own system user, with its home under data/home. To switch to this machine's accounts,
# set authenticator_class = "pam" and spawner_class = "hubext.local.spawner.LocalGPUSpawner"
# (docs/single-machine.md shows other authenticators).
c.JupyterHub.authenticator_class = "firstuseauthenticator.FirstUseAuthenticator"
c.FirstUseAuthenticator.dbm_path = str(DATA / "passwords.dbm")
c.FirstUseAuthenticator.create_users = False  # only allowed users (and users an admin adds) may log in
c.FirstUseAuthenticator.min_password_length = 8
c.JupyterHub.spawner_class = "hubext.local.spawner.HubUserGPUSpawner"
c.HubUserGPUSpawner.home_dir_template = str(DATA / "home" / "{username}")
"""
    return f"""# JupyterHub config of a single-machine Elastic GPU hub, written by `elastic-gpu init` on
# {datetime.now():%Y-%m-%d}. Edit freely: `elastic-gpu up` never overwrites it
# (`elastic-gpu init --force` writes a fresh one). Quotas and priorities: elastic-gpu.yaml.
# Guide: docs/single-machine.md.
import sys
from pathlib import Path

from hubext.hubconfig import configure_hub

c = get_config()  # noqa: F821
HERE = Path(__file__).resolve().parent
DATA = HERE / "data"

configure_hub(
    c,
    mode="local",
    admission_config_file=str(HERE / "elastic-gpu.yaml"),
    # '' = the GPUs NVML finds; e.g. "2xH100-80GB" = simulated cards (`elastic-gpu up --simulate-gpus` overrides)
    simulate_gpus={simulate!r},
    data_dir=str(DATA),
)

# ---- the hub's own files and ports ----
c.JupyterHub.db_url = f"sqlite:///{{DATA / 'jupyterhub.sqlite'}}"
c.JupyterHub.cookie_secret_file = str(DATA / "jupyterhub_cookie_secret")
c.JupyterHub.pid_file = str(DATA / "jupyterhub.pid")
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = {hub_port}  # the hub's internal API (the public port is `elastic-gpu up --port`)
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{proxy_api_port}"
c.JupyterHub.allow_named_servers = True
c.JupyterHub.named_server_limit_per_user = 3

# ---- who may log in ----
{auth}c.Authenticator.admin_users = {set(admins)!r}
c.Authenticator.allowed_users = {set(admins) | set(users)!r}

# ---- single-user servers ----
c.Spawner.cmd = [sys.executable, "-m", "jupyterhub.singleuser"]
c.Spawner.default_url = "/lab"
c.Spawner.start_timeout = 120
c.Spawner.http_timeout = 60

# Server profiles (KubeSpawner's format). `gpu`: memory_mib and cores_percent per GPU, count, model,
# priority_class, whole. `allowed_groups`: only members of these hub groups see the profile.
c.LocalGPUSpawner.profile_list = {profile_text}

# GPU kernel sizes: each becomes a kernelspec ("Python 3 (GPU 10 GiB)") that runs the kernel in its own
# process with that slice while the notebook server holds no GPU. Same keys as a profile's `gpu`, plus
# name, display_name and allowed_groups. `elastic-gpu up` installs the kernelspecs.
c.GPUBroker.kernel_sizes = {sizes_text}

# ---- `elastic-gpu status` / `quota` read the GPU API, and `up` installs the GPU kernelspecs, with this token ----
c.JupyterHub.services = list(c.JupyterHub.get("services", [])) + [
    {{"name": "elastic-gpu-cli", "api_token": (DATA / "cli-token").read_text().strip()}}
]
c.JupyterHub.load_roles = list(c.JupyterHub.get("load_roles", [])) + [
    {{
        "name": "elastic-gpu-cli",
        "scopes": ["read:servers", "custom:elastic-gpu:kernels"],
        "services": ["elastic-gpu-cli"],
    }}
]
"""


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
    for name in admins + users:
        if not name or any(ch in name for ch in " ,/:") or name != name.strip():
            raise CLIError(f"user name {name!r} is not allowed: no spaces, commas, slashes or colons")
    config_dir.mkdir(parents=True, exist_ok=True)
    data = config_dir / "data"
    data.mkdir(exist_ok=True)
    os.chmod(data, 0o755)
    simulate, gpus = detect_inventory(simulate)
    authenticator = choose_authenticator(authenticator, admins)
    written = []
    token = data / "cli-token"
    if not token.exists():
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    hub_config = config_dir / CONFIG_FILE
    if force or not hub_config.exists():
        hub_config.write_text(
            hub_config_text(
                authenticator=authenticator,
                admins=admins,
                users=users,
                simulate=simulate,
                profiles=default_profiles(gpus),
                kernel_sizes=default_kernel_sizes(gpus),
                hub_port=free_port(),
                proxy_api_port=free_port(),
            )
        )
        written.append(str(hub_config))
    admission = config_dir / ADMISSION_FILE
    if force or not admission.exists():
        admission.write_text(admission_yaml(gpus, admins, users, simulate))
        written.append(str(admission))
    return written


def cmd_init(args: argparse.Namespace) -> int:
    config_dir = Path(args.config_dir).expanduser().resolve()
    admins = args.admin or [default_admin()]
    written = init_config(
        config_dir,
        admins=admins,
        users=args.user or [],
        simulate=args.simulate_gpus or "",
        authenticator=args.authenticator,
        force=args.force,
    )
    if written:
        for path in written:
            say(f"wrote {path}")
    else:
        say(f"{config_dir} already has a config (use --force to write a fresh one)")
    return 0


# ---- up ----------------------------------------------------------------------------------------------


def find_proxy() -> str:
    """configurable-http-proxy from the project's node_modules, the current directory's, or PATH."""
    candidates = [
        os.environ.get("ELASTIC_GPU_PROXY", ""),
        str(REPO / "node_modules" / ".bin" / "configurable-http-proxy"),
        str(Path.cwd() / "node_modules" / ".bin" / "configurable-http-proxy"),
        shutil.which("configurable-http-proxy") or "",
    ]
    for path in candidates:
        if path and os.access(path, os.X_OK):
            if not shutil.which("node"):
                raise CLIError(
                    f"found {path} but not `node` (Node.js) to run it; install Node.js 18 or newer "
                    "(e.g. apt-get install nodejs) and run again"
                )
            return path
    raise CLIError(
        "configurable-http-proxy is not installed. Install it with `npm install configurable-http-proxy` "
        "in the project folder (./dev up does this), or put it on PATH, or set ELASTIC_GPU_PROXY to its path"
    )


def install_kernelspecs(url: str, token: str, log_path: Path) -> str:
    """Install a kernelspec per GPU kernel size the hub's broker offers; return what happened."""
    if importlib.util.find_spec("kernelprovider.__main__") is None:
        return "skipped: the kernel provisioner (kernelprovider) is not installed"
    cmd = [sys.executable, "-m", "kernelprovider", "install-kernelspecs", "--hub-url", url, "--sys-prefix"]
    env = dict(os.environ, JUPYTERHUB_API_TOKEN=token)
    with open(log_path, "ab") as log:
        log.write(f"\n[elastic-gpu up] {' '.join(cmd)}\n".encode())
        log.flush()
        result = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=120)
    if result.returncode != 0:
        return f"NOT installed: `{' '.join(cmd[1:4])}` failed (status {result.returncode}); see {log_path}"
    return f"installed into {sys.prefix}/share/jupyter/kernels"


def _port_free(ip: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, port))
        except OSError:
            return False
    return True


def _stale_proxy(data: Path) -> int | None:
    """The pid of a configurable-http-proxy left running by this config's previous hub, if any."""
    from .local.processes import process_alive

    try:
        pid = int((data / "jupyterhub-proxy.pid").read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except (OSError, ValueError):
        return None
    return pid if process_alive(pid) and "configurable-http-proxy" in cmdline else None


def _http_get(url: str, token: str = "", timeout: float = 5) -> tuple[int, Any]:
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"token {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
            status = resp.status
    except urllib.error.HTTPError as e:
        body, status = e.read(), e.code
    try:
        return status, json.loads(body) if body else None
    except ValueError:
        return status, body.decode(errors="replace")


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def cmd_up(args: argparse.Namespace) -> int:
    config_dir = Path(args.config_dir).expanduser().resolve()
    data = config_dir / "data"
    if not (config_dir / CONFIG_FILE).exists():
        say(f"first run: writing a config to {config_dir}")
        args.force = False
        cmd_init(args)
    else:
        say(f"config: {config_dir / CONFIG_FILE} and {config_dir / ADMISSION_FILE}")
    if not _port_free(args.ip, args.port):
        stale = _stale_proxy(data)
        if stale is None:
            raise CLIError(f"port {args.port} on {args.ip} is in use (another hub?); pick another with --port")
        say(f"the proxy of a hub that stopped abruptly (pid {stale}) holds port {args.port}; JupyterHub replaces it")
    proxy = find_proxy()
    say(f"proxy: {proxy}")
    log_path = data / "jupyterhub.log"
    cmd = [
        sys.executable,
        "-m",
        "jupyterhub",
        "-f",
        str(config_dir / CONFIG_FILE),
        f"--port={args.port}",
        f"--ip={args.ip}",
    ]
    if args.simulate_gpus:
        cmd.append(f"--LocalPool.simulate_gpus={args.simulate_gpus}")
    if args.debug:
        cmd.append("--log-level=DEBUG")
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(proxy).parent), str(Path(sys.executable).parent), env.get("PATH", "")])
    env["ELASTIC_GPU_CONFIG_DIR"] = str(config_dir)
    env["ELASTIC_GPU_PUBLIC_URL"] = f"http://{'127.0.0.1' if args.ip in ('', '0.0.0.0') else args.ip}:{args.port}"
    host = "127.0.0.1" if args.ip in ("", "0.0.0.0", "::") else args.ip
    url = f"http://{host}:{args.port}"
    say(f"starting JupyterHub (log: {log_path})")
    with open(log_path, "ab") as log:
        hub = subprocess.Popen(cmd, cwd=data, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    stopping = {"signal": 0}

    def on_signal(signum: int, _frame: Any) -> None:
        stopping["signal"] = signum
        if hub.poll() is None:
            hub.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    state_file = data / "hub.json"
    try:
        deadline = time.monotonic() + args.start_timeout
        while True:
            if hub.poll() is not None:
                if stopping["signal"]:
                    return 0
                raise CLIError(
                    f"JupyterHub exited with status {hub.returncode}; the end of {log_path}:\n{_tail(log_path)}"
                )
            try:
                status, _ = _http_get(f"{url}/hub/api/", timeout=2)
                if status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                hub.send_signal(signal.SIGTERM)
                raise CLIError(f"JupyterHub did not answer at {url} within {args.start_timeout} s; see {log_path}")
            time.sleep(0.3)
        state_file.write_text(
            json.dumps({"url": url, "pid": os.getpid(), "hub_pid": hub.pid, "started_at": time.time()})
        )
        say(f"GPUs: {_gpu_summary(url, data)}")
        if args.no_kernelspecs:
            say("GPU kernelspecs: not installed (--no-kernelspecs)")
        else:
            say(f"GPU kernelspecs: {install_kernelspecs(url, _read_token(data), log_path)}")
        say(f"Elastic GPU hub is up at {url}/")
        print(f"    GPU pool (admins): {url}/hub/gpu   ·   `elastic-gpu status` in another terminal", flush=True)
        config_text = (config_dir / CONFIG_FILE).read_text()
        admins = re.search(r"^c\.Authenticator\.admin_users = \{(.*)\}", config_text, re.M)
        if admins:
            print(f"    Admin user(s): {admins.group(1)}", flush=True)
        if "FirstUseAuthenticator" in config_text:
            print("    First login: the first password typed for an allowed name becomes its password.", flush=True)
        print("    Ctrl-C stops the hub and every server it started.", flush=True)
        while hub.poll() is None:
            try:
                hub.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
        if stopping["signal"]:
            return 0
        say(f"JupyterHub exited with status {hub.returncode}; the end of {log_path}:\n{_tail(log_path, 20)}")
        return hub.returncode or 1
    finally:
        if hub.poll() is None:
            hub.send_signal(signal.SIGTERM)
        try:
            hub.wait(timeout=args.stop_timeout)
        except subprocess.TimeoutExpired:
            say(f"JupyterHub did not stop in {args.stop_timeout} s; killing it")
            try:
                os.killpg(hub.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            hub.wait(10)
        state_file.unlink(missing_ok=True)
        if stopping["signal"]:
            leftovers = stop_leftover_holders(data)
            if leftovers:
                say(f"stopped {leftovers} GPU process(es) the hub left running")
        else:
            running = count_running_holders(data)
            if running:
                say(
                    f"{running} GPU server(s)/kernel(s) still run; the next `elastic-gpu up` adopts them "
                    "(or stops them when their process has exited)"
                )
        for s, handler in previous.items():
            signal.signal(s, handler)
        if stopping["signal"]:
            say("stopped")


def _live_holders(data: Path) -> list[int]:
    from .local.ledger import LEDGER_FILE, Ledger
    from .local.processes import process_alive

    path = data / LEDGER_FILE
    if not path.exists():
        return []
    ledger = Ledger(path)
    try:
        rows = ledger.rows()
    finally:
        ledger.close()
    return [
        int(r["holder"])
        for r in rows
        if r["holder"] and r["holder"].isdigit() and process_alive(int(r["holder"]), r["holder_started"])
    ]


def count_running_holders(data: Path) -> int:
    return len(_live_holders(data))


def stop_leftover_holders(data: Path, grace_seconds: float = 5.0) -> int:
    """Stop the process groups of GPU holders (servers, kernels) still alive after the hub exited.

    ``up`` promises that Ctrl-C stops everything the hub started; JupyterHub stops its servers,
    and this catches what outlives them (a GPU kernel whose server could not reach the broker).
    """
    from .local.processes import process_alive

    alive = _live_holders(data)
    found = len(alive)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in alive:
            try:
                os.killpg(pid, sig)
            except OSError:
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
        deadline = time.monotonic() + grace_seconds
        while time.monotonic() < deadline and any(process_alive(p) for p in alive):
            time.sleep(0.1)
        alive = [p for p in alive if process_alive(p)]
        if not alive:
            break
    return found


def _gpu_summary(url: str, data: Path) -> str:
    try:
        status, body = _http_get(f"{url}/hub/api/gpu/pool", _read_token(data), timeout=10)
    except OSError as e:
        return f"unknown ({e})"
    if status != 200 or not isinstance(body, dict):
        return f"unknown (GPU API answered {status})"
    gpus = [g for n in body["nodes"] for g in n["gpus"]]
    models: dict[str, int] = {}
    for g in gpus:
        models[g["model"]] = models.get(g["model"], 0) + 1
    text = ", ".join(f"{n} × {m}" for m, n in models.items()) or "none"
    return text + (" (SIMULATED: no real GPU is used)" if body.get("simulated") else "")


# ---- status / quota ------------------------------------------------------------------------------


def _read_token(data: Path) -> str:
    try:
        return (data / "cli-token").read_text().strip()
    except OSError:
        return ""


def _hub_url(args: argparse.Namespace, data: Path) -> str:
    if args.url:
        return args.url.rstrip("/")
    try:
        return json.loads((data / "hub.json").read_text())["url"]
    except (OSError, ValueError, KeyError):
        return f"http://127.0.0.1:{DEFAULT_PORT}"


def fetch_view(args: argparse.Namespace, what: str) -> tuple[dict[str, Any], str]:
    """The pool or quota view and a line saying where it came from (the hub's API or the ledger)."""
    config_dir = Path(args.config_dir).expanduser().resolve()
    data = config_dir / "data"
    url = _hub_url(args, data)
    reason = "--offline"
    if not args.offline:
        token = args.token or os.environ.get("JUPYTERHUB_API_TOKEN") or _read_token(data)
        try:
            status, body = _http_get(f"{url}/hub/api/gpu/{what}", token)
        except OSError as e:
            reason = f"the hub at {url} is not reachable ({getattr(e, 'reason', e)})"
        else:
            if status == 200 and isinstance(body, dict):
                return body, f"live, from the hub at {url}"
            if status in (401, 403):
                raise CLIError(
                    f"the hub at {url} refused the token ({status}): it needs the read:servers scope. "
                    f"Pass --token, or use the config dir's token (--config-dir)."
                )
            reason = f"the hub at {url} answered {status}"
    return offline_view(config_dir, what), f"from the ledger {data} ({reason}; as the hub last left it)"


def offline_view(config_dir: Path, what: str) -> dict[str, Any]:
    from quotas import AdmissionState, ConfigError, Pool, load_config, load_pool

    from .admin import pool_view, quota_view
    from .contract import allocation_from_dict, allocation_to_dict
    from .local.ledger import LEDGER_FILE, Ledger
    from .local.processes import process_alive

    path = config_dir / "data" / LEDGER_FILE
    if not path.exists():
        raise CLIError(
            f"no hub has run with the config dir {config_dir} yet (no {path}); start one with `elastic-gpu up`"
        )
    ledger = Ledger(path)
    try:
        inventory = ledger.inventory()
        nodes, simulated = inventory if inventory else ([], False)
        allocations = []
        for row in ledger.rows():
            holder, started = row["holder"], row["holder_started"]
            if holder and holder.isdigit() and not process_alive(int(holder), started):
                continue  # its process has exited: the hub drops it when it starts
            allocations.append(allocation_from_dict(json.loads(row["data"])))
        if what == "pool":
            return pool_view(
                nodes,
                [allocation_to_dict(a) for a in allocations],
                simulated=simulated,
                events=ledger.events(),
                source="ledger",
            )
        import yaml

        try:
            config = load_config(yaml.safe_load((config_dir / ADMISSION_FILE).read_text()) or {})
            state = AdmissionState(config, load_pool({"nodes": nodes}) if nodes else Pool(nodes=()))
        except (OSError, ConfigError, yaml.YAMLError) as e:
            raise CLIError(f"cannot read {config_dir / ADMISSION_FILE}: {e}") from None
        for a in allocations:
            state.add(a)
        return quota_view(state, source="ledger")
    finally:
        ledger.close()


def _mib(value: int | None) -> str:
    if value is None:
        return "—"
    return f"{value / 1024:.1f} GiB" if value >= 1024 else f"{value} MiB"


def _bar(used: float, total: float, width: int = 20) -> str:
    filled = 0 if not total else min(width, round(width * used / total))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def render_pool(view: dict[str, Any], origin: str) -> str:
    out = [f"GPU pool — {origin}"]
    if view.get("simulated"):
        out.append("SIMULATED GPUs: no real GPU is used; allocations and quotas are real.")
    t = view["totals"]
    out.append(
        f"{t['gpus']} GPU(s), {_mib(t['used_memory_mib'])} of {_mib(t['memory_mib'])} allocated "
        f"in {t['slices']} slice(s)"
    )
    for node in view["nodes"]:
        for g in node["gpus"]:
            out.append("")
            out.append(f"{node['name']}  GPU {g['index']}  {g['model']}  {g['uuid']}")
            util = g.get("utilization_percent")
            activity = (
                f"{util} % busy"
                if util is not None
                else ("not measured (simulated)" if view.get("simulated") else "not measured")
            )
            out.append(
                f"  memory  {_bar(g['used_memory_mib'], g['capacity_memory_mib'])} "
                f"{_mib(g['used_memory_mib'])} / {_mib(g['capacity_memory_mib'])}   "
                f"compute {_bar(g['used_cores_percent'], g['capacity_cores_percent'], 10)} "
                f"{g['used_cores_percent']} / {g['capacity_cores_percent']} %   activity: {activity}"
            )
            if not g["slices"]:
                out.append("  (no slices)")
            for s in g["slices"]:
                age = f"{s['age_seconds'] // 60} min" if s.get("age_seconds") is not None else ""
                flags = " borrowed" if s.get("borrowed") else ""
                out.append(
                    f"  {s['user']:<14} {s['kind']:<8} {_mib(s['memory_mib']):>9} {s['cores_percent']:>4} %  "
                    f"{s['workspace']}/{s['namespace']}  {s['priority_class']}{flags}  {age}  {s['allocation_id']}"
                )
    out.append("")
    if view.get("queue"):
        out.append("Queue:")
        for i, q in enumerate(view["queue"], 1):
            out.append(
                f"  {i}. {q['user']} ({q['workspace']}): {q['count']} × {_mib(q['memory_mib'])}, "
                f"{q['cores_percent']} % — waiting {q['waiting_seconds']:.0f} s: {q['reason']}"
            )
    else:
        out.append("Queue: empty")
    for e in view.get("events") or []:
        out.append(f"Preempted: {e['user']} ({e['allocation_id']}): {e['reason']}")
    return "\n".join(out)


def render_quota(view: dict[str, Any], origin: str) -> str:
    out = [f"GPU quota use — {origin}", ""]
    header = f"{'workspace / namespace / user':<34} {'memory':>22} {'compute':>16} {'slices':>10}"
    out.append(header)
    out.append("-" * len(header))

    def limit(v: int | None, fmt: Any) -> str:
        return "unlimited" if v is None else fmt(v)

    def row(label: str, level: dict[str, Any]) -> str:
        u, lim = level["used"], level["limits"]
        mem = f"{_mib(u['memory_mib'])} / {limit(lim['memory_mib'], _mib)}"
        cores = f"{u['cores_percent']} / {limit(lim['cores_percent'], lambda v: f'{v} %')}"
        gpus = f"{u['gpus']} / {limit(lim['gpus'], str)}"
        return f"{label:<34} {mem:>22} {cores:>16} {gpus:>10}"

    for ws in view["workspaces"]:
        out.append(row(f"{ws['name']}", ws))
        for ns in ws["namespaces"]:
            out.append(row(f"  {ns['name']}", ns))
            for user in ns["users"]:
                out.append(row(f"    {user['name']}", user))
    return "\n".join(out)


def cmd_status(args: argparse.Namespace) -> int:
    view, origin = fetch_view(args, "pool")
    print(json.dumps(view, indent=2) if args.json else render_pool(view, origin))
    return 0


def cmd_quota(args: argparse.Namespace) -> int:
    view, origin = fetch_view(args, "quota")
    print(json.dumps(view, indent=2) if args.json else render_quota(view, origin))
    return 0


# ---- the parser ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elastic-gpu",
        description="Elastic GPU for JupyterHub: fractional GPUs for notebooks. Single-machine mode.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def config_dir_option(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--config-dir",
            default=str(default_config_dir()),
            metavar="DIR",
            help="the hub's config folder: jupyterhub_config.py, elastic-gpu.yaml and data/ "
            "(default: $ELASTIC_GPU_CONFIG_DIR or ~/.elastic-gpu; now %(default)s)",
        )

    def init_options(p: argparse.ArgumentParser, when: str) -> None:
        p.add_argument(
            "--admin",
            action="append",
            metavar="NAME",
            help=f"hub admin user name; repeat for several{when} (default: your login name, or 'admin' as root)",
        )
        p.add_argument(
            "--user",
            action="append",
            metavar="NAME",
            help=f"another user allowed to log in; repeat for several{when}. Admins can add more on /hub/admin",
        )
        p.add_argument(
            "--authenticator",
            choices=("auto", "firstuse", "pam"),
            default="auto",
            help="how users log in"
            + when
            + ": 'firstuse' (hub-only accounts: the first password typed for an allowed name becomes its "
            "password; servers run as the hub's user), 'pam' (this machine's accounts; servers run as each "
            "user, needs root), 'auto' (pam when run as root and every admin is a system user, else firstuse; "
            "default)",
        )

    p_init = sub.add_parser("init", help="write an editable config folder (hub config, quotas, profiles)")
    config_dir_option(p_init)
    init_options(p_init, "")
    p_init.add_argument(
        "--simulate-gpus",
        metavar="SPEC",
        default="",
        help="simulated GPU inventory, e.g. 2xH100-80GB or 2xH100-80GB,1xA100-40GB; profiles and quotas are "
        f"sized from it (default: the GPUs NVML finds, or {DEFAULT_SIMULATED} when there are none)",
    )
    p_init.add_argument("--force", action="store_true", help="overwrite an existing config (data/ is kept)")
    p_init.set_defaults(func=cmd_init)

    p_up = sub.add_parser(
        "up",
        help="start the single-machine hub (writes a config on the first run) and print its URL",
        description="Start JupyterHub with fractional GPUs on this machine and print its URL. On the first run "
        "it writes the config folder (as `elastic-gpu init`). Runs in the foreground: Ctrl-C stops the hub "
        "and every server and kernel it started.",
    )
    config_dir_option(p_up)
    p_up.add_argument("--port", type=int, default=DEFAULT_PORT, help="public port of the hub (default: %(default)s)")
    p_up.add_argument(
        "--ip",
        default=DEFAULT_IP,
        help="address to listen on (default: %(default)s, this machine only; 0.0.0.0 for the network — put TLS "
        "in front)",
    )
    p_up.add_argument(
        "--simulate-gpus",
        metavar="SPEC",
        default="",
        help="run with a simulated GPU inventory, e.g. 2xH100-80GB, overriding the config "
        f"(default: the config's setting; a first run without a GPU uses {DEFAULT_SIMULATED})",
    )
    init_options(p_up, " (first run only, when the config is written)")
    p_up.add_argument(
        "--no-kernelspecs",
        action="store_true",
        help="do not install the GPU kernelspecs (by default, once the hub answers, one kernelspec per GPU kernel "
        "size it offers is installed into this Python environment)",
    )
    p_up.add_argument("--debug", action="store_true", help="log at DEBUG level (the log is data/jupyterhub.log)")
    p_up.add_argument(
        "--start-timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="seconds to wait for the hub to answer (default: %(default)s)",
    )
    p_up.add_argument(
        "--stop-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="seconds to wait for the hub to stop its servers before killing it (default: %(default)s)",
    )
    p_up.set_defaults(func=cmd_up)

    def view_options(p: argparse.ArgumentParser) -> None:
        config_dir_option(p)
        p.add_argument(
            "--url",
            default="",
            help="the hub's public URL (default: the URL `elastic-gpu up` recorded in the config dir, "
            f"else http://127.0.0.1:{DEFAULT_PORT})",
        )
        p.add_argument(
            "--token",
            default="",
            help="API token with the read:servers scope (default: $JUPYTERHUB_API_TOKEN, else the config "
            "dir's data/cli-token)",
        )
        p.add_argument(
            "--offline",
            action="store_true",
            help="read the SQLite ledger in the config dir instead of asking the hub (also the fallback when "
            "the hub is down)",
        )
        p.add_argument("--json", action="store_true", help="print the view as JSON (the API's format)")

    p_status = sub.add_parser(
        "status",
        help="the GPU pool in the terminal: each GPU, its slices, owners, memory and activity",
        description="Show each GPU with its slices (owner, kind, memory, compute, priority, age), how much "
        "is allocated, the activity NVML measures, the queue and recent preemptions. Asks the running hub's "
        "JSON API (/hub/api/gpu/pool); when the hub is down, reads the SQLite ledger it left and says so.",
    )
    view_options(p_status)
    p_status.set_defaults(func=cmd_status)

    p_quota = sub.add_parser(
        "quota",
        help="GPU use against quota limits per workspace, namespace and user",
        description="Show GPU memory, compute and slices in use against the limits of each workspace, "
        "namespace and user (/hub/api/gpu/quota, or the ledger when the hub is down).",
    )
    view_options(p_quota)
    p_quota.set_defaults(func=cmd_quota)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except CLIError as e:
        print(f"elastic-gpu {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
