"""Which account runs what, and who may read the hub's files (issue 19: never a user's server as root).

- The hub keeps its state (database, cookie secret, CLI token, GPU ledger, log, first-use
  passwords) readable by its own account only: ``harden_hub_state`` and umask 077 for the hub.
- First-use mode as root runs every server as one unprivileged system account,
  ``elastic-gpu`` (created here with ``useradd`` when missing): a "trusted team" mode in which
  users are not isolated from each other, and ``up`` says so.
- Servers run under another account than the hub (first-use as root, PAM): that account must
  reach the hub's Python, the packages it imports, the shim and its limits file under the config
  dir. ``unreachable`` finds the directory that stops it, so ``up`` can say exactly why.
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

from .base import HUB_STATE_FILE, CLIError

TEAM_ACCOUNT = "elastic-gpu"
#: useradd's exit statuses "can't update password file" and "... group file": another useradd holds the lock
USERADD_BUSY = (1, 10)

#: files in data/ that only the hub's account may read (prefixes: SQLite and dbm add suffixes)
PRIVATE_PREFIXES = (
    "jupyterhub.sqlite",
    "jupyterhub_cookie_secret",
    "cli-token",
    "elastic-gpu-ledger.sqlite",
    "jupyterhub.log",
    "passwords.dbm",
    "jupyterhub.pid",
    "jupyterhub-proxy.pid",
    "up.lock",
)
HUB_UMASK = 0o077


def harden_hub_state(data: Path) -> None:
    """data/ may be traversed (servers reach their home and limits file in it) but not listed;
    the hub's files in it are 0600. Files the hub runs as someone else's are left alone."""
    data.mkdir(parents=True, exist_ok=True)
    os.chmod(data, 0o711)
    me = os.geteuid()
    for path in data.iterdir():
        if path.name == HUB_STATE_FILE or not path.name.startswith(PRIVATE_PREFIXES):
            continue
        try:
            if path.is_file() and path.stat().st_uid == me:
                os.chmod(path, 0o600)
        except OSError:
            pass
    home = data / "home"
    if home.is_dir() and home.stat().st_uid == me:
        os.chmod(home, 0o711)


def ensure_team_account(home: Path) -> pwd.struct_passwd:
    """The unprivileged system account first-use servers run as when the hub is root; created if missing."""
    try:
        return pwd.getpwnam(TEAM_ACCOUNT)
    except KeyError:
        pass
    useradd = shutil.which("useradd") or ("/usr/sbin/useradd" if os.path.exists("/usr/sbin/useradd") else "")
    if not useradd:
        raise CLIError(
            f"first-use login as root runs every user's server as the unprivileged system account "
            f"{TEAM_ACCOUNT!r}, which does not exist, and `useradd` is not installed to create it. "
            f"Create it (e.g. `adduser --system --group {TEAM_ACCOUNT}`), or run `elastic-gpu up` as a normal user"
        )
    cmd = [
        useradd, "--system", "--user-group", "--no-create-home", "--home-dir", str(home),
        "--shell", "/usr/sbin/nologin", "--comment", "Elastic GPU servers of a trusted-team hub", TEAM_ACCOUNT,
    ]  # fmt: skip
    for _ in range(10):
        result = subprocess.run(cmd, capture_output=True, text=True)
        try:  # made by this useradd, or by another process that got there first
            return pwd.getpwnam(TEAM_ACCOUNT)
        except KeyError:
            pass
        if result.returncode not in USERADD_BUSY:
            break
        time.sleep(0.2)  # another useradd holds /etc/passwd: try again
    raise CLIError(
        f"could not create the system account {TEAM_ACCOUNT!r} that runs users' servers: "
        f"`{' '.join(cmd)}` failed: {result.stderr.strip() or result.returncode}"
    )


def unreachable(path: Path, account: str = "nobody", execute: bool = False) -> str:
    """Why ``account`` cannot read (or run) ``path``; '' when it can. Asked of the kernel itself, as that
    account (a forked child drops to it), so modes and ACLs count as they will for the server."""
    if os.geteuid() != 0:
        return ""  # servers run as the hub's own account
    entry = pwd.getpwnam(account)
    path = Path(os.path.abspath(path))
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: become the account, try, report, exit
        why = ""
        try:
            os.close(read_fd)
            os.setgroups(os.getgrouplist(account, entry.pw_gid))
            os.setgid(entry.pw_gid)
            os.setuid(entry.pw_uid)
            for target in dict.fromkeys([Path(os.path.realpath(path)), path]):
                blocked = next((d for d in reversed(target.parents) if not os.access(d, os.X_OK)), None)
                if blocked is not None:
                    why = f"cannot enter {blocked}"
                elif not os.access(target, os.X_OK if execute or target.is_dir() else os.R_OK):
                    why = f"cannot {'run' if execute else 'read'} {target}"
                if why:
                    break
            os.write(write_fd, why.encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        why = pipe.read().decode()
    os.waitpid(pid, 0)
    if not why:
        return ""
    blocked = Path(why.split(" ", 2)[2])
    try:
        info = blocked.stat()
        why += f" (mode {stat.S_IMODE(info.st_mode):04o}, owner {_owner(info)})"
    except OSError:
        pass
    return f"the account {account!r} {why}"


def _owner(info: os.stat_result) -> str:
    try:
        user = pwd.getpwuid(info.st_uid).pw_name
    except KeyError:
        user = str(info.st_uid)
    try:
        group = grp.getgrgid(info.st_gid).gr_name
    except KeyError:
        group = str(info.st_gid)
    return f"{user}:{group}"


def _needed_paths() -> list[tuple[Path, bool]]:
    """What a server running under another account needs from the hub's install: (path, must run)."""
    import jupyterhub

    paths = [(Path(sys.executable), True), (Path(jupyterhub.__file__), False)]
    try:
        import kernelprovider

        paths.append((Path(kernelprovider.__file__), False))
    except ImportError:
        pass
    try:
        from ..local.inventory import shim_library

        library = shim_library()
        if library:
            paths.append((Path(library), False))
    except ImportError:
        pass
    return paths


