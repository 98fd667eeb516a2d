"""Attack: keep running on the GPU after one's slice went back, in a child that left the kernel's session.

A cell starts ``setsid -f`` children with the kernel's GPU environment: one leaves the session
and process group, and (``-f``) its parent exits at once, so the child is not even the kernel's
descendant any more. When the slice ends (the kernel shut down, or preempted by a higher
priority), no process of that slice may remain.
"""

from __future__ import annotations

from tests.security.conftest import SPEC, WHOLE_SPEC
from tests.security.helpers import Session, broker_kernels, pid_alive, processes_with_env, used_mib, wait_until

ENV = "ELASTIC_GPU_ALLOCATION_ID"

ESCAPE = """
import os, subprocess, tempfile, time
pids = []
where = tempfile.mkdtemp(prefix="escape-")  # fresh: a name made of the kernel's pid was left by
# an earlier kernel with that pid (pids wrap at 32768), and its stale pid read as a dead child
for n in range(2):
    f = f"{where}/{n}"
    subprocess.run(["setsid", "-f", "sh", "-c", f"echo $$ > {f}; exec sleep 600"], check=True)
    while not os.path.exists(f) or not open(f).read().strip():
        time.sleep(0.05)
    pids.append(int(open(f).read()))
print(os.environ["ELASTIC_GPU_ALLOCATION_ID"], *pids)
"""


def escape(session: Session) -> tuple[str, list[int]]:
    allocation, *pids = session.run(ESCAPE).split()
    children = [int(p) for p in pids]
    assert all(pid_alive(p) for p in children)
    assert set(children) <= set(processes_with_env(ENV, allocation)), "the children carry the slice's environment"
    return allocation, children


def test_a_setsid_child_dies_when_the_kernel_is_shut_down(sec):
    hub = sec.hub
    session = Session(sec.server("alice"), SPEC)
    try:
        allocation, children = escape(session)
    finally:
        session.close()
    wait_until(lambda: session.kernel_id not in broker_kernels(hub), 30, "the kernel to be deleted")
    wait_until(
        lambda: not processes_with_env(ENV, allocation),
        15,
        "every process of the slice to be gone",
        log=lambda: f"still running: {processes_with_env(ENV, allocation)}",
    )
    assert not any(pid_alive(p) for p in children)


def test_a_setsid_child_dies_when_the_kernel_is_preempted(sec):
    hub = sec.hub
    victim = Session(sec.server("alice"), SPEC)
    winner = None
    try:
        allocation, children = escape(victim)
        winner = Session(sec.server("dave"), WHOLE_SPEC)  # a whole card at high priority: alice's slice goes
        wait_until(
            lambda: broker_kernels(hub).get(victim.kernel_id, {}).get("state") in (None, "failed", "stopped"),
            30,
            "alice's kernel to be preempted",
        )
        wait_until(
            lambda: not processes_with_env(ENV, allocation),
            15,
            "every process of the preempted slice to be gone",
            log=lambda: f"still running: {processes_with_env(ENV, allocation)}",
        )
        assert not any(pid_alive(p) for p in children)
    finally:
        victim.close()
        if winner is not None:
            winner.close()
    wait_until(lambda: used_mib(hub) == 0, 30, "the card to be free")
