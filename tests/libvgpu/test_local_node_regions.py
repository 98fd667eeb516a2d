"""Single-machine mode's node regions, as a hostile user would try them: the card's node region
(``regions/node/<uuid>.region``) holds every slice's entry (priority, memory in use, launches,
bursts, reclaims), and every shim on the card believes it. A user's code must not be able to
rewrite another slice's entry (zero its memory in use, fake its launches), nor replace the file,
while the hub relays each slice's own entry from its container region (libvgpu.agent.relay), as
the node agent does on Kubernetes."""

from __future__ import annotations

import asyncio
import os
import pwd
import subprocess
import time

import pytest

from libvgpu.regions import LAYOUT, NodeContainer, read_node_region
from quotas import Allocation, Owner

from . import test_backstop_local as backstop
from .test_backstop_local import SERVER_ACCOUNT, _as_server_account, start

machine = backstop.machine  # the local pool over the NVML double's two cards, alice's slice on card 0

MiB = 1 << 20

#: a user's code: open the card's node region for writing and zero an entry's memory in use
REWRITE = """import os, sys
path, offset = sys.argv[1], int(sys.argv[2])
try:
    fd = os.open(path, os.O_RDWR)
    os.pwrite(fd, bytes(8), offset)
except OSError as e:
    print("refused", e.errno)
    sys.exit(3)
print("rewritten")
"""


async def entry(path, name: str, at_least: int, seconds: float = 20) -> NodeContainer:
    """The live entry ``name`` of the node region ``path`` once its memory in use reaches
    ``at_least`` bytes (fails after ``seconds``)."""
    began, seen = time.monotonic(), None
    while time.monotonic() - began < seconds:
        try:
            seen = {c.name: c for c in read_node_region(path).containers}
        except (FileNotFoundError, ValueError):
            seen = None
        if seen and name in seen and seen[name].memory_used_bytes >= at_least:
            return seen[name]
        await asyncio.sleep(0.05)
    raise AssertionError(f"no entry {name} using {at_least} bytes in {path}: {seen}")


async def bobs_slice(pool, node, alice: Allocation, priority_class: str, priority: int) -> tuple[Allocation, dict]:
    """Bob's 1 GiB slice on alice's card, and the environment of his processes: they run as the
    server account (not the hub's), so they cannot write the node region."""
    _as_server_account(node, pool)
    account = pwd.getpwnam(SERVER_ACCOUNT)
    bob = Allocation(id="alloc-bob-1", owner=Owner("bob"), node="localhost", gpu_uuids=alice.gpu_uuids,
                     memory_mib=1024, cores_percent=50, priority_class=priority_class)
    await pool.record(bob)
    env = node.env(pool.holder_env(bob, priority, account.pw_uid, account.pw_gid))
    env["LD_PRELOAD"] = node.build.preload()
    return bob, env


async def test_a_user_cannot_rewrite_another_slices_node_region_entry(machine):
    pool, node, alice, alice_env = machine
    bob, bob_env = await bobs_slice(pool, node, alice, "default", 10)
    account = pwd.getpwnam(SERVER_ACCOUNT)
    start(node, alice_env, "init", "ctx", "alloc:300M")  # alice's kernel
    start(node, bob_env, "init", "ctx", "alloc:700M", account=SERVER_ACCOUNT, session=True)  # bob's
    region = pool.regions_dir / "node" / f"{alice.gpu_uuids[0]}.region"
    victim = await entry(region, alice.id, 300 * MiB)
    await entry(region, bob.id, 700 * MiB)  # bob's own entry is there (relayed from his container region)

    # bob's code zeroes alice's memory in use, so that the card looks free to a burst of his
    offset = 256 + victim.index * LAYOUT["entry.size"] + LAYOUT["entry.memory_used"]
    as_bob = {"user": SERVER_ACCOUNT, "group": account.pw_gid, "extra_groups": []}
    attack = subprocess.run(["/usr/bin/python3", "-I", "-S", "-c", REWRITE, str(region), str(offset)],
                            capture_output=True, text=True, timeout=60, **as_bob)
    assert attack.returncode == 3 and "refused 13" in attack.stdout, (attack.stdout, attack.stderr)  # EACCES
    after = {c.name: c for c in read_node_region(region).containers}
    assert after[alice.id].memory_used_bytes >= 300 * MiB, after  # her accounting is hers
    assert after[alice.id].container_id == victim.container_id

    # nor can his code replace the file, plant one for another card, or make it writable
    node_dir = region.parent
    for tamper in (f"mv {region} {region}.old", f"rm -f {region}", f"cp {region} {node_dir}/mine.region",
                   f"chmod 666 {region}"):
        done = subprocess.run(["sh", "-c", tamper], capture_output=True, text=True, timeout=60, **as_bob)
        assert done.returncode != 0, tamper
    assert os.stat(region).st_mode & 0o777 == 0o644 and os.stat(node_dir).st_mode & 0o7777 == 0o755


async def test_a_slice_of_a_users_account_holds_a_lower_priority_through_the_hubs_relay(machine):
    """Bob's slice (priority 100, his code as a server account: it cannot write the node region,
    its entry is relayed) launches; alice's kernel (priority 10) on the same card holds its
    launches meanwhile, as the node region shows."""
    pool, node, alice, alice_env = machine
    bob, bob_env = await bobs_slice(pool, node, alice, "high", 100)
    start(node, bob_env, "init", "ctx", "alloc:64M", "ready", "timeline:6:1000", account=SERVER_ACCOUNT, session=True)
    region = pool.regions_dir / "node" / f"{alice.gpu_uuids[0]}.region"
    high = await entry(region, bob.id, 64 * MiB)
    assert high.priority == 100 and high.held_since is None
    start(node, alice_env, "init", "ctx", "ready", "timeline:4:1000")
    began, low = time.monotonic(), None
    while time.monotonic() - began < 20 and not (low and low.held_since):
        low = next((c for c in read_node_region(region).containers if c.name == alice.id), None)
        await asyncio.sleep(0.05)
    assert low is not None and low.held_since is not None, low  # held for bob's relayed launches
    assert {c.name: c for c in read_node_region(region).containers}[bob.id].held_since is None


async def test_a_hub_removes_what_other_accounts_left_in_the_node_regions_of_an_earlier_version(tmp_path):
    """Before, ``regions/node`` was everyone's (1777, regions 0666): a user's code could have left a
    region of its own there (it would still own it, and could make it writable again), or a link."""
    from hubext.local.pool import LocalPool

    if os.geteuid() != 0:
        pytest.skip("plants files of another account (the hub runs as root in `elastic-gpu up`)")
    node_dir = tmp_path / "regions" / "node"
    node_dir.mkdir(parents=True)
    node_dir.chmod(0o1777)
    planted, link, hubs = node_dir / "GPU-sim-0000.region", node_dir / "GPU-sim-0001.region", node_dir / "old.region"
    planted.write_bytes(bytes(64))
    os.chown(planted, pwd.getpwnam(SERVER_ACCOUNT).pw_uid, -1)
    link.symlink_to("/etc/passwd")
    hubs.write_bytes(bytes(64))
    hubs.chmod(0o666)
    pool = LocalPool(simulate_gpus="2xH100-80GB", data_dir=str(tmp_path))

    async def gone(allocation_id: str, why: str) -> None:
        pass

    await pool.start(gone)
    try:
        assert not os.path.lexists(planted) and not os.path.lexists(link)
        assert os.stat(hubs).st_mode & 0o777 == 0o644
        st = os.stat(node_dir)
        assert (st.st_uid, st.st_mode & 0o7777) == (0, 0o755)
    finally:
        await pool.stop()
