"""Pod Security admission: the "baseline" and "restricted" profiles of the Pod Security Standards
(https://kubernetes.io/docs/concepts/security/pod-security-standards/, version "latest" as of
Kubernetes 1.33), written from the standard's field list. The emulator enforces them on pod
creation in a namespace labelled ``pod-security.kubernetes.io/enforce``, with the API server's
message (``violates PodSecurity "baseline:latest": hostPath volumes (volumes "a", "b")``), and
answers a pod that breaks the level of the ``warn`` label with a ``Warning`` header and one that
breaks the ``audit`` label's with an audit event (``KubeEmulator.audit_events``) annotated
``pod-security.kubernetes.io/audit-violations``, both ``would violate PodSecurity ...``; tests
call :func:`violations` on rendered pods.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

LEVELS = ("privileged", "baseline", "restricted")
ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"
WARN_LABEL = "pod-security.kubernetes.io/warn"
AUDIT_LABEL = "pod-security.kubernetes.io/audit"
AUDIT_ANNOTATION = "pod-security.kubernetes.io/audit-violations"

#: baseline: "Adding additional capabilities beyond those listed below must be disallowed"
BASELINE_CAPABILITIES = frozenset({
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
    "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
})
#: baseline: the sysctls allowed ("safe" set)
SAFE_SYSCTLS = frozenset({
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
})
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
#: restricted: the only volume types allowed
RESTRICTED_VOLUMES = frozenset({
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected",
    "secret",
})


def _containers(spec: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    for key in ("initContainers", "containers", "ephemeralContainers"):
        yield from spec.get(key) or []


def _names(items: list[str]) -> str:
    return ", ".join(f'"{n}"' for n in items)


def _baseline(pod: Mapping[str, Any]) -> list[str]:
    spec = pod.get("spec") or {}
    psc = spec.get("securityContext") or {}
    out: list[str] = []
    if (psc.get("windowsOptions") or {}).get("hostProcess") or any(
        ((c.get("securityContext") or {}).get("windowsOptions") or {}).get("hostProcess")
        for c in _containers(spec)
    ):
        out.append("hostProcess")
    host = [f"{k}={str(True).lower()}" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    if host:
        out.append(f"host namespaces ({', '.join(host)})")
    privileged = [c["name"] for c in _containers(spec) if (c.get("securityContext") or {}).get("privileged")]
    if privileged:
        out.append(f"privileged (container {_names(privileged)} must not set securityContext.privileged=true)")
    caps = []
    for c in _containers(spec):
        extra = [a for a in ((c.get("securityContext") or {}).get("capabilities") or {}).get("add") or []
                 if a not in BASELINE_CAPABILITIES]
        if extra:
            caps.append(f'container "{c["name"]}" must not include {_names(extra)} in securityContext.capabilities.add')
    if caps:
        out.append(f"non-default capabilities ({'; '.join(caps)})")
    host_path = [v["name"] for v in spec.get("volumes") or [] if v.get("hostPath") is not None]
    if host_path:
        out.append(f"hostPath volumes (volumes {_names(host_path)})")
    ports = [str(p["hostPort"]) for c in _containers(spec) for p in c.get("ports") or [] if p.get("hostPort")]
    if ports:
        out.append(f"hostPort (containers use hostPorts {', '.join(ports)})")
    apparmor = [
        sc.get("appArmorProfile", {}).get("type")
        for sc in [psc, *((c.get("securityContext") or {}) for c in _containers(spec))]
        if (sc.get("appArmorProfile") or {}).get("type") not in (None, "RuntimeDefault", "Localhost")
    ] + [
        v for k, v in ((pod.get("metadata") or {}).get("annotations") or {}).items()
        if k.startswith("container.apparmor.security.beta.kubernetes.io/")
        and v != "runtime/default" and not v.startswith("localhost/")
    ]
    if apparmor:
        out.append(f"forbidden AppArmor profile ({', '.join(apparmor)})")
    selinux = [
        sc["seLinuxOptions"]
        for sc in [psc, *((c.get("securityContext") or {}) for c in _containers(spec))]
        if sc.get("seLinuxOptions")
        and (
            (sc["seLinuxOptions"].get("type") or "") not in SELINUX_TYPES
            or sc["seLinuxOptions"].get("user")
            or sc["seLinuxOptions"].get("role")
        )
    ]
    if selinux:
        out.append("seLinuxOptions (type, user or role not allowed)")
    proc = [c["name"] for c in _containers(spec)
            if (c.get("securityContext") or {}).get("procMount") not in (None, "Default")]
    if proc:
        out.append(f"procMount (container {_names(proc)} must not set securityContext.procMount)")
    unconfined = [
        "pod" if sc is psc else "container"
        for sc in [psc, *((c.get("securityContext") or {}) for c in _containers(spec))]
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined"
    ]
    if unconfined:
        out.append('seccompProfile (seccompProfile.type "Unconfined" is forbidden)')
    sysctls = [s["name"] for s in psc.get("sysctls") or [] if s.get("name") not in SAFE_SYSCTLS]
    if sysctls:
        out.append(f"forbidden sysctls ({', '.join(sysctls)})")
    return out


def _restricted(pod: Mapping[str, Any]) -> list[str]:
    spec = pod.get("spec") or {}
    psc = spec.get("securityContext") or {}
    out: list[str] = []
    bad_volumes = [v["name"] for v in spec.get("volumes") or [] if not (set(v) - {"name"}) <= RESTRICTED_VOLUMES]
    if bad_volumes:
        out.append(f"restricted volume types (volumes {_names(bad_volumes)})")
    containers = list(_containers(spec))
    escalation = [c["name"] for c in containers
                  if (c.get("securityContext") or {}).get("allowPrivilegeEscalation") is not False]
    if escalation:
        out.append(f"allowPrivilegeEscalation != false (containers {_names(escalation)} must set "
                   "securityContext.allowPrivilegeEscalation=false)")
    caps = [c["name"] for c in containers
            if "ALL" not in (((c.get("securityContext") or {}).get("capabilities") or {}).get("drop") or [])
            or set(((c.get("securityContext") or {}).get("capabilities") or {}).get("add") or [])
            - {"NET_BIND_SERVICE"}]
    if caps:
        out.append(f"unrestricted capabilities (containers {_names(caps)} must set "
                   'securityContext.capabilities.drop=["ALL"])')
    non_root = [c["name"] for c in containers
                if (c.get("securityContext") or {}).get("runAsNonRoot", psc.get("runAsNonRoot")) is not True]
    if non_root:
        out.append(f"runAsNonRoot != true (containers {_names(non_root)} must set "
                   "securityContext.runAsNonRoot=true)")
    root = [c["name"] for c in containers
            if (c.get("securityContext") or {}).get("runAsUser", psc.get("runAsUser")) == 0]
    if root or psc.get("runAsUser") == 0:
        out.append("runAsUser=0 (pod and containers must not set runAsUser=0)")
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    seccomp = [c["name"] for c in containers
               if ((c.get("securityContext") or {}).get("seccompProfile") or {}).get("type", pod_seccomp)
               not in ("RuntimeDefault", "Localhost")]
    if seccomp:
        out.append(f'seccompProfile (containers {_names(seccomp)} must set securityContext.seccompProfile.type to '
                   '"RuntimeDefault" or "Localhost")')
    return out


def violations(pod: Mapping[str, Any], level: str) -> list[str]:
    """What in ``pod`` (a manifest dict) the Pod Security ``level`` forbids, in the API server's
    words; empty when it is allowed."""
    if level not in LEVELS:
        raise ValueError(f"Pod Security level {level!r} is not one of {', '.join(LEVELS)}")
    if level == "privileged":
        return []
    out = _baseline(pod)
    if level == "restricted":
        out += _restricted(pod)
    return out


def enforce_message(pod: Mapping[str, Any], level: str) -> str | None:
    """The refusal of a namespace that enforces ``level`` (None: admitted)."""
    found = violations(pod, level)
    return f'violates PodSecurity "{level}:latest": {", ".join(found)}' if found else None


def would_violate(pod: Mapping[str, Any], level: str | None) -> str | None:
    """The warning (``warn`` mode) or audit annotation (``audit`` mode) for ``level``."""
    if level not in ("baseline", "restricted"):
        return None
    found = violations(pod, level)
    return f'would violate PodSecurity "{level}:latest": {", ".join(found)}' if found else None