ACL_XATTR = "system.posix_acl_access"
_ACL_USER_OBJ, _ACL_USER, _ACL_GROUP_OBJ, _ACL_MASK, _ACL_OTHER = 0x01, 0x02, 0x04, 0x10, 0x20
_ACL_UNDEFINED_ID = 0xFFFFFFFF


def grant_passage(directory: Path, uid: int) -> None:
    """Let one account pass through ``directory`` (execute, no listing) with a POSIX ACL entry, as
    ``setfacl -m u:<uid>:x`` does; everyone else keeps the directory's mode. Raises OSError."""
    info = directory.stat()
    mode = stat.S_IMODE(info.st_mode)
    entries: dict[tuple[int, int], int] = {}
    try:
        raw = os.getxattr(directory, ACL_XATTR)
    except OSError:
        raw = b""
    if len(raw) >= 4:
        for k in range(4, len(raw) - 7, 8):
            tag, perm, ident = struct.unpack_from("<HHI", raw, k)
            entries[(tag, ident)] = perm
    else:
        entries[(_ACL_USER_OBJ, _ACL_UNDEFINED_ID)] = (mode >> 6) & 7
        entries[(_ACL_GROUP_OBJ, _ACL_UNDEFINED_ID)] = (mode >> 3) & 7
        entries[(_ACL_OTHER, _ACL_UNDEFINED_ID)] = mode & 7
    entries[(_ACL_USER, uid)] = entries.get((_ACL_USER, uid), 0) | 1
    mask = entries.get((_ACL_MASK, _ACL_UNDEFINED_ID), 0)
    for (tag, _), perm in entries.items():
        if tag in (_ACL_USER, _ACL_GROUP_OBJ, 0x08):  # the group class: named users and groups, the owning group
            mask |= perm
    entries[(_ACL_MASK, _ACL_UNDEFINED_ID)] = mask
    blob = struct.pack("<I", 2) + b"".join(
        struct.pack("<HHI", tag, perm, ident) for (tag, ident), perm in sorted(entries.items())
    )
    os.setxattr(directory, ACL_XATTR, blob)


def revoke_passage(directory: Path, uid: int) -> None:
    """Undo :func:`grant_passage` for one account (its ACL entry goes; the mask stays)."""
    try:
        raw = os.getxattr(directory, ACL_XATTR)
    except OSError:
        return
    entries = [struct.unpack_from("<HHI", raw, k) for k in range(4, len(raw) - 7, 8)]
    kept = [e for e in entries if not (e[0] == _ACL_USER and e[2] == uid)]
    os.setxattr(directory, ACL_XATTR, struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in kept))


def allowed_system_users(config_dir: Path) -> list[str]:
    """The users ``c.Authenticator.allowed_users`` and ``admin_users`` name that are accounts on this machine."""
    import ast

    from .base import CONFIG_FILE

    names: set[str] = set()
    for line in (config_dir / CONFIG_FILE).read_text().splitlines():
        if line.startswith(("c.Authenticator.allowed_users = ", "c.Authenticator.admin_users = ")):
            try:
                value = ast.literal_eval(line.split("=", 1)[1].strip())
            except (ValueError, SyntaxError):
                continue
            names.update(n for n in value if isinstance(n, str))
    found = []
    for name in sorted(names):
        try:
            pwd.getpwnam(name)
        except KeyError:
            continue
        found.append(name)
    return found


def config_dir_unreachable(config_dir: Path, who: str, why: str) -> CLIError:
    return CLIError(
        f"users' servers run as {who}, which cannot reach the config dir {config_dir} (their homes and GPU limits "
        f"files live in it): {why}. Use a config dir outside root's home (the default as root is "
        f"/var/lib/elastic-gpu), or pass --config-dir"
    )


