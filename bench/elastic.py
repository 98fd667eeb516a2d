"""Elastic slices against fixed slices: four bursty notebooks sharing one card, each guaranteed
25 % of its time and a quarter of its memory, run through the real shim against the CUDA/NVML
doubles (the NVML double sampling every 167 ms, as a driver does), the same trace on two cards
at once in one run: fixed slices (25 %) on one, elastic slices (25 % guaranteed, up to 100 %) on
the other, so both see the same load from the rest of the machine.

    python bench/elastic.py [--seconds 90] [--seed 7] [--floor-repeats 5]

Three phases, each measuring one thing:

* **steady**: the trace is shaped like notebook use: cells (GPU work of 0.1-3 s at the full
  card's speed, log-normal around 0.6 s) and think times between them (0.5-6 s, around 1.8 s);
  one cell in three also allocates past its guaranteed memory (12 of the card's 16 GiB are
  guaranteed, 3 GiB each; a notebook may burst to 9 GiB). Each notebook runs its trace
  closed-loop for ``--seconds``: the next cell starts a think time after the last ended. 90 s
  is long enough that the start does not dominate: the fluid model's ideal of the run is within
  2 % of the same trace continued to 10x (printed), where 30-75 s were up to 6 % off.
* **reclaim**: elastic only: two notebooks burst into memory a fourth is guaranteed before it
  opens; its first allocation waits until they give it back (their cells end: no hub here).
* **floor back**: three elastic notebooks burst; a fourth starts work (below).

Figures:

* ``work_ratio``: the card's time spent on the notebooks' work (GPU-seconds of cells completed
  per second), elastic over fixed, in the steady phase; ``ideal_work_ratio``: what a fluid
  model of the same trace gives (fixed 25 % slices, and the card shared equally by the
  notebooks in a cell: ideal work-conserving sharing, no limiter, no sampling); also printed:
  the measured busy over the model's, the trace's shape (cell and think lengths, cell:think)
  against the issue's model, and the closed loop's long-run ideal (4 notebooks, the card shared
  evenly among those in a cell) at the trace's cell:think, at the issue's, and at most at any;
* ``slowdown_p50_*``: the median cell's wall time over its time alone on the full card;
* ``floor_back_p95_s``: when three elastic notebooks burst on a busy card and a fourth starts
  work, how long until its share is within 5 points of its guarantee (the cores limiter's
  tolerance, bench/gpucheck/claims.py CORES_POINTS) or above in every 250 ms window from then on
  (probe step ``floorback``; 95th percentile of the repetitions);
* ``owner_ooms``: allocations within a notebook's guarantee that failed (the reclaim did not
  give the memory back in time), in all phases; ``burst_refused`` counts allocations past the
  guarantee refused (always in the fixed run: no burst there); ``reclaim waits`` counts the
  allocations within a guarantee that waited for bursts to be given back.

Where the work goes: for each steady run, by the number of notebooks in a cell at once (their
probe lines stamp when each step began), how long that was, the card's share their steps got,
and the card-seconds lost against ideal sharing of those moments (the whole card while any
notebook is in a cell; k / 4 with fixed slices); for the elastic run, how much of that loss
falls within 0.25 s of a cell beginning or ending.

Prints a table and one line:
``elastic work_ratio=… slowdown_p50_fixed=… slowdown_p50_elastic=… floor_back_p95_s=… owner_ooms=…
ideal_work_ratio=…``
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.gpucheck.claims import CORES_POINTS  # noqa: E402
from tests.libvgpu.harness import Node, Result, build_all  # noqa: E402

NOTEBOOKS = 4
CARD_MIB = 16384
REQUEST_MIB = 3072  # guaranteed: 12 of the card's 16 GiB
LIMIT_MIB = 3 * REQUEST_MIB
BASE_MIB = 2048  # what a notebook's kernel holds from its start (within its request)
CELL_MIB = 512  # what every cell allocates for itself and frees (within the request)
BURST_MIB = 4096  # what a memory-heavy cell adds (past the request)
BURST_CELL_STEPS = 60  # the reclaim: the bursters' cells, 3 s of work, memory-heavy
KERNEL_US = 2000
STEP_KERNELS = 25  # a cell is run in steps of 25 x 2 ms kernels (50 ms at the full card)
STEP_MS = STEP_KERNELS * KERNEL_US / 1000
LATE_S = 3.0  # the reclaim: the fourth notebook opens this long after the others
SECONDS = 90.0  # each steady run: its fluid ideal within 2 % of the same trace's long-run value
FLOOR_REPEATS = 5
HANDOFF_REPEATS = 3


@dataclass(frozen=True)
class Cell:
    steps: int  # of STEP_MS at the full card
    think_ms: int  # after it
    heavy: bool  # allocates past the request


def trace(rng: random.Random, seconds: float) -> list[Cell]:
    """Enough cells for ``seconds`` even at the fastest (every cell alone on the card)."""
    cells: list[Cell] = []
    total = 0.0
    while total < seconds * 1000:
        work = min(3000.0, max(100.0, rng.lognormvariate(math.log(600), 0.8)))
        think = min(6000.0, max(500.0, rng.lognormvariate(math.log(1800), 0.6)))
        cell = Cell(max(1, round(work / STEP_MS)), int(think), rng.random() < 1 / 3)
        cells.append(cell)
        total += cell.steps * STEP_MS + cell.think_ms
    return cells


def steps_of(cells: list[Cell], go: Path) -> list[str]:
    steps = ["init", "ctx", "ready", f"waitfile:{go}", f"alloc:{BASE_MIB}M"]
    for cell in cells:
        steps.append(f"alloc:{CELL_MIB}M")
        if cell.heavy:
            steps.append(f"alloc:{BURST_MIB}M")
        steps += [f"burst:{STEP_KERNELS}:{KERNEL_US}"] * cell.steps
        steps.append("free")
        if cell.heavy:
            steps.append("free")
        steps.append(f"sleep:{cell.think_ms}")
    return steps


@dataclass
class Outcome:
    work_ms: float = 0.0  # GPU time of the steps completed
    slowdowns: list[float] | None = None
    owner_ooms: int = 0
    burst_refused: int = 0
    reclaim_waits: int = 0  # owners' allocations that waited for bursts to be given back
    steps: list[tuple[int, float, float]] = field(default_factory=list)  # notebook, began, ms (wall)
    cells: list[tuple[int, float, float]] = field(default_factory=list)  # notebook, began, ended
    span: tuple[float, float] = (0.0, 0.0)  # the run's start and end (unix seconds)


def parse(nb: int, cells: list[Cell], out: str, outcome: Outcome) -> None:
    """Walks the probe's lines in the order of the steps (sleep and waitfile print nothing)."""
    lines = [ln.split() for ln in out.splitlines() if ln.split() and ln.split()[0] in ("alloc", "burst", "free")]
    it = iter(lines)

    def rc(words: list[str]) -> int:
        return int(dict(w.split("=", 1) for w in words[1:])["rc"])

    base = next(it, None)
    if base is None:
        return
    outcome.owner_ooms += rc(base) == 2
    for cell in cells:
        words = next(it, None)
        if words is None:
            return
        outcome.owner_ooms += rc(words) == 2  # the cell's own memory: within the request
        if cell.heavy:
            words = next(it, None)
            if words is None:
                return
            outcome.burst_refused += rc(words) == 2
        wall, began, ended = 0.0, -1.0, -1.0
        for _ in range(cell.steps):
            words = next(it, None)
            if words is None:
                break
            outcome.work_ms += STEP_MS
            kv = dict(w.split("=", 1) for w in words[1:])
            at, ms = float(kv["at_ms"]) / 1000, float(kv["ms"]) / 1000
            outcome.steps.append((nb, at, ms))
            began, ended, wall = at if began < 0 else began, at + ms, wall + ms * 1000
        if began >= 0:  # in the cell from its first step to the end of its last one completed
            outcome.cells.append((nb, began, ended))
        if words is None:
            return
        assert outcome.slowdowns is not None
        outcome.slowdowns.append(wall / (cell.steps * STEP_MS))
        for _ in range(1 + cell.heavy):
            next(it, None)


