"""The emulator's container runtime: runs one container, or one exec, in Linux namespaces.

Started by the kubelet as ``python runtime.py run|exec SPEC.json`` (root only). It is a
separate small program (not a fork of the emulator's threaded process), like runc:

``run``: unshares mount, uts, ipc and pid namespaces,
mounts a copy-on-write overlay of this machine's root filesystem (the "image": the test
environment), bind-mounts every volume at its mountPath (``readOnly`` honoured), a private
``/dev/shm`` and ``/tmp``, the pod's ``/etc/hosts`` and ``/etc/hostname``, hides the
emulator's data directory, sets the hostname, then forks the container's first process:
pid 1 of the new pid namespace, in the container's memory cgroup (it joins by one write:
``_join_cgroup``), chrooted into the overlay, with its own ``/proc``, uid, gid
and supplementary groups. This process stays outside as the container's "shim": it passes
SIGTERM/SIGINT/SIGHUP on to pid 1 only (as a container runtime does), waits for it and exits
with its status (128+n when a signal killed it).

``exec``: enters a running container (its namespaces, root, cgroup and user) and runs a
command there, as ``kubectl exec`` does.

The spec's ``state`` file receives ``{"pid": host_pid, "started": t}`` once pid 1 runs its
program (``t``: CLOCK_BOOTTIME seconds at its exec), or ``{"error": msg}`` when its program
cannot be executed (this process then exits 128); then ``{"exited": t, "status": code}`` when
pid 1 has ended (``code``: this process's exit status to come). Only the container's processes
join its memory cgroup, not this one.

``serve SOCKET_FD``: the kubelet's runtime server, started once per kubelet so that no container
start waits for an interpreter to start and import (on two busy cores that alone took longer
than the rest of a pod's start). It reads requests on the unix SOCK_SEQPACKET socket it inherits
(the kubelet holds its other end): each one message, the JSON ``{"spec": {...}, "log": LOG}``
with one file descriptor attached (SCM_RIGHTS), the container's channel (a stream socket whose
other end the kubelet reads). One message and one system call: the kubelet's request is whole
when it wakes the server, however long the kubelet's thread then waits for a CPU. On each, the
server forks a runtime that does what ``run`` does (in a process group of its own, stdout and
stderr to ``LOG``) and reports its states as JSON lines on the channel instead of the file; once
the server has reaped that runtime it writes ``{"exit": status}`` (negative: the signal that
killed it) and closes the channel. It exits when its stdin (a pipe from the kubelet) closes.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import errno
import json
import os
import selectors
import signal
import socket
import struct
import sys
import time
import warnings  # noqa: F401 - os.execvpe imports it lazily, after the chroot into an image

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int,
          data: str | None = None) -> None:
    _check(_libc.mount(source.encode() if source else None, target.encode(),
                       fstype.encode() if fstype else None, ctypes.c_ulong(flags),
                       data.encode() if data else None), f"mount {source} on {target}")


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def setns(fd: int, nstype: int) -> None:
    _check(_libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype)), "setns")


def sethostname(name: str) -> None:
    raw = name.encode()
    _check(_libc.sethostname(raw, ctypes.c_size_t(len(raw))), "sethostname")


def _join_cgroup(cgroup: str | None) -> None:
    """The calling process joins the container's cgroup (its children follow), by one write. The
    caller is single-threaded (just forked): in cgroup v1 it writes its ``tasks`` file, which
    moves this one thread without the kernel's write lock on every thread group (taking that lock
    waits for an RCU grace period, milliseconds and more on a busy machine; ``cgroup.procs``
    takes it); cgroup v2 has only ``cgroup.procs``."""
    if cgroup:
        try:
            fd = os.open(os.path.join(cgroup, "tasks"), os.O_WRONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = os.open(os.path.join(cgroup, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)


def resolve_in(root: str, path: str, create_dirs: bool = False) -> str:
    """``path`` inside ``root``, following symlinks as the container would see them.

    An absolute link (``/var/run -> /run``) is resolved against ``root``, never against
    this machine's root, so nothing is created or mounted outside the container.
    """
    parts = [p for p in path.split("/") if p and p != "."]
    current = root
    hops = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            current = os.path.dirname(current) if current != root else root
            continue
        candidate = os.path.join(current, part)
        if os.path.islink(candidate):
            hops += 1
            if hops > 40:
                raise OSError(errno.ELOOP, f"too many symlinks resolving {path}")
            target = os.readlink(candidate)
            parts = [p for p in target.split("/") if p and p != "."] + parts
            if target.startswith("/"):
                current = root
            continue
        if create_dirs and parts and not os.path.exists(candidate):
            os.mkdir(candidate, 0o755)
        current = candidate
    return current


def _mkpoint(root: str, path: str, is_file: bool) -> str:
    """Create a mount point for ``path`` inside ``root``; its real location."""
    real = resolve_in(root, path, create_dirs=True)
    if not os.path.lexists(real):
        if is_file:
            os.close(os.open(real, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
        else:
            os.mkdir(real, 0o755)
    return real


def _setup_rootfs(spec: dict) -> str:
    """Mount the container's filesystem (in this process's new mount namespace)."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    root, upper, work = spec["rootfs"], spec["upper"], spec["work"]
    for d in (root, upper, work):
        os.makedirs(d, exist_ok=True)
    lower = spec.get("lower") or "/"  # the image's filesystem, else this machine's
    mount("overlay", root, "overlay", 0, f"lowerdir={lower},upperdir={upper},workdir={work}")

    def inside(p: str) -> str:
        return os.path.join(root, p.lstrip("/"))

    for d in ("/dev", "/sys", "/proc", "/etc"):  # mount points an image may lack (in its layer)
        os.makedirs(inside(d), exist_ok=True)
    if spec.get("gpu_minors") is None:
        mount("/dev", inside("/dev"), None, MS_BIND | MS_REC)
    else:
        _private_dev(inside("/dev"), spec["gpu_minors"])
    mount("shm", inside("/dev/shm"), "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    mount("/sys", inside("/sys"), None, MS_BIND | MS_REC)
    for hidden in spec.get("hide") or []:
        mount("kubeemu-hidden", _mkpoint(root, hidden, False), "tmpfs", MS_NOSUID | MS_NODEV,
              "mode=755")
    for d in spec.get("dirs") or []:  # the image's own directories (its user's home ...)
        path = resolve_in(root, d["path"], create_dirs=True)
        if not os.path.exists(path):
            os.mkdir(path, 0o755)
            os.chown(path, d.get("uid", 0), d.get("gid", 0))
    for d in spec.get("traverse") or []:  # the image lets its user reach the interpreter
        path = resolve_in(root, d)
        with contextlib.suppress(OSError):
            mode = os.stat(path).st_mode
            if mode & 0o011 != 0o011:
                with contextlib.suppress(OSError):  # an ACL would keep the group out
                    os.removexattr(path, "system.posix_acl_access")
                os.chmod(path, mode | 0o011)
    for f in spec.get("files") or []:  # written into the container's layer, e.g. ld.so.preload
        path = resolve_in(root, f["path"], create_dirs=True)
        if os.path.islink(path) or os.path.isdir(path):
            continue
        with open(path, "w") as out:
            out.write(f["content"])
    for m in spec.get("mounts") or []:
        target = _mkpoint(root, m["target"], os.path.isfile(m["source"])
                          and not os.path.isdir(m["source"]))
        mount(m["source"], target, None, MS_BIND | MS_REC)
        if m.get("readOnly"):
            mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
    if spec.get("readOnlyRoot"):
        mount(None, root, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
    return root


#: what a container runtime puts in a container's /dev (besides its GPUs): bound from the host's
DEV_FILES = ("null", "zero", "full", "random", "urandom", "tty", "ptmx")
DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
             "stderr": "/proc/self/fd/2"}
NVIDIA_MAJOR, CONTROL_MINOR = 195, 255  # devices.py


def _private_dev(dev: str, gpu_minors: list[int]) -> None:
    """A /dev of the container's own (a root-owned tmpfs), as runc makes one: the usual devices
    made anew (mknod, as runc does outside a user namespace: one call each, where a bind mount of
    the host's node took a file, a mount, and an unmount when the container ends) with the host's
    numbers and modes, and the NVIDIA runtime's device nodes of the cards the container was given
    (``devices.py``): ``nvidiactl`` and ``nvidia<minor>`` (character devices 195:n)."""
    mount("kubeemu-dev", dev, "tmpfs", MS_NOSUID, "mode=755")
    for name in DEV_FILES:
        host = os.stat(os.path.join("/dev", name))
        target = os.path.join(dev, name)
        os.mknod(target, host.st_mode, host.st_rdev)
        os.chmod(target, host.st_mode & 0o7777)  # the umask took its share
    for name in ("pts", "shm", "mqueue"):
        os.mkdir(os.path.join(dev, name), 0o755)
    mount("/dev/pts", os.path.join(dev, "pts"), None, MS_BIND | MS_REC)
    for name, target in DEV_LINKS.items():
        os.symlink(target, os.path.join(dev, name))
    for minor in [CONTROL_MINOR, *gpu_minors]:
        path = os.path.join(dev, "nvidiactl" if minor == CONTROL_MINOR else f"nvidia{minor}")
        os.mknod(path, 0o20666, os.makedev(NVIDIA_MAJOR, minor))
        os.chmod(path, 0o666)


#: the niceness of the container's processes: the server and its runtimes run at RUNTIME_NICE
#: below it. With the kernel's autogroups (sched_autogroup_enabled) niceness only ranks the
#: threads of one session: the runtimes stay in the server's session (a process group of their
#: own each), whose autogroup keeps the default weight (the emulator takes no CPU weight from the
#: processes it hosts), and a container's pid 1 starts a session of its own just before it
#: executes the container's program, as runc's init does.
POD_NICE: int | None = None
RUNTIME_NICE = 10


def _become(spec: dict) -> None:
    if POD_NICE is not None:
        os.setpriority(os.PRIO_PROCESS, 0, POD_NICE)
    os.setgroups(spec.get("groups") or [])
    os.setgid(spec.get("gid", 0))
    os.setuid(spec.get("uid", 0))


def _child(spec: dict, root: str | None, errw: int, mount_proc: bool,
           marks_w: int | None = None) -> None:
    """In the forked child: join the container's cgroup, finish its view, become its user, exec.
    With ``marks_w``, write there the moments it joined its cgroup (0 without one) and was about
    to exec (two doubles)."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    argv = spec["argv"]
    try:
        # only the container's processes: this runtime stays out, so the cgroup is empty (and
        # can go) once the container's pid 1 has been reaped, while the runtime still exits
        _join_cgroup(spec.get("cgroup"))
        joined = _clock() if spec.get("cgroup") else 0.0
        if root is not None:
            os.chroot(root)
            os.chdir("/")
        if mount_proc:
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        _become(spec)
        cwd = spec.get("cwd") or "/"
        try:
            os.chdir(cwd)
        except OSError as e:
            os.write(errw, f'chdir to cwd ("{cwd}") set in config.json failed: '
                           f"{os.strerror(e.errno or 0).lower()}".encode())
            os._exit(128)
        if marks_w is not None:
            os.write(marks_w, struct.pack("dd", joined, _clock()))
        if mount_proc:  # the container's pid 1: a session (and autogroup) of its own
            os.setsid()
        try:
            os.execvpe(argv[0], argv, spec["env"])
        except OSError as e:
            if e.errno == errno.ENOENT and "/" not in argv[0]:
                why = "executable file not found in $PATH"
            else:
                why = os.strerror(e.errno or 0).lower()
            os.write(errw, f'exec: "{argv[0]}": {why}'.encode())
    except BaseException as e:  # noqa: BLE001 - whatever failed must reach the kubelet
        os.write(errw, f"{type(e).__name__}: {e}".encode())
    os._exit(128)


def _clock() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def schedstat(pid: int | str = "self") -> tuple[float, float]:
    """(seconds on a CPU, seconds waiting for one) of a process since it began (its main thread;
    ``/proc/<pid>/schedstat``); zeros where the kernel does not say."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            run_ns, wait_ns = f.read().split()[:2]
        return int(run_ns) / 1e9, int(wait_ns) / 1e9
    except (OSError, ValueError):
        return 0.0, 0.0


def _state_reporter(path: str | None):  # noqa: ANN202
    """Where the outcome of the exec goes; opened now (the path may vanish after chroot)."""
    if not path:
        return lambda state: None
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)

    def report(state: dict) -> None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(state).encode(), 0)

    return report


