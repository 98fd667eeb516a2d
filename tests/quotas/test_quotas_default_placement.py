"""The placement a pool gets with the shipped defaults (``load_config({})``): nodes chosen by
fragmentation (fgd), which counts a node's CPU and host memory, cards within a node by binpack
(issue 25: the default chosen on bench/placement.py's heterogeneous traces)."""

from __future__ import annotations

import dataclasses

from quotas import AdmissionState, load_config

from .builders import alloc, node, pool, req

DEFAULT = load_config({})


def test_the_default_keeps_a_node_whose_cpu_a_request_would_use_up_for_the_requests_to_come():
    """Node a has the fewest GPU memory free (binpack's pick) but only 8 CPUs left: a 20 GiB
    slice asking 8 CPUs there would leave its 140 GiB of free GPU memory to requests that need
    CPUs too, none of which could start there. The default puts it on b, which has CPUs to spare."""
    a = dataclasses.replace(node("a", 2), cpu_millicores=16_000)
    b = dataclasses.replace(node("b", 2), cpu_millicores=64_000)
    held = [alloc("x", "a-gpu0", 20, cpu_millicores=8_000), alloc("y", "b-gpu0", 10, cpu_millicores=8_000)]
    st = AdmissionState(DEFAULT, pool(a, b), held)
    d = st.decide(req(memory_gib=20, cpu_millicores=8_000, rid="new"))
    assert d.kind == "grant", d.reason
    assert d.allocation.node == "b", d.allocation
    # what the default was before issue 25 (binpack on nodes) ignores the CPU: it takes a
    binpack = AdmissionState(load_config({"placement": {"node": "binpack", "gpu": "binpack"}}), pool(a, b), held)
    assert binpack.decide(req(memory_gib=20, cpu_millicores=8_000, rid="new")).allocation.node == "a"


def test_on_one_node_the_default_places_slices_as_binpack_does():
    """One machine (a single node): the node policy has nothing to choose, and cards are binpack:
    a slice goes on the fullest card it fits."""
    st = AdmissionState(DEFAULT, pool(node("a", 3)), [alloc("x", "a-gpu1", 60), alloc("y", "a-gpu2", 30)])
    assert st.decide(req(memory_gib=10, rid="new")).allocation.gpu_uuids == ("a-gpu1",)
