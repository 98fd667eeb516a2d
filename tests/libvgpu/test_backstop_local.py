"""The backstop on one machine: the hub's local pool runs the node agent's backstop over what the
driver (here the NVML double) reports per process. As a user would try it: a hog that unsets
LD_PRELOAD and fills the card, the same hog restarted, a process that repoints LIBVGPU_CONFIG to
limits of its own, and one that uses a card its slice does not hold. Each is killed within 10 s,
every time, with a log line and a ledger event naming the user and the allocation; a process
that keeps to its slice runs on.

And a user who leaves every slice: code in a server (run as the shared server account) that
double-forks with ``setsid``, clears its environment (no allocation id, no shim) and uses the
GPU is linked to no slice; it is killed all the same, as a process of an account the hub runs
servers as, while the GPU processes of other accounts (the hub's, an admin's) run on."""

from __future__ import annotations

import logging
import os
import pwd
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from traitlets.config import Config

from hubext.local.pool import LocalPool
from quotas import Allocation, Owner


def pids_named(message: str) -> set[int]:
    """The processes a backstop line is about ("Process 376 (probe) uses ...", "Processes 12, 40
    (python) use ..."), not any number that happens to contain a pid's digits (a card's UUID, a
    size): pids wrap at 32768 on a busy machine, so a substring test matched the wrong lines."""
    named = re.search(r"\bProcess(?:es)? ((?:\d+(?: \([^)]*\))?, )*\d+(?: \([^)]*\))?) ", message)
    return {int(p) for p in re.findall(r"(?:^|, )(\d+)", named.group(1))} if named else set()


INTERVAL = 0.5  # the default is 2 s; (confirm_checks + 1) x interval is the bound either way


@pytest.fixture
async def machine(build, make_node, tmp_path, monkeypatch):
    """A local pool over two cards of the NVML double, and one 1 GiB slice of card 0 for alice."""
    node = make_node(CUDA_DOUBLE_DEVICES=2)
    for key, value in node.double_env.items():  # the pool's NVML reads the same simulated cards
        monkeypatch.setenv(key, value)
    # a copy of the NVML double per test: the double reads its environment (this node's card) once
    # per load, and a library loaded again from the same path is the same load
    nvml = tmp_path / "nvml" / "libnvidia-ml.so.1"
    nvml.parent.mkdir()
    shutil.copy(build.lib_dir / "libnvidia-ml.so.1", nvml)
    pool = LocalPool(
        config=Config({"Backstop": {"interval_seconds": INTERVAL}}),
        data_dir=str(tmp_path / "hub"),
        nvml_library=str(nvml),
    )

    async def gone(allocation_id: str, why: str) -> None:
        await pool.forget(allocation_id)

    await pool.start(gone)
    uuids = [g.uuid for n in (await pool.inventory()).nodes for g in n.gpus]
    assert len(uuids) == 2
    allocation = Allocation(id="alloc-alice-1", owner=Owner("alice"), node="localhost", gpu_uuids=(uuids[0],),
                            memory_mib=1024, cores_percent=50, priority_class="default")
    await pool.record(allocation)
    holder = subprocess.Popen(["sleep", "300"], start_new_session=True)
    await pool.bind(allocation.id, str(holder.pid))
    env = node.env(pool.holder_env(allocation, 10))
    env["LD_PRELOAD"] = node.build.preload()  # the shim under test
    yield pool, node, allocation, env
    holder.kill()
    holder.wait()
    await pool.stop()
    import pynvml

    pynvml.nvmlShutdown()  # the next test's NVML is its own
    pynvml.nvmlLib = None
    pynvml._nvmlGetFunctionPointer_cache.clear()