def _supervise(report, pid: int, errr: int, marks: dict | None = None,  # noqa: ANN001
               marks_r: int | None = None) -> int:
    """Wait for the container's pid 1; pass termination signals on to it. With ``marks`` (the
    runtime's moments so far) and ``marks_r`` (pid 1's, see :func:`_child`), the started state
    also carries ``marks`` and ``sched``: this runtime's and pid 1's (CPU, run-queue wait)
    seconds so far (:func:`schedstat`), so that a slow start says whether it computed or waited
    for a CPU."""
    chunks = []
    while True:
        data = os.read(errr, 65536)
        if not data:
            break
        chunks.append(data)
    os.close(errr)  # at its end: the program was executed (or its error written)
    started = _clock()
    error = b"".join(chunks).decode(errors="replace")
    state: dict = {"error": error} if error else {"pid": pid, "started": started}
    if marks_r is not None:
        raw = os.read(marks_r, 16)
        os.close(marks_r)
        if not error and marks is not None:
            if len(raw) == 16:
                joined, marks["exec"] = struct.unpack("dd", raw)
                if joined:  # (a container without a cgroup joins none)
                    marks["cgroup"] = joined
            state["marks"] = marks
            state["sched"] = {"runtime": schedstat(), "pid1": schedstat(pid)}
    report(state)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except ChildProcessError:
            return 128
        except InterruptedError:
            continue
    if error:
        return 128
    code = 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    # the container is over (its pid 1 gone, and with it every process of its pid namespace):
    # the kubelet may go on while this process still tears down the namespaces
    report({"exited": time.clock_gettime(time.CLOCK_BOOTTIME), "status": code})
    return code


