"""What the kubelet needs to run containers: the runtime process, identity, hosts file, net.

``runtime.py`` does the namespace and mount work in its own process; this module builds its
spec, starts it, and answers the kubelet's questions about a running container (does the pod
listen on this port; run this command inside it).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .images import Image

RUNTIME = Path(__file__).with_name("runtime.py")
NETSHIM_SRC = Path(__file__).with_name("netshim.c")
_build_lock = threading.Lock()


class StartFailed(Exception):
    """The runtime could not start the container's process (message as containerd words it)."""


def check_host() -> None:
    """Raise a clear error where containers cannot run (not root, no namespaces)."""
    if os.geteuid() != 0:
        raise RuntimeError("the kube emulator's kubelet runs pods as Linux containers and needs "
                           "root (namespaces, mounts, cgroups); this process runs as uid "
                           f"{os.geteuid()}")


def netshim_path() -> str:
    """The pod network library (netshim.c), built once per source version."""
    src = NETSHIM_SRC.read_bytes()
    digest = hashlib.sha256(src).hexdigest()[:16]
    out = Path(tempfile.gettempdir()) / f"kubeemu-netshim-{digest}" / "libkubeemu-net.so"
    with _build_lock:
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            os.chmod(out.parent, 0o755)
            tmp = out.with_name(f".build-{os.getpid()}.so")
            cc = os.environ.get("CC", "cc")
            res = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(NETSHIM_SRC),
                                  "-ldl"], capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(f"building the emulator's pod network library with {cc} "
                                   f"failed:\n{res.stderr}")
            os.chmod(tmp, 0o755)
            os.replace(tmp, out)
    return str(out)


def interpreter_dirs() -> list[str]:
    """Directories above this interpreter and its prefixes (the image's user must reach them)."""
    out: set[str] = set()
    for p in (os.path.realpath(sys.executable), sys.prefix, sys.base_prefix, sys.exec_prefix,
              os.path.dirname(sys.executable)):
        path = Path(p)
        for parent in [path, *path.parents]:
            if parent.is_dir():
                out.add(str(parent))
    return sorted(out, key=len)


def identity(pod: dict, container: dict, image: Image) -> tuple[int, int, list[int]]:
    """(uid, gid, supplementary groups) from the security contexts over the image's USER.

    Raises ValueError with the kubelet's message when runAsNonRoot forbids the result.
    """
    psc = pod["spec"].get("securityContext") or {}
    csc = container.get("securityContext") or {}

    def pick(key: str) -> Any:
        return csc.get(key) if csc.get(key) is not None else psc.get(key)

    uid = pick("runAsUser")
    gid = pick("runAsGroup")
    if uid is None:
        uid = image.uid
        if gid is None:
            gid = image.gid
    elif gid is None:
        gid = image.gid if uid == image.uid else 0
    if pick("runAsNonRoot") and uid == 0:
        meta = pod["metadata"]
        if pick("runAsUser") is not None:
            raise ValueError(f"container's runAsUser breaks non-root policy (pod: "
                             f'"{meta["name"]}_{meta["namespace"]}({meta["uid"]})", '
                             f"container: {container['name']})")
        raise ValueError(f'container has runAsNonRoot and image will run as root (pod: '
                         f'"{meta["name"]}_{meta["namespace"]}({meta["uid"]})", '
                         f"container: {container['name']})")
    groups = [gid]
    for g in psc.get("supplementalGroups") or []:
        groups.append(int(g))
    if psc.get("fsGroup") is not None:
        groups.append(int(psc["fsGroup"]))
    return int(uid), int(gid), sorted(set(groups))


def read_only_root(container: dict) -> bool:
    return bool((container.get("securityContext") or {}).get("readOnlyRootFilesystem"))


def listens(ip: str, port: int) -> bool:
    """Whether a TCP socket listens on exactly ip:port (a pod's own address)."""
    want4 = f"{socket.htonl(int.from_bytes(socket.inet_aton(ip), 'big')):08X}:{port:04X}"
    mapped = "0000000000000000FFFF0000" + want4.split(":")[0]
    for name, want in (("/proc/net/tcp", want4), ("/proc/net/tcp6", f"{mapped}:{port:04X}")):
        with contextlib.suppress(OSError), open(name) as f:
            next(f, None)
            for line in f:
                parts = line.split()
                if len(parts) > 3 and parts[3] == "0A" and parts[1] == want:
                    return True
    return False


