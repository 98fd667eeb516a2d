"""Capacity planning from the recorded history: how many GPUs the observed demand needs at a
given slice size (pure).

Every recorded session is replayed as demand at its own times. At slice size ``X`` (a fraction
of one card) a session that held ``count`` GPUs at share ``s`` needs ``count x ceil(s / X)``
slices of size X (at least one each: a session never shares its slice), and a card holds
``floor(1 / X)`` slices. The GPUs needed at an instant are ``ceil(slices in use / slices per
card)`` (slices are interchangeable across cards: no node boundaries, no waiting). The answer
gives the peak, a time-weighted percentile (p95: the demand is served without waiting 95 %
of the time) and the mean, beside what the sessions held as they asked (``gpus_held_peak``,
card-equivalents) and how many distinct cards they used.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Any

from .record import UsageRecord
from .report import ReportError, iso

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(GiB|MiB|%)?\s*$", re.IGNORECASE)


def parse_slice(text: str | float, card_memory_mib: int = 0) -> float:
    """A slice size as a fraction of one card: ``1/4``, ``0.25``, ``25%``, or ``20GiB`` / ``20480MiB``
    (memory: needs ``card_memory_mib``)."""
    value = str(text).strip()
    fraction: float | None = None
    if "/" in value:
        try:
            fraction = float(Fraction(value))
        except (ValueError, ZeroDivisionError):
            fraction = None
    else:
        m = _SIZE.match(value)
        if m:
            number, unit = float(m.group(1)), (m.group(2) or "").lower()
            if unit == "%":
                fraction = number / 100
            elif unit in ("gib", "mib"):
                if card_memory_mib <= 0:
                    raise ReportError(
                        f"slice size {value!r} is memory, but the card's memory is unknown: "
                        "give the size as a fraction (1/4, 0.25, 25%) or choose a GPU model."
                    )
                fraction = number * (1024 if unit == "gib" else 1) / card_memory_mib
            else:
                fraction = number
    if fraction is None or not 0 < fraction <= 1:
        raise ReportError(
            f"slice size {value!r} is not a share of one card: use 1/4, 0.25, 25% or a memory size such as "
            "20GiB (at most the whole card)."
        )
    return fraction


@dataclass
class CapacityPlan:
    start: float
    end: float
    slice_fraction: float
    slices_per_gpu: int
    percentile: float
    sessions: int
    gpus_needed_peak: int
    gpus_needed_percentile: int
    gpus_needed_mean: float
    slices_peak: int
    gpus_held_peak: float
    gpus_used: int
    model: str = ""
    #: (time, GPUs needed from then on) at every change, for the plot
    timeline: list[tuple[float, int]] = field(default_factory=list)

    def to_dict(self, timeline: bool = False) -> dict[str, Any]:
        data = asdict(self)
        data["from"], data["to"] = iso(self.start), iso(self.end)
        if not timeline:
            del data["timeline"]
        return data

    def sentence(self) -> str:
        return (
            f"At slice size {Fraction(self.slice_fraction).limit_denominator(64)} of a card "
            f"({self.slices_per_gpu} per GPU), the {self.sessions} sessions from {iso(self.start)} to "
            f"{iso(self.end)}{' on ' + self.model if self.model else ''} need {self.gpus_needed_peak} GPUs at "
            f"their peak and {self.gpus_needed_percentile} GPUs to be served without waiting "
            f"{self.percentile:g} % of the time (mean {self.gpus_needed_mean:.1f}); as they asked, they held "
            f"at most {self.gpus_held_peak:.2f} card-equivalents on {self.gpus_used} distinct GPUs."
        )


def plan_capacity(
    records: Iterable[UsageRecord],
    start: float,
    end: float,
    slice_fraction: float,
    *,
    now: float | None = None,
    percentile: float = 95.0,
    model: str = "",
) -> CapacityPlan:
    """GPUs needed for the recorded demand in [start, end) at ``slice_fraction`` (module docstring)."""
    if not end > start:
        raise ReportError(f"the period must end after it starts; got from {iso(start)} to {iso(end)}.")
    if not 0 < percentile <= 100:
        raise ReportError(f"percentile must be in (0, 100]; got {percentile!r}.")
    if not 0 < slice_fraction <= 1:
        raise ReportError(f"slice size must be a share of one card in (0, 1]; got {slice_fraction!r}.")
    now = end if now is None else now
    per_gpu = max(1, math.floor(1 / slice_fraction + 1e-9))
    changes: dict[float, list[float]] = {}  # time -> [delta slices, delta card-equivalents]
    sessions, uuids = 0, set()
    for r in records:
        if model and r.gpu_model != model:
            continue
        t0, t1 = max(start, r.granted_at), min(end, r.end(now))
        if t1 <= t0:
            continue
        sessions += 1
        uuids.update(u for u in r.gpu_uuids.split(",") if u)
        slices = r.count * max(1, math.ceil(r.share / slice_fraction - 1e-9))
        held = r.count * r.share
        for t, sign in ((t0, 1), (t1, -1)):
            delta = changes.setdefault(t, [0, 0.0])
            delta[0] += sign * slices
            delta[1] += sign * held
    timeline: list[tuple[float, int]] = []
    durations: dict[int, float] = {}
    slices = peak_slices = 0
    held = peak_held = 0.0
    last = start
    gpus = 0
    for t in sorted(changes):
        if t > last:
            durations[gpus] = durations.get(gpus, 0.0) + (t - last)
        slices += int(changes[t][0])
        held += changes[t][1]
        peak_slices, peak_held = max(peak_slices, slices), max(peak_held, held)
        gpus = math.ceil(slices / per_gpu)
        if not timeline or timeline[-1][1] != gpus:
            timeline.append((t, gpus))
        last = t
    if end > last:
        durations[gpus] = durations.get(gpus, 0.0) + (end - last)
    total = end - start
    mean = sum(g * d for g, d in durations.items()) / total
    covered, at_percentile = 0.0, 0
    for g in sorted(durations):
        covered += durations[g]
        at_percentile = g
        if covered >= total * percentile / 100 - 1e-9:
            break
    return CapacityPlan(
        start=start,
        end=end,
        slice_fraction=slice_fraction,
        slices_per_gpu=per_gpu,
        percentile=percentile,
        sessions=sessions,
        gpus_needed_peak=max(durations, default=0) if durations else 0,
        gpus_needed_percentile=at_percentile,
        gpus_needed_mean=mean,
        slices_peak=peak_slices,
        gpus_held_peak=peak_held,
        gpus_used=len(uuids),
        model=model,
        timeline=timeline,
    )