def _forward_signals(get_pid) -> None:  # noqa: ANN001
    def forward(signum: int, _frame: object) -> None:
        pid = get_pid()
        if pid:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, forward)


def run(spec: dict, report=None, began: float | None = None) -> int:  # noqa: ANN001
    """The container of ``spec``; its states to ``report`` (default: the spec's state file);
    ``began``: the moment this runtime was forked (default: now)."""
    report = report or _state_reporter(spec.get("state"))
    marks = {"runtime": began if began is not None else _clock()}
    child_pid = 0
    _forward_signals(lambda: child_pid)
    unshare(CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWPID)
    sethostname(spec["hostname"])
    marks["namespaces"] = _clock()
    errr, errw = os.pipe()
    marks_r, marks_w = os.pipe()
    # the root first, then pid 1 goes straight on to its program (joining its cgroup, if any,
    # by one write: _join_cgroup)
    _setup_rootfs(spec)
    marks["rootfs"] = _clock()
    pid = os.fork()
    if pid == 0:
        os.close(errr)
        os.close(marks_r)
        _child(spec, spec["rootfs"], errw, mount_proc=True, marks_w=marks_w)
    marks["pid1"] = _clock()
    os.close(errw)
    os.close(marks_w)
    child_pid = pid
    return _supervise(report, pid, errr, marks, marks_r)


