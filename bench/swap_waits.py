"""Waits to get a GPU back on Kubernetes: idle kernels swapped out (their pod resumes only onto
its own card) against idle kernels killed (the user's next cell starts a fresh kernel on any
card), the same sessions on the same pool, side by side in one run.

    python bench/swap_waits.py [--seed 1] [--hours 24] [--load 0.85] [--nodes 6,12,20]
                               [--idle-timeout 600] [--placement binpack|spread|fgd]

Driven through the real admission core and queue (``AdmissionState``, ``AdmissionQueue.pump``
with the product's defaults; no moves: a kernel pod cannot be moved, ``KubernetesKernelLauncher``
declares it). The sessions are bench/placement.py's (Poisson arrivals, log-normal lengths of
2 h on average, slices of 4-20 GiB and whole 80 GiB cards), offering ``--load`` of the
*smallest* pool's GPU memory; every larger pool gets the same sessions (more cards, same
demand). Within a session the user alternates work (exponential, 10 min on average) and pauses
(log-normal, 30 min on average); a pause longer than ``--idle-timeout`` reclaims the kernel's
slice at the timeout, and the user's next work asks for it again:

- **kill**: a new request for the same size, placed anywhere (the state is lost);
- **swap**: the resume, pinned to the card(s) it was swapped out from (``GPURequest.pinned_uuids``,
  as ``PodSwapMixin.resume_pins`` asks), its state kept;
- **node** (the product where the node's driver restores onto another card, driver 580+): a
  one-card resume asks for any card of its node of the same model, its own first
  (``GPUBroker._resume_cards``), and waits for whichever has room first;
- **keep**: the slice is never given back while the kernel pauses (its room kept on its card):
  no comeback waits, at the price of the first starts' waits.

While a kernel is swapped out (swap, node), its room on its card(s) is kept *soft* as the hub keeps
it (``GPUBroker.resume_room``, ``quotas/reserve.py``): a new slice takes it only where nothing
else fits. **node, no room kept** is the node variant without that (as the product was before),
measured in the same run.

The figures are the waits of those comebacks (p50, p95, max, and how many waited longer than
``GPUBroker.resume_queue_seconds``, 600 s, after which the product refuses the cell), the first
starts' p95, and how many cards ever held a slice. CPU and host memory are left out: both
variants ask the same GPUs. Requests still waiting at the end count with the wait so far.

One line per pool: ``swap_waits gpus=<n> kill_p95_s=<n> swap_p95_s=<n> ratio=<swap/kill>
node_p95_s=<n> node_ratio=<node/kill> unkept_p95_s=<n> unkept_ratio=<node without room kept/kill>``.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.placement import CARD_MIB, GIB, config, percentile, product_pool, session_trace, wait_nodes  # noqa: E402
from quotas import AdmissionState, GPURequest, Owner, Placement, SoftReservation  # noqa: E402
from quotas.queue import AdmissionQueue  # noqa: E402

#: GPUBroker.resume_queue_seconds: a resume waiting longer is refused (its cell is not run)
RESUME_QUEUE_SECONDS = 600.0
WORK_MEAN_S = 600.0
PAUSE_MEAN_S = 1800.0
PAUSE_SIGMA = 1.2


def periods(rng: random.Random, length: float) -> list[tuple[float, float]]:
    """A session's (work s, pause s) pairs until its length is used up (the last pause is 0: it ends)."""
    mu = math.log(PAUSE_MEAN_S) - PAUSE_SIGMA**2 / 2
    out: list[tuple[float, float]] = []
    used = 0.0
    while used < length:
        work = min(rng.expovariate(1 / WORK_MEAN_S), length - used)
        used += work
        pause = min(rng.lognormvariate(mu, PAUSE_SIGMA), max(0.0, length - used))
        used += pause
        out.append((work, pause))
    out[-1] = (out[-1][0], 0.0)
    return out


