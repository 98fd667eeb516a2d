"""Pytest fixtures for the Kubernetes emulator.

Import them into a conftest.py::

    from tests.kubeemu.fixtures import kube_emulator, kube_namespace  # noqa: F401

``kube_emulator`` is session-scoped and exports ``KUBECONFIG`` while it lives (also into
the kubernetes / kubernetes_asyncio module globals that captured it at import). It is one
emulator per test process even when several conftest files import the fixture: KubeSpawner
caches its client configuration (``kubespawner.clients.load_config``) and clients per
process, so a second API server in the same process would silently be ignored by it.
The shared emulator has no Node objects (pods run on the virtual node ``emu-node``);
tests that need nodes (GPU inventory, scheduling) add them with ``add_node`` in their own
namespace-independent way, or start their own ``KubeEmulator`` for a hub subprocess.

``kube_namespace`` gives each test a fresh namespace, deleted afterwards (its pods stop).
"""

from __future__ import annotations

import importlib
import os
import threading
import uuid
from collections.abc import Iterator

import pytest

from .emulator import KubeEmulator

# Both official clients read KUBECONFIG once, at import, into these module globals.
_DEFAULT_LOCATION_HOLDERS = ("kubernetes_asyncio.config.kube_config", "kubernetes_asyncio.config",
                             "kubernetes.config.kube_config", "kubernetes.config")
_saved_locations: dict[str, str] = {}


def _point_clients_at(path: str | None) -> None:
    """Make already-imported clients' default kubeconfig location follow KUBECONFIG."""
    for modname in _DEFAULT_LOCATION_HOLDERS:
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        if not hasattr(mod, "KUBE_CONFIG_DEFAULT_LOCATION"):
            continue
        if path is None:
            if modname in _saved_locations:
                mod.KUBE_CONFIG_DEFAULT_LOCATION = _saved_locations.pop(modname)
        else:
            _saved_locations.setdefault(modname, mod.KUBE_CONFIG_DEFAULT_LOCATION)
            mod.KUBE_CONFIG_DEFAULT_LOCATION = path


_lock = threading.Lock()
_shared: KubeEmulator | None = None
_users = 0
_old_kubeconfig: str | None = None


def acquire_shared_emulator() -> KubeEmulator:
    """The process-wide emulator (started on first use); pair with release_shared_emulator."""
    global _shared, _users, _old_kubeconfig
    with _lock:
        if _shared is None:
            emu = KubeEmulator(restart_backoff_seconds=1.0, bookmark_interval=1.0)
            emu.start()
            _shared = emu
            _old_kubeconfig = os.environ.get("KUBECONFIG")
            os.environ["KUBECONFIG"] = emu.kubeconfig_path
            _point_clients_at(emu.kubeconfig_path)
        _users += 1
        return _shared


def release_shared_emulator() -> None:
    global _shared, _users
    with _lock:
        _users -= 1
        if _users > 0 or _shared is None:
            return
        emu, _shared = _shared, None
        _point_clients_at(None)
        if _old_kubeconfig is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = _old_kubeconfig
    emu.stop()


@pytest.fixture(scope="session")
def kube_emulator() -> Iterator[KubeEmulator]:
    """A started emulator for the whole session, with KUBECONFIG pointing at it."""
    emu = acquire_shared_emulator()
    try:
        yield emu
    finally:
        release_shared_emulator()


@pytest.fixture
def kube_namespace(kube_emulator: KubeEmulator) -> Iterator[str]:
    """A fresh namespace (with its default service account) for one test."""
    name = "t-" + uuid.uuid4().hex[:10]
    kube_emulator.create({"metadata": {"name": name}}, "namespaces")
    try:
        yield name
    finally:
        try:
            kube_emulator.delete("namespaces", name, None)
        except Exception:
            pass