def exec_in(spec: dict) -> int:
    target = spec["pid"]
    report = _state_reporter(spec.get("state"))
    fds = {}
    for ns in ("ipc", "uts", "pid", "mnt"):
        fds[ns] = os.open(f"/proc/{target}/ns/{ns}", os.O_RDONLY)
    root_fd = os.open(f"/proc/{target}/root", os.O_RDONLY | os.O_DIRECTORY)
    setns(fds["ipc"], CLONE_NEWIPC)
    setns(fds["uts"], CLONE_NEWUTS)
    setns(fds["pid"], CLONE_NEWPID)
    setns(fds["mnt"], CLONE_NEWNS)
    os.fchdir(root_fd)
    os.chroot(".")
    for fd in (*fds.values(), root_fd):
        os.close(fd)
    child_pid = 0
    _forward_signals(lambda: child_pid)
    errr, errw = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(errr)
        _child(spec, None, errw, mount_proc=False)
    os.close(errw)
    child_pid = pid
    return _supervise(report, pid, errr)


#: the most a request may hold (its spec inline): the server's receive buffer
REQUEST_MAX = 1 << 20


def _serve_one(conn: socket.socket, control: socket.socket, request: dict) -> int:
    """In a forked runtime of the server: the container of ``request``, its states as lines on
    ``conn``."""
    began = _clock()
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    control.close()
    os.setpgid(0, 0)  # the kubelet signals the runtime's process group

    def report(state: dict) -> None:
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({**state, "runtime": os.getpid()}).encode() + b"\n")

    try:
        conn.setblocking(True)
        devnull = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(devnull, 0, inheritable=True)
        os.dup2(out, 1, inheritable=True)
        os.dup2(out, 2, inheritable=True)
        os.close(devnull)
        os.close(out)
        return run(request["spec"], report, began)
    except (OSError, ValueError, KeyError, TypeError) as e:
        msg = f"failed to create containerd task: OCI runtime create failed: {e}"
        report({"error": msg})
        print(msg, file=sys.stderr)
        return 128


