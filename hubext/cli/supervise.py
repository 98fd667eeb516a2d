"""``elastic-gpu up``: start JupyterHub for a config dir, watch it, and stop everything on Ctrl-C.

One hub per config dir: ``up`` holds ``data/up.lock`` for as long as it runs and records the hub
in ``data/hub.json``; a second ``up`` on the same dir says where the running hub is and exits
non-zero without touching it (its proxy, its state file, its log).
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from ..local.processes import process_alive, process_cmdline, process_start_time
from .accounts import HUB_UMASK, harden_hub_state, prepare_mode
from .base import ADMISSION_FILE, CONFIG_FILE, DEFAULT_IP, DEFAULT_PORT, CLIError, say
from .client import http_get, hub_running, read_hub_state, read_token, write_hub_state
from .config import config_mode
from .offline import live_holders, stop_leftover_holders, swapped_kernels
from .proxy import check_ports, find_proxy, hub_lines, left_behind, stop_left_behind


def claim_config_dir(config_dir: Path) -> IO[str]:
    """Lock the config dir for this ``up``; a CLIError when a hub already runs from it."""
    data = config_dir / "data"
    data.mkdir(parents=True, exist_ok=True)
    lock = open(data / "up.lock", "a+")  # noqa: SIM115 (held until this process exits)
    os.chmod(data / "up.lock", 0o600)
    state = read_hub_state(data)
    where = f" at {state['url']}" if state.get("url") else ""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        up_pid = state.get("up_pid")
        raise CLIError(
            f"a hub already runs with the config dir {config_dir}{where} (its `elastic-gpu up` is pid {up_pid}). "
            "Stop it first (Ctrl-C in its terminal), or start another hub with another --config-dir"
        ) from None
    if hub_running(state):
        lock.close()
        raise CLIError(
            f"a hub already runs with the config dir {config_dir}{where} (JupyterHub pid {state['hub_pid']}; the "
            f"`elastic-gpu up` that started it is gone). Stop it first (`kill {state['hub_pid']}`), or use another "
            "--config-dir"
        )
    hub_pid = _pid_file(data / "jupyterhub.pid")
    if hub_pid and "jupyterhub" in " ".join(process_cmdline(hub_pid)):
        lock.close()
        raise CLIError(
            f"a JupyterHub (pid {hub_pid}) already runs with the config dir {config_dir} (its pid file is "
            f"{data / 'jupyterhub.pid'}). Stop it first, or use another --config-dir"
        )
    return lock


def _pid_file(path: Path) -> int:
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        return 0
    return pid if process_alive(pid) else 0


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


def gpu_summary(url: str, data: Path) -> str:
    try:
        status, body = http_get(f"{url}/hub/api/gpu/pool", read_token(data), timeout=10)
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


class Hub:
    """The JupyterHub process ``up`` started: its command, environment, and how it stops."""

    def __init__(self, config_dir: Path, ip: str, port: int, args: argparse.Namespace, proxy: str) -> None:
        self.config_dir, self.data = config_dir, config_dir / "data"
        self.log_path = self.data / "jupyterhub.log"
        host = "127.0.0.1" if ip in ("", "0.0.0.0", "::") else ip
        self.url = f"http://{host}:{port}"
        self.cmd = [sys.executable, "-m", "jupyterhub", "-f", str(config_dir / CONFIG_FILE), f"--port={port}"]
        self.cmd.append(f"--ip={ip}")
        if args.simulate_gpus:
            self.cmd.append(f"--LocalPool.simulate_gpus={args.simulate_gpus}")
        if args.debug:
            self.cmd.append("--log-level=DEBUG")
        self.env = dict(os.environ)
        path = [str(Path(proxy).parent), str(Path(sys.executable).parent), self.env.get("PATH", "")]
        self.env["PATH"] = os.pathsep.join(path)
        self.env["ELASTIC_GPU_CONFIG_DIR"] = str(config_dir)
        self.env["ELASTIC_GPU_PUBLIC_URL"] = self.url
        self.proc: subprocess.Popen | None = None
        self.log_start = 0  # where this start's lines begin in the log (earlier runs' come before)

    def start(self) -> subprocess.Popen:
        fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "ab") as log:
            self.log_start = log.seek(0, os.SEEK_END)
            self.proc = subprocess.Popen(
                self.cmd,
                cwd=self.data,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                umask=HUB_UMASK,  # the hub's files (database, ledger, ...) are its own account's
            )
        return self.proc

    def wait_until_up(self, timeout: float, stopping: dict[str, int]) -> bool:
        """True once the hub answers; False when it was stopped by a signal meanwhile."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                if stopping["signal"]:
                    return False
                raise CLIError(f"JupyterHub exited with status {self.proc.returncode}; {self.own_lines()}")
            try:
                status, _ = http_get(f"{self.url}/hub/api/", timeout=2)
                if status == 200:
                    return True
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.proc.send_signal(signal.SIGTERM)
                raise CLIError(f"JupyterHub did not answer at {self.url} within {timeout} s; see {self.log_path}")
            time.sleep(0.3)

    def own_lines(self, lines: int = 40) -> str:
        """What JupyterHub wrote to its log since this start, without the proxy's lines."""
        text, dropped = hub_lines(self.log_path, self.log_start, lines)
        left_out = f", without the proxy's {dropped} line(s)" if dropped else ""
        return f"its last lines in {self.log_path}{left_out}:\n{text}"

    def stop(self, timeout: float) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            say(f"JupyterHub did not stop in {timeout} s; killing it")
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)


