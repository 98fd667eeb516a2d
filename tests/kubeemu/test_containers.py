"""Pods are real containers: namespaces, mounts, identity, limits, images, network, exec, DNS."""

from __future__ import annotations

import json
import os
import socket
import sys

import kubernetes
import pytest
from kubernetes.stream import stream

from tests.kubeemu.helpers import pod, py, tiny_image
from tests.kubeemu.images import Image


@pytest.fixture(scope="module")
def core(kube_emulator):
    api_client = kubernetes.config.new_client_from_config(kube_emulator.kubeconfig_path)
    yield kubernetes.client.CoreV1Api(api_client)
    api_client.close()


def _report(emu, name: str, ns: str, timeout: float = 15) -> dict:
    """The JSON line a pod printed last (its report), once it has finished."""
    emu.wait_for_pod_phase(name, ("Succeeded", "Failed"), ns, timeout=timeout)
    lines = [ln for ln in emu.pod_log(name, ns).splitlines() if ln.startswith("{")]
    assert lines, emu.pod_log(name, ns)
    return json.loads(lines[-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _events(core, ns: str, name: str) -> list[tuple[str, str]]:
    return [(e.reason, e.message) for e in core.list_namespaced_event(
        ns, field_selector=f"involvedObject.name={name}").items]


def _state(emu, name: str, ns: str) -> dict:
    p = emu.get("pods", name, ns) or {}
    return ((p.get("status") or {}).get("containerStatuses") or [{}])[0]


def test_pod_is_pid_1_in_its_own_namespaces_with_the_pod_name_as_hostname(
        kube_emulator, core, kube_namespace):
    code = ("import json, os, socket\n"
            "fds = sorted(int(f) for f in os.listdir('/proc/self/fd'))\n"
            "pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
            "print(json.dumps({'pid': os.getpid(), 'pids': pids, 'host': socket.gethostname(),"
            " 'etc_hostname': open('/etc/hostname').read().strip(), 'fds': fds}))\n")
    core.create_namespaced_pod(kube_namespace, pod("whoami", py(code), restartPolicy="Never"))
    report = _report(kube_emulator, "whoami", kube_namespace)
    assert report["fds"] == [0, 1, 2, 3]  # stdin, stdout, stderr (and the listing's): nothing of the runtime's
    assert report["pid"] == 1
    assert report["pids"] == [1]  # its /proc shows its own processes only
    assert report["host"] == "whoami" and report["etc_hostname"] == "whoami"


def test_pid_1_leads_its_own_session_and_the_emulator_takes_no_cpu_weight_from_the_pods(
        kube_emulator, core, kube_namespace):
    """As runc's init, a container's pid 1 is a session leader, at the pods' niceness. The
    emulator does not outweigh the processes it hosts (a hub, its users' servers): its thread (the
    control plane) runs at this process's niceness and the runtimes' session (autogroup) at the
    default weight, so a busy machine starves neither the hub's event loop nor the emulator; an
    exec'd command runs at the pods' niceness too."""
    ns = kube_namespace
    code = ("import json, os, time\n"
            "print(json.dumps({'sid': os.getsid(0), 'nice': os.getpriority(os.PRIO_PROCESS, 0)}), flush=True)\n"
            "time.sleep(60)\n")
    core.create_namespaced_pod(ns, pod("weights", py(code)))
    kube_emulator.wait_for(lambda: "sid" in kube_emulator.pod_log("weights", ns), message="its report")
    report = json.loads(kube_emulator.pod_log("weights", ns).splitlines()[0])
    pods_nice = os.getpriority(os.PRIO_PROCESS, 0)
    assert report == {"sid": 1, "nice": pods_nice}
    thread = kube_emulator._thread.native_id
    assert os.getpriority(os.PRIO_PROCESS, thread) == pods_nice  # not raised above the pods
    rt = kube_emulator.kubelet.runtime_for(ns, "weights")
    runtime_pid, pid1 = rt.proc_pids
    if os.path.exists("/proc/self/autogroup"):
        with open(f"/proc/{runtime_pid}/autogroup") as f:
            runtime_group = f.read().split()
        with open(f"/proc/{pid1}/autogroup") as f:
            pid1_group = f.read().split()
        assert runtime_group[1:] == ["nice", "0"], runtime_group
        assert pid1_group[0] != runtime_group[0] and pid1_group[1:] == ["nice", "0"], pid1_group
    out = stream(core.connect_get_namespaced_pod_exec, "weights", ns,
                 command=["python3", "-I", "-c", "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"],
                 stderr=True, stdout=True, stdin=False, tty=False)
    assert int(out) == pods_nice


def test_volumes_are_mounted_where_the_program_looks_readonly_and_subpath(
        kube_emulator, core, kube_namespace):
    ns = kube_namespace
    core.create_namespaced_config_map(ns, {"metadata": {"name": "probe-cfg"},
                                           "data": {"k": "from-configmap", "other": "x"}})
    # the paths are built at run time: nothing in command, args or env names them
    code = ("import errno, json, os\n"
            "base = '/etc/' + 'probe' + '-cfg'\n"
            "out = {'k': open(os.path.join(base, 'k')).read(),\n"
            "       'sub': open('/opt/' + 'only-k').read(),\n"
            "       'run': open('/var/run/' + 'kubeemu-probe/k').read(),\n"
            "       'preload': open('/etc/ld.so' + '.preload').read().splitlines()[0]}\n"
            "for path in (base + '/new', '/data-' + 'ro/new'):\n"
            "    try:\n"
            "        open(path, 'w')\n"
            "        out[path] = 'written'\n"
            "    except OSError as e:\n"
            "        out[path] = errno.errorcode[e.errno]\n"
            "open('/scratch/' + 'f', 'w').write('ok')\n"
            "out['scratch'] = open('/scratch/f').read()\n"
            "print(json.dumps(out))\n")
    core.create_namespaced_pod(ns, pod(
        "mounts", py(code), restartPolicy="Never",
        volumeMounts=[
            {"name": "cfg", "mountPath": "/etc/probe-cfg"},
            {"name": "cfg", "mountPath": "/opt/only-k", "subPath": "k"},
            # /var/run is a symlink (to /run) in most images: followed inside the container
            {"name": "cfg", "mountPath": "/var/run/kubeemu-probe"},
            {"name": "scratch", "mountPath": "/scratch"},
            {"name": "scratch", "mountPath": "/data-ro", "readOnly": True},
            {"name": "preload", "mountPath": "/etc/ld.so.preload", "subPath": "ld.so.preload",
             "readOnly": True},
        ],
        volumes=[{"name": "cfg", "configMap": {"name": "probe-cfg"}},
                 {"name": "scratch", "emptyDir": {}},
                 {"name": "preload", "configMap": {"name": "probe-cfg",
                                                   "items": [{"key": "other",
                                                              "path": "ld.so.preload"}]}}]))
    report = _report(kube_emulator, "mounts", ns)
    assert report["k"] == "from-configmap"
    assert report["sub"] == "from-configmap"
    assert report["run"] == "from-configmap"
    assert report["preload"] == "x"  # the mounted /etc/ld.so.preload is the volume's file
    assert report["/etc/probe-cfg/new"] == "EROFS"  # configMap volumes are read-only
    assert report["/data-ro/new"] == "EROFS"  # readOnly: true
    assert report["scratch"] == "ok"
    # nothing leaked onto this machine
    for path in ("/etc/probe-cfg", "/scratch", "/run/kubeemu-probe", "/var/run/kubeemu-probe"):
        assert not os.path.exists(path)


def test_read_only_root_filesystem(kube_emulator, core, kube_namespace):
    code = ("import errno, json\nout = {}\n"
            "for path in ('/etc/x', '/tmp/x', '/scratch/x'):\n"
            "    try:\n        open(path, 'w').write('1'); out[path] = 'ok'\n"
            "    except OSError as e:\n        out[path] = errno.errorcode[e.errno]\n"
            "print(json.dumps(out))\n")
    manifest = pod("rofs", py(code), restartPolicy="Never",
                   volumeMounts=[{"name": "scratch", "mountPath": "/scratch"}],
                   volumes=[{"name": "scratch", "emptyDir": {}}])
    manifest["spec"]["containers"][0]["securityContext"] = {"readOnlyRootFilesystem": True}
    core.create_namespaced_pod(kube_namespace, manifest)
    report = _report(kube_emulator, "rofs", kube_namespace)
    assert report == {"/etc/x": "EROFS", "/tmp/x": "EROFS", "/scratch/x": "ok"}


def test_writes_to_the_root_filesystem_stay_in_the_container(kube_emulator, core,
                                                             kube_namespace, tmp_path):
    marker = tmp_path / "written-by-pod"
    code = f"open({str(marker)!r}, 'w').write('1'); print('{{}}')\n"
    core.create_namespaced_pod(kube_namespace, pod("cow", py(code), restartPolicy="Never"))
    done = kube_emulator.wait_for_pod_phase("cow", ("Succeeded", "Failed"), kube_namespace)
    assert done["status"]["phase"] == "Succeeded"
    assert not marker.exists()  # the image's filesystem is copy-on-write


def test_run_as_user_group_and_fs_group(kube_emulator, core, kube_namespace):
    code = ("import json, os\n"
            "open('/data/f', 'w').write('x')\n"
            "st = os.stat('/data/f'); d = os.stat('/data')\n"
            "print(json.dumps({'uid': os.getuid(), 'gid': os.getgid(), 'groups': os.getgroups(),"
            " 'file_gid': st.st_gid, 'dir_gid': d.st_gid, 'secret_gid': "
            "os.stat('/etc/s/k').st_gid}))\n")
    core.create_namespaced_secret(kube_namespace, {"metadata": {"name": "s"},
                                                   "stringData": {"k": "v"}})
    core.create_namespaced_pod(kube_namespace, pod(
        "ids", py(code), restartPolicy="Never",
        securityContext={"runAsUser": 1000, "runAsGroup": 3000, "fsGroup": 2000},
        volumeMounts=[{"name": "data", "mountPath": "/data"},
                      {"name": "s", "mountPath": "/etc/s"}],
        volumes=[{"name": "data", "emptyDir": {}}, {"name": "s", "secret": {"secretName": "s"}}]))
    report = _report(kube_emulator, "ids", kube_namespace)
    assert report["uid"] == 1000 and report["gid"] == 3000
    assert sorted(report["groups"]) == [2000, 3000]
    assert report["dir_gid"] == 2000 and report["file_gid"] == 2000  # setgid volume
    assert report["secret_gid"] == 2000


def test_image_user_applies_and_run_as_non_root_refuses_root(kube_emulator, core,
                                                             kube_namespace):
    ns = kube_namespace
    code = "import json, os; print(json.dumps({'uid': os.getuid(), 'home': os.environ['HOME']}))"
    core.create_namespaced_pod(ns, pod("jovyan", py(code), restartPolicy="Never",
                                       securityContext={"runAsNonRoot": True}))
    manifest = pod("nb", py(code), restartPolicy="Never", securityContext={"runAsNonRoot": True})
    manifest["spec"]["containers"][0]["image"] = "quay.io/jupyter/base-notebook:latest"
    core.create_namespaced_pod(ns, manifest)
    assert _report(kube_emulator, "nb", ns) == {"uid": 1000, "home": "/home/jovyan"}

    def refused():
        st = _state(kube_emulator, "jovyan", ns)
        waiting = st.get("state", {}).get("waiting") or {}
        return waiting.get("reason") == "CreateContainerConfigError" and waiting

    waiting = kube_emulator.wait_for(refused, message="runAsNonRoot refusal")
    assert waiting["message"].startswith("container has runAsNonRoot and image will run as root")
    assert kube_emulator.get("pods", "jovyan", ns)["status"]["phase"] == "Pending"


def test_memory_limit_is_enforced_as_oom_killed_and_the_restart_policy_holds(
        kube_emulator, core, kube_namespace):
    if kube_emulator.kubelet.cgroup_base is None:
        pytest.fail("no memory cgroup can be created here: the emulator cannot enforce limits")
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n"
    core.create_namespaced_pod(kube_namespace, pod(
        "hog", py(code), restartPolicy="OnFailure",
        resources={"limits": {"memory": "64Mi"}, "requests": {"memory": "64Mi"}}))

    def restarted():
        st = _state(kube_emulator, "hog", kube_namespace)
        return st.get("restartCount", 0) >= 1 and st

    st = kube_emulator.wait_for(restarted, timeout=20, message="an OOM kill and a restart")
    term = st["lastState"]["terminated"]
    assert term["reason"] == "OOMKilled" and term["exitCode"] == 137


def test_a_memory_limited_containers_pid_1_joins_its_cgroup_once_its_root_is_mounted(
        kube_emulator, core, kube_namespace):
    """Pid 1 of a container with a memory limit is forked once the runtime has mounted its root
    and joins the container's cgroup itself, as one without a limit goes straight on to its
    program: no wait for the runtime to wake it (a wake-up costs a CPU's turn on a busy machine).
    Its children follow it into the cgroup; the runtime stays out."""
    if kube_emulator.kubelet.cgroup_base is None:
        pytest.fail("no memory cgroup can be created here: the emulator cannot enforce limits")
    code = "import subprocess, time\nsubprocess.Popen(['sleep', '60'])\ntime.sleep(60)\n"
    uid = core.create_namespaced_pod(kube_namespace, pod(
        "limited", py(code), resources={"limits": {"memory": "64Mi"}})).metadata.uid
    kube_emulator.wait_for_pod_phase("limited", "Running", kube_namespace)
    pid1 = kube_emulator.pod_pid("limited", kube_namespace)
    runtime = kube_emulator.kubelet.runtime_for(kube_namespace, "limited").proc.pid

    def memory_cgroup(pid: int) -> str:
        lines = open(f"/proc/{pid}/cgroup").read().splitlines()
        return next(ln.split(":", 2)[2] for ln in lines if ln.split(":")[1] in ("memory", ""))

    def children():
        with open(f"/proc/{pid1}/task/{pid1}/children") as f:
            return f.read().split()

    child = int(kube_emulator.wait_for(children, message="pid 1's child")[0])
    cgroup = memory_cgroup(pid1)
    assert os.path.basename(cgroup).startswith(uid[:8])
    assert memory_cgroup(child) == cgroup and memory_cgroup(runtime) != cgroup
    marks = kube_emulator.kubelet.timelines[uid].runs[-1]["marks"]
    # (the runtime's "pid1" moment is after its fork returned: pid 1 may have joined before it)
    assert marks["rootfs"] <= min(marks["pid1"], marks["cgroup"]) <= marks["cgroup"] <= marks["exec"], marks


def test_unknown_image_is_err_image_pull_then_back_off_until_it_exists(
        kube_emulator, core, kube_namespace):
    ns = kube_namespace
    manifest = pod("noimg", py("print('{}')"), restartPolicy="Never")
    manifest["spec"]["containers"][0]["image"] = "example.org/kubeemu/missing:1"
    core.create_namespaced_pod(ns, manifest)

    def reason_is(wanted):
        def check():
            waiting = _state(kube_emulator, "noimg", ns).get("state", {}).get("waiting") or {}
            return waiting.get("reason") == wanted and waiting
        return check

    waiting = kube_emulator.wait_for(reason_is("ErrImagePull"), message="ErrImagePull")
    assert 'failed to resolve reference "example.org/kubeemu/missing:1"' in waiting["message"]
    kube_emulator.wait_for(reason_is("ImagePullBackOff"), timeout=10, message="ImagePullBackOff")
    events = _events(core, ns, "noimg")
    assert ("BackOff", 'Back-off pulling image "example.org/kubeemu/missing:1"') in events
    assert ("Failed", "Error: ErrImagePull") in events
    assert kube_emulator.get("pods", "noimg", ns)["status"]["phase"] == "Pending"
    kube_emulator.images["example.org/kubeemu/missing:*"] = Image()  # the image is pushed
    try:
        kube_emulator.wait_for_pod_phase("noimg", "Succeeded", ns, timeout=15)
    finally:
        del kube_emulator.images["example.org/kubeemu/missing:*"]


def test_the_same_port_in_two_pods_neither_collides_nor_crosses(kube_emulator, core,
                                                                kube_namespace):
    ns = kube_namespace
    port, local_port = _free_port(), _free_port()
    server = ("import os, socket, threading\n"
              "def serve(addr):\n"
              "    s = socket.socket(); s.bind(addr); s.listen(8)\n"
              "    while True:\n"
              "        c, _ = s.accept(); c.sendall(os.environ['KUBEEMU_POD_NAME'].encode()); "
              "c.close()\n"
              f"threading.Thread(target=serve, args=(('127.0.0.1', {local_port}),),"
              " daemon=True).start()\n"
              f"serve(('0.0.0.0', {port}))\n")
    for name in ("a", "b"):
        core.create_namespaced_pod(ns, pod(name, py(server), labels={"app": name}))
    ips = {n: kube_emulator.wait_for_pod_phase(n, "Running", ns)["status"]["podIP"]
           for n in ("a", "b")}

    def ask(ip, p):
        try:
            with socket.create_connection((ip, p), timeout=2) as s:
                return s.recv(100).decode()
        except OSError:
            return None

    for n, ip in ips.items():
        assert kube_emulator.wait_for(lambda ip=ip: ask(ip, port), message=f"{n} serving") == n
    # each pod's "localhost" is its own: a client in pod "b" reaches b's local-only server
    client = ("import json, socket\nout = {}\n"
              f"for p in ({local_port}, {port}):\n"
              "    try:\n"
              "        with socket.create_connection(('127.0.0.1', p), timeout=2) as s:\n"
              "            out[p] = s.recv(100).decode()\n"
              "    except OSError as e:\n"
              "        out[p] = type(e).__name__\n"
              "print(json.dumps(out))\n")
    for n in ("a", "b"):
        resp = stream(core.connect_get_namespaced_pod_exec, n, ns,
                      command=["python3", "-I", "-c", client], stderr=True, stdout=True,
                      stdin=False, tty=False)
        assert json.loads(resp) == {str(local_port): n, str(port): n}
    # a pod that listens on nothing reaches neither of them on its localhost
    core.create_namespaced_pod(ns, pod("c", py(client), restartPolicy="Never"))
    report = _report(kube_emulator, "c", ns)
    assert report == {str(local_port): "ConnectionRefusedError",
                      str(port): "ConnectionRefusedError"}


def test_probes_reach_only_the_pods_own_processes(kube_emulator, core, kube_namespace):
    ns = kube_namespace
    port = _free_port()
    # this (host) process listens on all addresses: a pod's address answers on that port
    host = socket.socket()
    host.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    host.bind(("0.0.0.0", port))
    host.listen(8)
    try:
        core.create_namespaced_pod(ns, pod(
            "idle", py("import time; time.sleep(60)"),
            readinessProbe={"tcpSocket": {"port": port}, "periodSeconds": 1,
                            "failureThreshold": 1},
            livenessProbe={"httpGet": {"port": port, "path": "/"}, "periodSeconds": 1,
                           "failureThreshold": 2}))
        kube_emulator.wait_for_pod_phase("idle", "Running", ns)

        def unhealthy():
            reasons = [m for r, m in _events(core, ns, "idle") if r == "Unhealthy"]
            return (any(m.startswith("Readiness probe failed") for m in reasons)
                    and any(m.startswith("Liveness probe failed") for m in reasons) and reasons)

        reasons = kube_emulator.wait_for(unhealthy, message="both probes to fail")
        assert any("connection refused" in m for m in reasons)
        assert _state(kube_emulator, "idle", ns)["ready"] is False

        def restarted():
            return _state(kube_emulator, "idle", ns).get("restartCount", 0) >= 1

        kube_emulator.wait_for(restarted, timeout=15, message="the liveness restart")
        assert any(r == "Killing" and "failed liveness probe" in m
                   for r, m in _events(core, ns, "idle"))
    finally:
        host.close()


def test_exec_runs_inside_the_container(kube_emulator, core, kube_namespace):
    ns = kube_namespace
    manifest = pod("target", py("import time; time.sleep(60)"),
                   volumeMounts=[{"name": "cfg", "mountPath": "/etc/cfg"}],
                   volumes=[{"name": "cfg", "configMap": {"name": "cfg"}}],
                   securityContext={"runAsUser": 1234})
    core.create_namespaced_config_map(ns, {"metadata": {"name": "cfg"}, "data": {"k": "v"}})
    core.create_namespaced_pod(ns, manifest)
    kube_emulator.wait_for_pod_phase("target", "Running", ns)
    code = ("import json, os, socket\nprint(json.dumps({'k': open('/etc/cfg/k').read(), "
            "'uid': os.getuid(), 'host': socket.gethostname(), "
            "'init': open('/proc/1/cmdline').read().split(chr(0))[1]}))")
    out = stream(core.connect_get_namespaced_pod_exec, "target", ns,
                 command=["python3", "-I", "-c", code], stderr=True, stdout=True, stdin=False,
                 tty=False)
    assert json.loads(out) == {"k": "v", "uid": 1234, "host": "target", "init": "-c"}
    resp = stream(core.connect_get_namespaced_pod_exec, "target", ns,
                  command=["sh", "-c", "echo oops >&2; exit 3"], stderr=True, stdout=True,
                  stdin=False, tty=False, _preload_content=False)
    resp.run_forever(timeout=10)
    assert resp.returncode == 3
    assert "oops" in resp.read_stderr()
    # stdin goes through
    resp = stream(core.connect_get_namespaced_pod_exec, "target", ns, command=["cat"],
                  stderr=True, stdout=True, stdin=True, tty=False, _preload_content=False)
    resp.write_stdin("hello\n")
    assert kube_emulator.wait_for(lambda: resp.update(timeout=1) or resp.peek_stdout(),
                                  message="echo") == "hello\n"
    resp.close()
    with pytest.raises(kubernetes.client.exceptions.ApiException) as err:
        stream(core.connect_get_namespaced_pod_exec, "no-such-pod", ns, command=["true"],
               stderr=True, stdout=True, stdin=False, tty=False)
    assert "404" in str(err.value)  # the handshake is refused with the NotFound status


def test_service_and_pod_names_resolve_inside_pods(kube_emulator, core, kube_namespace):
    ns = kube_namespace
    port = _free_port()
    server = (f"import socket\ns = socket.socket(); s.bind(('0.0.0.0', {port})); s.listen(8)\n"
              "while True:\n    c, _ = s.accept(); c.sendall(b'hub here'); c.close()\n")
    core.create_namespaced_pod(ns, pod("hub-0", py(server), labels={"component": "hub"},
                                       readinessProbe={"tcpSocket": {"port": port},
                                                       "periodSeconds": 1}))
    core.create_namespaced_service(ns, {"metadata": {"name": "hub"}, "spec": {
        "selector": {"component": "hub"}, "ports": [{"port": port, "targetPort": port}]}})

    def ready():
        p = kube_emulator.get("pods", "hub-0", ns)
        return p["status"]["containerStatuses"][0]["ready"] and p

    hub_ip = kube_emulator.wait_for(ready, message="hub ready")["status"]["podIP"]
    code = ("import json, socket\nout = {}\n"
            f"for name in ('hub', 'hub.{ns}', 'hub.{ns}.svc.cluster.local'):\n"
            "    out[name] = socket.gethostbyname(name)\n"
            f"out['reply'] = socket.create_connection(('hub', {port}), timeout=2).recv(20)"
            ".decode()\n"
            "out['self'] = socket.gethostbyname(socket.gethostname())\n"
            "print(json.dumps(out))\n")
    core.create_namespaced_pod(ns, pod("client", py(code), restartPolicy="Never"))
    report = _report(kube_emulator, "client", ns)
    client_ip = kube_emulator.get("pods", "client", ns)["status"]["podIP"]
    assert report == {"hub": hub_ip, f"hub.{ns}": hub_ip, f"hub.{ns}.svc.cluster.local": hub_ip,
                      "reply": "hub here", "self": client_ip}


def test_missing_executable_inside_the_image_is_a_start_error(kube_emulator, core,
                                                              kube_namespace):
    core.create_namespaced_pod(kube_namespace, pod("nobin", ["/opt/none/bin/app"],
                                                   restartPolicy="Never"))
    failed = kube_emulator.wait_for_pod_phase("nobin", "Failed", kube_namespace)
    term = failed["status"]["containerStatuses"][0]["state"]["terminated"]
    assert term["reason"] == "StartError"
    assert 'exec: "/opt/none/bin/app": no such file or directory' in term["message"]


def test_an_image_with_its_own_filesystem_runs_its_entrypoint_user_and_files(kube_emulator, core, kube_namespace,
                                                                             tmp_path):
    """A container of an image that exists here (e.g. one `./dev images` built, unpacked by
    images.from_engine) runs from that image's filesystem, not this machine's, with the image's
    ENTRYPOINT and CMD combined with the pod's command and args as Kubernetes does, and the
    image's USER, WORKDIR and ENV."""
    emu, ns = kube_emulator, kube_namespace
    emu.images["registry.test/tiny:*"] = tiny_image(tmp_path / "rootfs")
    manifests = {  # no command, no args: ENTRYPOINT + CMD; args only: ENTRYPOINT + args
        "defaults": {},
        "args-only": {"args": ["cat /etc/image-name; id -u; pwd; echo $IMAGE_VAR $HOME; "
                               f"test -e {sys.executable} || echo no-host-python"]},
        "command": {"command": ["/bin/cat", "/etc/image-name"]},
    }
    try:
        for name, extra in manifests.items():
            manifest = pod(name, extra.pop("command", None), restartPolicy="Never", **extra)
            manifest["spec"]["containers"][0]["image"] = "registry.test/tiny:1"
            core.create_namespaced_pod(ns, manifest)
        for name in manifests:
            phase = emu.wait_for_pod_phase(name, ("Succeeded", "Failed"), ns, timeout=30)
            assert phase is not None
        logs = {name: emu.pod_log(name, ns).split() for name in manifests}
        assert logs["defaults"] == ["default-cmd"]
        assert logs["args-only"] == ["tiny-image", "1234", "/work", "from-image", "/home/imguser", "no-host-python"]
        assert logs["command"] == ["tiny-image"]
        assert all(emu.get("pods", n, ns)["status"]["phase"] == "Succeeded" for n in manifests)
    finally:
        del emu.images["registry.test/tiny:*"]
