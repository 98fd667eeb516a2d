"""The culler's words: durations, sizes and the reason a kernel is reclaimed, as users read them."""

from __future__ import annotations

import time

from quotas.messages import mib

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


def gib(size_mib: int) -> str:
    """A size as every message of the hub writes it (quotas.messages.mib)."""
    return mib(size_mib)