def run_modes(build, root: Path, traces: list[list[Cell]], seconds: float) -> tuple[Outcome, Outcome]:
    """The same trace on two cards at once, fixed slices on one and elastic on the other: both
    runs see the same load from the rest of the machine."""
    nodes = [Node(build, root / mode, CUDA_DOUBLE_MEMORY_MIB=CARD_MIB) for mode in ("fixed", "elastic")]
    try:
        go = root / "go"
        procs: list[list] = [[], []]
        for elastic, node in enumerate(nodes):
            for i, cells in enumerate(traces):
                limits = f"name=nb{i}\ncores_percent={100 // NOTEBOOKS}\nmemory_mib={REQUEST_MIB}"
                if elastic:
                    limits += f"\ncores_limit_percent=100\nmemory_limit_mib={LIMIT_MIB}"
                box = node.container(f"nb{i}", limits, node_regions=True)
                procs[elastic].append(box.start(*steps_of(cells, go), wait_for="ready"))
        go.touch()
        began = time.time()
        time.sleep(seconds)  # the run's length: the notebooks work meanwhile
        outcomes = (
            Outcome(slowdowns=[], span=(began, began + seconds)),
            Outcome(slowdowns=[], span=(began, began + seconds)),
        )
        for ps in procs:
            for proc in ps:
                proc.kill()
        for outcome, ps in zip(outcomes, procs, strict=True):
            for i, (proc, cells) in enumerate(zip(ps, traces, strict=True)):
                out, err = proc.communicate(timeout=30)
                parse(i, cells, out, outcome)
                outcome.reclaim_waits += err.count("held by other slices' bursts")
        return outcomes
    finally:
        for node in nodes:
            node.cleanup()


