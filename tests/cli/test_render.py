"""`elastic-gpu quota` and `status` in the terminal: the quota table's columns line up whatever the names."""

from __future__ import annotations

import re

from hubext.cli.render import render_quota


def assert_columns_line_up(text: str) -> None:
    """Every row of `elastic-gpu quota`'s table has its 'used / limit' slashes where the others have
    them, under the header's column names, and the rule is as wide as the widest row."""
    lines = text.splitlines()
    header_at = next(i for i, line in enumerate(lines) if line.startswith("workspace / namespace / user"))
    header, rule, rows = lines[header_at], lines[header_at + 1], lines[header_at + 2 :]
    assert rows and set(rule) == {"-"}, text
    slashes = [[m.start() for m in re.finditer(" / ", row)] for row in rows]
    assert all(len(s) == 3 for s in slashes), text
    assert all(s == slashes[0] for s in slashes), f"the columns do not line up:\n{text}"
    starts = [header.index(name) for name in ("memory", "compute", "slices")]
    for i, slash in enumerate(slashes[0]):
        assert starts[i] <= slash + 1, f"column {i + 1} starts left of its header:\n{text}"
        if i + 1 < len(starts):
            assert slash < starts[i + 1], f"column {i + 1} runs into the next one:\n{text}"
    assert len(rule) >= max(len(row) for row in rows), text


def level(name: str, used: tuple[int, int, int], limits: tuple[int | None, int | None, int | None]) -> dict:
    keys = ("memory_mib", "cores_percent", "gpus")
    return {"name": name, "used": dict(zip(keys, used, strict=True)), "limits": dict(zip(keys, limits, strict=True))}


def test_quota_columns_line_up_with_long_names_and_unlimited_limits():
    users = [
        level("a-user-with-a-name-longer-than-the-label-column", (0, 0, 0), (81920, None, 4)),
        level("bob", (20480, 25, 1), (30720, 100, 4)),
        level("boss", (163840, 800, 12), (163840, None, None)),
    ]
    namespace = {**level("default", (184320, 825, 13), (None, None, None)), "users": users}
    workspace = {**level("vision-team-workspace", (184320, 825, 13), (163840, None, None)), "namespaces": [namespace]}
    text = render_quota({"workspaces": [workspace]}, "from a test")
    assert_columns_line_up(text)
    assert re.search(r"^    bob\s+20 GiB / 30 GiB\s+25 % / 100 %\s+1 / 4$", text, re.M), text
    assert re.search(r"^    boss\s+160 GiB / 160 GiB\s+800 % / unlimited\s+12 / unlimited$", text, re.M), text
