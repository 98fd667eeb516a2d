"""SVG charts for admins, written by hand (no plotting library): stacked GPU-hours over time by
group, GPUs needed over time from a capacity plan, GPUs and waits per simulated scenario."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from xml.sax.saxutils import escape

from .capacity import CapacityPlan
from .record import UsageRecord
from .replay import ScenarioResult
from .report import Report, parse_group, usage_report

PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f")
WIDTH, HEIGHT, LEFT, RIGHT, TOP, BOTTOM = 900, 420, 70, 190, 40, 50
_STEPS = (3600, 3 * 3600, 6 * 3600, 12 * 3600, 86400, 7 * 86400, 30 * 86400)


def _num(value: float) -> str:
    return f"{value:.2g}" if 0 < value < 0.01 else f"{value:.2f}"


def _bucket_seconds(span: float, max_buckets: int) -> int:
    for step in _STEPS:
        if span / step <= max_buckets:
            return step
    return int(math.ceil(span / max_buckets))


def _nice_max(value: float) -> float:
    if value <= 0:
        return 1.0
    exp = 10 ** math.floor(math.log10(value))
    for m in (1, 2, 2.5, 5, 10):
        if value <= m * exp:
            return m * exp
    return 10 * exp


def _label(t: float, step: int) -> str:
    d = datetime.fromtimestamp(t, timezone.utc)
    return d.strftime("%m-%d") if step >= 86400 else d.strftime("%m-%d %H:%M")


def _frame(title: str, y_label: str, y_max: float, start: float, end: float, step: int) -> list[str]:
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="11">',
        f"<title>{escape(title)}</title>",
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="{LEFT}" y="22" font-size="14" font-weight="bold">{escape(title)}</text>',
        f'<text x="16" y="{TOP + plot_h / 2}" transform="rotate(-90 16 {TOP + plot_h / 2})" '
        f'text-anchor="middle">{escape(y_label)}</text>',
    ]
    for i in range(5):
        v = y_max * i / 4
        y = TOP + plot_h - plot_h * i / 4
        out.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{v:g}</text>')
    n_ticks = min(8, max(1, int((end - start) // step)))
    for i in range(n_ticks + 1):
        t = start + (end - start) * i / n_ticks
        x = LEFT + plot_w * i / n_ticks
        out.append(f'<text x="{x:.1f}" y="{TOP + plot_h + 16}" text-anchor="middle">{_label(t, step)}</text>')
    out.append(f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 8}" text-anchor="middle">time (UTC)</text>')
    return out


def _legend(names: Sequence[str]) -> list[str]:
    out = []
    for i, name in enumerate(names):
        y = TOP + 16 * i
        x = WIDTH - RIGHT + 14
        out.append(f'<rect x="{x}" y="{y}" width="10" height="10" fill="{PALETTE[i % len(PALETTE)]}"/>')
        out.append(f'<text x="{x + 16}" y="{y + 9}">{escape(name[:26])}</text>')
    return out


def usage_svg(
    records: Iterable[UsageRecord],
    start: float,
    end: float,
    by: str | Sequence[str] = "user",
    *,
    now: float | None = None,
    max_buckets: int = 48,
    max_groups: int = 8,
) -> str:
    """Stacked bars of GPU-hours (card-equivalents) per time bucket, one colour per group
    (the ``max_groups`` largest; the rest as 'other')."""
    records = list(records)
    keys = parse_group(by)
    step = _bucket_seconds(end - start, max_buckets)
    count = int(math.ceil((end - start) / step))
    edges = [start + i * step for i in range(count)] + [end]
    buckets = []
    totals: dict[str, float] = {}
    for a, b in zip(edges, edges[1:], strict=False):
        rows = usage_report(records, a, b, keys, now=now).rows if b > a else []
        values = {"/".join(str(r[k]) for k in keys) or "all": r["gpu_hours"] for r in rows}
        for name, v in values.items():
            totals[name] = totals.get(name, 0.0) + v
        buckets.append((a, b, values))
    top = sorted(totals, key=lambda n: -totals[n])[:max_groups]
    names = top + (["other"] if len(totals) > len(top) else [])
    stacks = []
    for a, b, values in buckets:
        stack = [values.get(n, 0.0) for n in top]
        if "other" in names:
            stack.append(sum(v for n, v in values.items() if n not in top))
        stacks.append((a, b, stack))
    top_bar = max((sum(s) for _, _, s in stacks), default=0.0)
    unit = "GPU-hours"  # the unit of the report beside it, however small the bars (no switch to seconds)
    y_max = _nice_max(top_bar)
    hours = step / 3600
    out = _frame(
        f"{unit} by {', '.join(keys) or 'total'} ({hours:g} h bars)",
        f"{unit} (card-equivalents)",
        y_max,
        start,
        end,
        step,
    )
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    for a, b, stack in stacks:
        x = LEFT + plot_w * (a - start) / (end - start)
        w = max(1.0, plot_w * (b - a) / (end - start) - 1)
        base = 0.0
        for i, v in enumerate(stack):
            if v <= 0:
                continue
            h = plot_h * v / y_max
            y = TOP + plot_h - plot_h * base / y_max - h
            out.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{PALETTE[i % len(PALETTE)]}">'
                f"<title>{escape(names[i])}: {_num(v)} {unit}</title></rect>"
            )
            base += v
    out += _legend(names)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def capacity_svg(plan: CapacityPlan) -> str:
    """GPUs needed over time at the plan's slice size, with its peak and percentile lines."""
    start, end = plan.start, plan.end
    step = _bucket_seconds(end - start, 48)
    y_max = _nice_max(max(plan.gpus_needed_peak, 1))
    out = _frame(f"GPUs needed at {plan.slices_per_gpu} slices per GPU", "GPUs needed", y_max, start, end, step)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def xy(t: float, g: float) -> str:
        return f"{LEFT + plot_w * (t - start) / (end - start):.1f},{TOP + plot_h - plot_h * g / y_max:.1f}"

    points, g = [xy(start, 0)], 0
    for t, gpus in plan.timeline:
        points += [xy(t, g), xy(t, gpus)]
        g = gpus
    points.append(xy(end, g))
    out.append(f'<polyline fill="none" stroke="{PALETTE[0]}" stroke-width="1.5" points="{" ".join(points)}"/>')
    lines = [(f"peak {plan.gpus_needed_peak}", plan.gpus_needed_peak, PALETTE[3])]
    lines.append((f"p{plan.percentile:g} {plan.gpus_needed_percentile}", plan.gpus_needed_percentile, PALETTE[2]))
    for _text, value, colour in lines:
        y = TOP + plot_h - plot_h * value / y_max
        out.append(
            f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{y:.1f}" y2="{y:.1f}" '
            f'stroke="{colour}" stroke-dasharray="4 3"/>'
        )
    out += [
        f'<rect x="{WIDTH - RIGHT + 14}" y="{TOP + 16 * i}" width="10" height="10" fill="{c}"/>'
        f'<text x="{WIDTH - RIGHT + 30}" y="{TOP + 16 * i + 9}">{escape(t)}</text>'
        for i, (t, _, c) in enumerate([("GPUs needed", 0, PALETTE[0]), *lines])
    ]
    out.append("</svg>")
    return "\n".join(out) + "\n"


