"""The JupyterLab extension as users get it: built from the committed source, installed with the
package (no Node.js), listed by ``jupyter labextension list``, its server extension switched on."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NAME = "@elastic-gpu/jupyterlab"


def plain(text: str) -> str:
    """The text without its terminal colours."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def test_the_committed_build_was_made_from_the_committed_source():
    result = subprocess.run(
        [sys.executable, str(REPO / "labextension" / "source_hash.py")], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stdout + result.stderr
    build = json.loads((REPO / "kernelprovider" / "labextension" / "package.json").read_text())
    entry = REPO / "kernelprovider" / "labextension" / build["jupyterlab"]["_build"]["load"]
    assert entry.is_file(), f"{entry} is named by the build but missing: run ./dev lab-build"


def test_the_installed_package_brings_the_prebuilt_extension_and_jupyter_lists_it_enabled():
    env = Path(sys.prefix)
    installed = env / "share" / "jupyter" / "labextensions" / NAME / "package.json"
    assert installed.is_file(), f"{installed} is missing: the package's data files were not installed"
    assert installed.read_text() == (REPO / "kernelprovider" / "labextension" / "package.json").read_text(), (
        "the installed extension is not the committed build: reinstall (./dev install)"
    )
    listed = subprocess.run(
        [sys.executable, "-m", "jupyter", "labextension", "list"], capture_output=True, text=True, timeout=120
    )
    line = next((ln for ln in plain(listed.stdout + listed.stderr).splitlines() if NAME in ln), "")
    assert "enabled" in line and "OK" in line, listed.stdout + listed.stderr
    servers = subprocess.run(
        [sys.executable, "-m", "jupyter", "server", "extension", "list"], capture_output=True, text=True, timeout=120
    )
    out = plain(servers.stdout + servers.stderr)
    assert re.search(r"kernelprovider\.labstatus\s+enabled", out) and re.search(
        r"kernelprovider\.labstatus\s+OK", out
    ), out
