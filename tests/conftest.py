"""The suite's order: the slowest test files first.

CI runs the suite three files at a time (pytest-xdist ``-n 3 --dist loadfile``), which hands the
files to the workers in the order it gets them. By default pytest-xdist puts the files with the
most tests first, so the slow files holding one or two tests (a hub, an emulator and kernels
started for one end-to-end test) started last, each after the others were done, and the run
ended with one worker busy and two idle. pyproject's addopts pass ``--no-loadscope-reorder``:
the collection order below is the order the workers get.

``tests/file_durations.json`` holds each file's seconds (setup, call and teardown of its tests)
in a run of the whole suite; the files are collected longest first, those it does not name after
them in their usual order. A file's tests keep their order. To refresh the table, run the suite
with ``--file-durations=PATH`` (``.ci/run`` writes ``.ci-file-durations.json``) and copy it here.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("file_durations.json")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--file-durations",
        metavar="PATH",
        default=None,
        help="write each test file's seconds (setup + call + teardown of its tests) to PATH as JSON, "
        "the table tests/conftest.py orders the files by (tests/file_durations.json)",
    )


def file_of(nodeid: str) -> str:
    """The test file of a node id, as the table names it (relative to the repository)."""
    return nodeid.split("::", 1)[0]


def slowest_first(items: list[pytest.Item], seconds: dict[str, float]) -> list[pytest.Item]:
    """``items`` with their files ordered by ``seconds`` (longest first; files not in it after,
    in their order); each file's tests stay together and in their order."""
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(file_of(item.nodeid), i)
    return sorted(items, key=lambda item: (-seconds.get(file_of(item.nodeid), 0.0), first[file_of(item.nodeid)]))


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    items[:] = slowest_first(items, seconds)


class FileDurations:
    """Adds up each file's reports (in the xdist controller, or the only process) and writes the
    table at the end of the session."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[file_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        table = {name: round(s, 1) for name, s in sorted(self.seconds.items(), key=lambda kv: -kv[1])}
        self.path.write_text(json.dumps(table, indent=1) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--file-durations")
    if path and not hasattr(config, "workerinput"):  # the controller sees every worker's reports
        config.pluginmanager.register(FileDurations(Path(path)), "file-durations")