def handoff(build, root: Path, repeats: int) -> list[list[float]]:
    """A bursts alone; B opens a cell of 0.5 s of work (the card halved), then thinks: A's share
    of the card in 50 ms bins from 100 ms before B's cell ended (ideal: 0.5, then 1 at once)."""
    found = []
    for rep in range(repeats):
        node = Node(build, root / f"handoff{rep}", CUDA_DOUBLE_MEMORY_MIB=CARD_MIB)
        try:
            go, procs = root / f"handoff{rep}-go", []
            for name, work in (
                ("a", ["burst:5:2000"] * 250),
                ("b", ["sleep:700", *["burst:5:2000"] * 50, "sleep:2500"]),
            ):
                limits = f"name={name}\ncores_percent={100 // NOTEBOOKS}\ncores_limit_percent=100"
                box = node.container(name, limits, node_regions=True)
                procs.append(box.start("init", "ctx", "ready", f"waitfile:{go}", *work, wait_for="ready"))
            go.touch()
            a, b = (
                [
                    (float(kv["at_ms"]), float(kv["ms"]))
                    for kv in Result.parse(0, *p.communicate(timeout=60)).all("burst")
                ]
                for p in procs
            )
            if not a or not b:
                continue
            ended = b[-1][0] + b[-1][1]

            def share(t0: float, t1: float, steps: list[tuple[float, float]] = a) -> float:
                """A's share of the card over [t0, t1) (ms): each step is 10 ms of work."""
                return sum(10 * max(0.0, min(t1, s + ms) - max(t0, s)) / ms for s, ms in steps if ms > 0) / (t1 - t0)

            found.append([share(ended + x, ended + x + 50) for x in range(-100, 400, 50)])
        finally:
            node.cleanup()
    return found