def _receive(control: socket.socket) -> tuple[dict, socket.socket] | None:
    """The next request on ``control`` and its channel; None when the kubelet closed its end."""
    size = socket.CMSG_SPACE(array.array("i", [0]).itemsize)
    data, ancillary, _, _ = control.recvmsg(REQUEST_MAX, size, socket.MSG_CMSG_CLOEXEC)  # no exec inherits it
    fds = array.array("i")
    for level, kind, raw in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(raw[:len(raw) - len(raw) % fds.itemsize])
    if not data and not fds:
        return None
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"a request carries one channel, not {len(fds)}")
    return json.loads(data), socket.socket(fileno=fds[0])


def serve(control: socket.socket) -> int:
    """The runtime server (module docstring): fork a runtime per request, report its exit."""
    global POD_NICE
    POD_NICE = os.getpriority(os.PRIO_PROCESS, 0)
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, max(-20, POD_NICE - RUNTIME_NICE))
    sel = selectors.DefaultSelector()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel.register(control, selectors.EVENT_READ, "request")
    sel.register(wake_r, selectors.EVENT_READ, "child")
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "kubelet")
    runtimes: dict[int, socket.socket] = {}
    while True:
        for key, _ in sel.select():
            if key.data == "kubelet" and not os.read(sys.stdin.fileno(), 4096):
                return 0  # the kubelet is gone (its runtimes live on until it kills them)
            if key.data == "request":
                try:
                    received = _receive(control)
                except (BlockingIOError, InterruptedError):
                    continue
                except (OSError, ValueError) as e:  # a request we cannot read: say so, go on
                    print(f"kubeemu runtime server: unreadable request: {e}", file=sys.stderr)
                    continue
                if received is None:
                    return 0  # the kubelet closed its end
                request, conn = received
                pid = os.fork()
                if pid == 0:
                    code = 128
                    try:
                        code = _serve_one(conn, control, request)
                    finally:
                        os._exit(code)
                runtimes[pid] = conn
            if key.data == "child":
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
        while runtimes:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = runtimes.pop(pid, None)
            if conn is not None:
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                with contextlib.suppress(OSError):
                    conn.sendall(json.dumps({"exit": code}).encode() + b"\n")
                conn.close()


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "serve":
        control = socket.socket(fileno=int(sys.argv[2]))
        control.setblocking(False)
        return serve(control)
    if len(sys.argv) != 3 or sys.argv[1] not in ("run", "exec"):
        print("usage: runtime.py run|exec SPEC.json | runtime.py serve SOCKET_FD", file=sys.stderr)
        return 2
    with open(sys.argv[2]) as f:
        spec = json.load(f)
    try:
        return run(spec) if sys.argv[1] == "run" else exec_in(spec)
    except OSError as e:
        msg = f"failed to create containerd task: OCI runtime create failed: {e}"
        if spec.get("state"):
            with open(spec["state"], "w") as f:
                json.dump({"error": msg}, f)
        print(msg, file=sys.stderr)
        return 128


if __name__ == "__main__":
    sys.exit(main())
