"""The ``elastic-gpu`` commands and their options: init, up, status, quota."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from .base import CONFIG_FILE, DEFAULT_IP, DEFAULT_PORT, DEFAULT_SIMULATED, default_config_dir, say
from .client import fetch_view
from .config import default_admin, init_config
from .render import render_pool, render_quota
from .supervise import cmd_up


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


def _view(args: argparse.Namespace, what: str) -> tuple[dict, str]:
    config_dir = Path(args.config_dir).expanduser().resolve()
    return fetch_view(config_dir, what, url=args.url, token=args.token, offline=args.offline)


def cmd_status(args: argparse.Namespace) -> int:
    view, origin = _view(args, "pool")
    print(json.dumps(view, indent=2) if args.json else render_pool(view, origin))
    return 0


def cmd_quota(args: argparse.Namespace) -> int:
    view, origin = _view(args, "quota")
    print(json.dumps(view, indent=2) if args.json else render_quota(view, origin))
    return 0


def _in_config_dir(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``run`` (usage, simulate) reading the hub config of ``--config-dir`` unless ``--config`` names one."""

    def with_config_dir(args: argparse.Namespace) -> int:
        args.default_config = Path(args.config_dir).expanduser().resolve() / CONFIG_FILE
        return run(args)

    return with_config_dir


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
            "(default: $ELASTIC_GPU_CONFIG_DIR, else /var/lib/elastic-gpu as root, else ~/.elastic-gpu; "
            "now %(default)s)",
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
            "password; every server runs as one account: yours, or the unprivileged 'elastic-gpu' when run as "
            "root — a trusted team, not isolated from each other), 'pam' (this machine's accounts; servers run as each "
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
    p_up.add_argument(
        "--port",
        type=int,
        default=0,
        help=f"public port of the hub (default: the port this config dir's hub ran on last, else {DEFAULT_PORT}; "
        "remembered in data/hub.json for `status` and `quota`)",
    )
    p_up.add_argument(
        "--ip",
        default="",
        help=f"address to listen on (default: the last one, else {DEFAULT_IP}, this machine only; 0.0.0.0 for the "
        "network — put TLS in front)",
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
            help="the hub's public URL (default: the URL `elastic-gpu up` recorded in the config dir, used only while "
            "that hub runs; the token is never sent elsewhere unless you name a URL here)",
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

    from hubext.metering.command import (
        SIMULATE_HELP,
        USAGE_HELP,
        add_simulate_arguments,
        add_usage_arguments,
        run_simulate,
        run_usage,
    )

    p_usage = sub.add_parser("usage", help=USAGE_HELP, description=USAGE_HELP)
    add_usage_arguments(p_usage)
    config_dir_option(p_usage)
    p_usage.set_defaults(func=_in_config_dir(run_usage))
    p_simulate = sub.add_parser("simulate", help=SIMULATE_HELP, description=SIMULATE_HELP)
    add_simulate_arguments(p_simulate)
    config_dir_option(p_simulate)
    p_simulate.set_defaults(func=_in_config_dir(run_simulate))
    return parser