def floor_back(build, root: Path, repeats: int) -> list[float]:
    """Seconds until a newcomer's floor holds, three elastic notebooks bursting meanwhile."""
    found = []
    for rep in range(repeats):
        node = Node(build, root / f"floor{rep}", CUDA_DOUBLE_MEMORY_MIB=CARD_MIB)
        try:
            elastic = f"cores_percent={100 // NOTEBOOKS}\ncores_limit_percent=100"
            for i in range(NOTEBOOKS - 1):
                box = node.container(f"b{i}", f"name=b{i}\n{elastic}", node_regions=True)
                box.start("init", "ctx", "ready", f"util:0:30:{KERNEL_US}:kernel", wait_for="ready")
            time.sleep(1.5)  # they burst: the card is theirs
            newcomer = node.container("new", f"name=new\n{elastic}", node_regions=True)
            floor = 100 // NOTEBOOKS - CORES_POINTS
            r = newcomer.run("init", "ctx", f"floorback:3:{KERNEL_US}:{floor}", timeout=60)
            found.append(r.num("floorback", "back_ms") / 1000)
        finally:
            node.cleanup()
    return found


BIN_S = 0.001


def binned(o: Outcome) -> tuple[list[int], list[float]]:
    """The run in BIN_S bins: how many notebooks were in a cell, and the card's share their
    steps got (each step's work, 50 ms at the full card, spread evenly over its wall time)."""
    start, end = o.span
    n = max(1, round((end - start) / BIN_S))
    open_, rate = [0] * n, [0.0] * n

    def bins(a: float, b: float) -> range:
        return range(max(0, round((a - start) / BIN_S)), min(n, round((b - start) / BIN_S)))

    for _, a, b in o.cells:
        for j in bins(a, b):
            open_[j] += 1
    for _, a, ms in o.steps:
        r = STEP_MS / 1000 / ms if ms > 0 else 0.0
        for j in bins(a, a + ms):
            rate[j] += r
    return open_, rate


def by_cells_open(o: Outcome) -> dict[int, tuple[float, float]]:
    """Where the card's time went: for each number k of notebooks in a cell at once, how long
    that was (s) and the card's share the notebooks' steps got meanwhile. Ideal work-conserving
    sharing gives the card whole whenever k >= 1; fixed 25 % slices give k / 4."""
    open_, rate = binned(o)
    out: dict[int, tuple[float, float]] = {}
    for k in range(NOTEBOOKS + 1):
        js = [j for j in range(len(open_)) if open_[j] == k]
        if js:
            out[k] = (len(js) * BIN_S, sum(rate[j] for j in js) / len(js))
    return out


def where_it_goes(name: str, o: Outcome, elastic: bool) -> str:
    """One line: the card's share while k notebooks were in a cell, and the card-seconds lost
    against ideal sharing of those same moments (the whole card; k / 4 with fixed slices)."""
    parts, lost = [], 0.0
    for k, (secs, share) in sorted(by_cells_open(o).items()):
        if k:
            ideal = 1.0 if elastic else k / NOTEBOOKS
            lost += secs * max(0.0, ideal - share)
        parts.append(f"{k} in a cell {secs:.1f} s busy {share:.2f}")
    return f"{name:8} | " + ", ".join(parts) + f"; card-seconds lost against ideal sharing of these moments {lost:.2f}"


def lost_by_change(o: Outcome, elastic: bool, after_s: float = 0.25) -> str:
    """Where the card-seconds lost against ideal sharing were: within ``after_s`` of a cell
    beginning (the newcomer's and the others' shares moving), within ``after_s`` of a cell
    ending (the others' shares growing back: a slice counts as busy 200 ms after its last
    launch), or later (the limiter at a steady share)."""
    open_, rate = binned(o)
    start = o.span[0]
    events = sorted([(a, "began") for _, a, _ in o.cells] + [(b, "ended") for _, _, b in o.cells])
    lost = {"began": 0.0, "ended": 0.0, "later": 0.0}
    e, last = 0, (-math.inf, "later")
    for j in range(len(open_)):
        t = start + j * BIN_S
        while e < len(events) and events[e][0] <= t:
            last, e = events[e], e + 1
        if open_[j]:
            ideal = 1.0 if elastic else open_[j] / NOTEBOOKS
            lost[last[1] if t - last[0] < after_s else "later"] += BIN_S * max(0.0, ideal - rate[j])
    return (
        f"card-seconds lost, within {after_s:g} s of a cell beginning {lost['began']:.2f}, "
        f"of a cell ending {lost['ended']:.2f}, later {lost['later']:.2f}"
    )