def signal_state(pid: int) -> dict[str, Any] | None:
    """What the kernel says of process ``pid``: its ``state`` (``S (sleeping)`` ...), and the
    signal numbers it ``caught`` (has a handler for) and ``ignored``; None once it is gone.

    A pid namespace's first process (a container's pid 1) never gets a signal from outside it
    that it has no handler for (SIGKILL aside): the kernel drops it, not even pending. A SIGTERM
    sent before its program has installed a handler is lost, and the container then runs until
    the kubelet kills it at the end of its grace period.
    """
    fields: dict[str, str] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    except OSError:
        return None

    def numbers(mask: str) -> list[int]:
        bits = int(mask or "0", 16)
        return [n for n in range(1, 65) if bits & (1 << (n - 1))]

    return {"state": fields.get("State", "?"), "caught": numbers(fields.get("SigCgt", "")),
            "ignored": numbers(fields.get("SigIgn", ""))}


def hosts_file(pod: dict, pod_ip: str, services: list[tuple[str, str, str]]) -> str:
    """The pod's /etc/hosts: localhost, the pod's own names, then Service names.

    ``services``: (namespace, name, address) of Services with a ready endpoint.
    """
    meta, spec = pod["metadata"], pod["spec"]
    ns = meta["namespace"]
    lines = ["# Kubernetes-managed hosts file (kubeemu).", "127.0.0.1\tlocalhost"]
    hostname = spec.get("hostname") or meta["name"]
    if spec.get("subdomain"):
        lines.append(f"{pod_ip}\t{hostname}.{spec['subdomain']}.{ns}.svc.cluster.local\t{hostname}")
    else:
        lines.append(f"{pod_ip}\t{hostname}")
    lines.append(f"{pod_ip}\t{pod_ip.replace('.', '-')}.{ns}.pod.cluster.local")
    for sns, name, address in services:
        names = [f"{name}.{sns}.svc.cluster.local", f"{name}.{sns}.svc", f"{name}.{sns}"]
        if sns == ns:
            names.append(name)
        lines.append(address + "\t" + " ".join(names))
    return "\n".join(lines) + "\n"


def write_in_place(path: Path, text: str) -> None:
    """Rewrite a bind-mounted file keeping its inode (a rename would detach the mount)."""
    data = text.encode()
    with contextlib.suppress(FileNotFoundError):
        if path.read_bytes() == data:
            return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
    finally:
        os.close(fd)


