"""The emulated kubelet: pods run as containers, each on its own loopback address."""

from __future__ import annotations

import gc
import json
import socket
import time
from pathlib import Path

import kubernetes
import pytest
from kubernetes.client.rest import ApiException

from tests.kubeemu.helpers import pod, py
from tests.kubeemu.podstart import now


@pytest.fixture(scope="module")
def core(kube_emulator):
    api_client = kubernetes.config.new_client_from_config(kube_emulator.kubeconfig_path)
    yield kubernetes.client.CoreV1Api(api_client)
    api_client.close()


REPORTER = r"""
import json, os, socket, sys
args = dict(a.lstrip('-').split('=', 1) for a in sys.argv[1:])
files = {}
for path in ('/etc/secret-vol/token', '/etc/podinfo/annotations', '/etc/podinfo/mem',
             os.environ['LIMITS_FILE']):
    files[path] = open(path).read()
srv = socket.socket()
srv.bind((args['ip'], int(args['port'])))
srv.listen(1)
print('serving on', srv.getsockname(), flush=True)
conn, _ = srv.accept()
env = {k: os.environ.get(k) for k in ('POD_NAME', 'POD_NS', 'MY_IP', 'TOKEN', 'MODE',
                                      'LIMITS_FILE', 'GREETING')}
conn.sendall(json.dumps({'env': env, 'files': files, 'cwd': os.getcwd()}).encode())
conn.close()
"""


def test_pod_runs_with_env_secret_and_downward_files_then_succeeds(kube_emulator, core,
                                                                   kube_namespace):
    ns = kube_namespace
    core.create_namespaced_secret(ns, {"metadata": {"name": "creds"},
                                       "stringData": {"token": "t0k3n"}})
    core.create_namespaced_config_map(ns, {"metadata": {"name": "cfg"},
                                           "data": {"mode": "fast", "limits.conf": "memory_mib=1024\n"}})
    manifest = pod(
        "reporter", py(REPORTER), args=["--ip=0.0.0.0", "--port=8888"],
        restartPolicy="Never",
        annotations={"elastic-gpu.jupyter.org/memory-mib": "1024"},
        env=[
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "MY_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
            {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "mode"}}},
            {"name": "LIMITS_FILE", "value": "/etc/libvgpu/limits.conf"},
            {"name": "GREETING", "value": "hello $(POD_NAME)"},
        ],
        volumeMounts=[
            {"name": "secret", "mountPath": "/etc/secret-vol", "readOnly": True},
            {"name": "podinfo", "mountPath": "/etc/podinfo"},
            {"name": "limits", "mountPath": "/etc/libvgpu/limits.conf",
             "subPath": "limits.conf"},
        ],
        volumes=[
            {"name": "secret", "secret": {"secretName": "creds"}},
            {"name": "podinfo", "downwardAPI": {"items": [
                {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}},
                {"path": "mem", "fieldRef": {
                    "fieldPath": "metadata.annotations['elastic-gpu.jupyter.org/memory-mib']"}},
            ]}},
            {"name": "limits", "configMap": {"name": "cfg"}},
        ])
    core.create_namespaced_pod(ns, manifest)
    running = kube_emulator.wait_for_pod_phase("reporter", "Running", ns)
    ip = running["status"]["podIP"]
    assert ip.startswith("127.") and ip != "127.0.0.1"
    assert running["status"]["containerStatuses"][0]["ready"] is True
    assert {c["type"]: c["status"] for c in running["status"]["conditions"]}["Ready"] == "True"

    def fetch() -> dict | None:
        try:
            with socket.create_connection((ip, 8888), timeout=2) as s:
                return json.loads(s.makefile().read())
        except OSError:
            return None

    report = kube_emulator.wait_for(fetch, message="the pod's server to answer on its IP")
    assert report["env"] == {
        "POD_NAME": "reporter", "POD_NS": ns, "MY_IP": ip, "TOKEN": "t0k3n", "MODE": "fast",
        "LIMITS_FILE": "/etc/libvgpu/limits.conf", "GREETING": "hello reporter"}
    # the volumes are mounted where the container looks (nothing is rewritten)
    assert report["files"] == {
        "/etc/secret-vol/token": "t0k3n",
        "/etc/podinfo/annotations": 'elastic-gpu.jupyter.org/memory-mib="1024"',
        "/etc/podinfo/mem": "1024",
        "/etc/libvgpu/limits.conf": "memory_mib=1024\n",
    }
    assert report["cwd"] == "/"  # the image's working directory
    done = kube_emulator.wait_for_pod_phase("reporter", "Succeeded", ns)
    term = done["status"]["containerStatuses"][0]["state"]["terminated"]
    assert term["exitCode"] == 0 and term["reason"] == "Completed"
    assert f"serving on ('{ip}', 8888)" in core.read_namespaced_pod_log("reporter", ns)
    reasons = [e.reason for e in core.list_namespaced_event(
        ns, field_selector="involvedObject.name=reporter").items]
    assert reasons[:4] == ["Scheduled", "Pulled", "Created", "Started"]