def ideal_run(traces: list[list[Cell]], elastic: bool, seconds: float, dt: float = 0.001) -> tuple[float, float]:
    """The card's busy share and the median cell's slowdown vs alone that the same trace gives
    in a fluid model: fixed slices at 25 % each, or the card shared equally by the notebooks in
    a cell (ideal work-conserving sharing, no limiter, no sampling): what the measured figures
    compare with."""
    n = len(traces)
    at, left, wait, began = [0] * n, [0.0] * n, [0.0] * n, [0.0] * n
    work, t, slowdowns = 0.0, 0.0, []
    while t < seconds:
        for i in range(n):
            if left[i] <= 0 and at[i] < len(traces[i]):
                wait[i] -= dt
                if wait[i] <= 0:
                    left[i], began[i] = traces[i][at[i]].steps * STEP_MS / 1000, t
        busy = [i for i in range(n) if left[i] > 0]
        for i in busy:
            done = min(left[i], (1 / len(busy) if elastic else 1 / NOTEBOOKS) * dt)
            left[i] -= done
            work += done
            if left[i] <= 0:
                cell = traces[i][at[i]]
                slowdowns.append((t + dt - began[i]) / (cell.steps * STEP_MS / 1000))
                wait[i] = cell.think_ms / 1000
                at[i] += 1
        t += dt
    return work / seconds, statistics.median(slowdowns) if slowdowns else math.nan


@dataclass
class Reclaim:
    owner_ooms: int = 0
    waits: int = 0  # allocations within a request that waited for bursts to be given back
    wait_s: float = math.nan  # how long the late notebook's first allocation took


def reclaim(build, root: Path) -> Reclaim:
    """The late notebook: three elastic notebooks open, two of them run a memory-heavy cell of
    3 s of work (each 4 GiB past its request: with the third's 2.5 GiB, 15.5 of the card's
    16 GiB), and the fourth opens LATE_S later and allocates within its request, which their
    bursts hold: it waits until they are given back (here: when the bursting cells end)."""
    node = Node(build, root, CUDA_DOUBLE_MEMORY_MIB=CARD_MIB)
    try:
        go, procs = root / "go", []
        cell = [f"burst:{STEP_KERNELS}:{KERNEL_US}"] * BURST_CELL_STEPS
        for i in range(NOTEBOOKS):
            limits = (
                f"name=nb{i}\ncores_percent={100 // NOTEBOOKS}\nmemory_mib={REQUEST_MIB}"
                f"\ncores_limit_percent=100\nmemory_limit_mib={LIMIT_MIB}"
            )
            box = node.container(f"nb{i}", limits, node_regions=True)
            if i < 2:  # the bursters
                steps = [
                    "init",
                    "ctx",
                    "ready",
                    f"waitfile:{go}",
                    f"alloc:{BASE_MIB + CELL_MIB}M",
                    f"alloc:{BURST_MIB}M",
                    *cell,
                    "free",
                    "free",
                ]
            elif i < NOTEBOOKS - 1:  # open, within its request
                steps = ["init", "ctx", "ready", f"waitfile:{go}", f"alloc:{BASE_MIB + CELL_MIB}M", "sleep:6000"]
            else:  # opens late: a 1-kernel step stamps when it asks for its memory, the next when it got it
                steps = [
                    "ready",
                    f"waitfile:{go}",
                    f"sleep:{int(LATE_S * 1000)}",
                    "init",
                    "ctx",
                    f"burst:1:{KERNEL_US}",
                    f"alloc:{BASE_MIB + CELL_MIB}M",
                    f"burst:1:{KERNEL_US}",
                ]
            procs.append(box.start(*steps, wait_for="ready"))
        go.touch()
        found = Reclaim()
        for i, proc in enumerate(procs):
            out, err = proc.communicate(timeout=60)
            r = Result.parse(proc.returncode, out, err)
            rcs = r.rcs("alloc")
            found.owner_ooms += sum(rc == 2 for rc in rcs[:1])  # within the request; a burst may be refused
            found.waits += err.count("held by other slices' bursts")
            if i == NOTEBOOKS - 1 and len(r.all("burst")) == 2:
                asked = r.one("burst", 0)
                found.wait_s = (float(r.one("burst", 1)["at_ms"]) - float(asked["at_ms"]) - float(asked["ms"])) / 1000
        return found
    finally:
        node.cleanup()