def start(node, env, *steps, account: str | None = None, session: bool = False):
    """The probe with ``steps``, then 'ready' and a wait; as ``account`` (default: the test's own)."""
    as_account = {"user": account, "group": pwd.getpwnam(account).pw_gid, "extra_groups": []} if account else {}
    proc = subprocess.Popen([str(node.build.probe), *steps, "ready", "wait"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=session, **as_account)
    node.processes.append(proc)
    line = proc.stdout.readline()
    while line and "ready" not in line:
        line = proc.stdout.readline()
    assert "ready" in line, proc.stderr.read()
    return proc


async def killed_within(proc, seconds: float) -> float:
    """Seconds until ``proc`` was killed (fails after ``seconds``)."""
    import asyncio

    began = time.monotonic()
    while proc.poll() is None:
        assert time.monotonic() - began < seconds, "not stopped in time"
        await asyncio.sleep(0.05)
    assert proc.returncode == -9
    return time.monotonic() - began


async def test_over_slice_and_shim_bypassing_processes_are_killed_every_time(machine, caplog):
    pool, node, allocation, env = machine
    bound = 10  # what the issue asks (acted on in ~1-1.5 s here; the defaults' bound is 6 s)
    no_shim = {k: v for k, v in env.items() if k != "LD_PRELOAD"}
    with caplog.at_level(logging.WARNING):
        good = start(node, env, "init", "ctx", "alloc:512M")
        await killed_within(start(node, no_shim, "init", "ctx", "alloc:3000M"), bound)  # over the slice
        await killed_within(start(node, no_shim, "init", "ctx", "alloc:3000M"), bound)  # respawned
        await killed_within(start(node, no_shim, "init", "ctx", "alloc:100M"), bound)  # under it, unshimmed
        mine = node.root / "mine.conf"
        mine.write_text(f"memory_mib=4096\ncontainer_region={node.root / 'mine.region'}\n")
        await killed_within(start(node, {**env, "LIBVGPU_CONFIG": str(mine)}, "init", "ctx", "alloc:100M"), bound)
        # another card: card 1, which the slice does not hold (the process clears the
        # CUDA_VISIBLE_DEVICES it was given, so the driver shows it every card)
        everything = {k: v for k, v in no_shim.items() if k != "CUDA_VISIBLE_DEVICES"}
        await killed_within(start(node, everything, "init", "ctx:1", "alloc:600M"), bound)
    assert good.poll() is None  # it kept to its slice through every check above
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Backstop")]
    assert len(lines) >= 5
    assert all("alice" in m and "alloc-alice-1" in m and "Killed process" in m for m in lines)
    events = [e for e in pool.events(50) if e["kind"] == "backstop"]
    assert len(events) >= 5 and all(e["user"] == "alice" for e in events)


SERVER_ACCOUNT = "nobody"  # what the shared server account (`elastic-gpu`) is here: unprivileged, not the hub's
OTHER_ACCOUNT = "daemon"  # an account the hub runs no server as

#: a user's code in their server: detach (setsid in a child that its parent leaves: a double fork,
#: re-parented to init, a session and group of its own), drop the environment, use the GPU
ESCAPE = """#!/bin/sh
out="$1"; shift
setsid -f sh -c 'out="$1"; shift; echo $$ > "$out.pid"; exec "$@" > "$out" 2>&1' escape "$out" "$@"
exec sleep 300
"""


def reachable(path: Path) -> None:
    """Let other accounts reach ``path`` through pytest's 0700 directories (up to the sticky temp dir)."""
    for d in (path, *path.parents):
        if d == Path("/") or d.stat().st_mode & 0o1000:
            break
        d.chmod(d.stat().st_mode | 0o011)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


async def test_a_detached_process_of_a_server_account_that_dropped_its_slice_is_killed(machine, caplog):
    import asyncio

    pool, node, alice_allocation, _ = machine
    if os.geteuid() != 0:
        pytest.skip("runs processes as other accounts (the hub runs as root in `elastic-gpu up`)")
    server_uid = pwd.getpwnam(SERVER_ACCOUNT).pw_uid
    for path in (node.build.root, node.root, Path(pool.data_dir)):
        reachable(path)
    state = Path(node.double_env["CUDA_DOUBLE_STATE"])  # the card: every account's driver uses it
    state.touch()
    state.chmod(0o666)
    # bob's GPU server, run as the server account (the hub binds it as it does a spawned server)
    bob = Allocation(id="alloc-bob-1", owner=Owner("bob"), node="localhost",
                     gpu_uuids=alice_allocation.gpu_uuids, memory_mib=1024, cores_percent=50,
                     priority_class="default")
    await pool.record(bob)
    bob_env = node.env(pool.holder_env(bob, 10, server_uid, pwd.getpwnam(SERVER_ACCOUNT).pw_gid))
    bob_env["LD_PRELOAD"] = node.build.preload()
    (node.root / "escape").mkdir()
    (node.root / "escape").chmod(0o777)
    script = node.root / "escape.sh"
    script.write_text(ESCAPE)
    script.chmod(0o755)
    hardware = [f"{k}={v}" for k, v in node.double_env.items()] + [f"LD_LIBRARY_PATH={node.build.lib_dir}"]
    bound = 10
    with caplog.at_level(logging.WARNING):
        # GPU work of accounts the hub runs no server as: the hub's own (an admin's job), another one
        admin = start(node, node.env(), "init", "ctx", "alloc:100M")
        other = start(node, node.env(), "init", "ctx", "alloc:100M", account=OTHER_ACCOUNT, session=True)
        # a kernel of bob's as it starts: its own session, not yet bound; its environment carries the slice
        kernel = start(node, bob_env, "init", "ctx", "alloc:200M", account=SERVER_ACCOUNT, session=True)
        server = subprocess.Popen(
            [str(script), str(node.root / "escape" / "out"), "env", "-i", *hardware, str(node.build.probe), "init",
             "ctx", "alloc:100M", "ready", "wait"],
            env=bob_env, user=SERVER_ACCOUNT, group=pwd.getpwnam(SERVER_ACCOUNT).pw_gid, extra_groups=[],
            start_new_session=True)
        node.processes.append(server)
        try:
            await pool.bind(bob.id, str(server.pid))
            out = node.root / "escape" / "out"
            began = time.monotonic()
            while "ready" not in (out.read_text() if out.exists() else ""):
                assert time.monotonic() - began < bound, out.read_text() if out.exists() else "no output"
                await asyncio.sleep(0.05)
            escaped = int(Path(f"{out}.pid").read_text())
            environ = Path(f"/proc/{escaped}/environ").read_bytes()
            assert b"ELASTIC_GPU_ALLOCATION_ID" not in environ and b"LD_PRELOAD" not in environ
            assert Path(f"/proc/{escaped}/stat").read_text().rsplit(")", 1)[1].split()[1] != str(server.pid)
            while alive(escaped):
                assert time.monotonic() - began < bound, "the detached process was not stopped"
                await asyncio.sleep(0.05)
        finally:
            pid_file = Path(f"{node.root / 'escape' / 'out'}.pid")
            if pid_file.exists() and alive(int(pid_file.read_text())):
                os.kill(int(pid_file.read_text()), 9)
    # the checks that judged the detached process judged these too, and left them alone
    assert admin.poll() is None and other.poll() is None and kernel.poll() is None
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Backstop")]
    assert any(escaped in pids_named(m) and SERVER_ACCOUNT in m and "Killed process" in m for m in lines), lines
    assert not any(p.pid in pids_named(m) for m in lines for p in (admin, other, kernel)), lines
    events = [e for e in pool.events(50) if e["kind"] == "backstop"]
    assert any(str(escaped) in e["reason"] and SERVER_ACCOUNT in e["user"] for e in events), events


async def _server_account_holder(pool, node, allocation_id: str, uuid: str):
    """An allocation bound to a holder that runs as the server account (so the hub counts that
    account as one it runs servers as), on card ``uuid``."""
    server_uid = pwd.getpwnam(SERVER_ACCOUNT).pw_uid
    allocation = Allocation(id=allocation_id, owner=Owner(allocation_id.split("-")[1]), node="localhost",
                            gpu_uuids=(uuid,), memory_mib=1024, cores_percent=50, priority_class="default")
    await pool.record(allocation)
    holder = subprocess.Popen(["sleep", "300"], start_new_session=True, user=SERVER_ACCOUNT,
                              group=pwd.getpwnam(SERVER_ACCOUNT).pw_gid, extra_groups=[])
    node.processes.append(holder)
    await pool.bind(allocation.id, str(holder.pid))
    assert server_uid in pool.server_accounts()
    return allocation


def _as_server_account(node, pool) -> None:
    if os.geteuid() != 0:
        pytest.skip("runs processes as other accounts (the hub runs as root in `elastic-gpu up`)")
    for path in (node.build.root, node.root, Path(pool.data_dir)):
        reachable(path)
    state = Path(node.double_env["CUDA_DOUBLE_STATE"])
    state.touch()
    state.chmod(0o666)


async def test_another_accounts_process_carrying_a_slices_id_never_gets_its_kernel_killed(machine, caplog):
    """Attack (a): a process of another account, without the shim, carries alice's allocation id
    (ids are listable) and uses 400 MiB on her card, so that her slice looks over its limit."""
    pool, node, alice, env = machine
    _as_server_account(node, pool)
    await _server_account_holder(pool, node, "alloc-bob-1", alice.gpu_uuids[0])
    bound = 10
    with caplog.at_level(logging.WARNING):
        kernel = start(node, env, "init", "ctx", "alloc:900M")  # alice's, as her holder's account
        no_shim = {k: v for k, v in env.items() if k != "LD_PRELOAD"}
        intruder = start(node, no_shim, "init", "ctx", "alloc:400M", account=SERVER_ACCOUNT, session=True)
        await killed_within(intruder, bound)  # a process of a server account in no slice of its own
    assert kernel.poll() is None  # alice's kernel runs on
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Backstop")]
    assert not any(kernel.pid in pids_named(m) for m in lines), lines
    events = [e for e in pool.events(50) if e["kind"] == "backstop"]
    assert events and all(e["user"] != "alice" for e in events), events  # the ledger does not blame alice


async def test_a_process_carrying_a_whole_card_allocations_id_is_not_let_off(machine, caplog):
    """Attack (b): carrying the id of someone's whole-card allocation (no memory limit, no shim
    check), a process of another account would use that card with no limit, never killed."""
    pool, node, alice, env = machine
    _as_server_account(node, pool)
    cards = [g.uuid for n in (await pool.inventory()).nodes for g in n.gpus]
    await _server_account_holder(pool, node, "alloc-bob-1", cards[0])  # the account runs servers
    carol = Allocation(id="alloc-carol-1", owner=Owner("carol"), node="localhost", gpu_uuids=(cards[1],),
                       memory_mib=4096, cores_percent=100, priority_class="default", whole=True)
    await pool.record(carol)
    holder = subprocess.Popen(["sleep", "300"], start_new_session=True)  # carol's, as the hub's account
    node.processes.append(holder)
    await pool.bind(carol.id, str(holder.pid))
    carried = {k: v for k, v in env.items() if k not in ("LD_PRELOAD", "CUDA_VISIBLE_DEVICES")}  # every card
    carried["ELASTIC_GPU_ALLOCATION_ID"] = carol.id
    with caplog.at_level(logging.WARNING):
        intruder = start(node, carried, "init", "ctx:1", "alloc:3000M", account=SERVER_ACCOUNT, session=True)
        await killed_within(intruder, 10)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Backstop")]
    assert any(intruder.pid in pids_named(m) and SERVER_ACCOUNT in m for m in lines), lines


async def test_a_slices_region_cannot_be_unlinked_or_renamed_for_a_fresh_limit(machine):
    """A user's code unlinks or renames its container region while a process holds memory, so
    that the next process would start a fresh region with a fresh limit."""
    pool, node, alice, _ = machine
    _as_server_account(node, pool)
    account = pwd.getpwnam(SERVER_ACCOUNT)
    bob = Allocation(id="alloc-bob-1", owner=Owner("bob"), node="localhost", gpu_uuids=alice.gpu_uuids,
                     memory_mib=1024, cores_percent=50, priority_class="default")
    await pool.record(bob)
    env = node.env(pool.holder_env(bob, 10, account.pw_uid, account.pw_gid))
    env["LD_PRELOAD"] = node.build.preload()
    as_bob = {"user": SERVER_ACCOUNT, "group": account.pw_gid, "extra_groups": []}
    start(node, env, "init", "ctx", "alloc:700M", account=SERVER_ACCOUNT, session=True)
    region = pool.region_dir(bob.id) / "container.region"
    for attack in (f"mv {region} {region}.old", f"rm -f {region}", f"ln -sf /dev/null {region}"):
        tamper = subprocess.run(["sh", "-c", attack], capture_output=True, text=True, **as_bob)
        second = subprocess.run([str(node.build.probe), "init", "ctx", "alloc:700M"], env=env, capture_output=True,
                                text=True, timeout=60, **as_bob)
        assert "alloc rc=2" in second.stdout, (attack, second.stdout, second.stderr)  # the slice's one limit
        assert tamper.returncode != 0, attack  # the directory is not the slice's to write
