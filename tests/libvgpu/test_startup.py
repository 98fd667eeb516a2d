"""Start-up: the shim initialises in a few milliseconds, and 100 processes starting at once on
one card are all initialised and allocate (how long that takes beside the same start without
the shim: bench/startup.py; a wall-clock bound here would measure the machine's load)."""

from __future__ import annotations

import statistics
import subprocess

from libvgpu.regions import read_container_region


def test_shim_initialisation_takes_under_10_ms(node):
    box = node.container("c", "memory_mib=1024\ncores_percent=50")
    with_shim = [box.run("init").num("init", "init_us") for _ in range(7)]
    assert statistics.median(with_shim) < 10_000, with_shim


def test_100_processes_starting_at_once_are_all_initialised_and_allocate(node):
    box = node.container("c", "memory_mib=1024")
    env = box.env()
    procs = [
        subprocess.Popen([str(node.build.probe), "init", "ctx", "alloc:1M"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(100)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outputs if o[1]][:3]
    for out, _ in outputs:
        assert "init rc=0 " in out and "ctx rc=0" in out and "alloc rc=0" in out, out
    assert read_container_region(box.region).memory_used_bytes[0] == 0  # all exited, all freed
