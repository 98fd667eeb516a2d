"""The suite's order (tests/conftest.py): the slowest files first, each file's tests together and
in their order, and a table that names only files that exist."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import DURATIONS, slowest_first

REPO = Path(__file__).resolve().parent.parent


class Item:
    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid


def test_the_slowest_files_come_first_and_each_files_tests_stay_together_in_their_order():
    ids = ["a.py::one", "b.py::one", "a.py::two", "c.py::one", "b.py::two", "d.py::one"]
    ordered = [i.nodeid for i in slowest_first([Item(n) for n in ids], {"c.py": 90.0, "b.py": 30.0})]
    assert ordered == ["c.py::one", "b.py::one", "b.py::two", "a.py::one", "a.py::two", "d.py::one"]


def test_the_durations_table_names_only_test_files_that_exist():
    table = json.loads(DURATIONS.read_text())
    assert table, "tests/file_durations.json is empty"
    missing = [name for name in table if not (REPO / name).is_file()]
    assert not missing, f"tests/file_durations.json names files that are gone: {missing}"
    assert all(isinstance(s, (int, float)) and s >= 0 for s in table.values()), table


def test_a_collection_puts_the_files_the_table_names_slow_before_the_others():
    table = json.loads(DURATIONS.read_text())
    fast = "tests/quotas/test_quotas_codecs.py"  # not in the table
    slow = "tests/quotas/test_quotas_incremental.py"  # in it (and quick to collect)
    assert fast not in table and slow in table
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", fast, slow],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    files = list(dict.fromkeys(line.split("::")[0] for line in proc.stdout.splitlines() if "::" in line))
    assert files == [slow, fast], files


def test_an_xdist_run_writes_each_files_seconds(tmp_path):
    out, fast = tmp_path / "durations.json", "tests/quotas/test_quotas_codecs.py"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", "1", "--dist", "loadfile",
         f"--basetemp={tmp_path / 'run'}", f"--file-durations={out}", fast],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    written = json.loads(out.read_text())
    assert list(written) == [fast] and written[fast] > 0, written
