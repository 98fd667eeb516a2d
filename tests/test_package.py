"""The package installs what it promises: top-level packages and the console script."""

import importlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["hubext", "kernelprovider", "culler", "quotas", "libvgpu"])
def test_top_level_package_imports(name):
    module = importlib.import_module(name)
    assert module.__doc__, f"{name} has no docstring"


def test_console_script_is_installed_and_answers_help():
    exe = shutil.which("elastic-gpu") or str(Path(sys.executable).parent / "elastic-gpu")
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "elastic-gpu" in out.stdout


def test_the_code_is_ruff_clean():
    ruff = Path(sys.executable).parent / "ruff"
    if not ruff.exists():
        pytest.skip("ruff is not installed (it comes with the [test] extra)")
    out = subprocess.run([str(ruff), "check", str(REPO)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


#: the packages' Python (not tests/ nor bench/), which STYLE.md and architecture.md keep cut by concern
PACKAGES = ("hubext", "libvgpu", "culler", "kernelprovider", "quotas", "labextension")


def test_modules_stay_small_in_every_package_and_modes_have_their_folders():
    """Every package stays cut by concern (architecture.md): no module over 600 lines, one
    folder per mode."""
    too_long = {
        str(path.relative_to(REPO)): n
        for folder in PACKAGES
        for path in (REPO / folder).rglob("*.py")
        if "node_modules" not in path.parts and (n := len(path.read_text().splitlines())) > 600
    }
    assert not too_long, f"modules over 600 lines (split them by concern): {too_long}"
    assert (REPO / "hubext" / "kubernetes").is_dir() and (REPO / "hubext" / "local").is_dir()


def test_the_gpu_model_name_is_defined_once():
    """One NVML-name -> pool-model function (libvgpu.contract.model_name); copies drifted before."""
    hits = [
        str(path.relative_to(REPO))
        for folder in ("hubext", "libvgpu", "culler", "kernelprovider", "quotas")
        for path in (REPO / folder).rglob("*.py")
        if "def model_name(" in path.read_text()
    ]
    assert hits == ["libvgpu/contract.py"], hits


def _imports(path: Path) -> set[str]:
    """The absolute modules a Python file imports (``import a.b``, ``from a.b import c``)."""
    import ast

    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_the_shims_package_imports_nothing_of_the_hub():
    """libvgpu owns the shim's file contract (libvgpu/contract.py); the hub, the culler and the
    node agent import it from there, so the node agent's image needs no JupyterHub code."""
    offenders = sorted(
        f"{path.relative_to(REPO)} imports {name}"
        for path in (REPO / "libvgpu").rglob("*.py")
        for name in _imports(path)
        if name == "hubext" or name.startswith("hubext.")
    )
    assert not offenders, offenders


def test_metering_does_not_import_the_cli_above_it():
    offenders = sorted(
        f"{path.relative_to(REPO)} imports {name}"
        for path in (REPO / "hubext" / "metering").rglob("*.py")
        for name in _imports(path)
        if name.startswith("hubext.cli")
    )
    assert not offenders, offenders


def test_metering_never_asks_which_mode_it_runs_in():
    """Metering hears slice events (hubext/events.py) and asks the pool for a slice's activity
    (PoolBackend.slice_activity): a third mode needs no edit of it."""
    import re

    pattern = re.compile(r"\.mode ==|checkpoints_itself|from \.\.local|from hubext\.(local|kubernetes)")
    offenders = [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for path in (REPO / "hubext" / "metering").rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not offenders, offenders


#: f-strings that print MiB on purpose: the admission YAML's comment gives its total in the unit of
#: the limits written below it
_MIB_ON_PURPOSE = ("in all (the unit of the limits below)",)
_PERCENT_SIZE = re.compile(r"%[-0-9.]*[dfgi] ?[MG]iB")


def _sizes_written_by_hand(path: Path) -> list[str]:
    """f-strings of ``path`` that print a size themselves: a value followed by 'MiB'/'GiB', or
    one computed with 1024 or a shift by 20 outside a call (quotas.messages.mib is the formatter)."""
    import ast

    hits = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _PERCENT_SIZE.search(node.value):
            hits.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value[:90]!r}")  # a log line's '%d MiB'
        if not isinstance(node, ast.JoinedStr) or any(s in ast.unparse(node) for s in _MIB_ON_PURPOSE):
            continue
        for i, part in enumerate(node.values):
            if not isinstance(part, ast.FormattedValue):
                continue
            after = node.values[i + 1] if i + 1 < len(node.values) else None
            unit = isinstance(after, ast.Constant) and after.value.lstrip().startswith(("MiB", "GiB"))
            code = ast.unparse(part.value)
            arithmetic = ("1024" in code or ">> 20" in code) and not isinstance(part.value, ast.Call)
            if unit or arithmetic:
                hits.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)[:90]}")
                break
    return hits


def test_sizes_are_written_by_the_one_formatter():
    """Every size a person reads goes through quotas.messages.mib ('10 GiB', '1.5 GiB',
    '10300 MiB'); formatters written by hand drifted ('17.625 GiB' vs '18048 MiB', a 1.5 GiB
    request shown as '1 GiB')."""
    hits = [
        hit
        for folder in ("hubext", "libvgpu", "culler", "kernelprovider", "quotas")
        for path in sorted((REPO / folder).rglob("*.py"))
        if path != REPO / "quotas" / "messages.py"
        for hit in _sizes_written_by_hand(path)
    ]
    assert not hits, "sizes formatted outside quotas/messages.py:\n" + "\n".join(hits)
