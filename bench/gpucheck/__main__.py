"""Runs the claim table on this machine's GPU, or on the doubles (``--doubles``); see the package
docstring."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from .claims import CLAIMS, Claim, NotModelled, Target

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

NO_GPU = "gpu-check: skipped: no NVIDIA GPU on this machine (nvidia-smi is missing or lists no GPU)"
#: a claim is not started with less time than this left before the deadline
CLAIM_RESERVE_S = 20
#: claims that measure CPU time per call run alone, after the others (doubles run the rest at once)
ALONE = {"launch_overhead"}


def gpu_present() -> bool:
    if not shutil.which("nvidia-smi"):
        return False
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _text(value: object) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    text = str(value)
    return json.dumps(text) if " " in text or not text else text


class Report:
    """Prints each claim's line (and appends it to $OUT/gpu-check.txt when $OUT is set)."""

    def __init__(self) -> None:
        out = os.environ.get("OUT")
        self.file = Path(out) / "gpu-check.txt" if out else None
        self.counts = {"ok": 0, "FAIL": 0, "skipped": 0}

    def line(self, text: str) -> None:
        print(text, flush=True)
        if self.file:
            with self.file.open("a") as f:
                f.write(text + "\n")

    def claim(self, name: str, verdict: str, figures: dict[str, object]) -> None:
        self.counts[verdict] += 1
        words = " ".join(f"{k}={_text(v)}" for k, v in figures.items())
        self.line(f"gpu {name} {verdict} {words}".rstrip())


def run_one(target: Target, claim: Claim, pidns: bool) -> tuple[str, dict[str, object]]:
    started = time.monotonic()
    try:
        if pidns:
            why = target.pidns_unavailable()
            if why:
                return "FAIL", {"error": f"no pid namespace: {why}"}
        ok, figures = claim.check(target, pidns)
    except NotModelled as exc:
        return "skipped", {**exc.figures, "why": str(exc)}
    except Exception as exc:  # noqa: BLE001 - a claim that crashed is a failed claim, said on its line
        return "FAIL", {"error": f"{type(exc).__name__}:{str(exc)[-300:]}"}
    return ("ok" if ok else "FAIL"), {**figures, "s": round(time.monotonic() - started, 1)}


def rows(only: set[str] | None) -> list[tuple[str, Claim, bool]]:
    found = []
    for claim in CLAIMS:
        for pidns in (False, True) if claim.pidns else (False,):
            name = claim.name + ("_pidns" if pidns else "")
            if not only or name in only or claim.name in only:
                found.append((name, claim, pidns))
    return found


def run_all(target: Target, table: list[tuple[str, Claim, bool]], report: Report, deadline: float,
            workers: int) -> None:
    """Runs the rows (``workers`` at a time; ALONE ones afterwards, one by one) and prints their
    lines in table order."""
    at_once = [r for r in table if r[1].name not in ALONE]
    alone = [r for r in table if r[1].name in ALONE]

    def guarded(row: tuple[str, Claim, bool]) -> tuple[str, dict[str, object]]:
        left = deadline - time.monotonic()
        if left < CLAIM_RESERVE_S:
            return "FAIL", {"error": f"not run: {left:.0f} s left before the deadline"}
        return run_one(target, row[1], row[2])

    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures: list[tuple[str, Future]] = [(r[0], pool.submit(guarded, r)) for r in at_once]
        for name, fut in futures:
            report.claim(name, *fut.result())
    for row in alone:
        report.claim(row[0], *guarded(row))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./dev gpu-check", description=(
        "Check every GPU claim of libvgpu on this machine's GPU (its python3 and PyTorch), or "
        "with --doubles against the CUDA/NVML doubles; one line per claim."))
    parser.add_argument("--doubles", action="store_true",
                        help="run against the CUDA/NVML doubles of tests/libvgpu (no GPU needed)")
    parser.add_argument("--only", default="", help="comma-separated claim names (default: all)")
    parser.add_argument("--deadline", type=float, default=450.0,
                        help="seconds for the whole run, build included (default 450); claims "
                        "left when it comes are reported as not run")
    parser.add_argument("--workers", type=int, default=0,
                        help="claims at once (default: 1 on a GPU, 12 on the doubles)")
    args = parser.parse_args(argv)
    only = {n.strip() for n in args.only.split(",") if n.strip()} or None
    table = rows(only)
    if only and not table:
        parser.error(f"no claim is called {', '.join(sorted(only))} (see bench/gpucheck/claims.py)")
    if not args.doubles and not gpu_present():
        print(NO_GPU)
        return 0
    start = time.monotonic()
    deadline = start + args.deadline
    report = Report()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        try:
            if args.doubles:
                from .target_doubles import DoubleTarget

                target: Target = DoubleTarget(Path(tmp))
            else:
                from .target_gpu import GpuTarget

                target = GpuTarget(Path(tmp))
        except Exception as exc:  # noqa: BLE001 - the build or the environment: one line, exit 1
            report.line(f"gpu build FAIL error={type(exc).__name__}:{str(exc).strip()[-400:]!r}")
            return 1
        report.line(f"gpu build ok {target.describe()} s={time.monotonic() - start:.1f}")
        workers = args.workers or (12 if args.doubles else 1)
        run_all(target, table, report, deadline, workers)
    c = report.counts
    report.line(f"gpu-check: {len(table)} claims: {c['ok']} ok, {c['FAIL']} FAIL, {c['skipped']} "
                f"skipped ({target.name}, {time.monotonic() - start:.0f} s)")
    # on the doubles every claim has a verdict (CI: every line must say ok); on a GPU a claim
    # the driver or PyTorch there cannot run says why on its line
    return 1 if c["FAIL"] or (args.doubles and c["skipped"]) else 0


if __name__ == "__main__":
    sys.exit(main())