@dataclass
class Run:
    """What one variant measured."""

    comebacks: list[float] = field(default_factory=list)
    first: list[float] = field(default_factory=list)
    refused: int = 0
    cards_used: set[str] = field(default_factory=set)

    def line(self) -> str:
        c = self.comebacks
        over = sum(w > RESUME_QUEUE_SECONDS for w in c)
        return (
            f"comebacks {len(c):5d}  p50 {percentile(c, 50):7.0f} s  p95 {percentile(c, 95):7.0f} s  "
            f"max {max(c, default=0):7.0f} s  over {RESUME_QUEUE_SECONDS:.0f} s {over:4d}  "
            f"first starts p95 {percentile(self.first, 95):6.0f} s  cards used {len(self.cards_used)}"
        )


def node_cards(state: AdmissionState, own: str) -> tuple[str, ...]:
    """Where a one-card resume asks when its node's driver restores onto another card (the
    driver's device map, as ``GPUBroker._resume_cards`` asks for a kernel pod): its own card first,
    then the node's other cards of the same model and mode; admission grants the first with room,
    or it waits for any of them."""
    ix = state.index
    gi = ix.gi_of[own]
    mine = ix.gpus[gi]
    alike = [ix.gpus[g].uuid for g in ix.node_gpus[ix.node_of_gpu[gi]]
             if g != gi and (ix.gpus[g].model, ix.gpus[g].mode) == (mine.model, mine.mode)]  # fmt: skip
    return (own, *alike)