def check_servers_can_reach(config_dir: Path, account: str = "nobody", grant: bool = False) -> list[Path]:
    """Raise a CLIError naming the directory that stops ``account`` (default: any other account) from
    running the hub's Python or reaching the config dir, where servers find their home and limits file.

    With ``grant``, a root-owned directory in the way is opened to that one account by an ACL entry
    (pass through, no listing); the directories so opened are returned."""
    who = "each user's account" if account == "nobody" else f"the account {account!r}"
    uid = pwd.getpwnam(account).pw_uid
    opened: list[Path] = []
    needs = _needed_paths() + [(config_dir / "data", False)]
    for path, execute in needs:
        why = unreachable(path, account, execute)
        while why and grant and " cannot enter " in why and len(opened) < 16:
            blocked = Path(why.split(" cannot enter ", 1)[1].split(" (mode ", 1)[0])
            try:
                if blocked.stat().st_uid != 0:
                    break
                grant_passage(blocked, uid)
            except OSError:
                break
            opened.append(blocked)
            why = unreachable(path, account, execute)
        if not why:
            continue
        if path == config_dir / "data":
            raise config_dir_unreachable(config_dir, who, why)
        raise CLIError(
            f"users' servers run as {who}, which cannot use this hub's Python installation: {why}. Install the "
            f"project and its Python where every account can read them (e.g. under /opt or /srv), or let others "
            f"pass through that directory (chmod o+x)"
        )
    return opened


def prepare_mode(config_dir: Path, mode: str, reason: str) -> list[str]:
    """Check (and for first-use as root, create) the account servers run as; return what ``up`` says."""
    data = config_dir / "data"
    root = os.geteuid() == 0
    if mode == "pam":
        if not root:
            raise CLIError(
                "this config logs in with PAM and runs each user's server as that user, which needs root: run "
                "`elastic-gpu up` as root, or write a first-use config (`elastic-gpu init --force --authenticator "
                "firstuse`)"
            )
        lines = [
            f"mode: PAM login (this machine's accounts), because {reason}",
            "    Each user's server and kernels run as that user; the hub's state is readable by root only.",
        ]
        why = unreachable(config_dir / "data", "nobody")
        if why:
            raise config_dir_unreachable(config_dir, "each user's account", why)
        for user in allowed_system_users(config_dir):
            check_servers_can_reach(config_dir, user)
        why = next((w for w in (unreachable(p, "nobody", x) for p, x in _needed_paths()) if w), "")
        if why:
            lines.append(
                f"!!! users who are not allowed yet (an admin may add them on /hub/admin) cannot start a server: {why}"
            )
        return lines
    if mode != "firstuse":
        return [f"mode: the authenticator and spawner jupyterhub_config.py names ({reason})"]
    lines = [f"mode: first-use login (hub-only accounts), because {reason}"]
    if root:
        from .base import CONFIG_FILE

        if "HubUserGPUSpawner.run_as_account" not in (config_dir / CONFIG_FILE).read_text():
            raise CLIError(
                f"{config_dir / CONFIG_FILE} (written by an older elastic-gpu) runs every user's server as the hub's "
                f"own account, which would be root. Add `c.HubUserGPUSpawner.run_as_account = {TEAM_ACCOUNT!r}` to "
                "it, or write a fresh config with `elastic-gpu init --force` (data/ is kept), or run `elastic-gpu up` "
                "as a normal user"
            )
        account = ensure_team_account(data / "home")
        home = data / "home"
        home.mkdir(exist_ok=True)
        os.chmod(home, 0o711)
        opened = check_servers_can_reach(config_dir, TEAM_ACCOUNT, grant=True)
        lines += [
            '!!! a single-account "trusted team" mode: every user\'s server and kernels run as the unprivileged',
            f"    system account {TEAM_ACCOUNT!r} (uid {account.pw_uid}), never as root.",
            "    Users are NOT isolated from each other: each can read and change the others' files (data/home/*),",
            "    see their processes and kernel connection files, and run code in their kernels. The hub's state",
            "    (database, cookie secret, tokens, GPU ledger, log) is readable by root only. Give logins only to",
            "    people who trust each other; for isolation use this machine's accounts (`elastic-gpu init --force",
            "    --authenticator pam`).",
        ]
        for directory in opened:
            lines.append(
                f"!!! let {TEAM_ACCOUNT!r} pass through {directory} (ACL entry u:{TEAM_ACCOUNT}:x, no listing) to "
                f"run this hub's Python; undo with `setfacl -x u:{TEAM_ACCOUNT} {directory}`"
            )
    else:
        me = pwd.getpwuid(os.geteuid())
        lines += [
            f'!!! a single-account "trusted team" mode: every user\'s server runs as your account {me.pw_name!r}',
            f"    (uid {me.pw_uid}), the hub's own.",
            "    Users are NOT isolated from each other or from the hub: their code can read every other user's",
            "    files and the hub's cookie secret and tokens. Fine for yourself alone; for other people run",
            "    `elastic-gpu up` as root (servers then run as an unprivileged account) or use PAM",
            "    (`elastic-gpu init --force --authenticator pam`, as root).",
        ]
    return lines
