"""`elastic-gpu simulate --sessions FILE` on hostile files and options, run as users run it (the
installed console script): each is refused with one sentence and exit status 2, in bounded time
(a hang is killed after 120 s) and memory (the process may not grow past 2 GiB), never a traceback."""

from __future__ import annotations

import math
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hubext.metering.report import ReportError
from hubext.metering.simulate import MAX_SESSION_GPUS, sessions_from_csv

ELASTIC_GPU = str(Path(sys.executable).parent / "elastic-gpu")
HEADER = "id,user,start,duration_seconds,size,count\n"
RECORDS_HEADER = (
    "id,user,namespace,workspace,kind,priority_class,node,gpu_uuids,gpu_model,gpu_memory_mib,count,memory_mib,"
    "cores_percent,whole,borrowed,granted_at,released_at,release_cause,release_why,last_seen\n"
)


def _limit_memory() -> None:
    two_gib = 2 << 30
    resource.setrlimit(resource.RLIMIT_AS, (two_gib, two_gib))


def simulate(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [ELASTIC_GPU, "simulate", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=_limit_memory,
        env={**os.environ, "PYTHONFAULTHANDLER": ""},
    )


def refused(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout[-500:], result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("elastic-gpu simulate: "), result.stderr[-2000:]
    for word in words:
        assert word in lines[0], (word, lines[0])


def row(start: str = "0", duration: str = "3600", size: str = "1/4", count: str = "1") -> str:
    return f"s1,alice,{start},{duration},{size},{count}\n"


HOSTILE_CSVS = {
    "non-utf8": (HEADER.encode() + b"s1,al\xff\xfece,0,3600,1/4,1\n", ("UTF-8",)),
    "a 128 KB cell": ((HEADER + row(size="x" * 131073)).encode(), ("line 2",)),
    "count=inf": ((HEADER + row(count="inf")).encode(), ("count",)),
    "count=1e9": ((HEADER + row(count="1000000000")).encode(), ("count",)),
    "start=nan": ((HEADER + row(start="nan")).encode(), ("start",)),
    "duration=inf": ((HEADER + row(duration="inf")).encode(), ("duration",)),
    "records count=inf": (
        (RECORDS_HEADER + "r1,alice,default,default,kernel,default,n,GPU-0,H100,81920,inf,20480,25,False,False,"
         "0,3600,stopped,,3600\n").encode(),
        ("count",),
    ),
    "records count=1e9": (
        (RECORDS_HEADER + "r1,alice,default,default,kernel,default,n,GPU-0,H100,81920,1e9,20480,25,False,False,"
         "0,3600,stopped,,3600\n").encode(),
        ("count",),
    ),
    "records granted_at=nan": (
        (RECORDS_HEADER + "r1,alice,default,default,kernel,default,n,GPU-0,H100,81920,1,20480,25,False,False,"
         "nan,3600,stopped,,3600\n").encode(),
        ("granted_at",),
    ),
}


@pytest.mark.parametrize("name", list(HOSTILE_CSVS))
def test_a_hostile_sessions_csv_is_refused_with_a_sentence(tmp_path, name):
    content, words = HOSTILE_CSVS[name]
    path = tmp_path / "sessions.csv"
    path.write_bytes(content)
    refused(simulate("--sessions", str(path)), *words)


def test_sessions_that_are_no_regular_file_are_refused(tmp_path):
    fifo = tmp_path / "fifo.csv"
    os.mkfifo(fifo)
    refused(simulate("--sessions", str(fifo)), "regular file")
    refused(simulate("--sessions", "/dev/zero"), "regular file")
    refused(simulate("--sessions", str(tmp_path)), "regular file")


def test_a_sessions_csv_larger_than_the_limit_is_refused(tmp_path):
    path = tmp_path / "huge.csv"
    with path.open("wb") as f:  # sparse: 3 GiB of nothing after a header
        f.write(HEADER.encode())
        f.truncate(3 << 30)
    refused(simulate("--sessions", str(path)), "MiB")


@pytest.mark.parametrize(
    ("option", "value"),
    [("--percentile", "nan"), ("--percentile", "inf"), ("--percentile", "0"), ("--percentile", "101"),
     ("--max-wait", "nan"), ("--max-wait", "-1"), ("--max-wait", "inf")],
)
def test_simulate_options_that_are_no_number_in_range_are_refused(tmp_path, option, value):
    path = tmp_path / "sessions.csv"
    path.write_text(HEADER + row())
    refused(simulate("--sessions", str(path), option, value), option)


def test_a_good_sessions_csv_still_replays(tmp_path):
    path = tmp_path / "sessions.csv"
    path.write_text(HEADER + row() + row(start="1800", count="2"))
    result = simulate("--sessions", str(path))
    assert result.returncode == 0, result.stderr
    assert "GPUs keep the p95 wait" in result.stdout, result.stdout


# ---- any text at all: sessions or a sentence ------------------------------------------------------

cells = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["nan", "inf", "-inf", "1e309", "-1", "0", "1", "1e9", "1/4", "25%", "20GiB", "0:60", "x"]),
)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(
    header=st.just(["start", "duration_seconds", "size", "count", "bursts"])
    | st.lists(
        st.sampled_from(["id", "user", "start", "end", "duration_seconds", "size", "count", "bursts", "granted_at"]),
        min_size=1,
        max_size=6,
        unique=True,
    ),
    rows=st.lists(st.lists(cells, min_size=1, max_size=6), max_size=3),
)
def test_any_sessions_csv_gives_sessions_or_a_sentence(header, rows):
    text = ",".join(header) + "\n" + "\n".join(",".join(c.replace(",", ";") for c in r) for r in rows) + "\n"
    try:
        sessions = sessions_from_csv(text, 81920)
    except ReportError as e:
        assert e.message and "\n" not in e.message
        return
    for s in sessions:
        assert math.isfinite(s.arrival) and math.isfinite(s.duration) and s.duration > 0
        assert 1 <= s.count <= MAX_SESSION_GPUS