def test_failing_container_fails_the_pod_with_its_exit_code(kube_emulator, core, kube_namespace):
    core.create_namespaced_pod(kube_namespace, pod(
        "fails", py("import sys; print('boom'); sys.exit(3)"), restartPolicy="Never"))
    failed = kube_emulator.wait_for_pod_phase("fails", "Failed", kube_namespace)
    term = failed["status"]["containerStatuses"][0]["state"]["terminated"]
    assert term["exitCode"] == 3 and term["reason"] == "Error"
    assert kube_emulator.pod_log("fails", kube_namespace) == "boom\n"


def test_missing_command_is_a_start_error(kube_emulator, core, kube_namespace):
    core.create_namespaced_pod(kube_namespace, pod(
        "nocmd", ["no-such-binary-kubeemu"], restartPolicy="Never"))
    failed = kube_emulator.wait_for_pod_phase("nocmd", "Failed", kube_namespace)
    term = failed["status"]["containerStatuses"][0]["state"]["terminated"]
    assert term["exitCode"] == 128 and term["reason"] == "StartError"
    assert 'exec: "no-such-binary-kubeemu"' in term["message"]


def test_on_failure_restarts_the_container(kube_emulator, core, kube_namespace):
    code = ("import os, sys; p = '/data/count'; n = int(open(p).read()) if os.path.exists(p) "
            "else 0; open(p, 'w').write(str(n + 1)); sys.exit(0 if n else 1)")
    core.create_namespaced_pod(kube_namespace, pod(
        "retry", py(code), restartPolicy="OnFailure",
        volumeMounts=[{"name": "work", "mountPath": "/data"}],
        volumes=[{"name": "work", "emptyDir": {}}]))
    done = kube_emulator.wait_for_pod_phase("retry", "Succeeded", kube_namespace, timeout=15)
    st = done["status"]["containerStatuses"][0]
    assert st["restartCount"] == 1
    assert st["lastState"]["terminated"]["exitCode"] == 1


def test_graceful_delete_sends_sigterm_and_pod_disappears(kube_emulator, core, kube_namespace,
                                                          tmp_path):
    code = ("import signal, sys, time\n"
            "def bye(*a):\n"
            "    open('/host/marker', 'w').write('TERM'); sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, bye)\n"
            "print('up', flush=True)\n"
            "time.sleep(60)\n")
    core.create_namespaced_pod(kube_namespace, pod(
        "graceful", py(code), volumeMounts=[{"name": "host", "mountPath": "/host"}],
        volumes=[{"name": "host", "hostPath": {"path": str(tmp_path), "type": "Directory"}}]))
    kube_emulator.wait_for_pod_phase("graceful", "Running", kube_namespace)
    kube_emulator.wait_for(lambda: "up" in kube_emulator.pod_log("graceful", kube_namespace),
                           message="process to install its handler")
    deleted = core.delete_namespaced_pod("graceful", kube_namespace, grace_period_seconds=20)
    assert deleted.metadata.deletion_timestamp
    assert deleted.metadata.deletion_grace_period_seconds == 20
    t0 = time.monotonic()
    kube_emulator.wait_for(lambda: kube_emulator.get("pods", "graceful", kube_namespace) is None,
                           timeout=10, message="pod removal")
    assert time.monotonic() - t0 < 5  # the process exited on SIGTERM, long before the grace
    assert (tmp_path / "marker").read_text() == "TERM"
    reasons = [e.reason for e in core.list_namespaced_event(
        kube_namespace, field_selector="involvedObject.name=graceful").items]
    assert "Killing" in reasons