def trace_shape(traces: list[list[Cell]]) -> str:
    """The trace's shape against the issue's model: cell and think lengths, and the cell:think
    ratio the model's figures imply (fixed 25 % caps busy 0.60: 4c / (4c + t) = 0.60, so
    c / t = 0.375; each notebook alone busy c / (c + t) = 0.27)."""
    cells = [c.steps * STEP_MS / 1000 for t in traces for c in t]
    thinks = [c.think_ms / 1000 for t in traces for c in t]
    ratio = statistics.mean(cells) / statistics.mean(thinks)
    return (
        f"trace: {len(cells)} cells, cell p50 {statistics.median(cells):.2f} s mean {statistics.mean(cells):.2f} s "
        f"(at the full card), think p50 {statistics.median(thinks):.2f} s mean {statistics.mean(thinks):.2f} s, "
        f"cell:think {ratio:.3f} (one notebook alone busy {ratio / (1 + ratio):.2f}); the issue's model "
        f"(fixed 0.60, work-conserving 0.875) implies cell:think 0.375 (alone busy 0.27)"
    )


def steady_state(ratio: float) -> tuple[float, float]:
    """The card's busy share in the long run at a cell:think ratio (mean cell at the full card
    over mean think): fixed 25 % slices 4r / (4r + 1); ideal sharing (the card split evenly among
    the notebooks in a cell, the next cell a think time after the last ended) is the closed
    "machine repairman" queue with a processor-sharing server, busy 1 - P(no cell), P(n cells)
    proportional to N! / (N - n)! r^n, whatever the lengths' distributions (the product form is
    insensitive to them: BCMP, Baskett et al. 1975)."""
    weights = [math.factorial(NOTEBOOKS) / math.factorial(NOTEBOOKS - n) * ratio**n for n in range(NOTEBOOKS + 1)]
    return NOTEBOOKS * ratio / (NOTEBOOKS * ratio + 1), 1 - 1 / sum(weights)


def steady_state_line(traces: list[list[Cell]]) -> str:
    cells = [c.steps * STEP_MS / 1000 for t in traces for c in t]
    r = statistics.mean(cells) / statistics.mean(c.think_ms / 1000 for t in traces for c in t)
    fixed, ideal = steady_state(r)
    best = max(steady_state(x / 1000)[1] / steady_state(x / 1000)[0] for x in range(10, 3000))
    model_fixed, model_ideal = steady_state(0.375)
    return (
        f"ideal sharing in the long run (closed queue, {NOTEBOOKS} notebooks): at this trace's cell:think {r:.3f} "
        f"{fixed:.3f} fixed, {ideal:.3f} ideal (ratio {ideal / fixed:.2f}); at the issue's 0.375 {model_fixed:.3f} "
        f"fixed, {model_ideal:.3f} ideal (ratio {model_ideal / model_fixed:.2f}); "
        f"at any cell:think at most {best:.2f}"
    )


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


