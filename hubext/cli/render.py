"""Terminal rendering of the pool and quota views (the API's JSON): bars and aligned tables."""

from __future__ import annotations

from typing import Any

from quotas.messages import mib, plural


def asked_size(q: dict[str, Any]) -> str:
    """A waiting request's size: '2 × 10 GiB, 25 %', or '1 whole GPU' (a whole card has no slice size)."""
    if q.get("whole"):
        return plural(q["count"], "whole GPU")
    return f"{q['count']} × {mib(q['memory_mib'])}, {q['cores_percent']} %"


def bar(used: float, total: float, width: int = 20) -> str:
    filled = 0 if not total else min(width, round(width * used / total))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def render_pool(view: dict[str, Any], origin: str) -> str:
    out = [f"GPU pool — {origin}"]
    if view.get("simulated"):
        out.append("SIMULATED GPUs: no real GPU is used; allocations and quotas are real.")
    t = view["totals"]
    out.append(
        f"{t['gpus']} GPU(s), {mib(t['used_memory_mib'])} of {mib(t['memory_mib'])} allocated "
        f"in {t['slices']} slice(s)"
    )
    for node in view["nodes"]:
        for g in node["gpus"]:
            out.append("")
            out.append(f"{node['name']}  GPU {g['index']}  {g['model']}  {g['uuid']}")
            if g.get("out_of_service"):  # a fatal Xid: no new slice goes there (docs/node-agent.md)
                out.append(f"  {g['out_of_service']}")
            util = g.get("utilization_percent")
            activity = (
                f"{util} % busy"
                if util is not None
                else ("not measured (simulated)" if view.get("simulated") else "not measured")
            )
            out.append(
                f"  memory  {bar(g['used_memory_mib'], g['capacity_memory_mib'])} "
                f"{mib(g['used_memory_mib'])} / {mib(g['capacity_memory_mib'])}   "
                f"compute {bar(g['used_cores_percent'], g['capacity_cores_percent'], 10)} "
                f"{g['used_cores_percent']} / {g['capacity_cores_percent']} %   activity: {activity}"
            )
            if not g["slices"]:
                out.append("  (no slices)")
            for s in g["slices"]:
                age = f"{s['age_seconds'] // 60} min" if s.get("age_seconds") is not None else ""
                flags = " borrowed" if s.get("borrowed") else ""
                out.append(
                    f"  {s['user']:<14} {s['kind']:<8} {mib(s['memory_mib']):>9} {s['cores_percent']:>4} %  "
                    f"{s['workspace']}/{s['namespace']}  {s['priority_class']}{flags}  {age}  {s['allocation_id']}"
                )
                # an elastic slice's limit and any slice's memory in use, on a line of their own
                if s.get("elastic") or s.get("in_use_text"):
                    parts = [f"memory {s['memory_text']}", f"compute {s['cores_text']}"] if s.get("elastic") else []
                    parts += [s["in_use_text"]] if s.get("in_use_text") else []
                    out.append(f"  {'':<14} {'':<8} {'; '.join(parts)}")
    out.append("")
    swapped = view.get("swapped") or []
    if swapped:
        out.append("Swapped out (host memory held, no slice):")
        for k in swapped:
            cull = f"culled at {k['cull_at_utc']}" if k.get("cull_at_utc") else "no cull time set by the culler"
            out.append(
                f"  {k['user']:<14} server {k['server_name'] or 'default'}  kernel {k['kernel_id'] or k['id']}  "
                f"{mib(k['memory_mib'])} slice  {mib(k['host_mib'])} in host memory since "
                f"{k['since_utc']}, {cull}{'  (resuming)' if k.get('state') == 'queued' else ''}"
            )
        out.append("")
    if view.get("queue"):
        out.append("Queue:")
        for i, q in enumerate(view["queue"], 1):
            out.append(
                f"  {i}. {q['user']} ({q['workspace']}): {asked_size(q)} — waiting {q['waiting_seconds']:.0f} s: "
                f"{q['reason']}"
            )
    else:
        out.append("Queue: empty")
    for e in view.get("events") or []:
        out.append(f"{str(e.get('kind') or 'event').capitalize()}: {e['user']} ({e['allocation_id']}): {e['reason']}")
    return "\n".join(out)


def used_of_limit_table(headers: list[str], rows: list[tuple[str, list[tuple[str, str]]]]) -> list[str]:
    """A table whose first column is a label and whose other columns are 'used / limit' pairs.

    Widths come from the content, so long names and numbers never push a column out of line:
    'used' is right-aligned and 'limit' left-aligned around a slash at the same place on every row.
    """
    label_width = max([len(headers[0])] + [len(label) for label, _ in rows])
    columns = len(headers) - 1
    used_w = [max([0] + [len(cells[i][0]) for _, cells in rows]) for i in range(columns)]
    limit_w = [max([0] + [len(cells[i][1]) for _, cells in rows]) for i in range(columns)]
    widths = [max(len(headers[i + 1]), used_w[i] + 3 + limit_w[i]) for i in range(columns)]

    def cell(i: int, used: str, limit: str) -> str:
        text = f"{used:>{used_w[i]}} / {limit:<{limit_w[i]}}"
        return f"{text:<{widths[i]}}"

    head = f"{headers[0]:<{label_width}}" + "".join(f"   {h:<{widths[i]}}" for i, h in enumerate(headers[1:]))
    lines = [head.rstrip()]
    body = [
        (f"{label:<{label_width}}" + "".join(f"   {cell(i, *c)}" for i, c in enumerate(cells))).rstrip()
        for label, cells in rows
    ]
    lines.append("-" * max(len(line) for line in [head.rstrip()] + body))
    return lines + body


def render_quota(view: dict[str, Any], origin: str) -> str:
    def limit(v: int | None, fmt: Any) -> str:
        return "unlimited" if v is None else fmt(v)

    def cells(level: dict[str, Any]) -> list[tuple[str, str]]:
        u, lim = level["used"], level["limits"]
        return [
            (mib(u["memory_mib"]), limit(lim["memory_mib"], mib)),
            (f"{u['cores_percent']} %", limit(lim["cores_percent"], lambda v: f"{v} %")),
            (str(u["gpus"]), limit(lim["gpus"], str)),
        ]

    rows: list[tuple[str, list[tuple[str, str]]]] = []
    for ws in view["workspaces"]:
        rows.append((ws["name"], cells(ws)))
        for ns in ws["namespaces"]:
            rows.append((f"  {ns['name']}", cells(ns)))
            for user in ns["users"]:
                rows.append((f"    {user['name']}", cells(user)))
    table = used_of_limit_table(["workspace / namespace / user", "memory", "compute", "slices"], rows)
    return "\n".join([f"GPU quota use — {origin}", ""] + table)