def test_sigkill_after_the_grace_period(kube_emulator, core, kube_namespace, caplog):
    code = ("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "print('up', flush=True)\ntime.sleep(60)\n")
    core.create_namespaced_pod(kube_namespace, pod("stubborn", py(code)))
    kube_emulator.wait_for(lambda: "up" in kube_emulator.pod_log("stubborn", kube_namespace),
                           message="process start")
    pid = kube_emulator.pod_pid("stubborn", kube_namespace)
    t0 = time.monotonic()
    core.delete_namespaced_pod("stubborn", kube_namespace, grace_period_seconds=1)
    kube_emulator.wait_for(lambda: kube_emulator.get("pods", "stubborn", kube_namespace) is None,
                           timeout=10, message="pod removal")
    assert 0.9 < time.monotonic() - t0 < 5
    assert not _runs(pid), "the container's process must be dead once its pod is gone"
    # the log says why the pod took its whole grace period (its pid 1 never got the SIGTERM)
    assert (f"pod {kube_namespace}/stubborn: its container's pid 1 (host pid {pid}, "
            in caplog.text and "has no SIGTERM handler" in caplog.text), caplog.text


def _runs(pid: int) -> bool:
    """Whether ``pid`` still runs: gone, or a zombie waiting for a busy init to reap it, does not."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_missing_secret_keeps_the_pod_waiting_until_it_exists(kube_emulator, core,
                                                              kube_namespace):
    ns = kube_namespace
    core.create_namespaced_pod(ns, pod("waits", None, env=[
        {"name": "T", "valueFrom": {"secretKeyRef": {"name": "later", "key": "k"}}}]))

    def waiting():
        p = kube_emulator.get("pods", "waits", ns)
        st = (p or {}).get("status", {}).get("containerStatuses") or [{}]
        return st[0].get("state", {}).get("waiting", {}).get("reason") == \
            "CreateContainerConfigError" and p

    p = kube_emulator.wait_for(waiting, message="CreateContainerConfigError")
    assert p["status"]["phase"] == "Pending"
    assert p["status"]["containerStatuses"][0]["state"]["waiting"]["message"] == \
        'secret "later" not found'
    core.create_namespaced_secret(ns, {"metadata": {"name": "later"}, "stringData": {"k": "v"}})
    kube_emulator.wait_for_pod_phase("waits", "Running", ns, timeout=10)


def test_readiness_probe_gates_ready(kube_emulator, core, kube_namespace):
    code = ("import os, socket, time\ntime.sleep(1.5)\ns = socket.socket()\n"
            "s.bind((os.environ['KUBEEMU_POD_IP'], 9000))\ns.listen(5)\ntime.sleep(60)\n")
    core.create_namespaced_pod(kube_namespace, pod(
        "probed", py(code), readinessProbe={"tcpSocket": {"port": 9000}, "periodSeconds": 1}))
    running = kube_emulator.wait_for_pod_phase("probed", "Running", kube_namespace)
    assert running["status"]["containerStatuses"][0]["ready"] is False

    def ready():
        p = kube_emulator.get("pods", "probed", kube_namespace)
        return p["status"]["containerStatuses"][0]["ready"] and p

    p = kube_emulator.wait_for(ready, timeout=10, message="readiness")
    assert {c["type"]: c["status"] for c in p["status"]["conditions"]}["Ready"] == "True"


def test_the_start_timeline_counts_an_init_containers_run_as_its_programs_time(kube_emulator, core,
                                                                            kube_namespace):
    """tests/kubeemu/podstart.py: what the bench and the end-to-end test print as the emulator's
    share of a pod's start leaves out what the pod's programs do."""
    code = ("import os, socket, time\ns = socket.socket()\n"
            "s.bind((os.environ['KUBEEMU_POD_IP'], 9000))\ns.listen(5)\ntime.sleep(60)\n")
    manifest = pod("timed", py(code), readinessProbe={"tcpSocket": {"port": 9000}, "periodSeconds": 1})
    manifest["spec"]["initContainers"] = [
        {"name": "prepare", "image": "python:3.11", "command": py("import time; time.sleep(0.5)")}]
    uid = core.create_namespaced_pod(kube_namespace, manifest).metadata.uid

    def ready():
        t = kube_emulator.kubelet.timelines.get(uid)
        return t if t is not None and t.ready is not None else None

    t = kube_emulator.wait_for(ready, timeout=60, message="the pod to be ready")
    init, main = t.runs
    assert (init["container"], init["init"], main["container"], main["init"]) == ("prepare", True, "main", False)
    assert t.created <= init["started"] <= init["exited"] <= main["spawned"] <= main["started"]
    emulator_s, program_s = t.create_to_process()
    assert program_s == init["exited"] - init["started"] >= 0.5  # the init container's sleep
    assert emulator_s == pytest.approx(main["started"] - t.created - program_s)
    assert t.running <= t.probe <= t.ready  # a readiness probe's round trip is the emulator's share
    assert t.running_to_ready() == t.ready - t.probe
    split = t.split()
    assert sum(split.values()) == pytest.approx(emulator_s)  # its steps make up the emulator's share
    # the runtime's own steps make up its part, for both containers; its CPU and run-queue wait
    runtime = t.runtime_split()
    assert sum(v for k, v in runtime.items() if k != "cgroup_late") == pytest.approx(split["runtime"])
    assert all(v >= 0 for v in runtime.values()) and runtime["cgroup_late"] <= runtime["pid1"]
    sched = t.sched()
    assert set(sched) == {"kubelet_cpu", "kubelet_wait", "runtime_cpu", "runtime_wait"}
    assert all(v >= 0 for v in sched.values()) and sched["runtime_cpu"] > 0
    assert " runtime_steps_s=server:" in t.line() and " sched_s=kubelet_cpu:" in t.line()
    assert t.line().startswith(f"kubeemu_pod_start timed create_to_process_s={emulator_s:.3f} "
                               f"init_program_s={program_s:.3f} running_to_ready_s={t.ready - t.probe:.3f} "
                               f"steps_s=to_kubelet:{split['to_kubelet']:.3f},")


def test_a_full_garbage_collection_due_is_made_once_the_pod_started_not_inside_its_start(
        kube_emulator, core, kube_namespace):
    """The emulator shares its test's interpreter, whose full collection stops the kubelet's thread
    while it walks every object (beside two hogs, one inside a pod's start made that start 0.38 s:
    bench/kubeemu_pod_start.py). One due when a pod starts is made once its process runs (or
    between starts), not inside the start."""
    kubelet = kube_emulator.kubelet
    kube_emulator.wait_for(lambda: not kubelet.starting_now(), timeout=30,
                           message=f"other pods' starts to end: {kubelet.starting_now()}")
    made = kubelet.full_collections
    ballast = [[] for _ in range(100_000)]  # the interpreter's own trigger waits for a quarter more
    gc.collect()
    began: list[float] = []

    def on_collection(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            began.append(now())

    # watched from before it is due: a pod of an earlier test whose run ends now (its namespace
    # being deleted) has the kubelet make it at once, in its own thread
    gc.callbacks.append(on_collection)
    try:
        for _ in range(gc.get_threshold()[2] + 1):
            gc.collect(1)  # each young collection counts towards the next full one: one is due
        uid = core.create_namespaced_pod(kube_namespace, pod("collected", ["sleep", "60"])).metadata.uid

        def ready():
            t = kube_emulator.kubelet.timelines.get(uid)
            return t if t is not None and t.ready is not None else None

        t = kube_emulator.wait_for(ready, timeout=60, message="the pod to be ready")
        started = t.created + sum(t.create_to_process())
        # made once the pod's process started (or, were other pods' runs ending, before it came)
        kube_emulator.wait_for(lambda: began, timeout=10, message="the full collection due")
    finally:
        gc.callbacks.remove(on_collection)
        del ballast
    assert not [b for b in began if t.created <= b <= started], (began, kubelet.full_collections - made, t.line())


def test_downward_api_volume_follows_annotation_changes(kube_emulator, core, kube_namespace):
    ns = kube_namespace
    core.create_namespaced_pod(ns, pod(
        "annotated", None, annotations={"limit": "1"},
        volumeMounts=[{"name": "info", "mountPath": "/etc/info"}],
        volumes=[{"name": "info", "downwardAPI": {"items": [
            {"path": "limit", "fieldRef": {"fieldPath": "metadata.annotations['limit']"}}]}}]))
    kube_emulator.wait_for_pod_phase("annotated", "Running", ns)
    path = kube_emulator.pod_root("annotated", ns) / "etc/info/limit"
    assert path.read_text() == "1"
    core.patch_namespaced_pod("annotated", ns, {"metadata": {"annotations": {"limit": "2"}}})
    kube_emulator.wait_for(lambda: path.read_text() == "2", message="file update")


def test_log_of_a_pod_that_has_not_started_is_a_bad_request(core, kube_namespace):
    core.create_namespaced_pod(kube_namespace, {"metadata": {"name": "nowhere"}, "spec": {
        "nodeName": "no-such-node", "containers": [{"name": "c", "image": "i"}]}})
    with pytest.raises(ApiException) as err:
        core.read_namespaced_pod_log("nowhere", kube_namespace)
    assert err.value.status == 400
    assert "is waiting to start" in json.loads(err.value.body)["message"]


def test_log_follow_streams_until_the_container_exits(kube_emulator, core, kube_namespace):
    code = "import time\nfor i in range(3):\n    print('line', i, flush=True); time.sleep(0.3)\n"
    core.create_namespaced_pod(kube_namespace, pod("chatty", py(code), restartPolicy="Never"))
    kube_emulator.wait_for(lambda: kube_emulator.pod_log("chatty", kube_namespace),
                           message="first output")
    resp = core.read_namespaced_pod_log("chatty", kube_namespace, follow=True,
                                        _preload_content=False)
    assert resp.data.decode() == "line 0\nline 1\nline 2\n"
    tail = core.read_namespaced_pod_log("chatty", kube_namespace, tail_lines=1)
    assert tail == "line 2\n"


def test_pod_security_baseline_refuses_host_paths_and_a_host_path_volume_claim_is_admitted(
    kube_emulator, core, kube_namespace, tmp_path
):
    """A namespace labelled pod-security.kubernetes.io/enforce=baseline refuses a hostPath volume
    with the API server's 403 and sentence; a claim bound to a hostPath PersistentVolume (the
    chart's claim of the agent's directory) is admitted and mounts that directory of the node,
    whose ownership the pod's fsGroup leaves alone (the kubelet manages no hostPath volume's)."""
    from tests.kubeemu.helpers import create_host_claim
    from tests.kubeemu.podsecurity import ENFORCE_LABEL

    core.patch_namespace(kube_namespace, {"metadata": {"labels": {ENFORCE_LABEL: "baseline"}}})
    (tmp_path / "ld.so.preload").write_text("from the node\n")
    with pytest.raises(ApiException) as e:
        core.create_namespaced_pod(kube_namespace, pod(
            "hostpath", py("pass"), volumeMounts=[{"name": "host", "mountPath": "/host"}],
            volumes=[{"name": "host", "hostPath": {"path": str(tmp_path), "type": "Directory"}}]))
    assert e.value.status == 403
    assert json.loads(e.value.body)["message"] == (
        'pods "hostpath" is forbidden: violates PodSecurity "baseline:latest": hostPath volumes (volumes "host")')
    create_host_claim(kube_emulator, kube_namespace, tmp_path, name="agent-dir")
    (tmp_path / "agents-own").mkdir(mode=0o711)
    before = [(p.stat().st_gid, p.stat().st_mode) for p in (tmp_path, tmp_path / "agents-own")]
    core.create_namespaced_pod(kube_namespace, pod(
        "claim", py("print(open('/etc/preload').read(), end='')"), restartPolicy="Never",
        securityContext={"fsGroup": 2000},
        volumeMounts=[{"name": "host", "mountPath": "/etc/preload", "subPath": "ld.so.preload", "readOnly": True}],
        volumes=[{"name": "host", "persistentVolumeClaim": {"claimName": "agent-dir"}}]))
    done = kube_emulator.wait_for_pod_phase("claim", ("Succeeded", "Failed"), kube_namespace)
    assert done["status"]["phase"] == "Succeeded", kube_emulator.pod_log("claim", kube_namespace)
    assert kube_emulator.pod_log("claim", kube_namespace) == "from the node\n"
    assert [(p.stat().st_gid, p.stat().st_mode) for p in (tmp_path, tmp_path / "agents-own")] == before