def cmd_up(args: argparse.Namespace) -> int:
    from .commands import cmd_init

    config_dir = Path(args.config_dir).expanduser().resolve()
    data = config_dir / "data"
    lock = claim_config_dir(config_dir)
    try:
        return _up(args, config_dir, data, cmd_init)
    finally:
        lock.close()


def _up(args: argparse.Namespace, config_dir: Path, data: Path, cmd_init: Any) -> int:
    if not (config_dir / CONFIG_FILE).exists():
        say(f"first run: writing a config to {config_dir}")
        args.force = False
        cmd_init(args)
    else:
        say(f"config: {config_dir / CONFIG_FILE} and {config_dir / ADMISSION_FILE}")
    previous = read_hub_state(data)
    port = args.port or int(previous.get("port") or DEFAULT_PORT)
    ip = args.ip or str(previous.get("ip") or DEFAULT_IP)
    for line in prepare_mode(config_dir, *config_mode(config_dir)):
        print(line if line.startswith((" ", "!")) else f"==> {line}", flush=True)
    harden_hub_state(data)
    stale = left_behind(data)
    check_ports(config_dir, ip, port, stale)
    if stale is not None:
        say(f"the proxy of a hub that stopped abruptly (pid {stale}) still runs; JupyterHub replaces it")
    proxy = find_proxy()
    say(f"proxy: {proxy}")
    hub = Hub(config_dir, ip, port, args, proxy)
    say(f"starting JupyterHub (log: {hub.log_path})")
    proc = hub.start()
    state = {"url": hub.url, "ip": ip, "port": port, "config_dir": str(config_dir), "running": True}
    state.update(up_pid=os.getpid(), hub_pid=proc.pid, hub_started=process_start_time(proc.pid))
    write_hub_state(data, state)
    stopping = {"signal": 0}

    def on_signal(signum: int, _frame: Any) -> None:
        stopping["signal"] = signum
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        if not hub.wait_until_up(args.start_timeout, stopping):
            return 0
        state["started_at"] = time.time()
        write_hub_state(data, state)
        announce(hub, args, config_dir)
        while proc.poll() is None:
            try:
                proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
        if stopping["signal"]:
            return 0
        say(f"JupyterHub exited with status {proc.returncode}; {hub.own_lines(20)}")
        return proc.returncode or 1
    finally:
        hub.stop(args.stop_timeout)
        proxy_pid = stop_left_behind(data)
        if proxy_pid:
            say(f"stopped the configurable-http-proxy (pid {proxy_pid}) JupyterHub left running")
        write_hub_state(data, {**state, "running": False, "stopped_at": time.time()})
        if stopping["signal"]:
            leftovers = stop_leftover_holders(data)
            if leftovers:
                say(f"stopped {leftovers} GPU process(es) the hub left running")
        else:
            running = len(live_holders(data)) + len(swapped_kernels(data))  # a swapped-out kernel holds no slice
            if running:
                say(
                    f"{running} GPU server(s)/kernel(s) still run; the next `elastic-gpu up` adopts them "
                    "(or stops them when their process has exited)"
                )
        for s, handler in handlers.items():
            signal.signal(s, handler)
        if stopping["signal"]:
            say("stopped")


def announce(hub: Hub, args: argparse.Namespace, config_dir: Path) -> None:
    """What a user needs once the hub answers: the GPUs, the kernelspecs, the URL, who logs in."""
    import re

    say(f"GPUs: {gpu_summary(hub.url, hub.data)}")
    if args.no_kernelspecs:
        say("GPU kernelspecs: not installed (--no-kernelspecs)")
    else:
        say(f"GPU kernelspecs: {install_kernelspecs(hub.url, read_token(hub.data), hub.log_path)}")
    say(f"Elastic GPU hub is up at {hub.url}/")
    print(f"    GPU pool (admins): {hub.url}/hub/gpu   ·   `elastic-gpu status` in another terminal", flush=True)
    config_text = (config_dir / CONFIG_FILE).read_text()
    admins = re.search(r"^c\.Authenticator\.admin_users = \{(.*)\}", config_text, re.M)
    if admins:
        print(f"    Admin user(s): {admins.group(1)}", flush=True)
    if "FirstUseAuthenticator" in config_text:
        print("    First login: the first password typed for an allowed name becomes its password.", flush=True)
    print("    Ctrl-C stops the hub and every server it started.", flush=True)
