"""Giving victims back (quotas/reprieve.py) without trying the node again for a victim the
request surely needs, and skipping the walk for one victim that fixes a short quota when none of
the level charges enough, choose exactly what the plain search chooses (issue 25), on random
heterogeneous pools with tight and loose workspace quotas, churned by the core itself."""

from __future__ import annotations

import dataclasses
import random

import pytest

from quotas import AdmissionState, Owner, load_config, reprieve
from quotas.reprieve import Reprieve

from .builders import CLASSES, GIB
from .test_quotas_fast_placement import random_pool, random_request

WORKSPACES = {
    "tight": {"limits": {"memory_mib": 300 * GIB}},
    "loose": {"limits": {"memory_mib": 4_000 * GIB}},
}


def owned(rng: random.Random, r):
    ws = rng.choice(["tight", "loose", "loose"])
    return dataclasses.replace(r, owner=Owner(f"u{rng.randrange(4)}", "default", ws))


@pytest.mark.parametrize("seed", range(5))
def test_preemption_shortcuts_choose_the_victims_the_plain_search_chooses(seed, monkeypatch):
    rng = random.Random(seed)
    config = load_config({"priority_classes": CLASSES, "workspaces": WORKSPACES,
                          "placement": {"node": "binpack", "gpu": "binpack"}})
    st = AdmissionState(config, random_pool(rng, 12))
    verdict, most = Reprieve._verdict, AdmissionState.own_most_below
    bounded = [0]

    def counting_most(self, *args):
        bounded[0] += 1
        return most(self, *args)

    skipped = {reprieve.NEEDED: 0, reprieve.SPARED: 0}

    def counting(self, *args):
        said = verdict(self, *args)
        if said in skipped:
            skipped[said] += 1
        return said

    compared = several = 0
    for i in range(260):
        d = st.decide(owned(rng, random_request(rng, i, classes=("default", "low", "lowest"))), now=float(i))
        if d.granted:
            st.apply(d)
        if st.allocations and rng.random() < 0.25:
            st.remove(rng.choice(sorted(st.allocations)))
        probe = owned(rng, dataclasses.replace(
            random_request(rng, 10_000 + i, classes=("high",)), count=rng.choice([1, 2, 4, 8]),
            whole=rng.random() < 0.4))
        monkeypatch.setattr(Reprieve, "_verdict", lambda self, *args: reprieve.TRY)
        monkeypatch.setattr(AdmissionState, "own_most_below", lambda self, *args: [1 << 60] * 3)
        plain = st.decide(probe, now=1e6)
        monkeypatch.setattr(Reprieve, "_verdict", counting)
        monkeypatch.setattr(AdmissionState, "own_most_below", counting_most)
        fast = st.decide(probe, now=1e6)
        assert (fast.kind, fast.allocation, fast.victims, fast.reason) == \
            (plain.kind, plain.allocation, plain.victims, plain.reason), probe
        compared += 1
        several += plain.kind == "preempt" and len(plain.victims) > 1
    assert compared == 260 and several > 5
    # the shortcuts were taken: victims judged needed, quota victims given back untried
    assert skipped[reprieve.NEEDED] > 20 and skipped[reprieve.SPARED] > 0, skipped
    assert bounded[0] > 5