def held_busy_svg(report: Report, max_rows: int = 15) -> str:
    """Horizontal bars per group: GPU-hours held, split into busy, idle (waste) and unmetered."""
    rows = sorted(report.rows, key=lambda r: -r["gpu_hours"])[:max_rows]
    label_w, bar_w, row_h = 180, 520, 22
    height = 50 + row_h * max(1, len(rows))
    top = max((r["gpu_hours"] for r in rows), default=0.0)
    scale = bar_w / top if top > 0 else 0.0
    parts = (("busy_gpu_hours", "busy", PALETTE[2]), ("idle_gpu_hours", "idle", PALETTE[1]))
    parts += (("unmetered_gpu_hours", "unmetered", "#bab0ac"),)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="egpu-held-busy" width="{label_w + bar_w + 160}" '
        f'height="{height}" font-family="sans-serif" font-size="11">',
        "<title>GPU-hours held: busy, idle and unmetered</title>",
    ]
    for i, (_, name, colour) in enumerate(parts):
        x = label_w + 110 * i
        out.append(f'<rect x="{x}" y="6" width="10" height="10" fill="{colour}"/>')
        out.append(f'<text x="{x + 14}" y="15">{name}</text>')
    for i, row in enumerate(rows):
        y = 30 + row_h * i
        name = "/".join(str(row[k]) for k in report.by) or "all"
        out.append(f'<text x="{label_w - 6}" y="{y + 13}" text-anchor="end">{escape(name[:28])}</text>')
        x = float(label_w)
        for key, part, colour in parts:
            w = row[key] * scale
            if w > 0:
                out.append(
                    f'<rect class="egpu-{part}" x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row_h - 6}" '
                    f'fill="{colour}"><title>{escape(name)}: {_num(row[key])} GPU-hours {part}</title></rect>'
                )
                x += w
        out.append(f'<text x="{x + 6:.1f}" y="{y + 13}">{_num(row["gpu_hours"])}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def scenarios_svg(results: Sequence[ScenarioResult], model: str = "") -> str:
    """Horizontal bars per scenario: the GPUs needed (or the fixed pool), labelled with the wait there."""
    label_w, bar_w, row_h = 220, 460, 26
    height = 56 + row_h * max(1, len(results))
    top = max((r.gpus or max(r.tried, default=0) for r in results), default=0)
    scale = bar_w / top if top > 0 else 0.0
    title = f"GPUs{' (' + model + ')' if model else ''} per scenario, and the wait there"
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="egpu-scenarios" width="{label_w + bar_w + 260}" '
        f'height="{height}" font-family="sans-serif" font-size="11">',
        f"<title>{escape(title)}</title>",
        f'<rect width="{label_w + bar_w + 260}" height="{height}" fill="white"/>',
        f'<text x="10" y="20" font-size="14" font-weight="bold">{escape(title)}</text>',
    ]
    for i, r in enumerate(results):
        y = 36 + row_h * i
        fixed = r.scenario.gpus is not None
        gpus = r.gpus if r.gpus is not None else max(r.tried, default=0)
        colour = PALETTE[1] if fixed else PALETTE[0] if r.gpus is not None else "#bab0ac"
        wait = "never served" if not math.isfinite(r.wait) else f"{r.wait:.0f} s"
        if r.gpus is None:
            text = f"more than {gpus} GPUs"
        elif fixed:
            text = f"{gpus} GPUs (fixed): p{r.percentile:g} wait {wait}"
        else:
            text = f"{gpus} GPUs: p{r.percentile:g} wait {wait}"
        out.append(f'<text x="{label_w - 6}" y="{y + 15}" text-anchor="end">{escape(r.scenario.name[:32])}</text>')
        out.append(
            f'<rect class="egpu-scenario" x="{label_w}" y="{y}" width="{gpus * scale:.1f}" height="{row_h - 8}" '
            f'fill="{colour}"><title>{escape(r.sentence())}</title></rect>'
        )
        out.append(f'<text x="{label_w + gpus * scale + 6:.1f}" y="{y + 15}">{escape(text)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