def traces_of(seed: int, seconds: float) -> list[list[Cell]]:
    """One trace per notebook, each from its own generator: a longer run's trace begins with a
    shorter one's (the long-run check below continues the same trace)."""
    return [trace(random.Random(seed * 1000 + i), seconds) for i in range(NOTEBOOKS)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=SECONDS, help=f"length of each steady run ({SECONDS:g})")
    parser.add_argument("--seed", type=int, default=7, help="the trace's random seed (7)")
    parser.add_argument(
        "--floor-repeats",
        type=int,
        default=FLOOR_REPEATS,
        help=f"newcomers timed for floor_back_p95_s ({FLOOR_REPEATS}; 0: none)",
    )
    args = parser.parse_args(argv)
    traces = traces_of(args.seed, args.seconds)
    with tempfile.TemporaryDirectory(prefix="bench-elastic-") as tmp:
        build = build_all(Path(tmp) / "build")
        fixed, elastic = run_modes(build, Path(tmp), traces, args.seconds)
        late = reclaim(build, Path(tmp) / "reclaim")
        handoffs = handoff(build, Path(tmp), HANDOFF_REPEATS)
        floors = floor_back(build, Path(tmp), args.floor_repeats)
    assert fixed.slowdowns is not None and elastic.slowdowns is not None
    busy_fixed = fixed.work_ms / 1000 / args.seconds
    busy_elastic = elastic.work_ms / 1000 / args.seconds
    print(f"four notebooks, one card, steady trace, {args.seconds:g} s each run (NVML double sampling every 167 ms)")
    print(
        f"{'':8} | {'card busy':>9} | {'cells':>5} | {'slowdown p50':>12} | {'p90':>5} | "
        f"{'owner OOMs':>10} | {'reclaim waits':>13} | {'burst refused':>13}"
    )
    for name, o, busy in (("fixed", fixed, busy_fixed), ("elastic", elastic, busy_elastic)):
        assert o.slowdowns is not None
        s = sorted(o.slowdowns) or [float("nan")]
        print(
            f"{name:8} | {busy:9.3f} | {len(o.slowdowns):5d} | {statistics.median(s):12.2f} | "
            f"{s[int(0.9 * (len(s) - 1))]:5.2f} | {o.owner_ooms:10d} | {o.reclaim_waits:13d} | "
            f"{o.burst_refused:13d}"
        )
    (model_fixed, slow_fixed), (model_elastic, slow_elastic) = (
        ideal_run(traces, e, args.seconds) for e in (False, True)
    )
    print(
        f"the same trace in a fluid model (no limiter): card busy {model_fixed:.3f} fixed, "
        f"{model_elastic:.3f} ideal work-conserving (work ratio {model_elastic / model_fixed:.2f}); "
        f"measured over ideal: fixed {busy_fixed / model_fixed:.2f}, elastic {busy_elastic / model_elastic:.2f}; "
        f"median cell slowdown {slow_fixed:.2f} fixed, {slow_elastic:.2f} ideal"
    )
    long_s = 10 * args.seconds
    long = traces_of(args.seed, long_s)
    (long_fixed, _), (long_elastic, _) = (ideal_run(long, e, long_s, 0.002) for e in (False, True))
    print(
        f"the same trace continued to {long_s:g} s in the fluid model: {long_fixed:.3f} fixed, {long_elastic:.3f} "
        f"ideal (ratio {long_elastic / long_fixed:.2f}: the {args.seconds:g} s run's ideal is "
        f"{(model_elastic / model_fixed) / (long_elastic / long_fixed) - 1:+.1%} off its long-run value)"
    )
    print(trace_shape(traces))
    print(steady_state_line(traces))
    print("where the card's time went, by the number of notebooks in a cell at once (measured):")
    print(where_it_goes("fixed", fixed, False))
    print(where_it_goes("elastic", elastic, True))
    print(f"elastic  | {lost_by_change(elastic, True)}")
    for shares in handoffs:
        print(
            "handoff: a bursting notebook's share in 50 ms bins from 100 ms before its neighbour's cell ended: "
            + " ".join(f"{x:.2f}" for x in shares)
        )
    print(
        f"reclaim: a notebook opening {LATE_S:g} s after two others burst into its guaranteed memory waited "
        f"{late.wait_s:.2f} s for it ({late.waits} reclaim waits, {late.owner_ooms} owner OOMs)"
    )
    print(f"floor back (s), {len(floors)} newcomers: " + " ".join(f"{f:.2f}" for f in floors))
    print(
        f"elastic work_ratio={busy_elastic / busy_fixed:.2f} "
        f"slowdown_p50_fixed={statistics.median(fixed.slowdowns):.2f} "
        f"slowdown_p50_elastic={statistics.median(elastic.slowdowns):.2f} "
        f"floor_back_p95_s={p95(floors) if floors else math.nan:.2f} "
        f"owner_ooms={fixed.owner_ooms + elastic.owner_ooms + late.owner_ooms} "
        f"ideal_work_ratio={model_elastic / model_fixed:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
