"""Start-up: the shim initialises in a few milliseconds, and never serialises processes: 100
processes starting at once on one card are all initialised within 2 s."""

from __future__ import annotations

import statistics
import subprocess
import time


def test_shim_initialisation_takes_under_10_ms(node):
    box = node.container("c", "memory_mib=1024\ncores_percent=50")
    with_shim = [box.run("init").num("init", "init_us") for _ in range(7)]
    assert statistics.median(with_shim) < 10_000, with_shim


def test_100_processes_starting_at_once_are_all_initialised_within_2_s(node):
    box = node.container("c", "memory_mib=1024")
    env = box.env()
    started_ns = time.time_ns()
    procs = [
        subprocess.Popen([str(node.build.probe), "init", "ctx", "alloc:1M"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(100)
    ]
    outputs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outputs if o[1]][:3]
    done = []
    for out, _ in outputs:
        fields = dict(w.split("=", 1) for w in out.split("\n")[0].split()[1:])
        assert fields["rc"] == "0"
        done.append(int(fields["done_ns"]))
        assert "alloc rc=0" in out
    assert (max(done) - started_ns) / 1e9 < 2.0
