"""Kernelspecs for the GPU kernel sizes a hub offers: "Python 3 (GPU 10 GiB)".

``python -m kernelprovider install-kernelspecs --hub-url URL`` asks the hub's broker for its
sizes (``GET /hub/api/gpu/kernel-sizes``) and installs one kernelspec per size. Each uses the
``elastic-gpu-provisioner`` provisioner with its size name, and interrupts by message, so
the kernel needs no signal from the notebook server.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from typing import Any

from quotas.messages import mib

PROVISIONER_NAME = "elastic-gpu-provisioner"
SPEC_PREFIX = "elastic-gpu-"


class KernelspecError(Exception):
    """A kernelspec could not be made or installed; the message says why and what to do."""


def kernelspec_name(size_name: str, prefix: str = SPEC_PREFIX) -> str:
    return prefix + re.sub(r"[^a-z0-9._-]+", "-", size_name.lower()).strip("-")


def kernelspec(size: Mapping[str, Any], language_display: str = "Python 3", python: str = "python") -> dict[str, Any]:
    """The kernel.json of a GPU size ({name, display_name, ...} as the broker lists them)."""
    name = size.get("name")
    if not isinstance(name, str) or not name:
        raise KernelspecError(f"A GPU kernel size needs a 'name', got {dict(size)!r}")
    display = size.get("display_name") or name
    return {
        # The broker starts the kernel; argv documents what runs there ({connection_file} is its own).
        "argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"{language_display} ({display})",
        "language": "python",
        "interrupt_mode": "message",
        "metadata": {
            "debugger": True,
            "elastic_gpu": {k: v for k, v in size.items() if k != "display_name"},
            "kernel_provisioner": {"provisioner_name": PROVISIONER_NAME, "config": {"size": name}},
        },
    }


def size_label(size: Mapping[str, Any]) -> tuple[str, str]:
    """The two lines a GPU kernel's launcher icon shows: memory ("10 GiB", "2 × 40 GiB", "whole")
    and compute ("25%", "1 GPU", "2 GPUs")."""
    count = size.get("count", 1) if isinstance(size.get("count", 1), int) else 1
    if size.get("whole"):
        return "whole", f"{count} GPU{'s' if count != 1 else ''}"
    memory = mib(size.get("memory_mib")) if isinstance(size.get("memory_mib"), int | float) else "GPU"
    if count > 1:
        memory = f"{count} × {memory}"
    cores = size.get("cores_percent")
    return memory, f"{cores}%" if isinstance(cores, int | float) else ""


def logo_svg(size: Mapping[str, Any]) -> str:
    """The launcher icon of a GPU kernel size (``logo-svg.svg`` in its kernelspec): "GPU" and its size."""
    memory, compute = (html.escape(part) for part in size_label(size))
    return (
        '<svg xmlns="http://www.w3.org/2000/svg" width="64" height="64" viewBox="0 0 64 64">'
        '<rect x="2" y="2" width="60" height="60" rx="8" fill="#76b900"/>'
        '<text x="32" y="22" font-family="sans-serif" font-size="15" font-weight="bold" fill="#fff" '
        'text-anchor="middle">GPU</text>'
        f'<text class="egpu-size" x="32" y="40" font-family="sans-serif" font-size="{11 if len(memory) < 8 else 8}" '
        f'fill="#fff" text-anchor="middle">{memory}</text>'
        f'<text x="32" y="55" font-family="sans-serif" font-size="10" fill="#fff" text-anchor="middle">{compute}</text>'
        "</svg>"
    )


def fetch_sizes(hub_url: str, token: str, timeout: float = 15.0) -> list[dict[str, Any]]:
    """The sizes the hub's broker offers to ``token``'s owner."""
    base = hub_url.rstrip("/")
    if not base.endswith("/hub/api"):
        base = base + ("/api" if base.endswith("/hub") else "/hub/api")
    req = urllib.request.Request(base + "/gpu/kernel-sizes", headers={"Authorization": f"token {token}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            data = json.loads(resp.read())
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read()).get("message", "")
        except (ValueError, AttributeError):
            message = ""
        raise KernelspecError(f"The hub at {hub_url} refused the size list (HTTP {e.code}): {message}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise KernelspecError(f"Cannot read GPU kernel sizes from {base}/gpu/kernel-sizes: {e}") from None
    sizes = data.get("sizes") if isinstance(data, dict) else None
    if not isinstance(sizes, list):
        raise KernelspecError(f"{base}/gpu/kernel-sizes did not answer a size list: {data!r}")
    return sizes


def install(
    sizes: Iterable[Mapping[str, Any]],
    *,
    user: bool = False,
    prefix: str | None = None,
    prefix_name: str = SPEC_PREFIX,
    language_display: str = "Python 3",
    python: str = "python",
    replace_stale: bool = True,
) -> list[str]:
    """Install one kernelspec per size; return their directories. Stale GPU kernelspecs are removed."""
    from jupyter_client.kernelspec import KernelSpecManager

    ksm = KernelSpecManager()
    installed, names = [], set()
    for size in sizes:
        name = kernelspec_name(str(size.get("name", "")), prefix_name)
        spec = kernelspec(size, language_display, python)
        names.add(name)
        with tempfile.TemporaryDirectory() as tmp:
            # install_kernel_spec copies modes: a 0700 temp dir would hide the spec from other accounts
            os.chmod(tmp, 0o755)
            with open(os.path.join(tmp, "kernel.json"), "w") as f:
                json.dump(spec, f, indent=1)
            os.chmod(os.path.join(tmp, "kernel.json"), 0o644)
            with open(os.path.join(tmp, "logo-svg.svg"), "w") as f:  # the launcher's icon: the size
                f.write(logo_svg(size))
            os.chmod(os.path.join(tmp, "logo-svg.svg"), 0o644)
            try:
                path = ksm.install_kernel_spec(tmp, kernel_name=name, user=user, prefix=prefix)
            except OSError as e:
                where = "--user" if user else (prefix or "the system kernelspec directory")
                raise KernelspecError(f"Cannot write kernelspec {name} in {where}: {e}") from None
        installed.append(path)
    if replace_stale:  # sizes the hub no longer offers
        target = _target_dir(ksm, user, prefix)
        for entry in sorted(os.listdir(target)) if os.path.isdir(target) else []:
            if entry.startswith(prefix_name) and entry not in names:
                shutil.rmtree(os.path.join(target, entry), ignore_errors=True)
    return installed


def _target_dir(ksm: Any, user: bool, prefix: str | None) -> str:
    """The kernels directory install_kernel_spec writes to for these options."""
    return os.path.dirname(ksm._get_destination_dir("x", user=user, prefix=prefix))
