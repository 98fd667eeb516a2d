"""The culler's words: durations, sizes and the reason a kernel is reclaimed, as users read them."""

from __future__ import annotations

import time

from .model import Verdict


def cull_sentence(v: Verdict) -> str:
    if v.reason == "pressure":
        return f"idle {human(v.idle_seconds)} while GPU requests are waiting ({v.detail})"
    if v.reason == "max-age":
        return f"reached its maximum age of {human(time.time() - v.kernel.created_at)}"
    if v.reason == "orphan":
        return f"its server is gone or does not know it, and its GPU was idle for {human(v.idle_seconds)}"
    return f"idle for {human(v.idle_seconds)} on both Jupyter and GPU"


def human(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds / 3600:.1f} h"


def gib(mib: int) -> str:
    return f"{mib / 1024:.1f} GiB" if mib >= 1024 else f"{mib} MiB"