def run(
    variant: str, n_nodes: int, trace: list[tuple], seed: int, hours: float, idle_timeout: float, placement: str
) -> Run:
    """One variant ('kill', 'swap', 'swap, node', 'swap, node, unkept' or 'keep') of the sessions
    ``trace`` on a pool of ``n_nodes`` nodes, placed by ``placement`` (node and card policy alike)."""
    cfg = config(placement, placement)
    state = AdmissionState(cfg, product_pool(wait_nodes(n_nodes)))
    line = AdmissionQueue.from_policy(cfg.policy)
    rng = random.Random(seed * 7919 + 1)
    plans = [periods(rng, length) for _, _, _, length in trace]
    out = Run()
    events: list[tuple[float, int, str, int]] = []
    seq = 0

    def at(t: float, kind: str, sid: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, sid))

    for sid, (t, _, _, _) in enumerate(trace):
        at(t, "arrive", sid)
    asked: dict[str, tuple[int, float, bool]] = {}  # request id -> (session, since, comeback)
    held: dict[int, tuple[str, tuple[str, ...]]] = {}  # session -> (allocation id, its cards)
    room: dict[str, SoftReservation] = {}  # swapped-out session -> its room, kept soft (as the hub does)
    keeps_room = variant in ("swap", "swap, node")

    def keep_room(sid: int, reservation: SoftReservation | None) -> None:
        if not keeps_room:
            return
        if reservation is None:
            room.pop(str(sid), None)
        else:
            room[str(sid)] = reservation
        state.index.soft.replace(state.index, room)
    step_of = [0] * len(trace)
    attempts = [0] * len(trace)

    def ask(sid: int, now: float, pins: tuple[str, ...], comeback: bool) -> None:
        gib, _, _, _ = trace[sid][1]
        attempts[sid] += 1
        rid = f"s{sid}.{attempts[sid]}"
        whole = gib == 0
        request = GPURequest(
            Owner(f"user{trace[sid][2]}"),
            memory_mib=CARD_MIB if whole else gib * GIB,
            cores_percent=100 if whole else max(5, gib * 100 // 80),
            whole=whole,
            request_id=rid,
            kind="kernel",
            pinned_uuids=pins,
        )
        asked[rid] = (sid, now, comeback)
        line.push(request, 100, now)

    end = hours * 3600
    while events:
        now, _, kind, sid = heapq.heappop(events)
        if kind == "arrive":
            ask(sid, now, (), False)
        elif kind == "pause":  # the end of a work period
            work, pause = plans[sid][step_of[sid]]
            aid, _ = held[sid]
            if pause == 0.0:
                state.remove(aid)
                del held[sid]
            elif pause > idle_timeout:
                at(now + idle_timeout, "reclaim", sid)
                at(now + pause, "back", sid)
            else:
                step_of[sid] += 1
                at(now + pause + plans[sid][step_of[sid]][0], "pause", sid)
        elif kind == "reclaim" and variant != "keep":
            aid, cards = held[sid]
            gone = state.remove(aid)
            if variant.startswith("swap"):
                keep_room(sid, SoftReservation(cards, gone.memory_mib, gone.cores_percent))
        elif kind == "back" and variant == "keep":  # its room was kept: it goes on at once
            step_of[sid] += 1
            out.comebacks.append(0.0)
            at(now + plans[sid][step_of[sid]][0], "pause", sid)
        elif kind == "back":
            step_of[sid] += 1
            _, cards = held.pop(sid)
            keep_room(sid, None)  # it asks: its request, first in line, takes its room
            if variant.startswith("swap, node") and len(cards) == 1:
                cards = node_cards(state, cards[0])
            ask(sid, now, cards if variant.startswith("swap") else (), True)
        for step in line.pump(state, now, moves_possible=False):
            rid = step.waiting.request.request_id
            if step.decision.granted:
                got, since, comeback = asked.pop(rid)
                (out.comebacks if comeback else out.first).append(now - since)
                cards = tuple(step.decision.allocation.gpu_uuids)
                out.cards_used.update(cards)
                held[got] = (rid, cards)
                at(now + plans[got][step_of[got]][0], "pause", got)
            elif step.decision.kind == "reject":
                asked.pop(rid, None)
                out.refused += 1
    for _, since, comeback in asked.values():  # still waiting at the end
        (out.comebacks if comeback else out.first).append(max(0.0, end - since))
    return out


def ratio(p95: float, kill_p95: float) -> float:
    """A variant's comeback p95 over a kill's (inf when a kill waits nothing and it does)."""
    return p95 / kill_p95 if kill_p95 else (math.inf if p95 else 1.0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--hours", type=float, default=24.0)
    p.add_argument("--load", type=float, default=0.85)
    p.add_argument("--nodes", default="6,12,20", help="pool sizes in nodes (about 6 GPUs each), comma-separated")
    p.add_argument("--idle-timeout", type=float, default=600.0, help="seconds of pause before a slice is reclaimed")
    p.add_argument("--placement", default=Placement().node, help="node and card placement (default: the product's)")
    a = p.parse_args(argv)
    sizes = [int(n) for n in a.nodes.split(",")]
    smallest = sum(g for g, _, _ in wait_nodes(min(sizes))) * 80
    trace = session_trace(a.seed, a.hours, a.load, smallest)
    print(
        f"{len(trace)} sessions over {a.hours:g} h, {a.load:.0%} of {smallest // 80} GPUs offered; pauses over "
        f"{a.idle_timeout:g} s reclaim the slice; placement {a.placement}"
    )
    for n in sizes:
        gpus = sum(g for g, _, _ in wait_nodes(n))
        kill = run("kill", n, trace, a.seed, a.hours, a.idle_timeout, a.placement)
        swap = run("swap", n, trace, a.seed, a.hours, a.idle_timeout, a.placement)
        node = run("swap, node", n, trace, a.seed, a.hours, a.idle_timeout, a.placement)
        unkept = run("swap, node, unkept", n, trace, a.seed, a.hours, a.idle_timeout, a.placement)
        keep = run("keep", n, trace, a.seed, a.hours, a.idle_timeout, a.placement)
        print(f"{gpus:4d} GPUs  kill: {kill.line()}")
        print(f"{gpus:4d} GPUs  swap: {swap.line()}")
        print(f"{gpus:4d} GPUs  node: {node.line()}")
        print(f"{gpus:4d} GPUs  node, no room kept: {unkept.line()}")
        print(f"{gpus:4d} GPUs  keep: {keep.line()}")
        k95, s95, n95, u95 = (percentile(r.comebacks, 95) for r in (kill, swap, node, unkept))

        print(
            f"swap_waits gpus={gpus} kill_p95_s={k95:.0f} swap_p95_s={s95:.0f} ratio={ratio(s95, k95):.2f} "
            f"node_p95_s={n95:.0f} node_ratio={ratio(n95, k95):.2f} "
            f"unkept_p95_s={u95:.0f} unkept_ratio={ratio(u95, k95):.2f}"
        )


if __name__ == "__main__":
    main()