class RuntimeServer:
    """The kubelet's runtime server (``runtime.py serve``): one interpreter, started with the
    kubelet, that forks a runtime per container, so a container's start waits for no
    interpreter to start and import."""

    def __init__(self) -> None:
        # requests go in one message each, with the container's channel (runtime.py's docstring)
        self.control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fd = theirs.fileno()
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(RUNTIME), "serve", str(fd)], stdin=subprocess.PIPE,
            pass_fds=(fd,), start_new_session=True)
        theirs.close()

    def request(self, spec: dict, log_path: Path) -> socket.socket:
        """Ask for the container of ``spec`` (its output to ``log_path``): one message, sent
        now; the channel its runtime reports on (this end, non-blocking)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            data = json.dumps({"spec": spec, "log": str(log_path)}).encode()
            self.control.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                           array.array("i", [theirs.fileno()]).tobytes())])
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        return ours

    def stop(self) -> None:
        """Stop the server (the runtimes it started are the kubelet's to kill)."""
        if self.proc.poll() is None:
            self.proc.terminate()  # (its stdin's end tells it too, should this process die first)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        with contextlib.suppress(OSError):
            self.proc.stdin.close()  # type: ignore[union-attr]
        self.control.close()


class RuntimeProcess:
    """A container's runtime forked by the server: its pid (its process group's id), its exit
    status once reaped (``returncode``, negative for a signal, as asyncio's), and the moments
    (CLOCK_BOOTTIME) its pid 1 executed its program (``started``) and ended (``exited``)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.pid = 0
        self.returncode: int | None = None
        self.started: float | None = None
        self.exited: float | None = None
        self._done = asyncio.get_running_loop().create_future()

    async def next_state(self) -> dict:
        line = await self.reader.readline()
        if not line:
            self._finish(128 if self.returncode is None else self.returncode)
            return {}
        state = json.loads(line)
        self.pid = state.get("runtime", self.pid)
        if "exited" in state:
            self.exited = state["exited"]
        if "status" in state:  # the container is over; its runtime is about to exit with it
            self._finish(int(state["status"]))
        if "exit" in state:
            self._finish(int(state["exit"]))
        return state

    def _finish(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        if self.exited is None:
            self.exited = time.clock_gettime(time.CLOCK_BOOTTIME)
        if not self._done.done():
            self._done.set_result(self.returncode)
        self.writer.close()

    async def follow(self) -> None:
        """Read the runtime's later states until its container is over."""
        with contextlib.suppress(OSError, ValueError):
            while self.returncode is None:
                await self.next_state()
        self._finish(128)

    async def wait(self) -> int:
        return await asyncio.shield(self._done)


async def start(server: RuntimeServer, spec: dict, spec_path: Path, log_path: Path,
                timeout: float = 30.0) -> tuple[RuntimeProcess, int]:
    """Start a container through the runtime server; (its runtime, host pid of its pid 1)."""
    spec_path.write_text(json.dumps(spec))  # the container's bundle, as runc's config.json
    try:
        sock = server.request(spec, log_path)
    except OSError as e:
        raise StartFailed(f"container runtime did not take the container ({e!r})") from None
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    proc = RuntimeProcess(reader, writer)
    try:
        state = await asyncio.wait_for(proc.next_state(), timeout)
    except (asyncio.TimeoutError, OSError, ValueError) as e:
        writer.close()
        raise StartFailed(f"container runtime did not start the container in time ({e!r})") from None
    if "error" in state:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(proc.follow(), 5)
        raise StartFailed(state["error"])
    if "pid" not in state:
        raise StartFailed(f"container runtime exited with {proc.returncode} before the "
                          "container started (see the pod log)")
    proc.started = state.get("started")
    proc.marks = state.get("marks") or {}  # type: ignore[attr-defined]
    proc.sched = state.get("sched") or {}  # type: ignore[attr-defined]
    proc.follow_task = asyncio.ensure_future(proc.follow())  # type: ignore[attr-defined]
    return proc, int(state["pid"])


async def exec_process(pid1: int, argv: list[str], env: dict[str, str], uid: int, gid: int,
                       groups: list[int], cwd: str, cgroup: str | None, work: Path,
                       stdin: bool = False, merge_stderr: bool = False
                       ) -> asyncio.subprocess.Process:
    """A command inside a running container (its namespaces, root, cgroup and user)."""
    work.mkdir(parents=True, exist_ok=True)
    fd, spec_path = tempfile.mkstemp(prefix="exec-", suffix=".json", dir=work)
    with os.fdopen(fd, "w") as f:
        json.dump({"pid": pid1, "argv": argv, "env": env, "uid": uid, "gid": gid,
                   "groups": groups, "cwd": cwd, "cgroup": cgroup,
                   "state": spec_path + ".state"}, f)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-S", str(RUNTIME), "exec", spec_path,
        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE)
    proc.spec_path = spec_path  # type: ignore[attr-defined]
    return proc


def exec_error(proc: asyncio.subprocess.Process) -> str | None:
    """After an exec exits: the runtime's message when the command could not be started."""
    path = getattr(proc, "spec_path", None)
    if not path:
        return None
    try:
        st = json.loads(Path(path + ".state").read_text() or "null") or {}
    except (OSError, ValueError):
        st = {}
    for p in (path, path + ".state"):
        with contextlib.suppress(OSError):
            os.unlink(p)
    return st.get("error")
